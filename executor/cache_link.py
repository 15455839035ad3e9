"""The executor's connection to the cache service (through ``cache_service.client``):
register the pool, send the engine's batched Steps over one bidirectional StepStream
(reopened after any failure), time the calls, and turn "pool unknown" (the service
restarted) or "session unknown" (our lease expired, e.g. after a long pause: the service
freed our requests) into :class:`PoolLost` so the engine re-registers and re-admits.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass

import grpc
import structlog

from cache_service.client import (
    CacheClient,
    CacheError,
    PoolInfo,
    PoolStats,
    StepResult,
    StepStream,
)
from cache_service.core.specs import KVCacheSpec
from cache_service.specs_proto import layer_spec_to_proto
from executor.cache import CacheGroup
from executor.errors import CacheUnavailable, PoolLost
from executor.forward_meta import GroupLayout
from kvcache_common.api.kvcache.v1 import cache_service_pb2 as pb
from kvcache_common.backoff import Backoff

__all__ = ["CacheLink", "CacheUnavailable", "PoolLost", "PoolPlan", "cache_groups",
           "group_layouts"]

log = structlog.get_logger("executor.cache_link")

#: Between resends of a Step in doubt: soon at first (a dropped connection), then every
#: second or so (a restarting service).
IN_DOUBT_BACKOFF = Backoff(0.1, 1.0)


@dataclass
class PoolPlan:
    """What we register: layer specs, a budget (a block count, or bytes) and options."""

    pool_id: str
    specs: dict[str, KVCacheSpec]
    max_model_len: int
    num_blocks: int | None = None
    memory_bytes: int | None = None
    enable_caching: bool = True
    vocab_size: int = 0
    host_tier_blocks: int = 0  # host-tier slots per group (0 = no host tier)

    def layer_protos(self) -> list[pb.LayerSpec]:
        """The LayerSpec message of each layer, in the plan's order."""
        return [layer_spec_to_proto(n, s) for n, s in self.specs.items()]


def group_layouts(info: PoolInfo) -> list[GroupLayout]:
    """The executor's view of the pool's groups (kind, block size, Mamba mode)."""
    out = []
    for g in info.groups:
        if g.kind == "mamba":
            out.append(GroupLayout("mamba", g.block_size, g.mamba_cache_mode))
        else:
            out.append(GroupLayout("attention", g.block_size))
    return out


def cache_groups(info: PoolInfo) -> list[CacheGroup]:
    """Each of the pool's groups as CacheTensors takes it: its layer names and its layout."""
    return [CacheGroup(tuple(g.layer_names), lay)
            for g, lay in zip(info.groups, group_layouts(info))]


class CacheLink:
    """A blocking connection for one pool, used by one thread (the engine's).

    The client holds a session (kept alive in the background): every request the engine
    adds belongs to it, so if this executor dies the service frees them when the lease
    runs out. Steps go over one StepStream (about 0.4 ms cheaper per call than a unary
    Step here) when ``use_stream``, else as unary Step calls. Every stream step has a
    deadline (``timeout_s``): when it passes, or the stream breaks, the client drops the
    stream, reconnects and resends the step under the same sequence number (the service
    applies it once), logging ``step_stream_retry`` and counting ``stream_retries``. An
    invalid batch ends the stream; the next step opens a new one.
    """

    def __init__(self, target: str, plan: PoolPlan, *, timeout_s: float = 10.0,
                 use_stream: bool = True, in_doubt_retry_s: float = 30.0) -> None:
        self.target = target
        self.plan = plan
        self.timeout_s = timeout_s
        self.client = CacheClient(target, default_timeout=timeout_s, max_retries=2,
                                  client_name=f"executor:{plan.pool_id}")
        self.use_stream = use_stream
        self._stream: StepStream | None = None
        self.info: PoolInfo | None = None
        self.call_seconds = 0.0
        self.calls = 0
        #: (start, end) of each step call since the engine last cleared it (the engine
        #: tells the part of a call that outlasted its forward pass).
        self.intervals: list[tuple[float, float]] = []
        self.stream_retries = 0
        self.in_doubt_retry_s = in_doubt_retry_s

    def close(self) -> None:
        """Drops the stream and closes the client (ending its session: the service frees this
        executor's requests)."""
        self._drop_stream()
        self.client.close()

    def _drop_stream(self) -> None:
        stream, self._stream = self._stream, None
        if stream is not None:
            stream.close()

    def _retried(self, reason: str, attempt: int) -> None:
        self.stream_retries += 1
        log.warning("step_stream_retry", reason=reason, attempt=attempt,
                    session_id=self.client.session_id, step_timeout_s=self.timeout_s)

    def _send(self, ops: Sequence[pb.Op], begin_step: bool) -> StepResult:
        if not self.use_stream:
            return self.client.step(self.plan.pool_id, ops, begin_step=begin_step)
        if self._stream is None:
            self._stream = self.client.step_stream(step_timeout=self.timeout_s,
                                                   on_retry=self._retried)
        try:
            return self._stream.step(self.plan.pool_id, ops, begin_step=begin_step)
        except BaseException:
            self._drop_stream()  # ended by the error, or out of step with our requests
            raise

    def _send_until_settled(self, ops: Sequence[pb.Op], begin_step: bool,
                            deadline: float) -> StepResult:
        """Sends a Step; while its outcome is in doubt (the service is unreachable: it may
        have applied and logged the Step, e.g. a --data-dir service restarting), resends
        the SAME Step (same session sequence number) until the service answers or
        ``deadline`` passes. The engine would re-plan after a failure, and a different
        Step under the number of one the service already applied is refused, or, resent
        under the next number, applied on top of it.

        The one place a Step is resent at two nested levels, on purpose: inside
        :meth:`_send`, the client resends the step itself (the stream after a lost stream
        or a missed step deadline, at most ``max_retries`` times, counted in
        :attr:`stream_retries`; a unary Step until its ``timeout_s``): fast, for a dropped
        connection or a hung replica. This loop resends it again once those are spent, for
        as long as a restarting service takes (``in_doubt_retry_s``, past the client's
        bounds), and after the in-doubt codes the client gives up on at once (UNKNOWN,
        INTERNAL; CANCELLED on a stream). Both resend the same stamp (the session keeps an in-doubt
        number for the next call), so the service applies the Step once whichever resend
        it answers.
        """
        attempt = 0
        while True:
            try:
                return self._send(ops, begin_step)
            except CacheError as exc:
                if not exc.in_doubt or time.perf_counter() >= deadline:
                    raise
                delay = IN_DOUBT_BACKOFF.delay(attempt)
                attempt += 1
                log.warning("cache_step_in_doubt", code=exc.code.name, attempt=attempt,
                            retry_in_s=round(delay, 3), error=exc.message)
                time.sleep(delay)

    def register(self) -> PoolInfo:
        """RegisterPool (idempotent for the same description)."""
        try:
            self.info = self.client.register_pool(
                self.plan.pool_id, self.plan.layer_protos(), num_blocks=self.plan.num_blocks,
                available_memory_bytes=(None if self.plan.num_blocks
                                        else int(self.plan.memory_bytes or 0)),
                max_model_len=self.plan.max_model_len, enable_caching=self.plan.enable_caching,
                vocab_size=self.plan.vocab_size or None,
                host_tier_blocks=self.plan.host_tier_blocks)
        except CacheError as exc:
            if exc.code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
                raise CacheUnavailable(exc.message) from None
            raise
        return self.info

    def step(self, ops: Sequence[pb.Op], *, begin_step: bool = False) -> StepResult:
        """One engine Step: resent while its outcome is in doubt (up to ``in_doubt_retry_s``),
        timed; raises PoolLost (the service forgot the pool or our session) or
        CacheUnavailable."""
        start = time.perf_counter()
        try:
            return self._send_until_settled(ops, begin_step, start + self.in_doubt_retry_s)
        except CacheError as exc:
            # The service names the field of every NOT_FOUND: ours is the pool id, or the
            # session the service forgot (a restart without a data dir).
            if exc.code == grpc.StatusCode.NOT_FOUND and exc.field in ("pool_id", "session_id"):
                raise PoolLost(exc.message, field=exc.field) from None
            if exc.code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
                raise CacheUnavailable(exc.message) from None
            raise
        finally:
            end = time.perf_counter()
            self.call_seconds += end - start
            self.calls += 1
            self.intervals.append((start, end))

    def evict_blocks(self, block_ids: Sequence[int]) -> None:
        """Has the service drop these device blocks' cache entries (their data is garbage:
        a failed host-tier promotion); raises CacheUnavailable / PoolLost like
        :meth:`step`."""
        try:
            self.client.reset_prefix_cache(self.plan.pool_id, block_ids=block_ids)
        except CacheError as exc:
            if exc.code == grpc.StatusCode.NOT_FOUND and exc.field in ("pool_id", "session_id"):
                raise PoolLost(exc.message, field=exc.field) from None
            if exc.code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
                raise CacheUnavailable(exc.message) from None
            raise

    def stats(self) -> PoolStats:
        """The pool's usage and counters."""
        return self.client.stats(self.plan.pool_id)
