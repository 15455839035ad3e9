"""Command lines of both servers, from their pydantic-settings models.

Precedence: flags over environment variables over defaults. ``--help`` lists every field as a
``--kebab-case`` flag with its description, its environment variable and its default;
booleans are ``--x`` / ``--no-x`` flags and ``Literal`` fields list their choices. A bad
value, and an unknown flag, is a usage error: one line naming the flag, exit status 2 (no
traceback, no usage dump).
"""

from __future__ import annotations

import os
import sys
import types
from argparse import ArgumentParser
from collections.abc import Sequence
from typing import NoReturn, TypeVar

from pydantic import ValidationError
from pydantic_settings import BaseSettings, CliSettingsSource

S = TypeVar("S", bound=BaseSettings)


def _document_env_vars(model: type[BaseSettings]) -> None:
    """Append ``[env PREFIX_NAME]`` to every field's description (once)."""
    prefix = model.model_config.get("env_prefix", "")
    changed = False
    for name, info in model.model_fields.items():
        tag = f"[env {prefix}{name.upper()}]"
        if info.description is None or tag not in info.description:
            info.description = f"{info.description or ''} {tag}".strip()
            changed = True
    if changed:
        model.model_rebuild(force=True)


class OneLineParser(ArgumentParser):
    """An argparse parser whose usage errors (an unknown flag, a missing or bad value) are
    ONE line on stderr, ``<prog>: error: <what> (see <prog> --help)``, exit status 2: not
    the whole usage first (8-18 lines that bury the line that matters)."""

    def error(self, message: str) -> NoReturn:
        """Writes the one error line and exits with status 2."""
        sys.stderr.write(f"{self.prog}: error: {message} (see {self.prog} --help)\n")
        sys.stderr.flush()
        raise SystemExit(2)


def parse_cli(model: type[S], argv: Sequence[str] | None, *, prog: str,
              description: str) -> S:
    """``model`` from ``argv`` (default ``sys.argv[1:]``) and the environment."""
    _document_env_vars(model)
    args = list(sys.argv[1:] if argv is None else argv)
    source: CliSettingsSource[ArgumentParser] = CliSettingsSource(
        model, cli_prog_name=prog, cli_kebab_case=True, cli_implicit_flags=True,
        cli_exit_on_error=True, cli_hide_none_type=True)
    source.root_parser.description = description
    source.root_parser.error = types.MethodType(  # type: ignore[method-assign]
        OneLineParser.error, source.root_parser)
    try:
        settings = model(_cli_settings_source=source(args=args))
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(p) for p in first["loc"]) or "settings"
        flag = setting_name(model, where, args) if first["loc"] else where
        sys.stderr.write(f"{prog}: error: {flag}: {first['msg']}\n")
        raise SystemExit(2) from None
    _ARGS[id(settings)] = args
    return settings


#: The command line each parsed settings object came from (by id), for setting_name.
_ARGS: dict[int, list[str]] = {}


def setting_name(settings: BaseSettings | type[BaseSettings], field: str,
                 args: Sequence[str] | None = None) -> str:
    """How a user names setting ``field`` in an error: ``--flag``, or ``--flag (from
    PREFIX_NAME)`` when its value came from the environment variable (no flag given).
    ``args``: the command line (default: the one ``settings`` was parsed from)."""
    model = settings if isinstance(settings, type) else type(settings)
    if args is None:
        args = [] if isinstance(settings, type) else _ARGS.get(id(settings), [])
    flag = "--" + field.replace("_", "-")
    negated = "--no-" + field.replace("_", "-")
    if any(a in (flag, negated) or a.startswith(flag + "=") for a in args):
        return flag
    env = f"{model.model_config.get('env_prefix', '')}{field}".upper()
    if any(name.upper() == env for name in os.environ):
        return f"{flag} (from {env})"
    return flag


def exit_with_error(prog: str, message: str, code: int) -> int:
    """One line ``<prog>: error: <message>`` on stderr (the format of a usage error above, for
    mistakes found after parsing: a port in use, a setting the model cannot work with);
    returns ``code`` for the caller to exit with."""
    sys.stderr.write(f"{prog}: error: {message}\n")
    sys.stderr.flush()
    return code
