"""The replication protocol in one process, without etcd: a :class:`Replicator` (the
owner's durability hook) streaming to a :class:`Standby` behind a real gRPC server on
loopback. The cluster's view of etcd (members, owners, the ``syncs/`` keys) is given as
plain dictionaries."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

import grpc
import pytest

from cache_service.client import layers, ops
from cache_service.client._builders import register_request
from cache_service.cluster.keys import SyncStandby
from cache_service.cluster.replication import Fenced, Replicator, Standby, mac
from cache_service.errors import Unavailable
from cache_service.registry import PoolRegistry
from cache_service.state import ServiceState
from kvcache_common.api.kvcache.internal.v1 import replication_pb2 as rpb
from kvcache_common.api.kvcache.internal.v1 import replication_pb2_grpc as rpb_grpc
from kvcache_common.api.kvcache.v1 import cache_service_pb2 as pb

LAYERS = [layers.full_attention("l0", block_size=16, num_kv_heads=2, head_size=8)]
OWNER_LEASE = 7
KEY = b"k" * 32  # the cluster's replication secret (etcd's replication-key in a cluster)


class Pair:
    """An owner state with its Replicator, and a Standby served on a real port."""

    def __init__(self, *, member_lease: int = OWNER_LEASE) -> None:
        self.members = {"owner": member_lease}
        self.owners: dict[str, tuple[str, int]] = {}
        self.owned = {"p": 5}
        self.standby = Standby(me=lambda: "standby", members=lambda: self.members,
                               owners=lambda: self.owners, owned=dict, trust=30.0)
        self.standby.key = KEY
        self.state = ServiceState(PoolRegistry(instance_id="owner"))
        self.server = grpc.aio.server()
        rpb_grpc.add_ReplicationServiceServicer_to_server(self.standby, self.server)
        self.port = self.server.add_insecure_port("127.0.0.1:0")
        #: pool id -> its ``syncs/`` entry, and an event per change of it.
        self.syncs: dict[str, SyncStandby] = {}
        self.synced = asyncio.Event()
        self.members_of_owner = {"owner": "unused:1", "standby": f"127.0.0.1:{self.port}"}

    async def record(self, pool_id: str, token: int, value: bytes) -> bool:
        """etcd's transaction on ``syncs/<pool>``, conditioned on the owner's token."""
        if self.owned.get(pool_id) != token:
            return False
        self.syncs[pool_id] = SyncStandby.decode(value)
        self.synced.set()
        return True

    async def named(self, pool_id: str, standby: str | None) -> SyncStandby:
        """Waits until the pool's ``syncs/`` entry names ``standby``."""
        while (entry := self.syncs.get(pool_id)) is None or entry.standby != standby:
            self.synced.clear()
            await asyncio.wait_for(self.synced.wait(), 10)
        return entry

    async def start(self) -> Replicator:
        await self.server.start()
        # The state's own default hook (in memory) inside, as a server without --data-dir.
        rep = Replicator(self.state.durability, self.state, mode="sync", timeout=30.0,
                         me=lambda: "owner", lease=lambda: OWNER_LEASE,
                         owned=lambda: self.owned,
                         members=lambda: self.members_of_owner)
        rep.record = self.record
        rep.key = KEY
        self.state.durability = rep
        return rep

    def register(self) -> None:
        """Registers pool ``p`` on the owner's state (a logged record, so it replicates)."""
        self.state.apply_call("register_pool", register_request(
            "p", LAYERS, num_blocks=64, max_model_len=256))

    async def stop(self, rep: Replicator) -> None:
        await rep.close()
        await self.server.stop(0)


def run(body: Callable[[Pair, Replicator], Awaitable[None]],
        make: Callable[[], Pair] = Pair) -> None:
    """Runs ``body`` with a started pair (owner + standby), stopping both afterwards."""
    async def main() -> None:
        pair = make()
        rep = await pair.start()
        try:
            await body(pair, rep)
        finally:
            await pair.stop(rep)
    asyncio.run(main())


def step(rid: str, tokens: list[int]) -> pb.StepRequest:
    return pb.StepRequest(pool_id="p", ops=[ops.add(rid, tokens),
                                            ops.allocate(rid, len(tokens))])


def view(state: ServiceState) -> tuple:
    """What a client can observe of pool ``p``: stats, event sequence, every request's
    blocks and counts."""
    entry = state.registry.entry("p")
    pool = entry.pool
    rids = ["a"] + [f"b{i}" for i in range(5)]
    return (pool.stats(), entry.feed.next_sequence,
            {rid: (pool.block_ids(rid), pool.request_info(rid)) for rid in rids
             if pool.has_request(rid)})


def test_a_standby_is_filled_then_follows_every_record_exactly() -> None:
    async def body(pair: Pair, rep: Replicator) -> None:
        # Before the standby exists: it gets these through the snapshot.
        pair.register()
        pair.state.apply_call("step", step("a", list(range(40))))
        rep.refresh()
        await asyncio.wait_for(rep.sync(), 10)
        # After: record by record, each acknowledged before sync() returns.
        for i in range(5):
            pair.state.apply_call("step", step(f"b{i}", list(range(i, i + 20))))
            await asyncio.wait_for(rep.sync(), 10)
        shadow = pair.standby.shadows["owner"]
        assert shadow.index == rep.index == 7 and shadow.state is not None
        assert view(shadow.state) == view(pair.state)  # the same state
        named = await pair.named("p", "standby")
        assert (named.owner, named.lease, named.epoch) == ("owner", OWNER_LEASE,
                                                           rep.epoch)
        assert pair.standby.take("p", "owner", named) is not None
    run(body)


def test_a_record_under_an_older_token_is_refused_and_fails_the_write() -> None:
    async def body(pair: Pair, rep: Replicator) -> None:
        pair.register()
        rep.refresh()
        await asyncio.wait_for(rep.sync(), 10)
        # etcd now shows the pool owned under a newer token (another replica took
        # it): the owner's next write must not be acknowledged.
        pair.owners["p"] = ("standby", 9)
        pair.state.apply_call("step", step("late", [1, 2, 3]))
        with pytest.raises(Fenced):
            await asyncio.wait_for(rep.sync(), 10)
        assert pair.standby.shadows["owner"].index == 1  # the record was not taken
    run(body)


def test_a_sender_that_is_no_live_member_under_its_lease_is_refused() -> None:
    async def main() -> None:
        pair = Pair(member_lease=OWNER_LEASE + 1)  # etcd shows another lease
        rep = await pair.start()
        try:
            pair.register()
            rep.refresh()
            with pytest.raises(Fenced):
                await asyncio.wait_for(rep.sync(), 10)
            assert "owner" not in pair.standby.shadows
        finally:
            await pair.stop(rep)
    asyncio.run(main())


def test_a_stream_not_signed_with_the_cluster_key_is_refused_before_anything_is_read() \
        -> None:
    async def main() -> None:
        pair = Pair()
        await pair.server.start()
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{pair.port}") as channel:
                call = rpb_grpc.ReplicationServiceStub(channel).Replicate()
                forged = mac(b"x" * 32, "hello", "owner", "e", OWNER_LEASE)
                await call.write(rpb.ReplicateRequest(hello=rpb.ReplicaHello(
                    source="owner", epoch="e", lease=OWNER_LEASE, mac=forged)))
                with pytest.raises(grpc.aio.AioRpcError) as err:
                    await call.read()
                assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
                assert err.value.details().startswith("hello.mac")
            assert pair.standby.shadows == {}
        finally:
            await pair.server.stop(0)
    asyncio.run(main())


def test_after_a_promotion_the_old_owner_gets_nothing_acknowledged() -> None:
    async def body(pair: Pair, rep: Replicator) -> None:
        pair.register()
        rep.refresh()
        await asyncio.wait_for(rep.sync(), 10)
        named = await pair.named("p", "standby")
        assert pair.standby.take("p", "owner", named) is not None  # promoted
        pair.state.apply_call("step", step("after", [1, 2, 3]))
        with pytest.raises(Fenced):
            await asyncio.wait_for(rep.sync(), 10)
    run(body)


def test_a_sender_this_standby_does_not_know_yet_is_waited_for_not_fenced() -> None:
    async def main() -> None:
        pair = Pair()
        pair.members = {}  # e.g. the standby is still joining
        rep = await pair.start()
        try:
            pair.register()
            rep.refresh()
            waiting = asyncio.ensure_future(rep.sync())
            done, _ = await asyncio.wait([waiting], timeout=0.5)
            assert not done  # the write waits for the standby (not refused, not answered)
            pair.members = {"owner": OWNER_LEASE}  # its view caught up
            await asyncio.wait_for(waiting, 10)
            assert pair.standby.shadows["owner"].index == 1
        finally:
            await pair.stop(rep)
    asyncio.run(main())


def test_a_write_answered_without_the_standby_is_recorded_first_so_it_never_promotes() \
        -> None:
    async def body(pair: Pair, rep: Replicator) -> None:
        pair.register()
        rep.refresh()
        await asyncio.wait_for(rep.sync(), 10)
        named = await pair.named("p", "standby")
        # The standby leaves the owner's view (its lease expired): the next write is
        # answered without it, but only after etcd names no standby in sync.
        del pair.members_of_owner["standby"]
        rep.refresh()
        pair.state.apply_call("step", step("alone", [1, 2, 3]))
        await asyncio.wait_for(rep.sync(), 10)
        assert pair.syncs["p"].standby is None
        # Its copy lacks that write: with the current entry it is not promoted; the
        # entry it was named by before is one only a fenced owner could bring back.
        assert pair.standby.shadows["owner"].index < rep.index
        assert pair.standby.take("p", "owner", pair.syncs["p"]) is None
        assert pair.standby.take("p", "owner", None) is None
        assert named.standby == "standby"
    run(body)


def test_a_write_is_not_answered_when_etcd_cannot_record_the_missing_standby() -> None:
    async def body(pair: Pair, rep: Replicator) -> None:
        pair.register()
        rep.refresh()
        await asyncio.wait_for(rep.sync(), 10)
        await pair.named("p", "standby")

        async def unreachable(pool_id: str, token: int, value: bytes) -> bool:
            raise ConnectionError("etcd unreachable")

        rep.record = unreachable
        del pair.members_of_owner["standby"]
        rep.refresh()
        pair.state.apply_call("step", step("alone", [1, 2, 3]))
        with pytest.raises(Unavailable, match="in doubt"):
            await asyncio.wait_for(rep.sync(), 10)
        assert pair.syncs["p"].standby == "standby"  # etcd unchanged
    run(body)
