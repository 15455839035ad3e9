"""Seeded client load for the chaos tier: one thread and one client per pool.

Each worker registers its pool and sends Steps one at a time -- new requests (prompts that
share prefixes, so the prefix cache is in play), decode appends, frees -- drawn from
``random.Random(seed, pool)``, and records every outcome in its pool's
:class:`checker.History`. A definite error or an in-doubt one (left after the client's own
resends) ends the worker: its model of the pool's live requests is then unsure, and the
checker allows the doubtful last Step either way.
"""

from __future__ import annotations

import random
import threading
import time

from cache_service.client import CacheClient, CacheError, layers, ops
from cache_service.client._builders import register_request
from kvcache_common.api.kvcache.v1 import cache_service_pb2 as pb

from .checker import History

LAYERS = [layers.full_attention(f"l{i}", block_size=16, num_kv_heads=2, head_size=8)
          for i in range(2)]
#: Shared prompt prefixes (the prefix cache makes a Step's effect depend on the ones before).
PREFIXES = [list(range(p * 1000, p * 1000 + 48)) for p in range(3)]


POOL: dict = {"num_blocks": 256, "max_model_len": 1024}


def pool_request(pool_id: str) -> pb.RegisterPoolRequest:
    return register_request(pool_id, LAYERS, **POOL)


def next_step(rng: random.Random, live: dict[str, int], pool_id: str, serial: int
              ) -> tuple[pb.StepRequest, dict[str, int]]:
    """A Step on the live requests (id -> tokens) and the live set after it."""
    after = dict(live)
    batch: list[pb.Op] = []
    for k in range(rng.choice((0, 1, 1, 2)) if len(live) < 8 else 0):
        rid = f"{pool_id}-r{serial}-{k}"
        prompt = rng.choice(PREFIXES)[:rng.randrange(8, 49)] + [rng.randrange(50000)
                                                             for _ in range(rng.randrange(1, 9))]
        batch += [ops.add(rid, prompt), ops.allocate(rid, len(prompt))]
        after[rid] = len(prompt)
    for rid in rng.sample(sorted(live), min(len(live), rng.randrange(0, 4))):
        if live[rid] >= 160 or rng.random() < 0.1:
            batch.append(ops.free(rid))
            del after[rid]
        else:
            batch += [ops.append(rid, [rng.randrange(50000)]), ops.allocate(rid, 1)]
            after[rid] += 1
    return pb.StepRequest(pool_id=pool_id, begin_step=rng.random() < 0.5,
                          ops=batch or [ops.new_step()]), after


class Load:
    """``pools`` workers on ``target``, each with its own client
    (``client_options``: CacheClient keywords), until :meth:`stop`."""

    def __init__(self, target: str, seed: int, pools: int = 3, *, prefix: str = "chaos",
                 client_options: dict | None = None) -> None:
        self.target = target
        self.seed = seed
        self.histories = [History(pool_request(f"{prefix}-{seed}-{i}")) for i in range(pools)]
        self._options = {"default_timeout": 15.0, "attempt_timeout": 1.0,
                         **(client_options or {})}
        self._stop = threading.Event()
        self._progress = threading.Condition()
        self._clients: list[CacheClient] = []
        self._threads = [threading.Thread(target=self._run, args=(h, i), daemon=True)
                         for i, h in enumerate(self.histories)]
        self.steps = 0
        self._ended = 0  # workers that returned
        self.pool_steps = [0] * pools  # acknowledged Steps per pool

    def start(self) -> Load:
        for history in self.histories:  # registered before the faults begin
            client = CacheClient(self.target, client_name="chaos", **self._options)
            self._clients.append(client)
            client.register_pool(history.pool_id, LAYERS, **POOL)
        for thread in self._threads:
            thread.start()
        return self

    def _run(self, history: History, index: int) -> None:
        try:
            self._steps(history, index)
        finally:
            with self._progress:  # a waiter for progress learns that this worker ended
                self._ended += 1
                self._progress.notify_all()

    def _steps(self, history: History, index: int) -> None:
        rng = random.Random(self.seed * 1000 + index)
        client = self._clients[index]
        live: dict[str, int] = {}
        serial = 0
        while not self._stop.is_set():
            serial += 1
            request, after = next_step(rng, live, history.pool_id, serial)
            start = time.monotonic()
            try:
                client.step_raw(request)
            except CacheError as exc:
                history.record(request, "doubt" if exc.in_doubt else "rejected",
                               time.monotonic() - start, f"{exc.code.name}: {exc.message}")
                return
            history.record(request, "ack", time.monotonic() - start)
            live = after
            with self._progress:
                self.steps += 1
                self.pool_steps[index] += 1
                self._progress.notify_all()

    def wait_steps(self, count: int, timeout: float = 60.0, pool: int | None = None) -> None:
        """Returns once ``count`` more Steps were acknowledged (over all pools, or on the
        ``pool``-th), or every worker ended."""
        def steps() -> int:
            return self.steps if pool is None else self.pool_steps[pool]
        with self._progress:
            goal = steps() + count
            if not self._progress.wait_for(lambda: steps() >= goal or self.done(), timeout):
                raise TimeoutError(f"the load acknowledged no {count} Steps in {timeout} s")

    def done(self) -> bool:
        """Every worker ended (a definite or in-doubt error each)."""
        return self._ended == len(self._threads)

    def stop(self) -> None:
        self._stop.set()
        for thread in self._threads:
            thread.join(60)

    def close(self) -> None:
        """Ends the clients (their sessions free what they hold: check before)."""
        for client in self._clients:
            client.close()
