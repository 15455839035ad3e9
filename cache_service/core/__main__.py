"""``python -m cache_service.core --build-info``: which build of the core this interpreter
loads (pure Python or mypyc-compiled, and why), as one JSON line."""

from __future__ import annotations

import argparse
import json
import sys

import cache_service.core.pool  # noqa: F401 (load the modules whose origin is reported)
from cache_service.core import _variant


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m cache_service.core",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("--build-info", action="store_true", required=True,
                   help="print the build this interpreter loads")
    p.parse_args(argv)
    print(json.dumps(_variant.build_info()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
