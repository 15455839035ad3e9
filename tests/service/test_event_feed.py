"""EventFeed: sequence numbers, bounded replay, resume, fan-out, OUT_OF_RANGE."""

from __future__ import annotations

import asyncio

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from cache_service.event_feed import EventFeed, SequenceOutOfRange


@settings(max_examples=60, deadline=None)
@given(capacity=st.integers(1, 20), batches=st.lists(st.integers(0, 9), max_size=12),
       start=st.integers(0, 150))
def test_read_returns_exactly_the_buffered_suffix(capacity: int, batches: list[int],
                                                   start: int) -> None:
    feed: EventFeed[int] = EventFeed(capacity)
    n = 0
    for size in batches:
        feed.publish(list(range(n, n + size)))  # event value == its sequence - 1
        n += size
    assert feed.next_sequence == n + 1
    assert feed.oldest == max(1, n + 1 - capacity)
    if feed.oldest <= start <= feed.next_sequence:
        items = feed.read(start, limit=1000)
        assert [seq for seq, _ in items] == list(range(start, n + 1))
        assert all(value == seq - 1 for seq, value in items)
    else:
        with pytest.raises(SequenceOutOfRange):
            feed.read(start, limit=1000)


def test_subscribers_get_every_event_in_order_and_end_on_close() -> None:
    async def scenario() -> tuple[list[int], list[int]]:
        feed: EventFeed[str] = EventFeed(100)
        feed.publish(["a", "b"])  # sequences 1, 2

        async def collect(from_sequence: int | None) -> list[int]:
            got = []
            async for batch in feed.subscribe(from_sequence):
                got.extend(seq for seq, _ in batch)
            return got

        replaying = asyncio.ensure_future(collect(1))
        live = asyncio.ensure_future(collect(None))
        await asyncio.sleep(0)
        for i in range(5):
            feed.publish([f"e{i}"])
            await asyncio.sleep(0)
        feed.close()
        return await replaying, await live

    replayed, live = asyncio.run(scenario())
    assert replayed == list(range(1, 8))
    assert live == list(range(3, 8))


def test_a_subscriber_that_falls_behind_the_buffer_gets_out_of_range() -> None:
    async def scenario() -> None:
        feed: EventFeed[int] = EventFeed(3)
        sub = feed.subscribe(None)
        first = asyncio.ensure_future(sub.__anext__())
        await asyncio.sleep(0)
        feed.publish([1])
        assert [s for s, _ in await first] == [1]
        feed.publish([2, 3, 4, 5, 6])  # the subscriber's next (2) is evicted
        with pytest.raises(SequenceOutOfRange):
            await sub.__anext__()

    asyncio.run(scenario())


def test_future_sequences_are_out_of_range() -> None:
    feed: EventFeed[int] = EventFeed(3)
    feed.publish([1, 2])
    with pytest.raises(SequenceOutOfRange):
        feed.read(4, limit=10)
    assert feed.read(3, limit=10) == []


def test_a_pickled_feed_keeps_its_sequence_and_buffer_and_reopens() -> None:
    import pickle

    async def scenario() -> None:
        feed: EventFeed[str] = EventFeed(3)
        feed.publish(["a", "b", "c", "d"])
        feed.close()  # a server closes its feeds at shutdown, then snapshots
        restored: EventFeed[str] = pickle.loads(pickle.dumps(feed))
        assert (restored.oldest, restored.next_sequence) == (2, 5)
        assert restored.read(2, 10) == [(2, "b"), (3, "c"), (4, "d")]
        restored.publish(["e"])
        assert restored.read(5, 10) == [(5, "e")] and not restored.closed

    asyncio.run(scenario())
