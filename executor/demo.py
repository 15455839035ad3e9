"""``kvcache-demo``: the project in one command.

Starts a cache service and two executors on loopback (subprocesses, ephemeral ports; one pool
with prefix caching, one without), runs the same shared-prefix workload against each (many
requests that share a long "system prompt" and differ in their tail, several in flight at
once), and prints what prefix caching saved: hit rate, prompt tokens computed vs served from
the cache, time to first token p50/p99, tokens per second, and whether the greedy outputs were
identical. Processes are stopped on exit and on Ctrl-C.

``--target HOST:PORT`` runs the workload once against an executor that is already running
(the docker-compose demo client does this); it waits (``--wait-seconds``, with a progress
line) until that executor is SERVING, i.e. registered with its cache service.

The model is a preset: a tiny random-weight model on the CPU (a few layers, hidden 128), so
the tokens are not text; what the demo shows is what the cache saves. Children never outlive
the demo: they get SIGTERM when it dies, even by SIGKILL (PR_SET_PDEATHSIG, see
``kvcache_common.launch``).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import signal
import statistics
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from executor.client import AsyncExecutorClient, Generation
from executor.presets import DEFAULT_PRESET, PRESETS
from kvcache_common.cli import OneLineParser

if TYPE_CHECKING:  # rich is imported when the demo runs, not when its module is imported
    from rich.console import Console
    from rich.progress import Progress


@dataclass
class RunSummary:
    label: str
    generations: list[Generation]
    wall_s: float

    @property
    def prompt_tokens(self) -> int:
        """Prompt tokens over every request."""
        return sum(g.prompt_tokens for g in self.generations)

    @property
    def cached_tokens(self) -> int:
        """Prompt tokens the cache served (not computed) over every request."""
        return sum(g.cached_tokens for g in self.generations)

    @property
    def output_tokens(self) -> int:
        """Generated tokens over every request."""
        return sum(len(g.token_ids) for g in self.generations)

    def ttft(self, q: float) -> float:
        """The ``q`` quantile of the time to first token, in seconds (0 without requests)."""
        values = sorted(g.time_to_first_token_s for g in self.generations)
        return values[min(len(values) - 1, int(q * len(values)))] if values else 0.0

    @property
    def tokens_per_s(self) -> float:
        """Generated tokens per second of the run's wall time."""
        return self.output_tokens / max(self.wall_s, 1e-9)

    def as_dict(self) -> dict[str, float | int | str]:
        """The run's numbers as one JSON-ready row."""
        return {"label": self.label, "requests": len(self.generations),
                "prompt_tokens": self.prompt_tokens, "cached_tokens": self.cached_tokens,
                "computed_prompt_tokens": self.prompt_tokens - self.cached_tokens,
                "hit_rate": self.cached_tokens / max(1, self.prompt_tokens),
                "ttft_p50_s": self.ttft(0.5), "ttft_p99_s": self.ttft(0.99),
                "ttft_mean_s": statistics.fmean(g.time_to_first_token_s for g in self.generations),
                "output_tokens": self.output_tokens, "wall_s": self.wall_s,
                "tokens_per_s": self.tokens_per_s,
                # Requests the executor preempted for lack of free blocks (then recomputed). The
                # cache service's kvcache_pool_preemptions also counts the executor's admission
                # roll-backs, which it sends as preempt ops: a different number.
                "engine_preemptions": sum(g.num_preemptions for g in self.generations)}


def make_workload(n: int, *, prefix_len: int, suffix_len: int, num_prefixes: int, vocab: int,
                  seed: int) -> list[list[int]]:
    """``n`` prompts over ``num_prefixes`` shared prefixes with unique tails."""
    rng = random.Random(seed)
    prefixes = [[rng.randrange(vocab) for _ in range(prefix_len)] for _ in range(num_prefixes)]
    return [prefixes[i % num_prefixes]
            + [rng.randrange(vocab) for _ in range(rng.randint(suffix_len // 2, suffix_len))]
            for i in range(n)]


async def run_workload(target: str, prompts: Sequence[Sequence[int]], *, max_tokens: int,
                       concurrency: int, label: str,
                       progress: Progress | None = None) -> RunSummary:
    """Sends ``prompts`` to the executor at ``target``, ``concurrency`` at a time; answers the
    run's summary."""
    client = AsyncExecutorClient(target)
    sem = asyncio.Semaphore(concurrency)
    task_id = progress.add_task(label, total=len(prompts)) if progress is not None else None

    async def one(p: Sequence[int]) -> Generation:
        async with sem:
            g = await client.generate(p, max_tokens)
        if progress is not None and task_id is not None:
            progress.advance(task_id)
        return g

    start = time.perf_counter()
    try:
        gens = await asyncio.gather(*(one(p) for p in prompts))
    finally:
        await client.close()
    return RunSummary(label, list(gens), time.perf_counter() - start)


def model_line(name: str, *, local: bool) -> str:
    """What the model is, said plainly: a preset is a tiny random-weight model."""
    cfg = PRESETS.get(name)
    if cfg is None:
        return f"model: {name}"
    where = " on the CPU" if local else ""
    return (f"model: preset {name!r}, a tiny random-weight model{where} ({cfg.num_layers} layers "
            f"{cfg.pattern}, hidden {cfg.hidden_size}, vocab {cfg.vocab_size}): the tokens are not "
            f"text; compare what the cache saves")


def print_summary(runs: list[RunSummary], identical: bool | None, console: Console,
                  model: str = "") -> None:
    """Prints the runs side by side (and whether their tokens were identical)."""
    from rich.table import Table

    table = Table(title="shared-prefix workload")
    table.add_column("metric")
    for r in runs:
        table.add_column(r.label, justify="right")
    stats = [r.as_dict() for r in runs]
    rows = [("requests", "requests", "{}"), ("prefix hit rate", "hit_rate", "{:.1%}"),
            ("prompt tokens", "prompt_tokens", "{}"),
            ("  computed", "computed_prompt_tokens", "{}"),
            ("  saved (cache hits)", "cached_tokens", "{}"), ("TTFT p50", "ttft_p50_s", "{:.3f} s"),
            ("TTFT p99", "ttft_p99_s", "{:.3f} s"), ("output tokens", "output_tokens", "{}"),
            ("tokens / s", "tokens_per_s", "{:.1f}"), ("wall time", "wall_s", "{:.2f} s"),
            ("preemptions (no free blocks)", "engine_preemptions", "{}")]
    for name, key, fmt in rows:
        table.add_row(name, *(fmt.format(s[key]) for s in stats))
    console.print(table)
    if model:
        console.print(model)
    if len(runs) == 2:
        on, off = runs
        speedup = off.ttft(0.5) / max(on.ttft(0.5), 1e-9)
        ratio = on.tokens_per_s / max(off.tokens_per_s, 1e-9)
        console.print(f"TTFT p50 speed-up with prefix caching: {speedup:.2f}x; "
                      f"throughput ratio: {ratio:.2f}x")
    if identical is not None:
        console.print("greedy outputs identical with and without caching: "
                      + ("[green]yes[/green]" if identical else "[red]NO[/red]"))


def wait_until_serving(target: str, seconds: float, console: Console) -> bool:
    """Until the executor at ``target`` is SERVING (True) or ``seconds`` pass (False), with a
    status line saying what it waits for."""
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    deadline = time.monotonic() + seconds
    told = False
    with grpc.insecure_channel(target) as channel, \
            console.status(f"waiting for the executor at {target} ...") as status:
        stub = health_pb2_grpc.HealthStub(channel)
        while True:
            try:
                answer = stub.Check(health_pb2.HealthCheckRequest(), timeout=2)
                if answer.status == health_pb2.HealthCheckResponse.SERVING:
                    return True
                what = "it is up but not registered with its cache service yet"
            except grpc.RpcError:
                what = "nothing answers there yet"
            left = deadline - time.monotonic()
            if left <= 0:
                return False
            if not told:  # once, also where the status line does not render (no terminal)
                console.print(f"waiting up to {seconds:g} s for the executor at {target} to be "
                              f"SERVING: {what}")
                told = True
            status.update(f"waiting for the executor at {target}: {what} ({left:.0f} s left)")
            time.sleep(min(0.5, left))  # poll interval of a user-facing wait


def _error(message: str, code: int) -> int:
    print(f"kvcache-demo: error: {message}", file=sys.stderr, flush=True)
    return code


def target_model(target: str) -> str:
    """The model name of the executor at ``target``."""
    from executor.client import ExecutorClient

    with ExecutorClient(target) as client:
        return client.info().model


def build_parser() -> argparse.ArgumentParser:
    """The kvcache-demo parser."""
    p = OneLineParser(prog="kvcache-demo", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", default=DEFAULT_PRESET, choices=sorted(PRESETS), help="model preset")
    p.add_argument("--requests", type=int, default=48, help="number of requests")
    p.add_argument("--prefix-len", type=int, default=256, help="tokens of the shared prefix")
    p.add_argument("--suffix-len", type=int, default=32, help="max unique tail tokens per request")
    p.add_argument("--num-prefixes", type=int, default=2, help="distinct shared prefixes")
    p.add_argument("--max-tokens", type=int, default=16, help="tokens generated per request")
    p.add_argument("--concurrency", type=int, default=8, help="requests in flight at once")
    p.add_argument("--seed", type=int, default=0, help="workload seed")
    p.add_argument("--target", default="",
                   help="HOST:PORT of a running executor (no local servers)")
    p.add_argument("--wait-seconds", type=float, default=120.0,
                   help="with --target: how long to wait for the executor to be SERVING")
    p.add_argument("--no-compare", action="store_true", help="skip the run without prefix caching")
    p.add_argument("--json", default="", help="also write the summary as JSON to this file")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    """kvcache-demo's entry point: runs the workload with and without prefix caching and
    compares; answers the exit code."""
    args = build_parser().parse_args(argv)
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from executor.launch import start_cache_service, start_executor

    console = Console()
    for name in ("requests", "prefix_len", "max_tokens", "concurrency", "num_prefixes"):
        if getattr(args, name) < 1:
            return _error(f"--{name.replace('_', '-')}: must be >= 1", 2)
    # SIGTERM behaves like Ctrl-C: the finally blocks stop the servers. (SIGINT explicitly too:
    # a shell without job control starts background jobs with SIGINT ignored.)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.signal(signal.SIGTERM, signal.default_int_handler)
    vocab = PRESETS[args.preset].vocab_size
    prompts = make_workload(args.requests, prefix_len=args.prefix_len, suffix_len=args.suffix_len,
                            num_prefixes=args.num_prefixes, vocab=vocab, seed=args.seed)
    procs = []
    runs: list[RunSummary] = []
    model = ""
    try:
        progress = Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                            TimeElapsedColumn(), console=console)
        if args.target:
            if not wait_until_serving(args.target, args.wait_seconds, console):
                return _error(f"--target {args.target}: no executor became SERVING within "
                              f"{args.wait_seconds:g} s; start one (kvcache-executor "
                              f"--cache-service HOST:PORT) and check that it registered with its "
                              f"cache service (its 'serving' log line)", 1)
            model = target_model(args.target)
            with progress:
                runs.append(asyncio.run(run_workload(
                    args.target, prompts, max_tokens=args.max_tokens,
                    concurrency=args.concurrency, label=args.target, progress=progress)))
        else:
            with console.status("starting the cache service and executors ..."):
                cache = start_cache_service()
                procs.append(cache)
                variants = [("caching on", "--enable-prefix-caching")] + (
                    [] if args.no_compare else [("caching off", "--no-enable-prefix-caching")])
                targets = []
                for label, flag in variants:
                    # --drain-seconds 0: the demo's executors serve only the demo, so when
                    # it stops (Ctrl-C) or dies (SIGKILL: PR_SET_PDEATHSIG sends them
                    # SIGTERM) nobody waits for their in-flight requests: stop at once
                    ex = start_executor(cache.target, "--preset", args.preset, flag,
                                        "--max-num-seqs", str(max(args.concurrency, 1)),
                                        "--drain-seconds", "0")
                    procs.append(ex)
                    targets.append((label, ex.target))
            console.print(f"cache service {cache.target}; executors "
                          + ", ".join(f"{t} ({label})" for label, t in targets)
                          + f"; preset {args.preset}")
            with progress:
                for label, target in targets:
                    runs.append(asyncio.run(run_workload(
                        target, prompts, max_tokens=args.max_tokens,
                        concurrency=args.concurrency, label=label, progress=progress)))
            model = args.preset
    except KeyboardInterrupt:
        console.print("interrupted; stopping servers")
        return 130
    finally:
        for p in procs:  # all at once: each one's shutdown overlaps the others'
            p.signal(signal.SIGTERM)
        for p in reversed(procs):
            p.stop()
    identical = None
    if len(runs) == 2:
        on, off = runs
        identical = [g.token_ids for g in on.generations] == [g.token_ids for g in off.generations]
    print_summary(runs, identical, console, model_line(model, local=not args.target))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"preset": args.preset, "runs": [r.as_dict() for r in runs],
                       "outputs_identical": identical}, f, indent=2)
    return 0 if identical in (None, True) else 1


if __name__ == "__main__":
    sys.exit(main())
