"""Replication: every pool's owner streams its log to a hot standby, which takes the pool
over with its state when the owner dies (cluster mode without shared storage).

**Owner side** (:class:`Replicator`, the state's durability hook wrapped around the data
directory's): every record ``ServiceState.apply`` accepts is appended to the local log
first, then numbered and queued for each standby link. With ``sync``, ``sync()`` (awaited
before a call is answered) also waits until every wanted standby acknowledged every record
appended so far, so a client is answered only for records a second replica holds. A
standby that is unreachable or still catching up is waited for at most ``timeout`` seconds
since it stopped being live; after that the owner answers without it (degraded, logged and
in ``kvcache_replication_degraded``), but only after etcd records that the pool has no
standby in sync (below). A standby that *refuses* a record (it saw a newer
fencing token: another replica owns the pool now) fails the call: a fenced owner never
gets a write acknowledged.

The standbys of an owner are, for each pool it owns, the pool's rendezvous owner among the
other members: the replica that claims the pool when this one is gone (placement needs no
new state). Each link gets the owner's *whole* log (the sessions and sequence numbers a
pool's calls depend on span pools), so the standby's copy is exactly the owner's state.

**In sync, by record** (``syncs/<pool>`` in etcd, :class:`~cache_service.cluster.keys.
SyncStandby`, written only through placement's transaction conditioned on the pool's
fencing token): the owner names a pool's standby there once the standby acknowledged
every record a write was answered without it (:attr:`Link.skipped`); before it answers a
write the standby it may have named lacks, it records that none is in sync, and a write
whose record etcd refuses or cannot take is not answered (in doubt). Naming and recording
out take one lock, so no write is answered between the check and the record.

**Standby side** (:class:`Standby`, the ``kvcache.internal.v1.ReplicationService``): one
:class:`Shadow` per source replica, a :class:`~cache_service.state.ServiceState` built from
the owner's snapshot and advanced by ``ServiceState.apply`` for each record (hot: nothing
to replay at promotion). A record is acknowledged on receipt and applied right after the
acknowledgement is sent (the standby's apply is off the owner's answer path); a promotion
applies whatever is still pending first. The standby refuses a stream whose sender is a
member under another lease than the one it names (a sender it does not know yet is asked
to retry), and a record for a pool that it owns itself or that etcd shows owned under a
newer token than the record's (fencing at the standby).

**Promotion** (:meth:`Standby.promote`): when the owner's lease expires the standby claims
the pool through placement's create-if-absent transaction (a new fencing token) and
installs it from its shadow through an ``AdoptPool`` record in its own log: same
incarnation, the sessions with their stored answers (a resent in-doubt Step is answered,
not applied twice). With ``sync`` the shadow is used only if ``syncs/<pool>``, read after
the claim fenced the old owner (so it cannot change any more), names this replica for the
shadow's very stream (owner, lease, epoch): a record, whatever the clocks say about when
each side noticed a broken stream. With ``async`` (nothing recorded) it is used if it was
live when its stream broke, less than ``timeout - ttl`` ago. Otherwise the pool is not
restored and clients register it again (a new incarnation): never a silent divergence.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import hmac
import pickle
import secrets
import time
from collections import deque
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import grpc
import structlog

from cache_service.cluster.etcd import ETCD_ERRORS
from cache_service.cluster.keys import SyncStandby, rendezvous_owner
from cache_service.core.errors import KVCacheError
from cache_service.errors import Unavailable
from cache_service.fairness import PoolGate
from cache_service.snapshot import dumps_state
from cache_service.state import DurabilityHook, ServiceState, WalRecord
from kvcache_common.api.kvcache.internal.v1 import replication_pb2 as rpb
from kvcache_common.api.kvcache.internal.v1 import replication_pb2_grpc as rpb_grpc

_log = structlog.get_logger("cache_service.cluster")

#: Records of one pool, fenced by its token (the others carry token 0).
_FENCED = frozenset({"step", "register_pool", "delete_pool", "reset_prefix_cache"})
#: Records ``syncs/<pool>`` := value while this replica owns the pool at the token (see
#: :meth:`~cache_service.cluster.placement.Placement.record_sync`).
RecordSync = Callable[[str, int, bytes], Awaitable[bool]]
#: Snapshot chunk size (under the default 64 MiB message limit).
CHUNK = 4 << 20
#: Records kept for a standby that reconnects (older ones: a snapshot instead).
BUFFER_RECORDS = 200_000
_NO_LIMIT = 1 << 62
#: What ``Replicator.recorded`` holds for a pool whose ``syncs/`` key is in doubt: no link
#: has this name, so the next write answered records the pool out first.
UNKNOWN = ""


class Fenced(Unavailable):
    """A standby refused this owner's record: another replica owns the pool now."""


def mac(key: bytes, *parts: bytes | str | int) -> bytes:
    """HMAC-SHA256 of ``parts`` (each length-prefixed, so no two part lists collide)
    under the cluster's replication secret."""
    h = hmac.new(key, digestmod=hashlib.sha256)
    for part in parts:
        data = part.encode() if isinstance(part, str) else (
            part.to_bytes(8, "big", signed=True) if isinstance(part, int) else part)
        h.update(len(data).to_bytes(8, "big"))
        h.update(data)
    return h.digest()


def standby_of(pool_id: str, owner: str, members: Any) -> str | None:
    """The standby of ``pool_id`` owned by ``owner``: its rendezvous owner among the other
    members (None when there is none)."""
    return rendezvous_owner(pool_id, [m for m in members if m != owner])


# -- owner side ---------------------------------------------------------------------------


@dataclass
class Link:
    """The stream to one standby."""

    member: str
    address: str
    acked: int = 0
    #: Caught up (its snapshot acknowledged) and connected.
    up: bool = False
    #: When it stopped being up (or was created); None while up.
    down_since: float | None = field(default_factory=time.monotonic)
    fenced: str | None = None
    task: asyncio.Task | None = None
    degraded_logged: bool = False
    #: The newest record a write was answered without this standby's acknowledgement of
    #: (at creation: every record so far); etcd may name it in sync once it acked this.
    skipped: int = 0
    #: Set when there is something to send, or the stream's reader ended.
    wake: asyncio.Event = field(default_factory=asyncio.Event)


class Replicator:
    """The state's durability hook in cluster mode with replication: ``inner`` (the data
    directory, or the in-memory default) first, then the standbys (see the module
    docstring). ``owned`` maps the pools this replica owns to their fencing tokens;
    ``members`` the live members to their addresses."""

    keeps_records = True

    def __init__(self, inner: DurabilityHook, state: ServiceState, *, mode: str,
                 timeout: float, me: Callable[[], str], lease: Callable[[], int],
                 owned: Callable[[], dict[str, int]],
                 members: Callable[[], dict[str, str]],
                 channel_options: list[tuple[str, Any]] | None = None) -> None:
        assert mode in ("sync", "async")
        self.inner = inner
        self.state = state
        self.mode = mode
        self.timeout = timeout
        self.epoch = secrets.token_hex(8)
        self.index = 0
        self.links: dict[str, Link] = {}
        self._me, self._lease, self._owned, self._members = me, lease, owned, members
        self._buffer: deque[rpb.ReplicatedRecord] = deque(maxlen=BUFFER_RECORDS)
        self._changed = asyncio.Event()
        self._options = channel_options or []
        self._closed = False
        self.needs_sync = mode == "sync" or inner.needs_sync
        #: The cluster's replication secret (set by the node when it joins, before any
        #: stream starts): every message a standby acts on carries its MAC.
        self.key = b""
        #: The servicer's pool gate (set by the server): a snapshot waits until no sliced
        #: call is half applied.
        self.gate: PoolGate | None = None
        #: Writes a pool's ``syncs/`` key (set by the node once placement exists).
        self.record: RecordSync | None = None
        #: pool id -> (the standby that etcd may name in sync for it, the token it was
        #: named under) -- pessimistic: set before that write, cleared only after the
        #: write naming none succeeded.
        self.recorded: dict[str, tuple[str, int]] = {}
        self._record_lock = asyncio.Lock()
        self._recorder: asyncio.Task | None = None
        #: Some owned pool's standby may be due to be named in sync.
        self._naming_due = False

    # -- the durability hook ------------------------------------------------------------

    def __getattr__(self, name: str) -> Any:
        # The data directory's own attributes (wal, snapshotter, sealed, seal, close, ...).
        return getattr(self.inner, name)

    def append(self, record: WalRecord) -> None:
        """Logs locally, then queues the record for every standby (numbered in apply
        order). Raises what the local log raises, with nothing queued."""
        if self.inner.keeps_records:
            self.inner.append(record)
        kind = record.WhichOneof("mutation")
        pool_id = getattr(record, kind).pool_id if kind in _FENCED else ""
        self.index += 1
        self._buffer.append(rpb.ReplicatedRecord(
            index=self.index, record=record.SerializeToString(), pool_id=pool_id,
            token=self._owned().get(pool_id, 0) if pool_id else 0))
        self._notify()

    async def sync(self) -> None:
        """The local log's sync, then (``sync``) every wanted standby's acknowledgement of
        every record appended so far; raises :class:`Fenced` when a standby refused one."""
        target = self.index
        if self.inner.needs_sync:
            await self.inner.sync()
        if self.mode == "sync":
            await self.replicated(target)

    async def replicated(self, target: int) -> None:
        """Returns once every wanted standby that is live, or has been down for less than
        the timeout, acknowledged record ``target``."""
        while True:
            if self._closed:
                raise Unavailable("this replica is leaving (replication stopped): the "
                                  "call's outcome is in doubt; retry on another replica")
            now = time.monotonic()
            waiting: list[Link] = []
            for link in self.links.values():
                if link.fenced is not None:
                    raise Fenced(f"standby {link.member} refused this replica's records "
                                 f"({link.fenced}); this replica lost its pools: retry")
                if link.acked >= target:
                    continue
                if link.down_since is not None and now - link.down_since >= self.timeout:
                    if not link.degraded_logged:
                        link.degraded_logged = True
                        _log.warning("replication_degraded", standby=link.member,
                                     down_seconds=round(now - link.down_since, 3),
                                     detail="writes are answered without this standby")
                    continue
                waiting.append(link)
            if not waiting:
                for link in self.links.values():
                    if link.acked < target:
                        link.skipped = max(link.skipped, target)
                # No await between this and the check of what etcd names in sync.
                if await self._record_out(target):
                    continue  # the lock was awaited: look again
                if self._naming_due:
                    # A standby that became live is named before this write is answered,
                    # so a failover right after keeps the pool (a failure to name it only
                    # costs that: the write is safe either way).
                    with contextlib.suppress(Exception):
                        await self._record_in_once()
                return
            wake = self._changed
            downs = [link.down_since + self.timeout for link in waiting
                     if link.down_since is not None]
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(wake.wait(), (min(downs) - now) if downs else None)

    def _unsynced(self, target: int) -> list[str]:
        """Owned pools whose standby etcd may name in sync lacks record ``target``."""
        owned = self._owned()
        stale = []
        for pool_id, (standby, _) in list(self.recorded.items()):
            link = self.links.get(standby)
            if link is None or link.acked < target:
                stale.append(pool_id)
            elif pool_id not in owned:
                del self.recorded[pool_id]  # fenced: its key is the next owner's now
        return stale

    async def _record_out(self, target: int) -> bool:
        """Before a write is answered without the standby etcd names in sync for some
        pool, records that pool's ``syncs/`` key as naming none (so that standby does not
        promote a copy that lacks the write). False when nothing had to be recorded;
        raises Unavailable (the write is not answered: in doubt) when etcd refuses or
        cannot be reached."""
        if not self._unsynced(target):
            return False
        async with self._record_lock:
            owned = self._owned()
            for pool_id in self._unsynced(target):
                standby, _ = self.recorded[pool_id]
                token = owned.get(pool_id)
                if token is None:
                    # Lost meanwhile: its new owner may hold a copy without this record.
                    del self.recorded[pool_id]
                    raise Unavailable(f"this replica lost pool {pool_id!r} before its "
                                      "standby had the call's record: the outcome is in "
                                      "doubt; retry")
                value = SyncStandby(self._me(), self._lease(), self.epoch, None).encode()
                try:
                    ok = self.record is not None and await self.record(
                        pool_id, token, value)
                except ETCD_ERRORS as exc:
                    raise Unavailable(f"cannot record in etcd that pool {pool_id!r} goes on "
                                      f"without its standby {standby} ({exc}): the call's "
                                      "outcome is in doubt; retry") from exc
                if not ok:
                    raise Unavailable(f"this replica lost pool {pool_id!r} (its fencing "
                                      "token moved): the call's outcome is in doubt; retry")
                del self.recorded[pool_id]
                self._naming_due = True  # named again once it caught up
                _log.warning("replication_degraded_recorded", pool_id=pool_id,
                             standby=standby,
                             detail="etcd names no standby in sync: a failover of this "
                             "pool now starts a new incarnation")
        return True

    async def _record_in(self) -> None:
        """Names in etcd, for each owned pool, its standby once that standby is caught up
        (acknowledged every record a write was answered without it, and every record
        before it was chosen), so that it may promote its copy. Runs until
        cancelled; an etcd failure is retried after a pause (a timer)."""
        while True:
            wake = self._changed
            try:
                if self._naming_due:
                    await self._record_in_once()
            except Exception as exc:  # noqa: BLE001 - etcd away: retried, never ends
                _log.warning("sync_standby_not_recorded", error=f"{type(exc).__name__}: "
                             f"{exc}")
                await asyncio.sleep(0.5)
                continue
            await wake.wait()

    async def _record_in_once(self) -> None:
        self._naming_due = False
        me, members = self._me(), self._members()
        for pool_id, token in list(self._owned().items()):
            standby = standby_of(pool_id, me, members)
            # A pool owned again under a new token (e.g. a new lease) is named anew: the
            # standby's copy of the new stream is what a promotion checks against.
            if standby is None or self.recorded.get(pool_id) == (standby, token):
                continue
            async with self._record_lock:
                link = self.links.get(standby)
                if self._owned().get(pool_id) != token:
                    continue
                if link is None or not link.up or link.acked < link.skipped:
                    self._naming_due = True  # looked at again after its next ack
                    continue
                # Pessimistic: from now on a write answered without it records it out.
                self.recorded[pool_id] = (standby, token)
                value = SyncStandby(me, self._lease(), self.epoch, standby).encode()
                try:
                    ok = self.record is not None and await self.record(pool_id, token,
                                                                       value)
                except BaseException:
                    # In doubt: etcd names the new standby or still the one before.
                    self.recorded[pool_id] = (UNKNOWN, token)
                    self._naming_due = True
                    raise
                if not ok:
                    # Not the owner any more (not written): whatever etcd named stays, and
                    # a write answered now must fail (recording none is refused).
                    self.recorded[pool_id] = (UNKNOWN, token)
                    continue
                _log.info("sync_standby_recorded", pool_id=pool_id, standby=standby,
                          index=link.acked)

    def _notify(self) -> None:
        self._changed.set()
        self._changed = asyncio.Event()
        for link in self.links.values():
            link.wake.set()

    # -- which standbys -----------------------------------------------------------------

    @property
    def degraded(self) -> bool:
        """Some owned pool has no standby that is up."""
        me, members = self._me(), self._members()
        for pool_id in self._owned():
            standby = standby_of(pool_id, me, members)
            link = self.links.get(standby) if standby is not None else None
            if link is None or not link.up:
                return True
        return False

    def refresh(self) -> None:
        """Links to the standbys of the owned pools; links to replicas that are no
        standby any more end (placement calls this after every change)."""
        if self._closed:
            return
        if self._recorder is None and self.mode == "sync":
            self._recorder = asyncio.create_task(self._record_in(), name="sync-standby")
        self._naming_due = True  # the owned pools or their standbys may have changed
        me, members = self._me(), self._members()
        wanted: dict[str, str] = {}
        for pool_id in self._owned():
            standby = standby_of(pool_id, me, members)
            if standby is not None:
                wanted[standby] = members[standby]
        for member, link in list(self.links.items()):
            if member not in wanted or wanted[member] != link.address:
                if link.task is not None:
                    link.task.cancel()
                del self.links[member]
                _log.info("standby_dropped", standby=member)
        for member, address in wanted.items():
            if member not in self.links:
                link = self.links[member] = Link(member, address, skipped=self.index)
                link.task = asyncio.create_task(self._run(link), name=f"replicate-{member}")
                _log.info("standby_chosen", standby=member, address=address)
        self._notify()

    async def close(self) -> None:
        self._closed = True
        if self._recorder is not None:
            self._recorder.cancel()
            await asyncio.gather(self._recorder, return_exceptions=True)
        for link in self.links.values():
            if link.task is not None:
                link.task.cancel()
        await asyncio.gather(*(link.task for link in self.links.values() if link.task),
                             return_exceptions=True)
        self.links.clear()
        self._notify()

    # -- one link -----------------------------------------------------------------------

    async def _run(self, link: Link) -> None:
        """Connects, fills and follows one standby until cancelled (reconnecting after a
        failure; a pause between attempts is a timer, not a synchronization)."""
        while True:
            try:
                async with grpc.aio.insecure_channel(link.address,
                                                     options=self._options) as channel:
                    await self._stream(link, rpb_grpc.ReplicationServiceStub(channel))
            except asyncio.CancelledError:
                raise
            except grpc.aio.AioRpcError as exc:
                if exc.code() == grpc.StatusCode.FAILED_PRECONDITION:
                    link.fenced = exc.details() or "fenced"
                    _log.warning("replication_fenced", standby=link.member,
                                 reason=link.fenced)
                else:
                    _log.warning("replication_broken", standby=link.member,
                                 error=f"{exc.code().name}: {exc.details()}")
            except (ConnectionError, asyncio.InvalidStateError) as exc:  # the stream ended
                _log.warning("replication_broken", standby=link.member, error=str(exc))
            except Exception as exc:  # noqa: BLE001 - a link never ends by itself
                _log.exception("replication_failed", standby=link.member, error=str(exc))
            if link.up:
                link.up = False
                link.down_since = time.monotonic()
            self._notify()
            await asyncio.sleep(0.2)

    async def _stream(self, link: Link, stub: rpb_grpc.ReplicationServiceStub) -> None:
        call = stub.Replicate()
        me, lease = self._me(), self._lease()
        await call.write(rpb.ReplicateRequest(hello=rpb.ReplicaHello(
            source=me, epoch=self.epoch, lease=lease,
            mac=mac(self.key, "hello", me, self.epoch, lease))))
        first = await call.read()
        if first is grpc.aio.EOF:
            raise ConnectionError("the standby ended the stream")
        link.fenced = None
        reader = asyncio.create_task(self._acks(link, call))
        try:
            position = first.index if first.has_state else 0
            if not first.has_state or position > self.index \
                    or not self._continues(position):
                position = await self._send_snapshot(call)
            live = False
            while True:
                if reader.done():
                    reader.result()  # raises the stream's error
                    raise ConnectionError("the standby ended the stream")
                if position < self.index:
                    if not self._continues(position):
                        position = await self._send_snapshot(call)
                        continue
                    # Looked up afresh each time: the buffer drops old records meanwhile.
                    record = self._buffer[position - self._buffer[0].index + 1]
                    if len(record.record) > CHUNK:
                        # e.g. an AdoptPool carrying a big pool: the (chunked) snapshot
                        # covers it, so a message never exceeds the limit.
                        position = await self._send_snapshot(call)
                        continue
                    if not record.mac:  # signed once, when first sent
                        record.mac = mac(self.key, self.epoch, record.index, record.pool_id,
                                         record.token, record.record)
                    await call.write(rpb.ReplicateRequest(record=record))
                    position = record.index
                    continue
                if not live:
                    await call.write(rpb.ReplicateRequest(live=rpb.ReplicaLive()))
                    live = True
                link.wake.clear()
                if position == self.index and not reader.done():
                    await link.wake.wait()
        finally:
            reader.cancel()
            with contextlib.suppress(asyncio.CancelledError, grpc.aio.AioRpcError):
                await reader
            call.cancel()

    def _continues(self, position: int) -> bool:
        """Record ``position + 1`` onwards is still buffered."""
        if position == self.index:
            return True
        return bool(self._buffer) and self._buffer[0].index <= position + 1

    async def _send_snapshot(self, call: Any) -> int:
        """The whole state as of the newest record, in chunks; answers its index. Taken
        when no sliced call is half applied (a Step's commit may yield between slices
        after its record was appended), with no await before it is pickled."""
        if self.gate is not None:
            await self.gate.wait_all_idle()
        index = self.index
        payload = dumps_state(self.state)
        signature = mac(self.key, self.epoch, index, payload)
        for offset in range(0, max(len(payload), 1), CHUNK):
            chunk = payload[offset:offset + CHUNK]
            last = offset + CHUNK >= len(payload)
            await call.write(rpb.ReplicateRequest(snapshot=rpb.ReplicaSnapshot(
                index=index, chunk=chunk, last=last, mac=signature if last else b"")))
        _log.info("standby_snapshot_sent", index=index, bytes=len(payload))
        return index

    async def _acks(self, link: Link, call: Any) -> None:
        try:
            await self._read_acks(link, call)
        finally:
            link.wake.set()  # the sender notices the end

    async def _read_acks(self, link: Link, call: Any) -> None:
        while (ack := await call.read()) is not grpc.aio.EOF:
            link.acked = max(link.acked, ack.index)
            if not link.up:  # any answer after the Hello follows a snapshot or a tail
                link.up = True
                self._naming_due = True
                link.down_since = None
                link.degraded_logged = False
                _log.info("standby_live", standby=link.member, index=link.acked)
            # Only the writers waiting for acknowledgements: the senders have nothing new.
            self._changed.set()
            self._changed = asyncio.Event()


# -- standby side -------------------------------------------------------------------------


@dataclass
class Shadow:
    """This replica's copy of another replica's state."""

    source: str
    epoch: str
    lease: int
    state: ServiceState | None = None
    index: int = 0
    #: When the copy stopped being live (its stream broke, or it is not caught up yet).
    broken_at: float | None = field(default_factory=time.monotonic)
    #: Highest fencing token seen per pool.
    tokens: dict[str, int] = field(default_factory=dict)
    #: Its owner lost a pool to this replica: no record of this source is taken any more.
    fenced: bool = False
    streams: int = 0
    #: Records acknowledged but not applied yet (applied right after the acknowledgement).
    pending: deque[rpb.ReplicatedRecord] = field(default_factory=deque)

    def safe(self, now: float, trust: float) -> bool:
        """Holds every record the source can have answered (see the module docstring)."""
        return self.state is not None and (self.broken_at is None
                                           or now - self.broken_at < trust)


def _apply(state: ServiceState, record: WalRecord) -> None:
    """Applies an owner's record as recovery does: under no limits (it was accepted under
    the owner's)."""
    registry = state.registry
    limits = state.max_ops_per_step, state.max_tokens_per_step, registry.max_total_blocks
    state.max_ops_per_step = state.max_tokens_per_step = registry.max_total_blocks = _NO_LIMIT
    try:
        state.apply(record)
    finally:
        state.max_ops_per_step, state.max_tokens_per_step, registry.max_total_blocks = limits


class Standby(rpb_grpc.ReplicationServiceServicer):
    """The Replication service: keeps one :class:`Shadow` per source. ``members`` answers
    member id -> lease of the live members, ``owners`` pool id -> (member, token) as etcd
    shows them, ``owned`` the pools this replica serves."""

    def __init__(self, *, me: Callable[[], str], members: Callable[[], dict[str, int]],
                 owners: Callable[[], dict[str, tuple[str, int]]],
                 owned: Callable[[], dict[str, int]], trust: float,
                 by_record: bool = True) -> None:
        self._me, self._members, self._owners, self._owned = me, members, owners, owned
        self.trust = trust
        #: ``sync``: a copy is promoted only if etcd names it in sync (``syncs/<pool>``);
        #: ``async`` (no such record: the owner never waits) keeps the timing rule.
        self.by_record = by_record
        self.shadows: dict[str, Shadow] = {}
        #: The cluster's replication secret (set by the node when it joins; until then
        #: every stream is refused).
        self.key = b""

    async def Replicate(self, request_iterator: AsyncIterator[rpb.ReplicateRequest],
                        context: grpc.aio.ServicerContext) -> AsyncIterator[rpb.ReplicateResponse]:
        first = await anext(aiter(request_iterator), None)
        if first is None or first.WhichOneof("kind") != "hello":
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                                "the first message of a stream must be a hello")
        assert first is not None  # aborted above
        hello = first.hello
        if not self.key:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "this replica has not joined yet")
        if not hmac.compare_digest(hello.mac, mac(self.key, "hello", hello.source,
                                                  hello.epoch, hello.lease)):
            await context.abort(grpc.StatusCode.UNAUTHENTICATED,
                                "hello.mac: not signed with this cluster's replication key")
        members = self._members()
        if hello.source not in members or hello.source == self._me():
            # Not fenced: this replica may be joining, or its view of etcd lags behind
            # (the sender retries; its writes wait for this standby meanwhile).
            await context.abort(grpc.StatusCode.UNAVAILABLE,
                                f"{hello.source!r} is no member this replica knows (yet)")
        if members[hello.source] != hello.lease:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION,
                                f"{hello.source!r} is no live member under lease "
                                f"{hello.lease} as this replica sees etcd")
        shadow = self.shadows.get(hello.source)
        if shadow is not None and shadow.fenced and shadow.lease == hello.lease:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION,
                                f"{hello.source} lost its pools to {self._me()} under "
                                f"lease {hello.lease}")
        if shadow is None or (shadow.epoch, shadow.lease) != (hello.epoch, hello.lease):
            shadow = self.shadows[hello.source] = Shadow(hello.source, hello.epoch,
                                                         hello.lease)
        shadow.streams += 1
        yield rpb.ReplicateResponse(index=shadow.index, has_state=shadow.state is not None)
        chunks: list[bytes] = []
        try:
            async for message in request_iterator:
                kind = message.WhichOneof("kind")
                if shadow.fenced:
                    await context.abort(grpc.StatusCode.FAILED_PRECONDITION,
                                        f"{hello.source} lost its pools to {self._me()}")
                if kind == "record":
                    await self._record(shadow, message.record, context)
                    yield rpb.ReplicateResponse(index=shadow.index, has_state=True)
                    if not self._catch_up(shadow):
                        await context.abort(grpc.StatusCode.ABORTED,
                                            "this copy diverged from its owner; refill it")
                elif kind == "snapshot":
                    chunks.append(message.snapshot.chunk)
                    if message.snapshot.last:
                        payload = b"".join(chunks)
                        if not hmac.compare_digest(message.snapshot.mac, mac(
                                self.key, shadow.epoch, message.snapshot.index, payload)):
                            await context.abort(
                                grpc.StatusCode.UNAUTHENTICATED,
                                "snapshot.mac: not signed with this cluster's replication key")
                        # Written by dumps_state on a live member and signed with the
                        # cluster's secret (checked above), like a snapshot file of this
                        # service, never by a client.
                        state = pickle.loads(payload)  # noqa: S301
                        chunks.clear()
                        shadow.state, shadow.index = state, message.snapshot.index
                        shadow.pending.clear()
                        shadow.broken_at = shadow.broken_at or time.monotonic()
                        _log.info("standby_filled", source=hello.source,
                                  index=shadow.index, pools=len(state.registry))
                        yield rpb.ReplicateResponse(index=shadow.index, has_state=True)
                elif kind == "live" and shadow.state is not None:
                    shadow.broken_at = None
        finally:
            shadow.streams -= 1
            if shadow.streams == 0 and shadow.broken_at is None:
                shadow.broken_at = time.monotonic()

    async def _record(self, shadow: Shadow, message: rpb.ReplicatedRecord,
                      context: grpc.aio.ServicerContext) -> None:
        """Checks one record (it continues the copy; fencing) and keeps it to be applied:
        it is acknowledged on receipt, applied right after the acknowledgement is sent
        (:meth:`_catch_up`; a promotion applies what is pending first), so the standby's
        apply is off the owner's answer path."""
        if not hmac.compare_digest(message.mac, mac(self.key, shadow.epoch, message.index,
                                                    message.pool_id, message.token,
                                                    message.record)):
            await context.abort(grpc.StatusCode.UNAUTHENTICATED,
                                "record.mac: not signed with this cluster's replication key")
        if shadow.state is None or message.index != shadow.index + 1:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                                f"record {message.index} does not continue this copy "
                                f"(at {shadow.index}, state {shadow.state is not None})")
        pool_id, token = message.pool_id, message.token
        if pool_id and token:
            owner = self._owners().get(pool_id)
            # A view that names another member under an older token is merely behind
            # (the watch delivers the newer key soon): only a newer token fences.
            if pool_id in self._owned() or token < shadow.tokens.get(pool_id, 0) or (
                    owner is not None and owner[1] > token):
                await context.abort(grpc.StatusCode.FAILED_PRECONDITION,
                                    f"pool {pool_id!r} is owned under a newer fencing token "
                                    f"than {token}")
            shadow.tokens[pool_id] = token
        shadow.pending.append(message)
        shadow.index = message.index

    @staticmethod
    def _catch_up(shadow: Shadow) -> bool:
        """Applies the records received but not applied yet; False (the copy is dropped:
        it diverged, the owner refills it) when one is rejected."""
        while shadow.pending and shadow.state is not None:
            message = shadow.pending.popleft()
            try:
                _apply(shadow.state, WalRecord.FromString(message.record))
            except KVCacheError as exc:
                # The owner accepted it on the same state: this copy diverged.
                _log.error("standby_diverged", source=shadow.source, index=message.index,
                           error=str(exc))
                shadow.state, shadow.index = None, 0
                shadow.pending.clear()
                return False
        return shadow.state is not None

    def named(self, shadow: Shadow, record: SyncStandby | None) -> bool:
        """etcd's ``syncs/<pool>`` names this replica the in-sync standby of the very
        stream ``shadow`` copies (same owner, lease and epoch)."""
        return record is not None and record.standby == self._me() and (
            record.owner, record.lease, record.epoch) == (shadow.source, shadow.lease,
                                                          shadow.epoch)

    def take(self, pool_id: str, holder: str,
             record: SyncStandby | None = None) -> bytes | None:
        """The state of ``pool_id`` (``export_pool``) from the copy of ``holder``'s state,
        when that copy is safe: with ``by_record``, ``record`` (the pool's ``syncs/`` key,
        read after the claim fenced the holder) names this copy (:meth:`named`); else
        :meth:`Shadow.safe`. The holder is fenced here from now on. None (logged) when
        there is no safe copy."""
        shadow = self.shadows.get(holder)
        now = time.monotonic()
        if shadow is not None:
            self._catch_up(shadow)  # every record acknowledged is in the copy
        safe = shadow is not None and (self.named(shadow, record) if self.by_record
                                       else shadow.safe(now, self.trust))
        if shadow is None or not safe or shadow.state is None \
                or pool_id not in shadow.state.registry:
            _log.warning("standby_copy_unusable", pool_id=pool_id, holder=holder,
                         named=None if record is None else record.standby,
                         has_copy=shadow is not None and shadow.state is not None,
                         broken_seconds=None if shadow is None or shadow.broken_at is None
                         else round(now - shadow.broken_at, 3))
            return None
        shadow.fenced = True
        return shadow.state.export_pool(pool_id)
