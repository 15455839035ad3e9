"""Per-pool KV event feed: sequence numbers, a bounded replay buffer, async fan-out.

Every published event gets the pool's next sequence number (1, 2, 3, ...). The last
``capacity`` events stay in a ring buffer so that a subscriber that reconnects can resume
from the sequence after the last one it saw. The buffer is the only copy: subscribers read
from it at their own pace, so a subscriber that falls more than ``capacity`` events behind
loses its place and gets :class:`SequenceOutOfRange`, exactly like a reconnect that asks
for a sequence too old.

No gRPC and no locks: publish and subscribe run on the one event loop that owns the
allocator state.
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import AsyncIterator
from typing import Generic, TypeVar

from cache_service.errors import SequenceOutOfRange

E = TypeVar("E")


class EventFeed(Generic[E]):
    """Sequenced events of one pool. Invariant: the buffer holds the consecutive sequences
    ``[oldest, next_sequence)``, at most ``capacity`` of them."""

    def __init__(self, capacity: int) -> None:
        if capacity < 1:
            raise ValueError("capacity must be >= 1")
        self.capacity = capacity
        self._buffer: deque[E] = deque(maxlen=capacity)
        self._next = 1
        self._closed = False
        self._changed = asyncio.Event()

    def __getstate__(self) -> dict:
        """The buffer and sequence (a snapshot); subscribers and their wake-up event stay
        with the running server."""
        return {"capacity": self.capacity, "buffer": list(self._buffer), "next": self._next}

    def __setstate__(self, state: dict) -> None:
        # A restored feed is open: a server closes its feeds when it stops, and the
        # snapshot written then must not carry that into the next run.
        self.capacity = state["capacity"]
        self._buffer = deque(state["buffer"], maxlen=self.capacity)
        self._next = state["next"]
        self._closed = False
        self._changed = asyncio.Event()

    @property
    def next_sequence(self) -> int:
        """The sequence the next published event will get."""
        return self._next

    @property
    def oldest(self) -> int:
        """The oldest sequence still buffered (== next_sequence when empty)."""
        return self._next - len(self._buffer)

    @property
    def closed(self) -> bool:
        """Whether the feed was closed (its pool deleted, or the server stopping): every
        subscription has ended."""
        return self._closed

    def publish(self, events: list[E]) -> None:
        """Appends events in order and wakes the subscribers."""
        if not events or self._closed:
            return
        self._buffer.extend(events)
        self._next += len(events)
        self._wake()

    def close(self) -> None:
        """Ends every subscription (their iterators stop)."""
        self._closed = True
        self._wake()

    def _wake(self) -> None:
        # Swap in a fresh Event so that waiters wake once and later waiters block again.
        changed, self._changed = self._changed, asyncio.Event()
        changed.set()

    def read(self, from_sequence: int, limit: int) -> list[tuple[int, E]]:
        """Up to ``limit`` buffered events from ``from_sequence`` on, with their sequences."""
        self._check(from_sequence)
        start = from_sequence - self.oldest
        stop = min(len(self._buffer), start + limit)
        # deque indexing is O(n) from the ends; islice would be too. Buffers are small
        # enough (and readers near the tail) that index access is fine.
        return [(from_sequence + i, self._buffer[start + i]) for i in range(stop - start)]

    def _check(self, from_sequence: int) -> None:
        if from_sequence < self.oldest or from_sequence > self._next:
            raise SequenceOutOfRange(
                f"from_sequence {from_sequence} is outside the replay buffer "
                f"[{self.oldest}, {self._next}] (buffer holds {self.capacity} events)",
                oldest=self.oldest, next_sequence=self._next)

    async def subscribe(self, from_sequence: int | None = None, *,
                        batch: int = 1024) -> AsyncIterator[list[tuple[int, E]]]:
        """Yields batches of ``(sequence, event)`` from ``from_sequence`` (None = only new
        events) until the feed closes. Raises :class:`SequenceOutOfRange` at once for a bad
        ``from_sequence``, and later if this subscriber falls behind the buffer."""
        nxt = self._next if from_sequence is None else from_sequence
        self._check(nxt)
        while True:
            changed = self._changed
            if nxt < self._next:
                items = self.read(nxt, batch)
                nxt += len(items)
                yield items
                continue
            if self._closed:
                return
            await changed.wait()
