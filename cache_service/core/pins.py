"""Prefix pins: cached prefixes held out of eviction while a pin lives.

A *pin* names a prefix of one pool (its block hashes at the pool's recipe, from token ids
or given directly) and holds one reference on every block a request with that prompt
would take as its prefix hit: in each group, the blocks ``find_longest_cache_hit`` answers
(full attention: every block of the hit; sliding window: the tail the window needs; Mamba:
the checkpoint at the hit's end). A referenced block is not in the free queue, so it can
be neither handed out nor evicted; that is the whole mechanism, the free queue and the
eviction order of every unpinned block stay exactly vLLM's.

When a pin is dropped its references are released as a request's are (``free_blocks``,
tail first): blocks nothing else holds re-enter the free queue at its back, as if the pin
were one last use ending now.

A pin taken on a prefix that is not (wholly) cached yet holds what is cached and grows as
more of it is cached (:meth:`PinTable.refresh`, run by the pool after each batch and before
each free while such pins exist).

Bounds (checked when a pin is taken, never at eviction time):

* ``cap``: the blocks all pins of the pool may hold. The pool counts every distinct
  pinned block plus, for each pin still growing, the blocks it may still take (its
  ``bound`` less what it holds); a pin that would take that count above the cap is
  refused. Since no pin ever holds more than its bound, the pinned blocks never exceed the
  cap, and the default cap leaves room for one request of ``max_model_len``.
* ``account_quota``: the blocks one account's pins may be charged: each pin is charged
  its bound while it grows and what it holds once whole.

No clock here: a pin lives until :meth:`PinTable.drop`; TTLs are the service's
(``cache_service.pin_keeper``), which drops an expired pin through a logged record.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from cache_service.core.block_pool import BlockPool
from cache_service.core.coordinator import KVCacheCoordinator
from cache_service.core.errors import AlreadyExists, InvalidArgument, NotFound, ResourceExhausted
from cache_service.core.grouping import max_memory_usage_bytes, page_size_bytes
from cache_service.core.specs import KVCacheConfig, SizingLimits

#: Longest pin id (as request ids: keeps hostile ids from bloating tables).
MAX_PIN_ID_LEN = 256


def default_cap(config: KVCacheConfig, max_model_len: int,
                max_in_flight_tokens: int | None) -> int:
    """The default ``max_pinned_blocks``: the usable blocks less the worst case of one
    request of ``max_model_len`` (so pins alone never make such a request inadmissible)."""
    usable = config.num_blocks - 1
    if not config.groups:
        return 0
    page = page_size_bytes(config)
    worst = max_memory_usage_bytes(config.groups, SizingLimits(max_model_len,
                                                               max_in_flight_tokens))
    return max(0, usable - -(-worst // page))


@dataclass(slots=True)
class Pin:
    """One pin. ``held``: ids of the blocks it holds a reference on, per group in hit
    order. ``bound``: the most blocks it can ever hold (reserved against the cap while
    it grows)."""

    pin_id: str
    account: str
    hashes: list[bytes]
    max_len: int
    bound: int
    held: list[list[int]] = field(default_factory=list)
    hit_tokens: int = 0
    #: The hit can still grow (part of the prefix is not cached yet).
    growing: bool = True
    #: What :meth:`PinTable.add` charges its account (set by ``check_new``; what an outer
    #: quota, such as a tenant's, checks).
    new_charge: int = 0

    @property
    def num_held(self) -> int:
        """Blocks the pin holds a reference on, over all groups."""
        return sum(len(g) for g in self.held)

    @property
    def charge(self) -> int:
        """What the pin counts against its account's quota."""
        return self.bound if self.growing else self.num_held


@dataclass(frozen=True, slots=True)
class PinInfo:
    """What a caller sees of a pin."""

    pin_id: str
    account: str
    prefix_tokens: int  # the pinned prefix's length (the hit cap of its lookup)
    hit_tokens: int  # of it, the part cached and held now
    num_blocks: int  # blocks it holds a reference on
    growing: bool


class PinTable:
    """The pins of one pool and the references they hold.

    Invariants: ``refs[b]`` == the number of pins whose ``held`` lists block ``b``; every
    pinned block has ``ref_cnt >= refs[b]`` (so it is out of the free queue);
    ``num_pinned_blocks <= committed <= cap``."""

    def __init__(self, block_pool: BlockPool, coordinator: KVCacheCoordinator, *,
                 cap: int, account_quota: int | None, hash_block_size: int) -> None:
        self._block_pool = block_pool
        self._coordinator = coordinator
        self.cap = cap
        self.account_quota = account_quota
        self._hbs = hash_block_size
        self.pins: dict[str, Pin] = {}
        self.refs: dict[int, int] = {}
        #: account -> sum of its pins' charges
        self.charged: dict[str, int] = {}
        self.refusals = 0  # pins refused by the cap or a quota (a statistic)
        # Hits end on multiples of this (the hybrid alignment; the block size otherwise).
        self._align = max([m.cache_hit_alignment_tokens for m in coordinator.managers]
                          + [hash_block_size])

    # -- reads -------------------------------------------------------------------------
    @property
    def num_pinned_blocks(self) -> int:
        """Distinct blocks held by pins."""
        return len(self.refs)

    @property
    def committed(self) -> int:
        """Pinned blocks plus what growing pins may still take: what the cap bounds."""
        return len(self.refs) + sum(max(0, p.bound - p.num_held)
                                    for p in self.pins.values() if p.growing)

    def info(self, pin: Pin) -> PinInfo:
        """What a caller sees of ``pin``."""
        return PinInfo(pin.pin_id, pin.account, pin.max_len, pin.hit_tokens, pin.num_held,
                       pin.growing)

    def get(self, pin_id: str) -> Pin:
        """The pin (NotFound naming pin_id if there is none)."""
        pin = self.pins.get(pin_id)
        if pin is None:
            raise NotFound(f"unknown pin {pin_id!r:.80}", field="pin_id")
        return pin

    def pinned_hashes(self) -> set[bytes]:
        """Every hash some pin names (PeekPrefix marks pinned prefixes with it)."""
        return {h for p in self.pins.values() for h in p.hashes}

    # -- changes -------------------------------------------------------------------------
    def check_new(self, pin_id: str, account: str, hashes: Sequence[bytes],
                  max_len: int, prefix_field: str = "token_ids") -> Pin:
        """The pin :meth:`add` would take (raises, changing nothing, if it is refused);
        a refusal of the prefix names ``prefix_field`` (how the caller gave it)."""
        if type(pin_id) is not str or not pin_id or len(pin_id) > MAX_PIN_ID_LEN:
            raise InvalidArgument(f"pin_id must be 1-{MAX_PIN_ID_LEN} characters",
                                  field="pin_id")
        if pin_id in self.pins:
            raise AlreadyExists(f"pin {pin_id!r:.80} exists; renew or drop it",
                                field="pin_id")
        if max_len < self._align:
            raise InvalidArgument(
                f"the prefix must be able to hit at least {self._align} tokens (a hit never "
                f"covers the whole prompt: pin one token more than the prefix)",
                field=prefix_field)
        bound = sum(max_len // m.block_size for m in self._coordinator.managers)
        pin = Pin(pin_id, account, list(hashes), max_len, bound)
        needed, hit, growing = self._resolve(pin)
        pin.hit_tokens, pin.growing = hit, growing
        new = {b for g in needed for b in g if b not in self.refs}
        reserve = max(0, bound - sum(len(g) for g in needed)) if growing else 0
        after = self.committed + len(new) + reserve
        if after > self.cap:
            self.refusals += 1
            raise ResourceExhausted(
                f"pinning this prefix would take the pool's pinned blocks to {after}, beyond "
                f"its limit (max_pinned_blocks) of {self.cap}", field=prefix_field)
        charge = bound if growing else sum(len(g) for g in needed)
        quota = self.account_quota
        if quota is not None and self.charged.get(account, 0) + charge > quota:
            self.refusals += 1
            raise ResourceExhausted(
                f"account {account!r:.80} has {self.charged.get(account, 0)} pinned blocks; "
                f"this pin would add {charge}, beyond the limit (pinned_block_quota) of "
                f"{quota}", field=prefix_field)
        pin.held, pin.new_charge = [[] for _ in needed], charge
        return pin

    def add(self, pin: Pin) -> None:
        """Takes a pin :meth:`check_new` answered (cannot fail)."""
        self.pins[pin.pin_id] = pin
        self.charged[pin.account] = self.charged.get(pin.account, 0) + pin.charge
        self._update(pin)

    def drop(self, pin_id: str) -> None:
        """Releases the pin's references (tail first) and forgets it."""
        pin = self.pins.pop(pin_id)
        self.charged[pin.account] -= pin.charge
        if not self.charged[pin.account]:
            del self.charged[pin.account]
        self._release([b for g in pin.held for b in g])
        pin.held = []

    @property
    def any_growing(self) -> bool:
        """Whether some pin still grows (the pool refreshes pins only then)."""
        return any(p.growing for p in self.pins.values())

    def refresh(self, *, force: bool = False) -> None:
        """Grows every growing pin to what is cached now (and re-resolves every pin with
        ``force``, after cache entries were dropped under held blocks)."""
        for pin in self.pins.values():
            if pin.growing or force:
                self._update(pin)

    def check_invariants(self) -> None:
        """Assert the table's invariants (class docstring); for tests."""
        refs: dict[int, int] = {}
        charged: dict[str, int] = {}
        for pin in self.pins.values():
            ids = [b for g in pin.held for b in g]
            assert len(set(ids)) == len(ids), f"pin {pin.pin_id!r} holds a block twice"
            assert pin.num_held <= pin.bound, f"pin {pin.pin_id!r} holds beyond its bound"
            for b in ids:
                refs[b] = refs.get(b, 0) + 1
            charged[pin.account] = charged.get(pin.account, 0) + pin.charge
        assert refs == self.refs, "pin references out of sync with the pins"
        nonzero = {a: c for a, c in charged.items() if c}
        assert {a: c for a, c in self.charged.items() if c} == nonzero, \
            "account charges out of sync"
        for b, n in refs.items():
            block = self._block_pool.get_block(b)
            assert not block.is_null and block.ref_cnt >= n, f"pinned block {b}: ref_cnt"
        assert len(self.refs) <= self.committed <= max(self.cap, 0) or not self.pins, \
            f"pinned blocks {len(self.refs)} / committed {self.committed} > cap {self.cap}"
        quota = self.account_quota
        if quota is not None:
            assert all(c <= quota for c in charged.values()), "an account is over its quota"

    # -- internals -----------------------------------------------------------------------
    def _resolve(self, pin: Pin) -> tuple[list[list[int]], int, bool]:
        """(blocks a hit of the prefix takes now, per group; hit tokens; whether the hit
        can still grow)."""
        blocks, hit, _ = self._coordinator.find_longest_cache_hit(
            pin.hashes, pin.max_len, self._block_pool)  # device blocks only: pins hold them
        needed = [[b.block_id for b in g if not b.is_null] for g in blocks]
        # Whole when no further aligned hit fits under the cap.
        return needed, hit, hit + self._align <= pin.max_len

    def _update(self, pin: Pin) -> None:
        needed, hit, growing = self._resolve(pin)
        old = {b for g in pin.held for b in g}
        new = {b for g in needed for b in g}
        gone = [b for g in pin.held for b in g if b not in new]  # in hit order
        before = pin.charge
        # Take the new references before releasing the old ones: a block in both stays
        # out of the free queue throughout.
        take = [self._block_pool.get_block(b) for g in needed for b in g if b not in old]
        self._block_pool.touch(take)
        refs = self.refs
        for block in take:
            refs[block.block_id] = refs.get(block.block_id, 0) + 1
        pin.held, pin.hit_tokens, pin.growing = needed, hit, growing
        self.charged[pin.account] += pin.charge - before
        self._release(gone)

    def _release(self, block_ids: list[int]) -> None:
        refs = self.refs
        for b in block_ids:
            n = refs[b] - 1
            if n:
                refs[b] = n
            else:
                del refs[b]
        get = self._block_pool.get_block
        # Tail first, as a request frees: the prefix's head survives longest.
        self._block_pool.free_blocks([get(b) for b in reversed(block_ids)])
