"""``kvcache-ctl``'s command line: connection flags (or ``KVCACHE_*`` variables), one
subcommand per view, one-line errors and documented exit codes.

Exit codes: 0 done; 1 the service refused the call (an unknown pool or request, a missing or
wrong token, ...: the status code is named); 2 a usage error (bad flag or file); 3 the
service (or etcd) cannot be reached; 130 interrupted (Ctrl-C, e.g. to end ``events
--follow``).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import grpc

from kvcache_common.cli import OneLineParser

EXIT_OK, EXIT_REFUSED, EXIT_USAGE, EXIT_UNREACHABLE, EXIT_INTERRUPTED = 0, 1, 2, 3, 130
PROG = "kvcache-ctl"
_UNREACHABLE = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED)


class UsageError(Exception):
    """A mistake in the command line or a file it names (exit 2)."""


def _env(name: str, default: str | None = None) -> str | None:
    return os.environ.get(name, default)


def _connection_flags() -> OneLineParser:
    common = OneLineParser(add_help=False)
    g = common.add_argument_group("connection (flags win over the environment)")
    g.add_argument("--target", default=_env("KVCACHE_TARGET", "127.0.0.1:50051"),
                   help="HOST:PORT of the cache service; cluster mode: several, "
                        "comma-separated [env KVCACHE_TARGET] (default %(default)s)")
    g.add_argument("--token", default=_env("KVCACHE_AUTH_TOKEN"),
                   help="bearer token, as the server's --auth-token [env KVCACHE_AUTH_TOKEN]")
    g.add_argument("--tls", action="store_true",
                   default=_env("KVCACHE_TLS", "") in ("1", "true", "yes"),
                   help="speak TLS (system roots unless --tls-ca) [env KVCACHE_TLS=1]")
    g.add_argument("--tls-ca", type=Path, default=_env("KVCACHE_TLS_CA"),
                   help="PEM root certificate(s) to trust; implies --tls [env KVCACHE_TLS_CA]")
    g.add_argument("--tls-server-name", default=_env("KVCACHE_TLS_SERVER_NAME"),
                   help="the name the server's certificate must carry "
                        "[env KVCACHE_TLS_SERVER_NAME]")
    g.add_argument("--timeout", type=float, default=float(_env("KVCACHE_TIMEOUT", "3") or 3),
                   help="seconds per call [env KVCACHE_TIMEOUT] (default %(default)s)")
    g.add_argument("--json", action="store_true", help="JSON for scripts instead of tables "
                   "(events: one JSON object per line)")
    return common


def _etcd_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--etcd-endpoints", default=_env("KVCACHE_ETCD_ENDPOINTS"),
                   help="etcd client endpoints host:port[,host:port], as the servers' "
                        "[env KVCACHE_ETCD_ENDPOINTS]")
    p.add_argument("--cluster-name", default=_env("KVCACHE_CLUSTER_NAME", "default"),
                   help="as the servers' --cluster-name [env KVCACHE_CLUSTER_NAME] "
                        "(default %(default)s)")


def build_parser() -> OneLineParser:
    """The kvcache-ctl parser: the connection flags, then one subcommand per view."""
    common = _connection_flags()
    p = OneLineParser(prog=PROG, description=__doc__.split("\n\n")[0].replace("``", ""),
                      epilog="Exit codes: 0 done, 1 refused by the service, 2 usage error, "
                             "3 service or etcd unreachable, 130 interrupted. "
                             "See docs/operations.md.")
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND",
                           parser_class=OneLineParser)

    def add(name: str, help_text: str) -> argparse.ArgumentParser:
        return sub.add_parser(name, parents=[common], help=help_text, description=help_text)

    add("pools", "every pool: blocks used / cached / free, usage, hit rate, requests")
    c = add("pool", "one pool: its configuration, counters and per-group stats")
    c.add_argument("pool_id")
    c = add("request", "one request's state and block tables per group")
    c.add_argument("pool_id")
    c.add_argument("request_id")
    c = add("peek", "how much of a prompt each pool holds, per group, and why each group's "
            "reach stopped (explain); reads only")
    c.add_argument("pool_ids", nargs="+", metavar="POOL")
    src = c.add_mutually_exclusive_group(required=True)
    src.add_argument("--tokens-file", type=Path, help="token ids: a JSON list, or integers "
                     "separated by spaces, commas or newlines ('-' = stdin)")
    src.add_argument("--tokens", help="token ids inline, comma-separated")
    src.add_argument("--text", help="tokenizer-free text mode: each UTF-8 byte of TEXT is "
                     "one token id (0-255)")
    c.add_argument("--cache-salt", default=None, help="the cache salt the requests would use")
    c.add_argument("--lora-name", default=None, help="the LoRA adapter they would use")
    c = add("sessions", "open sessions: client, lease left, last sequence number, and per "
            "pool the requests and blocks they hold against the session quota")
    c.add_argument("--requests", action="store_true", help="also list the request ids")
    c = add("events", "a readable tail of a pool's KV event feed")
    c.add_argument("pool_id")
    c.add_argument("--from", dest="from_sequence", type=int, default=None, metavar="SEQ",
                   help="first sequence number (resume at last seen + 1); default: the "
                        "last 20 events, or with --follow only new ones")
    c.add_argument("--incarnation", type=int, default=None,
                   help="the pool incarnation SEQ belongs to (refused if the pool changed)")
    c.add_argument("--follow", "-f", action="store_true",
                   help="keep printing new events until Ctrl-C")
    c = add("cluster", "cluster mode, from etcd: members, who owns which pool, fencing "
            "tokens, where placement would put each pool")
    _etcd_flags(c)
    c = add("top", "a live view: pools as rows, refreshed every second (q or Ctrl-C quits)")
    c.add_argument("--metrics-url", default=_env("KVCACHE_METRICS_URL"),
                   help="the service's /metrics URL, for Steps/s and p99 Step latency "
                        "(default: http://<target host>:9400/metrics) [env KVCACHE_METRICS_URL]")
    c.add_argument("--interval", type=float, default=1.0, help="seconds between refreshes")
    c.add_argument("--sort", default="usage", choices=["pool", "usage", "hit", "evictions",
                                                        "steps", "p99", "sessions"],
                   help="initial sort column (keys: u h e s p n c)")
    c.add_argument("--once", action="store_true",
                   help="print one frame (two samples --interval apart) and exit")
    return p


# -- tokens -------------------------------------------------------------------------------

def read_tokens(args: argparse.Namespace) -> list[int]:
    """The prompt of ``peek``: --tokens, --tokens-file or --text."""
    if args.text is not None:
        return list(args.text.encode())
    if args.tokens is not None:
        text = args.tokens
        where = "--tokens"
    else:
        where = f"--tokens-file {args.tokens_file}"
        try:
            text = sys.stdin.read() if str(args.tokens_file) == "-" \
                else args.tokens_file.read_text()
        except OSError as exc:
            raise UsageError(f"{where}: {exc.strerror or exc}") from None
    text = text.strip()
    try:
        values = json.loads(text) if text.startswith("[") else [
            int(t) for t in re.split(r"[\s,]+", text) if t]
    except ValueError as exc:
        raise UsageError(f"{where}: not a list of integer token ids ({exc})") from None
    if not values or not all(isinstance(v, int) and v >= 0 for v in values):
        raise UsageError(f"{where}: needs at least one token id, each an integer >= 0")
    return values


# -- commands -----------------------------------------------------------------------------

Output = tuple[Any, list[Any]]  # (JSON-ready data, rich renderables)


def _client(args: argparse.Namespace) -> Any:
    from cache_service.client import CacheClient

    root = None
    if args.tls_ca is not None:
        try:
            root = Path(args.tls_ca).read_bytes()
        except OSError as exc:
            raise UsageError(f"--tls-ca {args.tls_ca}: {exc.strerror or exc}") from None
    return CacheClient(args.target, token=args.token, tls=args.tls, root_certificates=root,
                       ssl_target_name_override=args.tls_server_name, session=False,
                       default_timeout=args.timeout, client_name="kvcache-ctl")


def _pools(client: Any, args: argparse.Namespace) -> Output:
    from cache_service.ctl.views import pool_row, pools_table

    rows = [pool_row(info, client.stats(info.pool_id)) for info in client.list_pools()]
    return rows, [pools_table(rows)]


def _pool(client: Any, args: argparse.Namespace) -> Output:
    from cache_service.ctl.views import pool_data, pool_tables

    data = pool_data(client.get_pool(args.pool_id), client.stats(args.pool_id))
    return data, pool_tables(data)


def _request(client: Any, args: argparse.Namespace) -> Output:
    from cache_service.ctl.views import request_data, request_tables

    state = client.get_request(args.pool_id, args.request_id)
    data = request_data(args.pool_id, args.request_id, client.get_pool(args.pool_id), state)
    return data, request_tables(data)


def _peek(client: Any, args: argparse.Namespace) -> Output:
    from cache_service.ctl.views import peek_data, peek_tables

    tokens = read_tokens(args)
    response = client.routing_view(args.pool_ids, tokens, cache_salt=args.cache_salt,
                                   lora_name=args.lora_name, explain=True)
    rows = peek_data(response, len(tokens))
    return rows, peek_tables(rows)


def _sessions(client: Any, args: argparse.Namespace) -> Output:
    from cache_service.ctl.views import sessions_data, sessions_table

    rows = sessions_data(client.list_sessions())
    return rows, [sessions_table(rows, args.requests)]


def _cluster(args: argparse.Namespace) -> Output:
    from cache_service.ctl.cluster_view import cluster_data, cluster_tables

    if not args.etcd_endpoints:
        raise UsageError("--etcd-endpoints (or KVCACHE_ETCD_ENDPOINTS) is required")
    try:
        data = cluster_data(args.etcd_endpoints, args.cluster_name, args.timeout)
    except ValueError as exc:
        raise UsageError(f"--etcd-endpoints: {exc}") from None
    return data, cluster_tables(data)


def _events(client: Any, args: argparse.Namespace, out: Callable[[str], None]) -> int:
    """Prints events (see ``events --help``); on Ctrl-C, how to resume on stderr."""
    from cache_service.ctl.views import event_data, event_line

    start, end = args.from_sequence, None
    if not args.follow:
        end = client.stats(args.pool_id).last_event_sequence
        if start is None:
            start = max(1, end - 19)
        if end < start:
            return EXIT_OK
    printing = [False, False]  # [printing a line now, a Ctrl-C came meanwhile]

    def on_sigint(signum: int, frame: object) -> None:
        if printing[0]:
            printing[1] = True
        else:
            raise KeyboardInterrupt

    previous = signal.signal(signal.SIGINT, on_sigint)
    try:
        for event in client.subscribe_events(args.pool_id, start, args.incarnation):
            row = event_data(args.pool_id, event)
            # The line and its note as one step for Ctrl-C: the resume hint names exactly
            # the last line printed (a Ctrl-C meanwhile is raised right after).
            printing[0] = True
            out(json.dumps(row) if args.json else event_line(row))
            args.resume = (event.sequence, event.incarnation)
            printing[0] = False
            if printing[1]:
                raise KeyboardInterrupt
            if end is not None and event.sequence >= end:
                return EXIT_OK
    except KeyboardInterrupt:
        _resume_hint(args)
        return EXIT_INTERRUPTED
    finally:
        signal.signal(signal.SIGINT, previous)
    return EXIT_OK


def _resume_hint(args: argparse.Namespace) -> None:
    """After Ctrl-C of ``events``: how to go on after the last line printed."""
    last = getattr(args, "resume", None)
    if last is not None:
        sys.stderr.write(f"{PROG}: resume with: {PROG} events {args.pool_id} --from "
                         f"{last[0] + 1} --incarnation {last[1]} --follow\n")


_COMMANDS: dict[str, Callable[[Any, argparse.Namespace], Output]] = {
    "pools": _pools, "pool": _pool, "request": _request, "peek": _peek,
    "sessions": _sessions,
}


def _fail(message: str, code: int) -> int:
    sys.stderr.write(f"{PROG}: error: {message}\n")
    return code


def run(args: argparse.Namespace) -> int:
    """Runs the parsed command; answers the exit code (0 done, 1 refused, 3 unreachable)."""
    from rich.console import Console

    from cache_service.client import CacheError

    console = Console()
    if args.command == "cluster":
        from cache_service.ctl.cluster_view import EtcdUnreachable

        try:
            data, renderables = _cluster(args)
        except EtcdUnreachable as exc:
            return _fail(f"--etcd-endpoints {args.etcd_endpoints}: {exc}", EXIT_UNREACHABLE)
        _show(console, args, data, renderables)
        return EXIT_OK
    client = _client(args)
    try:
        if args.command == "top":
            from cache_service.ctl.top import run_top

            return run_top(client, args, console)
        if args.command == "events":
            return _events(client, args, lambda line: print(line, flush=True))
        data, renderables = _COMMANDS[args.command](client, args)
        _show(console, args, data, renderables)
        return EXIT_OK
    except CacheError as exc:
        if exc.code in _UNREACHABLE:
            return _fail(f"cannot reach the cache service at {args.target} "
                         f"({exc.code.name}: {exc.message.splitlines()[0] if exc.message else ''})"
                         " -- check --target / KVCACHE_TARGET", EXIT_UNREACHABLE)
        hint = " (--token / KVCACHE_AUTH_TOKEN)" if exc.code in (
            grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.PERMISSION_DENIED) else ""
        return _fail(f"{exc.code.name}: {exc.message}{hint}", EXIT_REFUSED)
    finally:
        client.close()


def _show(console: Any, args: argparse.Namespace, data: Any, renderables: list[Any]) -> None:
    if args.json:
        print(json.dumps(data, indent=2))
        return
    for r in renderables:
        console.print(r)


def main(argv: Sequence[str] | None = None) -> int:
    """kvcache-ctl's entry point: parses ``argv`` and runs; answers the exit code (2: usage,
    130: interrupted)."""
    args = build_parser().parse_args(argv)
    try:
        return run(args)
    except UsageError as exc:
        return _fail(str(exc), EXIT_USAGE)
    except KeyboardInterrupt:  # wherever it landed (e.g. while the stream was torn down)
        _resume_hint(args)
        return EXIT_INTERRUPTED
    except BrokenPipeError:  # `kvcache-ctl events ... | head`
        sys.stderr.close()
        return EXIT_OK
