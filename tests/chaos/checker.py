"""The chaos tier's one checker: what a client saw acknowledged is there exactly once.

A load client (``load.py``) keeps, per pool, the history it sent: the RegisterPool and every
Step with its outcome -- ``"ack"`` (answered), ``"doubt"`` (an in-doubt error left after the
client's resend bound: applied or not, nobody knows) or ``"rejected"`` (a definite error:
not applied). One client per pool, one call at a time, so the pool's history is a sequence.

:func:`check` replays the acknowledged history of each pool through the pure core (a fresh
:class:`cache_service.state.ServiceState`: ``apply`` is deterministic) and compares what the
replay holds with what the service answers now: every request's block tables and counts
(GetRequest), every freed request gone (NOT_FOUND), and the pool's stats (GetPoolStats,
the event sequence included). A Step in doubt (at most the last one of a history: the load
client stops after one) may have been applied or not: the replay is tried both ways, and
either matching is exact. Anything else is a verdict against the service:

* ``lost``: requests whose state is short of the replay (an acknowledged Step missing, a
  freed request back, a request gone);
* ``duplicated``: requests past the replay (a Step applied twice);
* ``mismatched``: pools whose other state (tables, stats) differs.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Literal

import grpc

from cache_service import convert
from cache_service.client import CacheClient, CacheError, PoolStats, RequestState
from cache_service.client._results import request_state_from, stats_from
from cache_service.registry import PoolRegistry
from cache_service.state import ServiceState
from kvcache_common.api.kvcache.v1 import cache_service_pb2 as pb

Outcome = Literal["ack", "doubt", "rejected"]


@dataclass
class Sent:
    """One Step of a history: the request (unstamped), its outcome, and how long it took."""

    request: pb.StepRequest
    outcome: Outcome
    seconds: float
    error: str = ""


@dataclass
class History:
    """What one client sent to one pool, in order."""

    register: pb.RegisterPoolRequest
    steps: list[Sent] = field(default_factory=list)
    #: every request id an acknowledged (or doubtful) Step added
    request_ids: set[str] = field(default_factory=set)

    @property
    def pool_id(self) -> str:
        return self.register.pool_id

    def record(self, request: pb.StepRequest, outcome: Outcome, seconds: float,
               error: str = "") -> None:
        plain = pb.StepRequest()
        plain.CopyFrom(request)
        plain.ClearField("session_id")
        plain.ClearField("sequence")
        self.steps.append(Sent(plain, outcome, seconds, error))
        if outcome != "rejected":
            self.request_ids |= {op.add_request.request_id for op in plain.ops
                                 if op.WhichOneof("op") == "add_request"}


@dataclass
class PoolView:
    """A pool as one side (the service, or the replay) holds it."""

    stats: PoolStats | None  # None: the pool is gone
    requests: dict[str, RequestState]  # the live ones among the history's request ids


@dataclass
class Verdict:
    """The outcome of :func:`check` over every pool."""

    acknowledged: int = 0
    in_doubt: int = 0
    rejected: int = 0
    lost: int = 0
    duplicated: int = 0
    mismatched: list[str] = field(default_factory=list)
    #: the longest time one Step took (a stall), seconds
    longest_step: float = 0.0
    errors: list[str] = field(default_factory=list)

    @property
    def exact(self) -> bool:
        return not (self.lost or self.duplicated or self.mismatched)

    def explain(self) -> str:
        return (f"{self.acknowledged} acknowledged, {self.in_doubt} in doubt, "
                f"{self.rejected} rejected, {self.lost} lost, {self.duplicated} duplicated, "
                f"mismatched pools {self.mismatched}, longest Step "
                f"{self.longest_step:.2f} s; errors {self.errors[:5]}")


def replay(history: History, include_doubt: bool) -> PoolView:
    """The pool after its acknowledged Steps (and the doubtful one, if ``include_doubt``),
    applied to a fresh core state."""
    state = ServiceState(PoolRegistry())
    state.apply_call("register_pool", history.register)
    for sent in history.steps:
        if sent.outcome == "ack" or (sent.outcome == "doubt" and include_doubt):
            state.apply_call("step", sent.request)
    entry = state.registry.get(history.pool_id)
    pool = entry.pool
    requests = {}
    for rid in history.request_ids:
        if pool.has_request(rid):
            info = pool.request_info(rid)
            requests[rid] = request_state_from(pb.GetRequestResponse(
                block_ids=convert.tables(pool.block_ids(rid)),
                num_computed_tokens=info.num_computed_tokens, num_tokens=info.num_tokens,
                num_block_hashes=info.num_block_hashes, status=info.status,
                num_preemptions=info.num_preemptions,
                num_placeholder_tokens=info.num_placeholder_tokens))
    return PoolView(stats_from(convert.stats_to_proto(pool.stats(),
                                                      entry.feed.next_sequence - 1)),
                    requests)


def observe(client: CacheClient, history: History) -> PoolView:
    """The pool as the service answers it now."""
    try:
        stats = client.stats(history.pool_id)
    except CacheError as exc:
        if exc.code == grpc.StatusCode.NOT_FOUND:
            return PoolView(None, {})
        raise
    requests = {}
    for rid in sorted(history.request_ids):
        try:
            requests[rid] = client.get_request(history.pool_id, rid)
        except CacheError as exc:
            if exc.code != grpc.StatusCode.NOT_FOUND:
                raise
    return PoolView(stats, requests)


def _compare(seen: PoolView, expected: PoolView) -> tuple[int, int, bool]:
    """(lost, duplicated, other mismatch) of ``seen`` against ``expected``."""
    lost = duplicated = 0
    if seen.stats is None:
        return len(expected.requests) or 1, 0, False
    for rid in set(seen.requests) | set(expected.requests):
        got, want = seen.requests.get(rid), expected.requests.get(rid)
        if got == want:
            continue
        if got is None or want is None:
            lost += 1  # an acknowledged request gone, or an acknowledged free undone
        elif got.num_tokens > want.num_tokens:
            duplicated += 1
        elif got.num_tokens < want.num_tokens:
            lost += 1
        else:
            return lost, duplicated, True
    return lost, duplicated, seen.stats != expected.stats


def check(client: CacheClient, histories: Iterable[History]) -> Verdict:
    """Compares every history's replay with the service (read through ``client``)."""
    verdict = Verdict()
    for history in histories:
        outcomes = [s.outcome for s in history.steps]
        verdict.acknowledged += outcomes.count("ack")
        verdict.in_doubt += outcomes.count("doubt")
        verdict.rejected += outcomes.count("rejected")
        verdict.errors += [s.error for s in history.steps if s.error]
        verdict.longest_step = max([verdict.longest_step]
                                   + [s.seconds for s in history.steps])
        seen = observe(client, history)
        results = [_compare(seen, replay(history, include_doubt=doubt))
                   for doubt in ([False, True] if "doubt" in outcomes else [False])]
        if any(r == (0, 0, False) for r in results):
            continue
        lost, duplicated, other = min(results, key=lambda r: (r[0] + r[1], r[2]))
        verdict.lost += lost
        verdict.duplicated += duplicated
        if other or not (lost or duplicated):
            verdict.mismatched.append(history.pool_id)
    return verdict
