#!/usr/bin/env python3
"""The engine loop of bench/bench_mooncake.py, shared by every side: a Mooncake FAST'25 trace
(one JSON object per line: ``timestamp``, ``input_length``, ``output_length``, ``hash_ids`` of
512-token blocks) replayed through a lock-step scheduler against a vLLM-shaped manager.

Standard library only, so that the vLLM oracle's interpreter runs this same file for the vLLM
side (``--vllm``, with ../shared/tools/vllm-oracle on its path): both sides see the same
requests, tokens and decode stream, and an exact core makes the same decisions.

The loop (vLLM's scheduler, simplified as bench_core.py's): requests in trace order (the
timestamps only order them: the replay runs as fast as the manager answers); at most
``max_concurrency`` running; a ``max_batched_tokens`` budget per step with chunked prefill;
running requests first, the newest preempted when an allocation fails; a waiting request is
looked up and admitted only if its whole sequence fits; each finished prompt decodes
``output_length`` tokens (one per step, drawn from one seeded random stream), then is freed.
Every step ends by draining the manager's KV events (the stream a kv-router indexes).

Token ids: trace block ``h`` holds the tokens ``h * 512 + j`` (j < 512), so equal hash ids
mean equal tokens and the engine's own prefix hashing finds exactly the trace's sharing; the
last block is cut to ``input_length``.
"""

from __future__ import annotations

import argparse
import gc
import json
import random
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

TRACE_BLOCK = 512
VOCAB = 32000
#: Per-call latency categories; the first four are the manager ops (as bench_core.py).
LAT_KEYS = ("lookup", "allocate_prefill", "allocate_decode", "free", "events", "add", "append")
MANAGER_KEYS = ("lookup", "allocate_prefill", "allocate_decode", "free", "events")


@dataclass
class TraceRequest:
    rid: str
    timestamp: int
    hash_ids: list[int]
    input_length: int
    output_length: int
    handle: Any = None
    decoded: int = 0
    first_admission: bool = True

    def tokens(self) -> list[int]:
        """The prompt's tokens: each hash id stands for a block of distinct tokens, cut at
        ``input_length``."""
        out: list[int] = []
        for h in self.hash_ids:
            base = h * TRACE_BLOCK
            out.extend(range(base, base + TRACE_BLOCK))
        return out[: self.input_length]


def load_trace(path: Path, max_requests: int | None = None) -> list[TraceRequest]:
    """The trace's requests in timestamp order (stable: ties keep file order); a request
    with no hash ids or a zero input is skipped (nothing to cache or look up)."""
    reqs = []
    with open(path) as f:
        for no, line in enumerate(f):
            if not line.strip():
                continue
            rec = json.loads(line)
            hash_ids = [int(h) for h in rec["hash_ids"]]
            n_in = int(rec["input_length"])
            if not hash_ids or n_in <= 0:
                continue
            if n_in > len(hash_ids) * TRACE_BLOCK:
                raise ValueError(f"{path}:{no + 1}: input_length {n_in} exceeds "
                                 f"{len(hash_ids)} blocks of {TRACE_BLOCK}")
            reqs.append(TraceRequest(f"m{no}", int(rec.get("timestamp", 0)), hash_ids, n_in,
                                     max(1, int(rec.get("output_length", 1)))))
            if max_requests is not None and len(reqs) >= max_requests:
                break
    reqs.sort(key=lambda r: r.timestamp)
    return reqs


def max_model_len(reqs: list[TraceRequest], block_size: int) -> int:
    """The longest request (input and output) rounded up to whole blocks."""
    longest = max(r.input_length + r.output_length for r in reqs)
    return -(-longest // block_size) * block_size


class ManagerSide:
    """A vLLM-shaped manager (``get_computed_blocks`` / ``allocate_slots`` / ``free`` /
    ``take_events``) over request objects made by ``make_request``; ``running`` and
    ``preempted`` are the request-status values, ``append`` adds one decoded token."""

    def __init__(self, manager: Any, make_request: Callable[[TraceRequest], Any],
                 running: Any, preempted: Any, append: Callable[[Any, int], None]) -> None:
        self.mgr = manager
        self.make_request = make_request
        self.running_status = running
        self.preempted_status = preempted
        self._append = append

    def add(self, tr: TraceRequest) -> Any:
        """The manager's request object of the trace request (made by ``make_request``)."""
        return self.make_request(tr)

    def lookup(self, req: Any) -> tuple[Any, int]:
        """The manager's cached prefix of ``req``: (its blocks, hit tokens)."""
        blocks, hit, _ = self.mgr.get_computed_blocks(req)
        return blocks, hit

    def admit(self, req: Any, n: int, blocks: Any, hit: int, has_running: bool) -> bool:
        """First allocation of ``n`` tokens on top of the hit (the whole sequence must fit);
        False: no room."""
        return self.mgr.allocate_slots(req, n, num_new_computed_tokens=hit,
                                       new_computed_blocks=blocks, full_sequence_must_fit=True,
                                       has_scheduled_reqs=has_running) is not None

    def after_admit(self, req: Any, n: int, hit: int) -> None:
        """Marks the admitted request running with the hit and ``n`` tokens computed."""
        req.status = self.running_status
        req.num_computed_tokens = hit + n

    def allocate(self, req: Any, n: int) -> bool:
        """Room for ``n`` more tokens of a running request; False: no room."""
        return self.mgr.allocate_slots(req, n) is not None

    def after_allocate(self, req: Any, n: int) -> None:
        """Counts the ``n`` allocated tokens as computed."""
        req.num_computed_tokens += n

    def free(self, req: Any) -> None:
        """Frees the request's blocks (the manager also frees a preempted one this way)."""
        self.mgr.free(req)

    preempt = free

    def after_preempt(self, req: Any) -> None:
        """Marks the request preempted: nothing computed, one more preemption."""
        req.status = self.preempted_status
        req.num_computed_tokens = 0
        req.num_preemptions += 1

    def append(self, req: Any, token: int) -> None:
        """Appends one decoded token (with the ``append`` given)."""
        self._append(req, token)

    def new_step(self) -> None:
        """Tells the manager a scheduler step starts."""
        self.mgr.new_step_starts()

    def take_events(self) -> list[Any]:
        """The KV events the manager produced since the last call."""
        return list(self.mgr.take_events())

    @staticmethod
    def computed(req: Any) -> int:
        """The request's computed tokens."""
        return int(req.num_computed_tokens)

    @staticmethod
    def num_tokens(req: Any) -> int:
        """The request's tokens (prompt and decoded)."""
        return int(req.num_tokens)


def count_events(events: list[Any]) -> tuple[int, int]:
    """(blocks stored, blocks removed) announced by KV events (vLLM's and the core's
    ``BlockStored`` / ``BlockRemoved``, or the service's event messages, by class name)."""
    stored = removed = 0
    for e in events:
        name = type(e).__name__
        if name == "BlockStored":
            stored += len(e.block_hashes)
        elif name == "BlockRemoved":
            removed += len(e.block_hashes)
    return stored, removed


def run_loop(side_name: str, drv: Any, reqs: list[TraceRequest], *, seed: int,
             max_concurrency: int, max_batched_tokens: int) -> dict[str, Any]:
    """Replays ``reqs`` through ``drv`` (a :class:`ManagerSide`-shaped driver) and returns
    decisions, block-op counts and per-call latencies (ns)."""
    rng = random.Random(seed)
    lat: dict[str, list[int]] = {k: [] for k in LAT_KEYS}
    pc = time.perf_counter_ns
    waiting = list(reversed(reqs))  # pop() from the end: trace order
    running: list[TraceRequest] = []
    n_alloc_fail = n_preempt = prompt_tokens = hit_tokens = n_steps = finished = 0
    query_blocks = stored_blocks = removed_blocks = 0
    gc.collect()
    gc.freeze()  # the trace is not GC churn (as the oracle and vLLM's engine)
    t_wall = time.perf_counter()

    def do_preempt(victim: TraceRequest) -> None:
        nonlocal n_preempt
        t0 = pc()
        drv.preempt(victim.handle)
        lat["free"].append(pc() - t0)
        drv.after_preempt(victim.handle)
        waiting.append(victim)
        n_preempt += 1

    def after_compute(tr: TraceRequest) -> bool:
        nonlocal finished
        h = tr.handle
        if drv.computed(h) < drv.num_tokens(h):
            return False  # partial prefill chunk
        tr.decoded += 1
        if tr.decoded >= tr.output_length:
            t0 = pc()
            drv.free(h)
            lat["free"].append(pc() - t0)
            tr.handle = None
            finished += 1
            return True
        tok = rng.randrange(VOCAB)
        t0 = pc()
        drv.append(h, tok)
        lat["append"].append(pc() - t0)
        return False

    while waiting or running:
        n_steps += 1
        drv.new_step()
        budget = max_batched_tokens
        scheduled: list[TraceRequest] = []
        i = 0
        while i < len(running) and budget > 0:
            tr = running[i]
            h = tr.handle
            remaining = drv.num_tokens(h) - drv.computed(h)
            n = min(remaining, budget)
            key = "allocate_decode" if remaining == 1 else "allocate_prefill"
            t0 = pc()
            ok = drv.allocate(h, n)
            lat[key].append(pc() - t0)
            if not ok:
                n_alloc_fail += 1
                victim = running.pop()
                do_preempt(victim)
                if victim is tr:
                    break
                continue
            drv.after_allocate(h, n)
            budget -= n
            scheduled.append(tr)
            i += 1
        while waiting and len(running) < max_concurrency and budget > 0:
            tr = waiting[-1]
            if tr.handle is None:
                t0 = pc()
                tr.handle = drv.add(tr)
                lat["add"].append(pc() - t0)
            h = tr.handle
            t0 = pc()
            blocks, num_hit = drv.lookup(h)
            lat["lookup"].append(pc() - t0)
            n = min(drv.num_tokens(h) - num_hit, budget)
            t0 = pc()
            ok = drv.admit(h, n, blocks, num_hit, bool(running))
            lat["allocate_prefill"].append(pc() - t0)
            if not ok:
                n_alloc_fail += 1
                break
            waiting.pop()
            if tr.first_admission:
                tr.first_admission = False
                prompt_tokens += tr.input_length
                hit_tokens += num_hit
                query_blocks += len(tr.hash_ids)
            drv.after_admit(h, n, num_hit)
            budget -= n
            running.append(tr)
            scheduled.append(tr)
        done = {id(tr) for tr in scheduled if after_compute(tr)}
        if done:
            running = [tr for tr in running if id(tr) not in done]
        t0 = pc()
        events = drv.take_events()
        lat["events"].append(pc() - t0)
        s, r = count_events(events)
        stored_blocks += s
        removed_blocks += r
        if not scheduled and waiting:
            raise RuntimeError("a request can never be admitted; raise --num-blocks")
    t_wall = time.perf_counter() - t_wall
    gc.unfreeze()
    mgr_ns = sum(sum(lat[k]) for k in MANAGER_KEYS)
    mgr_ops = sum(len(lat[k]) for k in MANAGER_KEYS if k != "events")
    return {
        "side": side_name,
        "decisions": {"steps": n_steps, "finished": finished, "preemptions": n_preempt,
                      "alloc_failures": n_alloc_fail, "hit_tokens": hit_tokens,
                      "stored_blocks": stored_blocks, "removed_blocks": removed_blocks},
        "prompt_tokens": prompt_tokens,
        "query_blocks": query_blocks,
        "manager_ops": mgr_ops,
        "manager_ns": mgr_ns,
        "hashing_ns": sum(lat["add"]) + sum(lat["append"]),
        "wall_s": round(t_wall, 3),
        "latency_ns": {k: sorted(v) for k, v in lat.items()},
    }


# --- the vLLM side, run by the oracle venv's interpreter --------------------------------------

def _vllm_side(args: argparse.Namespace, reqs: list[TraceRequest]) -> ManagerSide:
    sys.path.insert(0, str(args.oracle_dir))
    import vllm_oracle as vo  # noqa: PLC0415

    cfg = vo.OracleConfig(scenario=args.config, num_blocks=args.num_blocks,
                          block_size=args.block_size, sliding_window=args.sliding_window,
                          max_model_len=args.max_model_len, hash_fn="sha256")
    hash_fn = vo.get_hash_fn_by_name("sha256")
    vo.init_none_hash(hash_fn)
    kv, sbs, hbs = vo.build_kv_cache_config(cfg)
    mgr = vo.KVCacheManager(kv_cache_config=kv, max_model_len=args.max_model_len,
                            scheduler_block_size=sbs, hash_block_size=hbs,
                            enable_caching=True, enable_kv_cache_events=True)
    hasher = vo.get_request_block_hasher(hbs, hash_fn)

    def make(tr: TraceRequest) -> Any:
        return vo.Request(request_id=tr.rid, prompt_token_ids=tr.tokens(),
                          sampling_params=vo.SamplingParams(max_tokens=tr.output_length),
                          pooling_params=None, block_hasher=hasher)

    return ManagerSide(mgr, make, vo.RequestStatus.RUNNING, vo.RequestStatus.PREEMPTED,
                       lambda req, tok: req.append_output_token_ids(tok))


def main(argv: list[str] | None = None) -> int:
    """vLLM's side of the replay (run by the oracle's interpreter): prints its result as JSON."""
    p = argparse.ArgumentParser(description="vLLM side of bench/bench_mooncake.py "
                                            "(run with the vLLM oracle venv's python)")
    p.add_argument("--vllm", action="store_true", required=True)
    p.add_argument("--oracle-dir", type=Path, required=True)
    p.add_argument("--trace", type=Path, required=True)
    p.add_argument("--max-requests", type=int, default=None)
    p.add_argument("--config", default="full")
    p.add_argument("--num-blocks", type=int, required=True)
    p.add_argument("--block-size", type=int, required=True)
    p.add_argument("--sliding-window", type=int, required=True)
    p.add_argument("--max-model-len", type=int, required=True)
    p.add_argument("--max-concurrency", type=int, required=True)
    p.add_argument("--max-batched-tokens", type=int, required=True)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    reqs = load_trace(args.trace, args.max_requests)
    drv = _vllm_side(args, reqs)
    import vllm  # noqa: PLC0415

    out = run_loop("vllm", drv, reqs, seed=args.seed, max_concurrency=args.max_concurrency,
                   max_batched_tokens=args.max_batched_tokens)
    out["vllm_version"] = vllm.__version__
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
