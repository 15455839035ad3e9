"""Placement and fencing: which replica owns each pool, kept consistent through etcd.

This replica keeps a view of ``members/``, ``owners/`` and ``pools/`` (one listing, then a
watch from the listing's revision) and acts on it under one lock:

- **place** (RegisterPool on any replica): the rendezvous owner among the live members gets
  ``owners/<pool>`` under *its* lease plus ``pools/<pool>`` (the registration), in one
  transaction that succeeds only if neither exists; the caller is redirected to the owner.
- **take over**: a pool with a registration but no owner (its owner's lease expired or was
  revoked) is claimed by the rendezvous owner among the live members, again by a
  create-if-absent transaction that also names it the pool's holder (``holders/<pool>``,
  no lease), reading the previous holder first. With a ``restore`` (a shared data root)
  the pool is rebuilt at once from the previous holder's state; without one, or when that
  state cannot be read, the pool stays absent until its next RegisterPool creates it anew,
  so clients see NOT_FOUND for the pool (state lost: re-register) instead of an empty pool
  that silently forgot their requests.
- **adopt**: an ownership key naming this replica under its current lease (placed by
  another replica) is served from now on, the pool created by the RegisterPool the client
  is redirected with.
- **lose**: a pool whose ownership key no longer names this replica under its current lease
  and token is dropped from this replica at once.
- **hand over** (SIGTERM, :meth:`Placement.hand_over`): the leaving replica, its log sealed,
  writes each pool to a hand-over file and moves ``owners/<pool>`` to the pool's rendezvous
  owner among the other members, under THAT member's lease, in a transaction conditioned on
  its own fencing token; the value names the file. The successor, seeing an ownership key
  naming it with a hand-over, installs the pool from that file before serving it, then
  names itself the pool's holder. A pool moves within a few etcd round trips of SIGTERM,
  not after a lease TTL, and nobody reads a log that is still being written.

Fencing: :meth:`Placement.check` runs before every call on a pool (every write included,
with no await between it and the write). It passes only if this replica holds the pool
under an ownership token it obtained AND its lease is certainly still alive
(:meth:`Membership.lease_valid`). A replica cut off from etcd stops accepting writes before
its lease can expire in etcd, hence before any other replica can claim its pools.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

import structlog

from cache_service.cluster.etcd import ETCD_ERRORS, RETRY_BACKOFF, Etcd, stray_cancel
from cache_service.cluster.keys import KeyLayout, Owner, rendezvous_owner
from cache_service.cluster.membership import Membership
from cache_service.errors import NotFound, Unavailable
from kvcache_common.api.kvcache.v1 import cache_service_pb2 as pb
from kvcache_common.redirect import OWNER_ADDRESS_KEY, OWNER_MEMBER_KEY

_log = structlog.get_logger("cache_service.cluster")

#: Rebuilds pool ``pool_id`` on this replica from the state its previous holder (a member
#: id) left on storage this replica can read; logs and returns when it cannot (the pool is
#: then served absent: clients register it again).
Restore = Callable[[str, str], Awaitable[None]]
#: Installs pool ``pool_id`` handed over by replica ``source`` from its hand-over file
#: (path relative to the shared data root); answers False (logged) when it cannot.
Receive = Callable[[str, str, str], Awaitable[bool]]
#: Writes the hand-over file of an owned pool at its fencing token (the log sealed);
#: answers the file's path relative to the shared data root (None: no state here).
WriteHandoff = Callable[[str, int], Awaitable[str | None]]


class PoolMoved(Unavailable):
    """The pool is owned by another replica: UNAVAILABLE (nothing applied here) with the
    owner's address in trailing metadata, so the client retries there."""

    def __init__(self, pool_id: str, owner: Owner, field: str = "pool_id") -> None:
        super().__init__(f"pool {pool_id!r} is owned by replica {owner.member} at "
                         f"{owner.address}; retry there", field=field)
        # A negative pushback tells a client's gRPC retry policy not to retry here: the
        # client sends the call to the owner instead.
        self.trailing_metadata = ((OWNER_ADDRESS_KEY, owner.address),
                                  (OWNER_MEMBER_KEY, owner.member),
                                  ("grpc-retry-pushback-ms", "-1"))


@dataclass(frozen=True)
class Member:
    address: str
    lease: int


class Placement:
    """The ownership view and the actions on it (see the module docstring)."""

    def __init__(self, etcd: Etcd, keys: KeyLayout, membership: Membership,
                 has_local: Callable[[str], bool], restore: Restore | None,
                 discard: Callable[[str], None],
                 local_pools: Callable[[], list[str]] = list,
                 receive: Receive | None = None) -> None:
        self.etcd = etcd
        self._receive = receive
        self.keys = keys
        self.membership = membership
        self._has_local = has_local
        self._restore = restore
        self._discard = discard
        self._local_pools = local_pools
        self.members: dict[str, Member] = {}
        self.owners: dict[str, Owner] = {}
        self.registered: set[str] = set()  # pools with a pools/<id> key
        #: pool id -> fencing token, for the pools this replica serves.
        self.owned: dict[str, int] = {}
        self._lock = asyncio.Lock()
        self._task: asyncio.Task | None = None
        self.synced = asyncio.Event()
        #: Called after the owned pools or the members may have changed (replication
        #: picks the standbys from them).
        self.on_change: Callable[[], None] | None = None

    def _changed(self) -> None:
        if self.on_change is not None:
            self.on_change()

    @property
    def me(self) -> str:
        """This replica's member id."""
        return self.membership.member_id

    # -- fencing (hot path) -------------------------------------------------------------

    def check(self, pool_id: str, field: str = "pool_id") -> int:
        """The pool's fencing token if this replica may serve it now; otherwise raises
        PoolMoved (another replica owns it), Unavailable (ownership in transition or not
        confirmed) or NotFound."""
        token = self.owned.get(pool_id)
        if token is not None and time.monotonic() < self.membership.valid_until:
            return token
        if not self.synced.is_set():
            # Joining: pools recovered from this replica's own log may be owned elsewhere
            # by now, and a pool unknown here may exist elsewhere: neither is answered yet.
            raise Unavailable(f"replica {self.me} is joining the cluster; retry",
                              field=field)
        owner = self.owners.get(pool_id)
        if owner is not None and owner.member != self.me:
            raise PoolMoved(pool_id, owner, field)
        if token is None and owner is not None and owner.member == self.me:
            raise Unavailable(f"pool {pool_id!r} is being taken over by replica {self.me}; "
                              "retry", field=field)
        if token is not None or owner is not None:
            raise Unavailable(f"replica {self.me} cannot confirm its ownership of pool "
                              f"{pool_id!r} (etcd unreachable); retry", field=field)
        if pool_id in self.registered:
            raise Unavailable(f"pool {pool_id!r} is failing over to another replica; "
                              "retry", field=field)
        raise NotFound(f"unknown pool {pool_id!r}", field=field)

    def owner_of(self, pool_id: str) -> Owner | None:
        """The pool's owner as last seen in etcd (None: no owner key)."""
        return self.owners.get(pool_id)

    # -- view ---------------------------------------------------------------------------

    async def start(self) -> None:
        """Starts following etcd; returns once the first listing has been acted on."""
        self._task = asyncio.create_task(self._follow(), name="etcd-placement")
        await self.synced.wait()

    async def stop(self) -> None:
        """Stops following etcd (the view stays as it was)."""
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)

    async def _follow(self) -> None:
        failures = 0  # attempts in a row that ended before a listing was acted on
        while True:
            events: asyncio.Queue = asyncio.Queue()
            client = self.etcd.client
            try:
                revision = await self._load()
                await self.reconcile()
                self.synced.set()
                failures = 0
                watch = await client.watch_prefix(
                    self.keys.root, start_revision=revision + 1)
                pump = asyncio.create_task(self._pump(watch, events))
                try:
                    while True:
                        try:
                            # Reconcile at least every TTL even when nothing changes (a
                            # claim that failed on a transient error is retried).
                            event = await asyncio.wait_for(events.get(), self.membership.ttl)
                        except TimeoutError:
                            await self.reconcile()
                            continue
                        if isinstance(event, BaseException):
                            raise event
                        self._apply(event)
                        while not events.empty():
                            event = events.get_nowait()
                            if isinstance(event, BaseException):
                                raise event
                            self._apply(event)
                        await self.reconcile()
                finally:
                    pump.cancel()
            except (Exception, asyncio.CancelledError) as exc:  # noqa: BLE001 - list, watch again
                if isinstance(exc, asyncio.CancelledError) and not stray_cancel():
                    raise
                if not isinstance(exc, ETCD_ERRORS + (RuntimeError, asyncio.CancelledError)):
                    _log.exception("cluster_view_failed")
                _log.warning("etcd_watch_lost", endpoint=self.etcd.endpoint, error=str(exc))
                await self.etcd.reconnect(client)
                # A pause between attempts while etcd is away (a timer, not a sync).
                await asyncio.sleep(RETRY_BACKOFF.delay(failures))
                failures += 1

    @staticmethod
    async def _pump(watch, events: asyncio.Queue) -> None:
        try:
            async for event in watch:
                await events.put(event)
            await events.put(RuntimeError("etcd watch ended"))
        except (Exception, asyncio.CancelledError) as exc:  # noqa: BLE001 - to the follower
            if isinstance(exc, asyncio.CancelledError) and not stray_cancel():
                raise
            # The follower relists and watches again (a watch whose channel was closed
            # under it ends cancelled: without this the view would silently go stale).
            await events.put(exc if isinstance(exc, Exception)
                             else RuntimeError("etcd watch cancelled"))

    async def _load(self) -> int:
        """Replaces the view with a full listing; answers its revision."""
        listing = await self.etcd.client.get_prefix(self.keys.root)  # one revision
        members: dict[str, Member] = {}
        owners: dict[str, Owner] = {}
        registered: set[str] = set()
        for kv in listing:
            self._put(kv, members, owners, registered)
        self.members, self.owners, self.registered = members, owners, registered
        return listing.header.revision

    def _put(self, kv, members: dict, owners: dict, registered: set) -> None:
        parsed = self.keys.parse(kv.key)
        if parsed is None:
            return
        kind, name = parsed
        try:
            if kind == "members":
                data = json.loads(kv.value)
                members[name] = Member(str(data["address"]), kv.lease)
            elif kind == "owners":
                owners[name] = Owner.decode(kv.value, kv.lease, kv.mod_revision)
            elif kind == "pools":
                registered.add(name)
        except (ValueError, KeyError, TypeError) as exc:
            _log.error("bad_cluster_key", key=kv.key.decode(errors="replace"), error=str(exc))

    def _apply(self, event) -> None:
        if event.kind == "PUT":
            self._put(event.kv, self.members, self.owners, self.registered)
            return
        parsed = self.keys.parse(event.kv.key)
        if parsed is None:
            return
        kind, name = parsed
        if kind == "members":
            self.members.pop(name, None)
        elif kind == "owners":
            self.owners.pop(name, None)
        elif kind == "pools":
            self.registered.discard(name)

    # -- actions ------------------------------------------------------------------------

    async def reconcile(self) -> None:
        """Lose, adopt and take over (see the module docstring) until the view and this
        replica's pools agree."""
        async with self._lock:
            me, lease = self.me, self.membership.lease_id
            for pool_id, token in list(self.owned.items()):
                owner = self.owners.get(pool_id)
                if owner is None or (owner.member, owner.lease, owner.token) != (me, lease,
                                                                                  token):
                    self._lose(pool_id, owner)
            for pool_id in self._local_pools():
                if pool_id in self.owned:
                    continue
                owner = self.owners.get(pool_id)
                if owner is not None and owner.member != me:
                    # Kept here (recovered from this replica's own log at start, or kept
                    # while its ownership was in doubt), but owned elsewhere now.
                    self._lose(pool_id, owner)
                elif owner is None and pool_id not in self.registered:
                    self._discard(pool_id)  # deleted meanwhile: nobody takes it over
            for pool_id, owner in list(self.owners.items()):
                if owner.member == me and owner.lease == lease and pool_id not in self.owned:
                    await self._instantiate(pool_id, owner.token, handoff=owner)
            if self.membership.lease_valid():
                for pool_id in sorted(self.registered - self.owners.keys()):
                    if rendezvous_owner(pool_id, self.members) == me:
                        await self._claim(pool_id)
            self._changed()

    def _lose(self, pool_id: str, owner: Owner | None) -> None:
        """Stops serving ``pool_id``. Its state is dropped (a logged drop) only once
        another replica owns it: a pool whose ownership key merely vanished (this
        replica's lease expired, e.g. etcd was away longer than the TTL) is kept as it is,
        so that whoever claims it next -- this replica, or another one reading this
        replica's log -- finds every acknowledged write."""
        self.owned.pop(pool_id, None)
        if owner is not None and owner.member != self.me and self._has_local(pool_id):
            self._discard(pool_id)
        _log.warning("ownership_lost", pool_id=pool_id,
                     new_owner=owner.member if owner else None)

    async def _claim(self, pool_id: str) -> None:
        tx = self.etcd.client.transactions
        # Only an owner writes the holder key, and it has none now: what is read here is
        # what the claim below replaces.
        got = await self.etcd.client.get(self.keys.holder(pool_id))
        holder = got.value.decode() if got is not None else None
        ok, responses = await self.etcd.client.transaction(
            compare=[tx.create(self.keys.owner(pool_id)) == 0,
                     tx.create(self.keys.pool(pool_id)) > 0],
            success=[tx.put(self.keys.owner(pool_id),
                            Owner.encode(me := self.me, self.membership.address),
                            lease=self.membership.lease_id),
                     tx.put(self.keys.holder(pool_id), me.encode())],
            failure=[])
        if not ok:
            return  # someone else was faster, or the pool was deleted: the watch says which
        token = responses[0].response_put.header.revision
        self.owners[pool_id] = Owner(me, self.membership.address, self.membership.lease_id,
                                     token)
        _log.info("pool_taken_over", pool_id=pool_id, token=token, holder=holder)
        await self._instantiate(pool_id, token, holder)

    async def _instantiate(self, pool_id: str, token: int, holder: str | None = None, *,
                           handoff: Owner | None = None) -> None:
        """Serves an owned pool from now on. Taken over from another ``holder``: with a
        ``restore``, rebuilt from that holder's state first (a copy this replica kept from
        an earlier ownership is older than the holder's: dropped). Handed over (the
        ownership key names a hand-over file): installed from that file, else (it cannot
        be read) from the leaving replica's sealed log; then this replica is the holder."""
        if (handoff is not None and handoff.handoff is not None and handoff.source
                and handoff.source != self.me and self._receive is not None):
            if self._has_local(pool_id):
                self._discard(pool_id)
            if not await self._receive(pool_id, handoff.source, handoff.handoff) \
                    and self._restore is not None:
                await self._restore(pool_id, handoff.source)
            await self._name_holder(pool_id, token)
        elif self._restore is not None and holder is not None and holder != self.me:
            if self._has_local(pool_id):
                self._discard(pool_id)
            await self._restore(pool_id, holder)
        self.owned[pool_id] = token
        _log.info("pool_owned", pool_id=pool_id, token=token)

    async def _name_holder(self, pool_id: str, token: int) -> None:
        """``holders/<pool>`` := this replica, while it still owns the pool at ``token``
        (its log now has the pool: a later takeover reads it here)."""
        tx = self.etcd.client.transactions
        try:
            await self.etcd.client.transaction(
                compare=[tx.mod(self.keys.owner(pool_id)) == token],
                success=[tx.put(self.keys.holder(pool_id), self.me.encode())], failure=[])
        except ETCD_ERRORS as exc:  # the holder stays the leaving replica (its log is sealed)
            _log.warning("holder_not_updated", pool_id=pool_id, error=str(exc))

    async def record_sync(self, pool_id: str, token: int, value: bytes) -> bool:
        """``syncs/<pool>`` := ``value`` while this replica owns the pool at ``token`` (a
        fenced former owner cannot write it); False when it does not own it any more.
        Raises what etcd raises (the caller treats the outcome as in doubt)."""
        tx = self.etcd.client.transactions
        ok, _ = await self.etcd.client.transaction(
            compare=[tx.mod(self.keys.owner(pool_id)) == token],
            success=[tx.put(self.keys.sync(pool_id), value)], failure=[])
        return bool(ok)

    async def sync_standby(self, pool_id: str) -> bytes | None:
        """The value of ``syncs/<pool>`` (None: no such key). Read by a new owner after its
        claim: the former owner, fenced by the claim, cannot change it any more."""
        got = await self.etcd.client.get(self.keys.sync(pool_id))
        return got.value if got is not None else None

    async def hand_over(self, write: WriteHandoff) -> dict[str, str]:
        """Passes every owned pool to its rendezvous owner among the other members (see
        the module docstring); the caller sealed the log first. Stops following etcd
        (this replica's own moves must not make it drop pools through a sealed log).
        Answers pool id -> new owner of the pools moved; the others (no other member, or
        etcd unreachable) go with the lease when it is revoked or expires."""
        await self.stop()
        others = {m: v for m, v in self.members.items() if m != self.me}
        moved: dict[str, str] = {}

        async def move(pool_id: str, token: int) -> None:
            target = rendezvous_owner(pool_id, others)
            if target is None:
                return
            started = time.monotonic()
            path = await write(pool_id, token)
            member = others[target]
            tx = self.etcd.client.transactions
            ok, _ = await self.etcd.client.transaction(
                compare=[tx.mod(self.keys.owner(pool_id)) == token],
                success=[tx.put(self.keys.owner(pool_id),
                                Owner.encode(target, member.address, source=self.me,
                                             handoff=path), lease=member.lease)],
                failure=[])
            if ok:
                moved[pool_id] = target
                self.owned.pop(pool_id, None)
            _log.info("pool_handed_over" if ok else "pool_not_handed_over",
                      pool_id=pool_id, to=target, handoff=path,
                      seconds=round(time.monotonic() - started, 3))

        owned = list(self.owned.items())
        results = await asyncio.gather(*(move(p, t) for p, t in owned),
                                       return_exceptions=True)
        for (pool_id, _), result in zip(owned, results, strict=True):
            if isinstance(result, BaseException):
                _log.warning("pool_not_handed_over", pool_id=pool_id, error=str(result))
        return moved

    async def place(self, request: pb.RegisterPoolRequest) -> None:
        """Places a pool being registered here (its registration already validated).
        Returns when this replica owns it (the caller registers it locally); raises
        PoolMoved when another replica owns it or was chosen."""
        pool_id = request.pool_id
        if pool_id in self.owned:
            self.check(pool_id)
            return
        tx = self.etcd.client.transactions
        async with self._lock:
            for _ in range(3):
                got = await self.etcd.client.get(self.keys.owner(pool_id))
                if got is not None:
                    owner = Owner.decode(got.value, got.lease, got.mod_revision)
                    self.owners[pool_id] = owner
                    if owner.member != self.me or owner.lease != self.membership.lease_id:
                        raise PoolMoved(pool_id, owner)
                    self.owned[pool_id] = owner.token
                    self._changed()
                    return
                if not self.membership.lease_valid():
                    break
                target = rendezvous_owner(pool_id, self.members)
                if target is None or (member := self.members.get(target)) is None:
                    break
                try:
                    ok, responses = await self.etcd.client.transaction(
                        compare=[tx.create(self.keys.owner(pool_id)) == 0,
                                 tx.create(self.keys.pool(pool_id)) == 0],
                        success=[tx.put(self.keys.owner(pool_id),
                                        Owner.encode(target, member.address),
                                        lease=member.lease),
                                 tx.put(self.keys.pool(pool_id),
                                        request.SerializeToString()),
                                 tx.put(self.keys.holder(pool_id), target.encode())],
                        failure=[])
                except ETCD_ERRORS as exc:  # e.g. the chosen member's lease just expired
                    _log.warning("placement_failed", pool_id=pool_id, target=target,
                                 error=str(exc))
                    continue
                if not ok:
                    # Owned meanwhile (the loop redirects there), or registered without an
                    # owner: its owner died and the takeover has not happened yet.
                    if await self.etcd.client.get(self.keys.owner(pool_id)) is None:
                        raise Unavailable(f"pool {pool_id!r} is failing over to another "
                                          "replica; retry", field="pool_id")
                    continue
                token = responses[0].response_put.header.revision
                owner = Owner(target, member.address, member.lease, token)
                self.owners[pool_id] = owner
                self.registered.add(pool_id)
                _log.info("pool_placed", pool_id=pool_id, owner=target, token=token)
                if target != self.me:
                    raise PoolMoved(pool_id, owner)
                self.owned[pool_id] = token
                self._changed()
                return
        raise Unavailable(f"cannot place pool {pool_id!r} now (no live replica or etcd "
                          "unreachable); retry", field="pool_id")

    async def delete(self, pool_id: str) -> None:
        """Removes the pool's ownership and registration keys (this replica owns it):
        nobody takes a deleted pool over."""
        token = self.check(pool_id)
        tx = self.etcd.client.transactions
        async with self._lock:
            ok, _ = await self.etcd.client.transaction(
                compare=[tx.mod(self.keys.owner(pool_id)) == token],
                success=[tx.delete(self.keys.owner(pool_id)),
                         tx.delete(self.keys.pool(pool_id)),
                         tx.delete(self.keys.holder(pool_id)),
                         tx.delete(self.keys.sync(pool_id))],
                failure=[])
            if not ok:
                raise Unavailable(f"replica {self.me} lost pool {pool_id!r} meanwhile; "
                                  "retry", field="pool_id")
            # ``owned`` keeps the pool until the registry has dropped it (forget()).
            self.owners.pop(pool_id, None)
            self.registered.discard(pool_id)

    def forget(self, pool_id: str) -> None:
        """The pool was deleted here: no longer served."""
        self.owned.pop(pool_id, None)

    async def on_new_lease(self) -> None:
        """After the lease was granted again every ownership under the old one is gone."""
        async with self._lock:
            for pool_id in list(self.owned):
                self._lose(pool_id, self.owners.get(pool_id))
        await self.reconcile()
