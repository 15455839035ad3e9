"""Long calls share the event loop: the server runs on one loop, so a call that computes for
half a second stalls every other client for that long. Long work is therefore cut into
slices (a decode op over many requests, the hashing of a long PeekPrefix prompt) and the
loop serves other calls between slices.

Slicing must not let anything observe or change a pool between the slices of one call:
:class:`PoolGate` marks the pools a sliced call is working on, and every call on such a
pool (mutation or read) waits until it is done. Calls on other pools go ahead at once.
No gRPC here.
"""

from __future__ import annotations

import asyncio
import enum
import gc
import time
from collections.abc import Callable, Generator, Iterable, Sequence
from typing import TypeVar

T = TypeVar("T")

#: Request-ops applied between two yields of the work (well under 1 ms).
SLICE_REQUESTS = 32
#: Prompt blocks hashed between two yields of a PeekPrefix (about the same cost).
PEEK_SLICE_BLOCKS = 16
#: The loop is given back once a sliced call has run this long. Another call needs
#: several loop turns (receive, handle, send), each waiting for at most one turn of the
#: long call: so a turn must be short, but not so short that switching dominates.
TURN_SECONDS = 0.0005


class _Pending(enum.Enum):
    # A one-member enum rather than object(): `value is _PENDING` then narrows the type.
    PENDING = enum.auto()


_PENDING = _Pending.PENDING


def _turn(work: Generator[None, None, T],
          go_on: Callable[[], bool] = lambda: True) -> T | _Pending:
    """Runs ``work`` for one turn (at least one slice, then while the turn lasts and
    ``go_on()``): its value if it ended, else ``_PENDING``."""
    turn_ends = time.perf_counter() + TURN_SECONDS
    try:
        next(work)
        while time.perf_counter() < turn_ends and go_on():
            next(work)
    except StopIteration as end:
        return end.value
    return _PENDING


class PoolGate:
    """Which pools a sliced call is working on; the others' calls wait for them."""

    def __init__(self) -> None:
        self._busy: dict[str, asyncio.Event] = {}
        #: Tasks finishing the work of cancelled callers (referenced until they end).
        self._orphans: set[asyncio.Task] = set()
        self._waiting = 0  # calls in wait_idle, waiting for a busy pool

    async def wait_idle(self, pools: Iterable[str]) -> None:
        """Returns once none of ``pools`` is being worked on by a sliced call. Nothing
        may await between this and the work it guards (the loop is the lock)."""
        pools = list(pools)
        while True:
            busy = next((self._busy[p] for p in pools if p in self._busy), None)
            if busy is None:
                return
            self._waiting += 1
            try:
                await busy.wait()
            finally:
                self._waiting -= 1

    async def wait_all_idle(self) -> None:
        """Returns once no pool is being worked on by a sliced call: the state is then the
        one after every accepted record (e.g. to be copied whole). Nothing may await
        between this and what it guards."""
        while self._busy:
            await next(iter(self._busy.values())).wait()

    async def run(self, work: Generator[None, None, T], pools: list[str]) -> T:
        """Runs a sliced mutation of ``pools``: once they are idle, a first turn at once
        (most calls end within it, with no task or loop switch), the rest by
        :meth:`finish`. Errors of the work (its validation) raise from here."""
        await self.wait_idle(pools)
        value = _turn(work)
        return await self.finish(work, pools) if value is _PENDING else value

    async def finish(self, work: Generator[None, None, T], pools: Iterable[str]) -> T:
        """Runs a started sliced mutation to its end, with ``pools`` marked busy and the
        loop free between slices. A cancelled caller does not stop it (its first slice is
        applied and logged, so the rest must follow): the rest then runs in a task of its
        own, the pools still marked busy until it ends. The usual case (not cancelled)
        runs in the caller's task: no task and no future per call."""
        pools = [p for p in pools if p not in self._busy]
        done = asyncio.Event()
        for pool in pools:
            self._busy[pool] = done
        handed_off = False
        try:
            while True:
                try:
                    await asyncio.sleep(0)
                except asyncio.CancelledError:
                    handed_off = True
                    task = asyncio.ensure_future(self._finish_alone(work, pools, done))
                    self._orphans.add(task)
                    task.add_done_callback(self._orphans.discard)
                    raise
                value = _turn(work)
                if value is not _PENDING:
                    break
        finally:
            if not handed_off:
                self._release(pools, done)
        if self._waiting:
            # Calls that waited for these pools go first (their wake-ups are queued
            # already), as when the work ended in a task of its own.
            await asyncio.sleep(0)
        return value

    async def _finish_alone(self, work: Generator[None, None, T], pools: list[str],
                            done: asyncio.Event) -> None:
        """The rest of a sliced mutation whose caller was cancelled (see :meth:`finish`)."""
        try:
            while True:
                await asyncio.sleep(0)
                if _turn(work) is not _PENDING:
                    return
        finally:
            self._release(pools, done)

    def _release(self, pools: list[str], done: asyncio.Event) -> None:
        for pool in pools:
            del self._busy[pool]
        done.set()

    async def read(self, work: Generator[None, None, T], pool: str | Sequence[str]) -> T:
        """Runs a sliced read of ``pool`` (or of several pools), each slice only while no
        sliced mutation is working on them (so the read never sees half of one)."""
        pools = (pool,) if isinstance(pool, str) else pool
        busy = self._busy
        while True:
            await self.wait_idle(pools)
            # A read's slices are read-only: cheap to check the pools stay idle each time.
            value = _turn(work, lambda: not busy or all(p not in busy for p in pools))
            if value is not _PENDING:
                return value
            await asyncio.sleep(0)


async def keep_heap_frozen(interval: float = 5.0) -> None:
    """Moves the objects that survived ``interval`` seconds out of the garbage collector's
    view (``gc.freeze``), until cancelled.

    The allocator's state is millions of long-lived objects (blocks, requests, token
    lists); a full collection scans them all and stalled every client for ~0.2-0.4 s with
    10k requests. Frozen objects are never scanned. What the allocator frees is freed by
    reference counting; the one cyclic structure (a pool's linked free-block queue) becomes
    garbage only when a pool is deleted, which calls :func:`thaw_heap`."""
    while True:
        await asyncio.sleep(interval)
        gc.freeze()


def thaw_heap() -> None:
    """Gives frozen objects back to the collector (after a pool was dropped: its blocks
    link to each other, so only a collection can free them)."""
    gc.unfreeze()
