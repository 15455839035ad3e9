"""``kvcache-executor`` / ``python -m executor``: parse the settings, then start the server
(:mod:`executor.server`).

Settings are parsed before torch is imported, so ``--help`` and a mistyped flag answer at once,
and ``OMP_NUM_THREADS`` (one intra-op thread unless set: executors share the host's cores) is
in the environment before torch reads it.
"""

from __future__ import annotations

import asyncio
import os
import sys
from collections.abc import Sequence

from executor.errors import InvalidArgument
from executor.settings import parse_settings
from kvcache_common.cli import exit_with_error
from kvcache_common.listen import ports_in_use
from kvcache_common.logs import configure_logging

PROG = "kvcache-executor"


def main(argv: Sequence[str] | None = None) -> int:
    """Parse flags/env (a mistake: one line, exit 2), build and check the model and settings
    (anything that cannot work: one line naming the setting, exit 2), serve until SIGTERM."""
    settings = parse_settings(argv)
    busy = ports_in_use(settings.host, settings.port, settings.metrics_port)
    if busy:  # before the model is built: a second start of the same command answers at once
        return exit_with_error(PROG, busy, 2)
    configure_logging(settings.log_level)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    from executor.server import prepare, serve

    try:
        ex = prepare(settings)
    except InvalidArgument as exc:
        return exit_with_error(PROG, str(exc), 2)
    code = asyncio.run(serve(settings, ex))
    if argv is None:
        # The process's own command line: it ends here. Everything that matters is closed
        # (the 'stopped' line is out); the interpreter's teardown of the model and its
        # object graph (a final garbage collection) would take seconds more.
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    return code


if __name__ == "__main__":
    sys.exit(main())
