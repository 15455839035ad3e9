"""The executor's host tier (issue 26; docs/executor.md#host-tier): host memory that holds
cached blocks the cache service demoted from the device pool, and the copies between the two.

Layout: the service numbers host slots PER KV-cache group (``TierCopy.host_slot`` in
``[0, host_tier_blocks)`` of ``TierCopy.group``), so every group has its own slots: for group
g with L_g layers, ``slots[g][j]`` is a ``[host_tier_blocks, page_size_bytes]`` byte tensor
holding layer j's page of each host slot (layer j of a group lives in device slot j of
:class:`~executor.cache.CacheTensors`). Memory = ``sum_g L_g * host_tier_blocks * page``. On
CUDA the tensors are pinned (page-locked) so copies are DMA transfers; on CPU plain memory.

Ordering (the service's rule, per Step answer, answers in the order received): every
demotion (device block -> host slot), then every promotion (host slot -> device block), then
the answer's block copies, then the forward pass. One call of :meth:`HostTier.demote` /
:meth:`HostTier.promote` runs one answer's list, batched per layer (one gather and one
scatter per layer of each group, not one copy per block). Within one list, sources and
destinations are in different memories, so a batched copy equals the copies one by one,
except that a destination named twice gets its last source (we keep the last).

CUDA: the copies run on a side stream that first waits for the compute stream (the blocks
a demotion reads were written by earlier forward passes); the compute stream then waits for
the side stream before anything later (block copies, the forward pass) touches device
blocks. Demotions: one device gather of the group's layers; the compute stream waits for
that gather only; the device-to-host copy into a pinned staging buffer runs on a third
stream, and the scatter into the host slots waits for it (:meth:`HostTier.flush`, run
before the next tier operation reads host memory), so the transfer overlaps the promotions
and the forward pass. Promotions: host gather into pinned staging -> one host-to-device
copy -> device scatter, on the side stream; the compute stream waits for all of it.

Faults: a copy that fails never lets garbage be read. A failed demotion marks its host
slots bad (a later promotion from one fails); a failed promotion's device blocks are
returned to the caller, who must not run a forward pass over them (the engine preempts the
requests that hold them and has the service drop their cache entries; the requests then
recompute). :attr:`HostTier.fault` is a test hook: ``fault(kind, copy)`` returning True
makes that copy fail (its destination is scribbled over, as a torn copy would leave it).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Collection, Iterable, Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

import torch
from torch import Tensor

from executor.cache import CacheTensors

#: Byte written over the destination of a failed copy (fault injection): as bf16/fp16/fp32
#: data it reads as large values, so a forward pass over it visibly changes the outputs.
SCRIBBLE = 0x7B


class TierCopy(NamedTuple):
    """One block between the device pool and the host tier (the protocol's TierCopy)."""

    group: int
    block_id: int
    host_slot: int


def tier_copies(msgs: Iterable[object]) -> list[TierCopy]:
    """TierCopy tuples of protocol messages or client results (anything with ``group``,
    ``block_id`` and ``host_slot``)."""
    return [TierCopy(int(m.group), int(m.block_id), int(m.host_slot))  # type: ignore[attr-defined]
            for m in msgs]


def fail_nth(kind: str, n: int) -> Callable[[str, TierCopy], bool]:
    """A :attr:`HostTier.fault` hook (fault injection, tests): the ``n``-th copy of
    ``kind`` ("demotion" or "promotion"), counting from 1, fails; every other one runs."""
    seen = 0

    def fault(k: str, copy: TierCopy) -> bool:
        nonlocal seen
        if k != kind:
            return False
        seen += 1
        return seen == n
    return fault


@dataclass
class TierStats:
    """Counters of one executor's host tier."""

    demotions: int = 0
    promotions: int = 0
    failed_demotions: int = 0
    failed_promotions: int = 0
    resets: int = 0
    copy_seconds: float = 0.0  # host time spent issuing (CPU: running) the copies


@dataclass
class _PendingScatter:
    """A demotion batch whose device-to-host transfer may still run (CUDA)."""

    group: int
    slots: Tensor  # host slot indices (CPU, int64)
    staging: Tensor  # pinned [L_g, n, page]
    event: object  # torch.cuda.Event: recorded after the device-to-host copy
    gathered: Tensor  # the device gather the copy reads: kept alive until it is done


@dataclass
class HostTier:
    """The host slots of every group and the copies between them and the device cache.

    Invariant: a host slot not in :attr:`bad` holds exactly the bytes of the device block
    last demoted into it (once :meth:`flush` has run)."""

    cache: CacheTensors
    host_tier_blocks: int
    fault: Callable[[str, TierCopy], bool] | None = None
    stats: TierStats = field(default_factory=TierStats)

    def __post_init__(self) -> None:
        if self.host_tier_blocks < 1:
            raise ValueError(f"host_tier_blocks: must be >= 1, got {self.host_tier_blocks}")
        dev = self.cache.device
        self.cuda = dev.type == "cuda"
        page = self.cache.page_size_bytes
        self.slots: list[list[Tensor]] = [
            [torch.zeros(self.host_tier_blocks, page, dtype=torch.uint8, pin_memory=self.cuda)
             for _ in g.layer_names]
            for g in self.cache.groups]
        #: (group, host slot) pairs whose content is garbage (a failed demotion).
        self.bad: set[tuple[int, int]] = set()
        self._pending: list[_PendingScatter] = []
        # CUDA: the copies' stream, and one for demotions' device-to-host transfers (which
        # nothing on the device waits for: they overlap the promotions and the forward).
        self._stream = torch.cuda.Stream(device=dev) if self.cuda else None
        self._d2h = torch.cuda.Stream(device=dev) if self.cuda else None

    @property
    def failures(self) -> int:
        """Copies that failed so far (demotions and promotions)."""
        return self.stats.failed_demotions + self.stats.failed_promotions

    @property
    def nbytes(self) -> int:
        """Bytes of host memory the tier holds."""
        return sum(t.numel() for g in self.slots for t in g)

    def reset(self) -> None:
        """Forget every slot (the service was told ResetHostTier: nothing is read from
        them again before a demotion writes them)."""
        self.flush()
        self.bad.clear()
        self.stats.resets += 1

    # ------------------------------------------------------------------ the copies
    def demote(self, copies: Sequence[TierCopy],
               suspect: Collection[tuple[int, int]] = ()) -> list[tuple[int, int]]:
        """Device block -> host slot for each copy (one answer's list, in order). Returns
        the (group, host slot) pairs that failed (now in :attr:`bad`); a copy from a
        ``suspect`` (group, block) pair (garbage: a failed promotion's destination) fails."""
        t0 = time.perf_counter()
        self.flush()  # an earlier demotion into the same slot must land first
        failed: list[tuple[int, int]] = []
        for group, batch in self._by_group(copies, "demotion", key=lambda c: c.host_slot):
            bad = [c for c in batch
                   if (group, c.block_id) in suspect or self._injected("demotion", c)]
            ok = [c for c in batch if c not in bad]
            try:
                if ok:
                    self._demote(group, ok)
            except RuntimeError:  # a torn batch: none of its slots can be trusted
                bad = batch
            if bad:
                self._scribble_host(group, [c.host_slot for c in bad])
            for c in batch:
                self.bad.discard((group, c.host_slot))
            self.bad.update((group, c.host_slot) for c in bad)
            failed += [(group, c.host_slot) for c in bad]
        self.stats.demotions += len(copies) - len(failed)
        self.stats.failed_demotions += len(failed)
        self.stats.copy_seconds += time.perf_counter() - t0
        return failed

    def promote(self, copies: Sequence[TierCopy]) -> list[tuple[int, int]]:
        """Host slot -> device block for each copy (one answer's list, in order, after its
        demotions). Returns the (group, device block) pairs that failed: their content is
        garbage and no forward pass may read them."""
        t0 = time.perf_counter()
        self.flush()  # a slot demoted by an earlier answer must be in host memory first
        failed: list[tuple[int, int]] = []
        for group, batch in self._by_group(copies, "promotion", key=lambda c: c.block_id):
            bad = [c for c in batch
                   if (group, c.host_slot) in self.bad or self._injected("promotion", c)]
            ok = [c for c in batch if c not in bad]
            try:
                if ok:
                    self._promote(group, ok)
            except RuntimeError:
                bad = batch
            if bad:
                self._scribble_device(group, [c.block_id for c in bad])
            failed += [(group, c.block_id) for c in bad]
        self.stats.promotions += len(copies) - len(failed)
        self.stats.failed_promotions += len(failed)
        self.stats.copy_seconds += time.perf_counter() - t0
        return failed

    def flush(self) -> None:
        """Completes the deferred host-side half of earlier demotions (CUDA; a no-op on
        CPU): after it, every demoted slot holds its bytes."""
        pending, self._pending = self._pending, []
        for p in pending:
            p.event.synchronize()  # type: ignore[attr-defined]
            for j, host in enumerate(self.slots[p.group]):
                host.index_copy_(0, p.slots, p.staging[j])

    # ------------------------------------------------------------------ internals
    def _by_group(self, copies: Sequence[TierCopy], kind: str,
                  key: Callable[[TierCopy], int]) -> list[tuple[int, list[TierCopy]]]:
        """The copies by group (in order), range-checked, a destination named twice keeping
        its last copy (what running them one by one leaves)."""
        groups: dict[int, dict[int, TierCopy]] = {}
        n_groups, n_blocks = len(self.slots), self.cache.num_blocks
        for c in copies:
            if not 0 <= c.group < n_groups:
                raise ValueError(f"{kind}: group {c.group} is not in [0, {n_groups})")
            if not 0 < c.block_id < n_blocks:
                raise ValueError(f"{kind}: block {c.block_id} is not in [1, {n_blocks})")
            if not 0 <= c.host_slot < self.host_tier_blocks:
                raise ValueError(f"{kind}: host slot {c.host_slot} is not in "
                                 f"[0, {self.host_tier_blocks})")
            dests = groups.setdefault(c.group, {})
            dests.pop(key(c), None)
            dests[key(c)] = c
        return [(g, list(d.values())) for g, d in groups.items()]

    def _injected(self, kind: str, c: TierCopy) -> bool:
        return self.fault is not None and self.fault(kind, c)

    def _device_slots(self, group: int) -> list[Tensor]:
        return self.cache.slots[:len(self.slots[group])]

    def _demote(self, group: int, batch: list[TierCopy]) -> None:
        host_idx = torch.tensor([c.host_slot for c in batch], dtype=torch.long)
        dev_slots = self._device_slots(group)
        if not self.cuda:
            dev_idx = torch.tensor([c.block_id for c in batch], dtype=torch.long)
            for host, dev in zip(self.slots[group], dev_slots):
                host.index_copy_(0, host_idx, dev.index_select(0, dev_idx))
            return
        stream, d2h = self._stream, self._d2h
        assert stream is not None and d2h is not None
        compute = torch.cuda.current_stream(self.cache.device)
        stream.wait_stream(compute)  # the forward passes that wrote these blocks
        with torch.cuda.stream(stream):
            dev_idx = torch.tensor([c.block_id for c in batch], dtype=torch.long,
                                   device=self.cache.device)
            gathered = torch.stack([dev.index_select(0, dev_idx) for dev in dev_slots])
            gather_done = torch.cuda.Event()
            gather_done.record(stream)
        # Whatever writes the device blocks next (promotions, block copies, the forward:
        # all queued on `stream` or `compute` after this) waits for the gather only.
        compute.wait_event(gather_done)
        staging = torch.empty(gathered.shape, dtype=torch.uint8, pin_memory=True)
        with torch.cuda.stream(d2h):
            d2h.wait_event(gather_done)
            staging.copy_(gathered, non_blocking=True)
            copied = torch.cuda.Event()
            copied.record(d2h)
        # `gathered` is referenced until flush() has waited for `copied`.
        self._pending.append(_PendingScatter(group, host_idx, staging, copied, gathered))

    def _promote(self, group: int, batch: list[TierCopy]) -> None:
        host_idx = torch.tensor([c.host_slot for c in batch], dtype=torch.long)
        dev_slots = self._device_slots(group)
        if not self.cuda:
            dev_idx = torch.tensor([c.block_id for c in batch], dtype=torch.long)
            for host, dev in zip(self.slots[group], dev_slots):
                dev.index_copy_(0, dev_idx, host.index_select(0, host_idx))
            return
        stream = self._stream
        assert stream is not None
        page = self.cache.page_size_bytes
        staging = torch.empty(len(dev_slots), len(batch), page, dtype=torch.uint8,
                              pin_memory=True)
        for j, host in enumerate(self.slots[group]):
            torch.index_select(host, 0, host_idx, out=staging[j])
        compute = torch.cuda.current_stream(self.cache.device)
        stream.wait_stream(compute)  # earlier work on the destination blocks
        with torch.cuda.stream(stream):
            dev_idx = torch.tensor([c.block_id for c in batch], dtype=torch.long).to(
                self.cache.device)
            moved = staging.to(self.cache.device, non_blocking=True)
            for j, dev in enumerate(dev_slots):
                dev.index_copy_(0, dev_idx, moved[j])
        compute.wait_stream(stream)  # the forward reads the promoted blocks
        moved.record_stream(stream)
        dev_idx.record_stream(stream)

    def _scribble_host(self, group: int, host_slots: list[int]) -> None:
        idx = torch.tensor(host_slots, dtype=torch.long)
        for host in self.slots[group]:
            host.index_fill_(0, idx, SCRIBBLE)

    def _scribble_device(self, group: int, blocks: list[int]) -> None:
        idx = torch.tensor(blocks, dtype=torch.long, device=self.cache.device)
        for dev in self._device_slots(group):
            dev.index_fill_(0, idx, SCRIBBLE)
