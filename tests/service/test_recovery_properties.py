"""Recovery as a property (no processes): random record sequences go through
``ServiceState.apply`` with a data directory (background snapshots every few records:
compactions of the log into the previous snapshot),
then the "machine crashes" at a random byte of the log's last segment. The state
recovered from the directory must equal the state after exactly the records whose bytes
survived whole -- block tables, free-queue order, prefix-cache map, stats, event feeds,
sessions with their sequence numbers and stored answers -- and must go on answering the
next record identically."""

from __future__ import annotations

import os
import struct
import tempfile
from pathlib import Path
from typing import Any

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from cache_service.client import StepBuilder, layers
from cache_service.client._builders import register_request
from cache_service.core.errors import KVCacheError
from cache_service.core.host_tier import slot_of
from cache_service.durability import open_data_dir
from cache_service.registry import PoolRegistry
from cache_service.state import ServiceState, WalRecord
from cache_service.wal import HEADER_SIZE, SEGMENT_HEADER_SIZE, list_segments
from kvcache_common.api.kvcache.internal.v1 import wal_pb2
from kvcache_common.api.kvcache.v1 import cache_service_pb2 as pb

POOL = "p"
LAYERS = [layers.full_attention("f", block_size=4, num_kv_heads=1, head_size=4),
          layers.sliding_window("s", block_size=4, num_kv_heads=1, head_size=4,
                                sliding_window=8)]


def _new_state(instance_id: str) -> ServiceState:
    return ServiceState(PoolRegistry(16, instance_id=instance_id), lease_ttl_seconds=5.0)


def _replay(state: ServiceState, payload: bytes) -> None:
    state.apply(WalRecord.FromString(payload))


def fingerprint(state: ServiceState) -> dict[str, Any]:
    """Everything observable about a state, in comparable form."""
    pools = {}
    for entry in state.registry:
        pool = entry.pool
        bp = pool.manager.pool
        pools[entry.pool_id] = {
            "incarnation": entry.incarnation,
            "stats": pool.stats(),
            "requests": {rid: (pool.request_info(rid), pool.block_ids(rid))
                         for rid in pool.request_ids()},
            "free_queue": [b.block_id for b in bp.free_block_queue.get_all_free_blocks()],
            "prefix_map": [[(h, [b.block_id for b in (v.values() if isinstance(v, dict)
                                                      else [v])]) for h, v in m.items()]
                           for m in bp._maps],
            "events": (entry.feed.next_sequence, entry.feed.read(entry.feed.oldest, 10**6)),
            "host_tier": _host_tier(pool),
        }
    sessions = {sid: (s.client_name, s.last_sequence, s.expiring,
                      state.ownership.requests_of(sid),
                      s.last_request.SerializeToString() if s.last_request else b"",
                      s.last_response.SerializeToString() if s.last_response else b"")
                for sid, s in state.sessions.items()}
    return {"pools": pools, "sessions": sessions, "counters": state.counters}


def _host_tier(pool: Any) -> Any:
    """A pool's host tier (docs/protocol.md#host-tier): per group its entries in LRU order
    with their slots, the free slots and the reserved ones (None without a tier)."""
    tier = pool.manager.host_tier
    if tier is None:
        return None
    return [([(key, slot_of(p)) for key, p in lru.items()], tier._next_fresh[g],
             list(tier._freed[g]), sorted(tier.reserved[g]))
            for g, lru in enumerate(tier.lru)]


@st.composite
def records(draw: st.DrawFn) -> list[WalRecord]:
    """A plausible client history: mostly valid records (a model tracks request ids and
    session sequence numbers), some invalid ones (rejected, never logged). A third of the
    histories run on a small pool with a small host tier (demotions, promotions, the
    tier's LRU and resets)."""
    tier = draw(st.sampled_from([0, 0, 6]))
    out = [WalRecord(register_pool=register_request(POOL, LAYERS,
                                                    num_blocks=36 if tier else 64,
                                                    max_model_len=64, host_tier_blocks=tier))]
    live: list[str] = []
    sessions: dict[str, int] = {}
    prompts: list[list[int]] = []
    n = 0
    # With a tier: requests that finish at once (their blocks cached and free, to be
    # evicted: demoted) and prompts seen before (hits from host memory: promoted).
    kinds = ["add", "add", "decode", "decode", "free", "preempt", "reset", "open", "close",
             "expire", "bad", "decode_placeholders", "fill", "reset_host_tier"]
    kinds += ["add_free"] * (6 if tier else 0)
    for _ in range(draw(st.integers(1, 40))):
        kind = draw(st.sampled_from(kinds))
        if kind == "open":
            sid = f"s{len(sessions)}"
            sessions[sid] = 0
            out.append(WalRecord(open_session=wal_pb2.OpenSession(session_id=sid)))
            continue
        if kind in ("close", "expire") and sessions:
            sid = draw(st.sampled_from(sorted(sessions)))
            if kind == "close":
                out.append(WalRecord(close_session=pb.CloseSessionRequest(session_id=sid)))
            else:
                out.append(WalRecord(expire_session=wal_pb2.ExpireSession(
                    session_id=sid, max_requests=draw(st.integers(1, 3)))))
            continue
        if kind == "reset":
            out.append(WalRecord(reset_prefix_cache=pb.ResetPrefixCacheRequest(pool_id=POOL)))
            continue
        batch = StepBuilder(POOL, begin_step=draw(st.booleans()))
        if kind == "add_free":
            rid = f"r{n}"
            n += 1
            reuse: bool = bool(prompts) and draw(st.booleans())
            if reuse:
                seen: list[int] = draw(st.sampled_from(prompts))
                prompt = [*seen, draw(st.integers(0, 5))]
            else:
                prompt = draw(st.lists(st.integers(0, 5), min_size=8, max_size=24))
                prompts.append(prompt)
            batch.add(rid, prompt).lookup(rid)
            out.append(WalRecord(step=batch.request))
            batch = StepBuilder(POOL, begin_step=True)
            batch.allocate(rid, len(prompt)).free(rid)  # hit or not: allocate() re-looks up
        elif kind == "add" or not live:
            rid = f"r{n}"
            n += 1
            prompt = draw(st.lists(st.integers(0, 5), min_size=1, max_size=24))
            batch.add(rid, prompt).allocate(rid, len(prompt))
            live.append(rid)
        elif kind == "decode":
            rids = draw(st.lists(st.sampled_from(live), min_size=1, unique=True))
            batch.decode(rids, [draw(st.integers(0, 5)) for _ in rids])
        elif kind == "decode_placeholders":  # rejected unless every token is computed
            batch.decode(draw(st.lists(st.sampled_from(live), min_size=1, unique=True)),
                         placeholders=True)
        elif kind == "fill":  # rejected unless the request has a placeholder
            batch.fill([draw(st.sampled_from(live))], [draw(st.integers(0, 5))])
        elif kind == "reset_host_tier":  # a no-op on a pool without a tier
            batch.reset_host_tier()
        elif kind in ("free", "preempt"):
            rid = draw(st.sampled_from(live))
            if kind == "free":
                batch.free(rid)
                live.remove(rid)
            else:
                batch.preempt(rid)
        else:  # an invalid batch: rejected whole, not logged
            batch.add("bad", [1, 2]).allocate("nobody", 1)
        request = batch.request
        if bool(sessions) and draw(st.booleans()):
            sid = draw(st.sampled_from(sorted(sessions)))
            request.session_id = sid
            # Usually the next number; sometimes a retry of the last or a gap.
            request.sequence = sessions[sid] + draw(st.sampled_from([1, 1, 1, 0, 2]))
            if request.sequence == sessions[sid] + 1:
                sessions[sid] += 1
        out.append(WalRecord(step=request))
    return out


def _apply_all(state: ServiceState, recs: list[WalRecord]) -> list[WalRecord]:
    """Applies each record; answers the accepted ones (the ones a log holds), in order."""
    accepted = []
    for rec in recs:
        try:
            state.apply(rec)
        except KVCacheError:
            continue
        accepted.append(rec)
    return accepted


@settings(max_examples=40, deadline=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(recs=records(), snapshot_every=st.integers(2, 12), cut=st.floats(0, 1),
       torn_snapshot=st.booleans())
def test_recovered_state_is_the_state_after_the_surviving_records(
        recs: list[WalRecord], snapshot_every: int, cut: float, torn_snapshot: bool) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        directory = Path(tmp)
        data_dir, state = open_data_dir(directory, new_state=_new_state, apply=_replay,
                                        fsync="never", snapshot_every=snapshot_every)
        state.durability = data_dir
        # The compaction on a thread: the code a compaction process runs, without starting
        # an interpreter per snapshot (tests/service/test_wal.py and test_durability.py
        # run the real process).
        data_dir.snapshotter.in_process = True
        accepted = _apply_all(state, recs)
        assert accepted[0] is recs[0]  # the pool exists: the history is not vacuous
        # The crash: no final snapshot; a snapshot child may have died mid-write.
        data_dir.snapshotter.wait()
        assert data_dir.snapshotter.failed == 0
        data_dir.wal.close()
        os.close(data_dir._lock_fd)  # what the kernel does for a killed process
        if torn_snapshot:
            (directory / "snapshot-99999999999999999999.tmp").write_bytes(b"half a snapsh")
        snapshot_index = data_dir.snapshotter.last_index
        last = list_segments(directory)[-1][1]
        size = last.stat().st_size
        keep = int(size * cut)
        with open(last, "r+b") as f:
            f.truncate(keep)
        survivors = _surviving_records(last)

        reference = _new_state(data_dir.instance_id)
        expected = accepted[:snapshot_index + survivors]
        assert len(_apply_all(reference, expected)) == len(expected)

        recovered_dir, recovered = open_data_dir(directory, new_state=_new_state,
                                                 apply=_replay, fsync="never")
        try:
            assert recovered_dir.recovery.snapshot_index == snapshot_index
            assert fingerprint(recovered) == fingerprint(reference)
            # Hidden state (pending lookups, step epochs, table caches) shows in answers.
            recovered.durability = recovered_dir
            for rec in recs[-3:]:
                assert _answer(recovered, rec) == _answer(reference, rec)
            assert fingerprint(recovered) == fingerprint(reference)
        finally:
            recovered_dir.close()


def _answer(state: ServiceState, rec: WalRecord) -> Any:
    try:
        return state.apply(rec).SerializeToString()
    except KVCacheError as exc:
        return (type(exc), exc.field)


def _surviving_records(path: Path) -> int:
    """How many whole records the (truncated) segment holds."""
    data = path.read_bytes()
    pos, count = SEGMENT_HEADER_SIZE, 0
    while pos + HEADER_SIZE <= len(data):
        length = struct.unpack_from("<I", data, pos)[0]
        if pos + HEADER_SIZE + length > len(data):
            break
        pos += HEADER_SIZE + length
        count += 1
    return count
