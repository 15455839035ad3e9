"""A cluster member as the server sees it: the pool registry behind the fencing check,
membership + placement started and stopped with the server, redirects and the PeekPrefix
fan-out."""

from __future__ import annotations

import asyncio
import secrets
import socket
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

import grpc
import structlog

from cache_service import convert
from cache_service.calls import REQUEST_ID_KEY, request_id_metadata
from cache_service.cluster.etcd import ETCD_ERRORS, Etcd
from cache_service.cluster.handoff import HandoffError, read_handoff, write_handoff
from cache_service.cluster.keys import KeyLayout, SyncStandby
from cache_service.cluster.membership import Membership
from cache_service.cluster.placement import Placement
from cache_service.cluster.registry import ClusterRegistry
from cache_service.cluster.replication import Replicator, Standby
from cache_service.errors import InvalidArgument, KVCacheError
from cache_service.leases import LeaseKeeper
from cache_service.registry import build_pool, check_pool_id
from cache_service.settings import Settings
from cache_service.state import ServiceState, WalRecord
from cache_service.tenants import Namespace
from kvcache_common.api.kvcache.internal.v1 import replication_pb2_grpc as rpb_grpc
from kvcache_common.api.kvcache.internal.v1 import wal_pb2
from kvcache_common.api.kvcache.v1 import cache_service_pb2 as pb
from kvcache_common.api.kvcache.v1 import cache_service_pb2_grpc as pb_grpc

_log = structlog.get_logger("cache_service.cluster")

#: This replica's own part of a PeekPrefix: (the caller's namespace, request) -> response.
LocalPeek = Callable[[Namespace, pb.PeekPrefixRequest], Awaitable[pb.PeekPrefixResponse]]

#: Metadata on a PeekPrefix one replica sends another: answer from your own pools only.
FORWARDED_KEY = "x-kvcache-forwarded"


def advertised_address(settings: Settings, port: int) -> str:
    """The address other replicas and clients reach this one at: ``--advertise-address``, else
    the host (the machine's name for a wildcard bind) and ``port``."""
    if settings.advertise_address:
        return settings.advertise_address
    host = settings.host
    if host in ("0.0.0.0", "::", ""):
        host = socket.gethostname()
    return f"{host}:{port}"


class ClusterNode:
    """Built on the server's state (whose registry is a :class:`ClusterRegistry`); joins
    the cluster with :meth:`join` once the port is known, leaves with :meth:`leave`.
    ``leases``: the server's lease keeper (sessions a taken-over pool brings get leases).
    ``read_peer`` reads one pool's state (``export_pool``) out of another replica's data
    directory (shared data root)."""

    def __init__(self, settings: Settings, state: ServiceState, *, leases: LeaseKeeper,
                 read_peer: Callable[[Settings, Path, str], bytes]) -> None:
        assert settings.etcd_endpoints
        assert isinstance(state.registry, ClusterRegistry), "build the state with cluster=True"
        self.settings = settings
        self.state = state
        self.keys = KeyLayout(settings.cluster_name)
        self.etcd = Etcd(settings.etcd_endpoints, timeout=max(1.0, settings.etcd_lease_ttl / 3))
        self.registry: ClusterRegistry = state.registry
        self.membership: Membership | None = None
        self.placement: Placement | None = None
        self._peers: dict[str, tuple[grpc.aio.Channel, pb_grpc.CacheServiceStub]] = {}
        self.leases = leases
        self.read_peer = read_peer
        #: Set once :meth:`join` succeeded (the servicer acts as a member from then on).
        self.joined = False
        #: Replication (see cache_service.cluster.replication): this replica's side as
        #: an owner (wrapping the state's durability hook) and as a standby (a service).
        self.replicator: Replicator | None = None
        if settings.replication != "none":
            self.replicator = Replicator(
                state.durability, state, mode=settings.replication,
                timeout=settings.replication_wait, me=lambda: self._membership().member_id,
                lease=lambda: self._membership().lease_id,
                owned=lambda: self.placement.owned if self.placement is not None else {},
                members=lambda: {m: v.address for m, v in self.placement.members.items()}
                if self.placement is not None else {},
                channel_options=[
                    ("grpc.max_send_message_length", settings.max_message_bytes),
                    ("grpc.max_receive_message_length", settings.max_message_bytes)])
            state.durability = self.replicator
        self.standby = Standby(
            me=lambda: self._membership().member_id,
            # Empty until the first view of etcd is loaded (a joining replica knows none).
            members=lambda: {m: v.lease for m, v in self.placement.members.items()}
            if self.placement is not None and self.placement.synced.is_set() else {},
            owners=lambda: {p: (o.member, o.token) for p, o in self.placement.owners.items()}
            if self.placement is not None else {},
            owned=lambda: self.placement.owned if self.placement is not None else {},
            trust=settings.replication_wait - settings.etcd_lease_ttl,
            by_record=settings.replication != "async")

    def _membership(self) -> Membership:
        assert self.membership is not None, "join first"
        return self.membership

    def add_servicers(self, server: grpc.aio.Server) -> None:
        """Adds the replica-to-replica services (replication) to the gRPC server."""
        rpb_grpc.add_ReplicationServiceServicer_to_server(self.standby, server)

    async def join(self, port: int, timeout: float = 30.0) -> None:
        """Registers this replica and acts on the cluster's current state; raises
        ConnectionError when etcd cannot be reached within ``timeout``."""
        address = advertised_address(self.settings, port)
        member_id = self.settings.member_id or address
        self.membership = Membership(self.etcd, self.keys, member_id, address,
                                     self.settings.etcd_lease_ttl)
        shared = self.settings.shared_data_root is not None
        self.placement = Placement(self.etcd, self.keys, self.membership,
                                   self.registry.has, self._restore, self._discard,
                                   lambda: [entry.pool_id for entry in self.registry],
                                   self._receive if shared else None)
        self.registry.placement = self.placement
        if self.replicator is not None:
            self.placement.on_change = self.replicator.refresh
            self.replicator.record = self.placement.record_sync
        self.membership.on_new_lease = self.placement.on_new_lease
        await self.membership.join(time.monotonic() + timeout)
        key = await asyncio.wait_for(self._replication_key(), timeout)
        self.standby.key = key
        if self.replicator is not None:
            self.replicator.key = key
        await asyncio.wait_for(self.placement.start(), timeout)
        self.joined = True

    async def _replication_key(self) -> bytes:
        """The cluster's replication secret: created (32 random bytes, no lease) by the
        first replica that asks, read by every later one. Replication messages carry its
        MAC, so a peer that cannot read etcd cannot feed a standby."""
        key = self.keys.replication_key()
        tx = self.etcd.client.transactions
        await self.etcd.client.transaction(
            compare=[tx.create(key) == 0],
            success=[tx.put(key, secrets.token_bytes(32))], failure=[])
        got = await self.etcd.client.get(key)
        if got is None or not got.value:
            raise ConnectionError(f"etcd lost {key.decode()} right after it was written")
        return bytes(got.value)

    async def _restore(self, pool_id: str, holder: str) -> None:
        """Takes ``pool_id`` over from ``holder`` (a replica whose lease expired, so it is
        fenced) with its state: from this replica's copy of the holder's state when it
        is a safe one (replication), else from the holder's directory under the shared
        data root; without either the pool stays absent (clients register it again: a
        new incarnation), which is logged."""
        started = time.perf_counter()
        # The syncs/ key is read only where there is a copy to check it against.
        record = await self._sync_standby(pool_id) if holder in self.standby.shadows \
            else None
        payload = self.standby.take(pool_id, holder, record)
        if payload is not None and self._install(pool_id, holder, payload, started,
                                                 via="standby"):
            return
        if self.settings.shared_data_root is not None:
            await self._adopt(pool_id, holder)
            return
        _log.warning("pool_not_adopted", pool_id=pool_id, holder=holder,
                     reason="no safe copy of the holder's state here (no --replication "
                     "standby caught up, no --shared-data-root): a new incarnation")

    async def _sync_standby(self, pool_id: str) -> SyncStandby | None:
        """The pool's ``syncs/`` entry (which standby its last owner kept in sync), read
        after this replica's claim fenced that owner; None (logged) when absent or
        unreadable, so no copy is promoted."""
        assert self.placement is not None
        try:
            value = await self.placement.sync_standby(pool_id)
            return SyncStandby.decode(value) if value is not None else None
        except ETCD_ERRORS + (ValueError, KeyError, TypeError) as exc:
            _log.warning("sync_standby_unreadable", pool_id=pool_id, error=str(exc))
            return None

    async def _adopt(self, pool_id: str, holder: str) -> None:
        """Takes ``pool_id`` over from ``holder`` (a replica whose lease expired, so it is
        fenced) with its state: reads the holder's directory under the shared data root,
        read-only, and installs the pool through an AdoptPool record (this replica's own
        log keeps it). When the holder's data cannot be read the pool stays absent
        (clients register it again: a new incarnation), which is logged."""
        root = self.settings.shared_data_root
        assert root is not None
        directory = root / holder
        started = time.perf_counter()
        try:
            # Off the event loop: replaying another replica's log takes a while.
            payload = await asyncio.to_thread(self.read_peer, self.settings, directory,
                                              pool_id)
        except KVCacheError:
            _log.warning("pool_not_adopted", pool_id=pool_id, holder=holder,
                         reason="not in the holder's state (never registered there)")
            return
        except Exception as exc:  # noqa: BLE001 - unreadable data: today's behaviour
            _log.error("pool_adoption_failed", pool_id=pool_id, holder=holder,
                       data_dir=str(directory), error=f"{type(exc).__name__}: {exc}")
            return
        self._install(pool_id, holder, payload, started, via="log")

    def _install(self, pool_id: str, holder: str, payload: bytes, started: float,
                 via: str) -> bool:
        """Applies the AdoptPool record of ``payload`` (logged here); sessions it brings
        get leases. False (logged) when the state is refused."""
        try:
            with self.registry.unfenced():
                result = self.state.apply(WalRecord(adopt_pool=wal_pb2.AdoptPool(
                    pool_id=pool_id, from_member=holder, state=payload)))
        except KVCacheError as exc:
            _log.error("pool_adoption_failed", pool_id=pool_id, holder=holder, via=via,
                       error=f"{type(exc).__name__}: {exc}")
            return False
        assert isinstance(result, wal_pb2.AdoptPoolResult)  # what an adoption answers
        for sid in result.session_ids:  # timers are not state: fresh leases here
            self.leases.start(sid)
        _log.warning("pool_adopted", pool_id=pool_id, holder=holder, via=via,
                     incarnation=self.registry.entry(pool_id).incarnation,
                     sessions=len(result.session_ids),
                     seconds=round(time.perf_counter() - started, 3))
        return True

    async def _receive(self, pool_id: str, source: str, handoff: str) -> bool:
        """Installs a pool handed over by ``source`` from its hand-over file (``handoff``,
        relative to the shared data root) and makes the AdoptPool record durable before
        the pool is served; False (logged) when the file cannot be used."""
        root = self.settings.shared_data_root
        assert root is not None
        started = time.perf_counter()
        path = (root / handoff).resolve()
        try:
            if not path.is_relative_to(root.resolve()):
                raise HandoffError(f"hand-over file {handoff!r} is outside the shared "
                                   f"data root {root}")
            payload = await asyncio.to_thread(read_handoff, path)
        except HandoffError as exc:
            _log.error("handoff_unreadable", pool_id=pool_id, source=source, error=str(exc))
            return False
        if not self._install(pool_id, source, payload, started, via="handoff"):
            return False
        await self.state.durability.sync()
        return True

    async def hand_over(self, seal: Callable[[], None],
                        settle: Callable[[list[str]], Awaitable[None]]) -> None:
        """SIGTERM with a shared data root: ``seal()`` the log (no write is accepted from
        now on), ``settle(pools)`` until no call is still applying to them, then pass each
        owned pool to its successor through a hand-over file (see
        :meth:`Placement.hand_over`). Pools it cannot pass on go with the lease."""
        root, directory = self.settings.shared_data_root, self.settings.state_dir
        if self.placement is None or root is None or directory is None:
            return
        started = time.monotonic()
        seal()
        await settle(list(self.placement.owned))

        async def write(pool_id: str, token: int) -> str | None:
            if not self.registry.has(pool_id):
                return None  # placed but never registered here: nothing to hand over
            payload = self.state.export_pool(pool_id)
            path = await asyncio.to_thread(write_handoff, directory, pool_id, token, payload)
            return str(path.relative_to(root))

        moved = await self.placement.hand_over(write)
        _log.info("handed_over", pools=len(moved),
                  seconds=round(time.monotonic() - started, 3))

    def _discard(self, pool_id: str) -> None:
        """Drops a pool this replica lost, through the one mutation path (so a write-ahead
        log records it and a restart does not bring the stale copy back)."""
        if getattr(self.state.durability, "sealed", False):
            return  # leaving: nothing is written after the seal
        with self.registry.unfenced():
            self.state.apply(WalRecord(delete_pool=pb.DeletePoolRequest(pool_id=pool_id)))

    async def leave(self) -> None:
        """Stops following etcd and revokes the lease (other replicas take the pools)."""
        if self.placement is not None:
            await self.placement.stop()
        if self.replicator is not None:
            await self.replicator.close()
        if self.membership is not None:
            await self.membership.leave()
        await self.etcd.close()
        for channel, _ in self._peers.values():
            await channel.close()

    # -- servicer hooks -----------------------------------------------------------------

    async def place(self, request: pb.RegisterPoolRequest) -> None:
        """RegisterPool (its pool id already the internal one: ``tenant/pool`` for a
        tenant's): validates the registration (nothing is written for a bad one), then
        places it; returns if this replica owns it, else raises PoolMoved."""
        check_pool_id(request.pool_id, qualified=True)
        assert self.placement is not None
        if not self.registry.has(request.pool_id):
            build_pool(convert.description_from_proto(request))
        await self.placement.place(request)

    async def unplace(self, pool_id: str) -> None:
        """After this replica refused to register ``pool_id`` (internal id; e.g. beyond a
        tenant's limit or the block budget): a pool placed here but not registered here
        has its etcd keys removed, so a rejected RegisterPool leaves nothing behind."""
        assert self.placement is not None
        if not self.registry.has(pool_id) and pool_id in self.placement.owned:
            try:
                await self.placement.delete(pool_id)
            except KVCacheError as exc:  # lost meanwhile: the new owner's business
                _log.warning("unplace_failed", pool_id=pool_id, error=str(exc))
            self.placement.forget(pool_id)

    async def delete(self, pool_id: str) -> None:
        """DeletePool of ``pool_id`` (internal id): its etcd keys are removed first, so
        nobody takes it over. A pool not here is left to the apply path, which answers a
        session's retry from the session, redirects, or answers NOT_FOUND."""
        assert self.placement is not None
        if self.registry.has(pool_id):
            await self.placement.delete(pool_id)

    def _peer(self, address: str) -> pb_grpc.CacheServiceStub:
        peer = self._peers.get(address)
        if peer is None:
            channel = grpc.aio.insecure_channel(address)
            peer = self._peers[address] = (channel, pb_grpc.CacheServiceStub(channel))
        return peer[1]

    async def peek_prefix(self, request: pb.PeekPrefixRequest, ns: Namespace,
                          context: grpc.aio.ServicerContext, local: LocalPeek
                          ) -> pb.PeekPrefixResponse:
        """PeekPrefix over pools on several replicas: this replica's pools answered here
        (``local``), the others by their owners concurrently, within the caller's deadline.

        Tenancy: pool ids are the caller's (``ns`` maps them); a forwarded call carries the
        caller's ``authorization``, so the owner answers for the same tenant and an id the
        caller cannot name is answered here (NOT_FOUND), never looked up elsewhere."""
        assert self.placement is not None
        metadata = dict(context.invocation_metadata() or ())
        remote: dict[str, list[str]] = {}
        if FORWARDED_KEY not in metadata:  # a forwarded call is answered here only
            for pool_id in request.pool_ids:
                internal = ns.inner(pool_id)
                owner = self.placement.owner_of(internal) if internal is not None else None
                if (internal not in self.placement.owned and owner is not None
                        and owner.member != self.placement.me):
                    remote.setdefault(owner.address, []).append(pool_id)
        if not remote:
            return await local(ns, request)
        first: dict[str, int] = {}
        for i, pid in enumerate(request.pool_ids):  # before any id is sent anywhere
            if pid in first:
                raise InvalidArgument(f"pool {pid!r} is named twice (first at pool_ids"
                                      f"[{first[pid]}])", field=f"pool_ids[{i}]")
            first[pid] = i
        moved = {pid for pids in remote.values() for pid in pids}
        here = [pid for pid in request.pool_ids if pid not in moved]
        forward: list[tuple[str, str]] = [(FORWARDED_KEY, "1")]
        if "authorization" in metadata:
            forward.append(("authorization", metadata["authorization"]))
        remaining = context.time_remaining()
        timeout = remaining if remaining is not None else 10.0

        def sub(pool_ids: list[str]) -> pb.PeekPrefixRequest:
            msg = pb.PeekPrefixRequest()
            msg.CopyFrom(request)
            del msg.pool_ids[:]
            msg.pool_ids.extend(pool_ids)
            return msg

        asked = [self._peer(address).PeekPrefix(sub(pids), timeout=timeout,
                                                metadata=tuple(forward))
                 for address, pids in remote.items()]
        hits: dict[str, pb.PoolHit] = {}
        try:
            if here:
                hits.update((h.pool_id, h) for h in (await local(ns, sub(here))).hits)
            for answer in await asyncio.gather(*asked):
                hits.update((h.pool_id, h) for h in answer.hits)
        except grpc.aio.AioRpcError as exc:
            # The owner's answer, passed on (its status details name the field), under this
            # call's request id.
            trailers = tuple((key, value) for key, value in exc.trailing_metadata() or ()
                             if key != REQUEST_ID_KEY) + request_id_metadata()
            await context.abort(exc.code(), exc.details() or "", trailers)
        finally:
            for call in asked:
                call.cancel()  # e.g. a local error: the other answers are not waited for
        return pb.PeekPrefixResponse(hits=[hits[pid] for pid in request.pool_ids])
