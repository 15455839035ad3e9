"""The server's registry of pools: idempotent registration, description diffs, deletion.

A pool is registered from a :class:`PoolDescription` (layer specs + size + options). The
same description under the same id answers the existing pool; another description names
the first differing field (``layers[2].sliding_window``) in an ``AlreadyExists`` error.
Each pool has its own :class:`~cache_service.event_feed.EventFeed`; pools share nothing.
No gRPC here.
"""

from __future__ import annotations

import dataclasses
import hashlib
import re
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from cache_service.core.grouping import get_kv_cache_config, page_size_bytes
from cache_service.core.pool import Pool, PoolOptions
from cache_service.core.prefix_index import PrefixIndex, keyspace_of
from cache_service.core.restore import fill_added_attributes
from cache_service.core.specs import KVCacheConfig, KVCacheSpec, SizingLimits
from cache_service.errors import (
    AlreadyExists,
    InvalidArgument,
    KVCacheError,
    NotFound,
    ResourceExhausted,
)
from cache_service.event_feed import EventFeed
from cache_service.tenants import TENANT_RE, tenant_of

POOL_ID_RE = re.compile(r"[A-Za-z0-9._:-]{1,128}")
#: The most bytes one block id may cost across all layers. Layer pages are bounded on
#: their own (see convert); grouping may still scale pages up (block sizes unified to a
#: common multiple), so the pool's sum is checked again once grouped.
MAX_BLOCK_BYTES = 1 << 48
#: Default server block budget (sum of num_blocks over all pools): what the metadata of a
#: pool can grow to once every block was handed out is ~100 bytes per block, so the
#: default bounds the allocator's own memory to a few GiB.
DEFAULT_MAX_TOTAL_BLOCKS = 1 << 24

# Core spec attribute -> the protocol field that carries it (for diff messages).
_SPEC_FIELD_NAMES = {"shapes": "mamba_states", "dtypes": "mamba_states"}
_OPTION_FIELD_NAMES = {"account_block_quota": "session_block_quota",
                       "pinned_block_quota": "session_pinned_block_quota"}
_CHECKED_WITH_LAYOUT = frozenset({"prefix_cache_retention_interval", "use_eagle",
                                  "host_tier_blocks", "num_hash_lookahead_tokens"})
_CONFIG_FIELD_NAMES = {"available_memory": "available_memory_bytes",
                       "max_model_len": "options.max_model_len"}


@dataclass(frozen=True)
class PoolDescription:
    """What a pool is registered with. Exactly one of ``num_blocks`` and
    ``available_memory_bytes`` is set."""

    layers: tuple[tuple[str, KVCacheSpec], ...]
    options: PoolOptions
    num_blocks: int | None = None
    available_memory_bytes: int | None = None
    hybrid: bool = True
    skip_capacity_check: bool = False


@dataclass
class PoolEntry:
    """One registered pool: its description, allocator and event feed."""

    pool_id: str
    description: PoolDescription
    pool: Pool
    feed: EventFeed
    incarnation: int = 1

    @property
    def config(self) -> KVCacheConfig:
        """The pool's KV cache configuration."""
        return self.pool.config

    @property
    def budget_blocks(self) -> int:
        """What the pool takes of block budgets (--max-total-blocks, a tenant's
        max_blocks): see :func:`budget_blocks`."""
        return budget_blocks(self.config, self.description)

    def __setstate__(self, state: dict) -> None:
        """Unpickled (a snapshot, an AdoptPool record, a standby's catch-up): a pool from
        an older release's snapshot gets the attributes added since (core/restore.py)."""
        self.__dict__.update(state)
        fill_added_attributes(self.pool)

    def flush_events(self) -> None:
        """Moves the allocator's pending KV events into the feed (call after mutations)."""
        events = self.pool.take_events()
        if events:
            self.feed.publish(events)


def first_difference(old: PoolDescription, new: PoolDescription) -> str | None:
    """The protocol path of the first field where two descriptions differ, or None."""
    if len(old.layers) != len(new.layers):
        return "layers"
    for i, ((old_name, old_spec), (new_name, new_spec)) in enumerate(
            zip(old.layers, new.layers)):
        if old_name != new_name:
            return f"layers[{i}].name"
        if type(old_spec) is not type(new_spec):
            return f"layers[{i}].kind"
        for f in dataclasses.fields(old_spec):
            if getattr(old_spec, f.name) != getattr(new_spec, f.name):
                return f"layers[{i}].{_SPEC_FIELD_NAMES.get(f.name, f.name)}"
    for name in ("num_blocks", "available_memory_bytes"):
        if getattr(old, name) != getattr(new, name):
            return name
    for f in dataclasses.fields(old.options):
        if getattr(old.options, f.name) != getattr(new.options, f.name):
            return f"options.{_OPTION_FIELD_NAMES.get(f.name, f.name)}"
    if old.hybrid != new.hybrid:
        return "options.hybrid"
    if old.skip_capacity_check != new.skip_capacity_check:
        return "options.skip_capacity_check"
    return None


def budget_blocks(config: KVCacheConfig, desc: PoolDescription) -> int:
    """Device blocks plus host-tier slots (options.host_tier_blocks per group): a host
    slot costs the server the same bookkeeping as a cached block, so block budgets
    bound both and a tier cannot grow a pool's metadata past them."""
    return config.num_blocks + desc.options.host_tier_blocks * len(config.groups)


def budget_field(desc: PoolDescription) -> str:
    """The protocol field that sized the pool (named by budget errors)."""
    return "num_blocks" if desc.num_blocks is not None else "available_memory_bytes"


def build_config(desc: PoolDescription) -> KVCacheConfig:
    """The pool layout of a description (raises ConfigError/InvalidArgument). Cheap: no
    per-block work, so a budget can be checked before anything is built."""
    names = [name for name, _ in desc.layers]
    if not names:
        raise InvalidArgument("at least one layer is required", field="layers")
    seen: set[str] = set()
    for i, name in enumerate(names):
        if not name:
            raise InvalidArgument("layer name is empty", field=f"layers[{i}].name")
        if name in seen:
            raise InvalidArgument(f"duplicate layer name {name!r}", field=f"layers[{i}].name")
        seen.add(name)
    opts = desc.options
    limits = SizingLimits(max_model_len=opts.max_model_len,
                          max_in_flight_tokens=opts.max_in_flight_tokens)
    try:
        config = get_kv_cache_config(dict(desc.layers),
                                     available_memory=desc.available_memory_bytes,
                                     num_blocks=desc.num_blocks,
                                     limits=None if desc.skip_capacity_check else limits,
                                     hybrid=desc.hybrid)
    except InvalidArgument as exc:
        # The core names its own arguments; the protocol calls the budget differently.
        exc.field = _CONFIG_FIELD_NAMES.get(exc.field, exc.field)
        raise
    per_block = page_size_bytes(config)
    if per_block > MAX_BLOCK_BYTES:
        raise InvalidArgument(f"one block id would cost {per_block} bytes across the layers "
                              f"(after grouping), more than the limit of {MAX_BLOCK_BYTES}",
                              field="layers")
    return config


def build_pool(desc: PoolDescription) -> Pool:
    """A fresh allocator for a description (raises ConfigError/InvalidArgument)."""
    return Pool(build_config(desc), desc.options)


def incarnation_id(instance_id: str, ordinal: int) -> int:
    """The incarnation of the ``ordinal``-th pool created in a state of ``instance_id``:
    a non-zero 64-bit id. Derived, not drawn at random, so that replaying the same
    registrations on the same state gives the same ids (recovery) while a new instance
    (a fresh in-memory start, a new data directory) or a new registration gives new ones."""
    digest = hashlib.blake2b(f"{instance_id}/{ordinal}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big") or 1


class PoolRegistry:
    """Pools by id. Not thread-safe by design: the server's event loop owns it.
    ``instance_id`` names this state's life (see :func:`incarnation_id`).

    Invariant: ``total_blocks`` (the sum of every pool's num_blocks) <= ``max_total_blocks``.
    """

    def __init__(self, event_buffer: int = 10000, instance_id: str = "", *,
                 max_total_blocks: int = DEFAULT_MAX_TOTAL_BLOCKS) -> None:
        self._pools: dict[str, PoolEntry] = {}
        self._event_buffer = event_buffer
        self.instance_id = instance_id
        self._created = 0  # pools ever created in this state: the next incarnation ordinal
        self.max_total_blocks = max_total_blocks
        self.total_blocks = 0
        #: Every pool's cached prefixes in one map (PeekPrefix answers from
        #: it): derived from the pools, so never pickled (see __getstate__).
        self.index = PrefixIndex()
        #: Bumped by every registration and deletion (lets callers cache lookups by id).
        self.version = 0

    def register(self, pool_id: str, desc: PoolDescription) -> tuple[PoolEntry, bool]:
        """The pool ``pool_id``, created if new; ``(entry, created)``."""
        entry, created = self.prepare_register(pool_id, desc)
        if created:
            self.add(entry)
        return entry, created

    def prepare_register(self, pool_id: str, desc: PoolDescription) -> tuple[PoolEntry, bool]:
        """The validation half of :meth:`register`: the existing pool (created False), or
        a new one NOT yet registered (:meth:`add` it). Raises and changes nothing on a bad
        description, one that differs from the registered pool's, or one beyond the block
        budget; every check runs before the pool is built (which is O(1) in its size)."""
        check_pool_id(pool_id, qualified=True)
        existing = self._pools.get(pool_id)
        if existing is not None:
            diff = first_difference(existing.description, desc)
            if diff is None:
                return existing, False
            raise AlreadyExists(f"pool {pool_id!r} exists with a different description "
                                f"(first difference: {diff})", field=diff)
        config = build_config(desc)
        need = budget_blocks(config, desc)
        if self.total_blocks + need > self.max_total_blocks:
            host = need - config.num_blocks
            raise ResourceExhausted(
                f"the pool would have {config.num_blocks} blocks"
                + (f" and {host} host-tier slots" if host else "")
                + f"; the server's block budget (--max-total-blocks) has "
                f"{self.max_total_blocks - self.total_blocks} of {self.max_total_blocks} left",
                field="options.host_tier_blocks" if host and config.num_blocks
                + self.total_blocks <= self.max_total_blocks else budget_field(desc))
        try:
            pool = Pool(config, desc.options)
        except KVCacheError as exc:
            # Options the core checks against the layout: name them as the protocol does.
            if exc.field in _CHECKED_WITH_LAYOUT:
                exc.field = f"options.{exc.field}"
            raise
        return PoolEntry(pool_id, desc, pool, EventFeed(self._event_buffer)), True

    def add(self, entry: PoolEntry) -> None:
        """Registers a pool from :meth:`prepare_register`, giving it the next incarnation."""
        assert entry.pool_id not in self._pools, f"pool {entry.pool_id!r} registered twice"
        entry.incarnation = self.next_incarnation()
        self._created += 1
        self.adopt(entry)

    def adopt(self, entry: PoolEntry) -> None:
        """Registers a pool taken over from another state as it was there: its incarnation
        is kept (no new ordinal is used) and the block budget is not checked (refusing
        would lose the clients' state; the pool existed within the cluster's budget)."""
        assert entry.pool_id not in self._pools, f"pool {entry.pool_id!r} registered twice"
        self._pools[entry.pool_id] = entry
        self.total_blocks += entry.budget_blocks
        self.index.attach(entry.pool_id, entry.pool, keyspace_of(entry.pool,
                                                                  tenant_of(entry.pool_id)))
        self.version += 1

    def __getstate__(self) -> dict:
        """Everything but the routing index: it is derived from the pools' prefix-cache
        maps, so a snapshot leaves it out and a restored registry rebuilds it."""
        state = dict(self.__dict__)
        del state["index"]
        return state

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self.index = PrefixIndex()
        for entry in self._pools.values():
            self.index.attach(entry.pool_id, entry.pool,
                              keyspace_of(entry.pool, tenant_of(entry.pool_id)))

    def next_incarnation(self) -> int:
        """The incarnation the next :meth:`add` gives (nothing changes)."""
        return incarnation_id(self.instance_id, self._created)

    def get(self, pool_id: str, *, field: str = "pool_id") -> PoolEntry:
        """The pool, or NotFound naming ``field``."""
        entry = self._pools.get(pool_id)
        if entry is None:
            raise NotFound(f"unknown pool {pool_id!r}", field=field)
        return entry

    def entry(self, pool_id: str) -> PoolEntry:
        """The pool, looked up without the checks :meth:`get` may add (KeyError if
        absent): for a commit, whose record's pools passed :meth:`fence` already."""
        return self._pools[pool_id]

    def fence(self, pool_id: str) -> None:
        """Raises (a core error) if this server may not change ``pool_id`` now;
        :meth:`ServiceState.apply <cache_service.state.ServiceState.apply>` asks it last
        before logging a pool's record. Always passes here: a cluster member's registry
        (:mod:`cache_service.cluster.registry`) checks its ownership of the pool."""

    def delete(self, pool_id: str) -> int:
        """Drops a pool; answers how many requests it still had. Subscribers' feeds close."""
        entry = self.get(pool_id)
        del self._pools[pool_id]
        self.total_blocks -= entry.budget_blocks
        self.index.detach(pool_id)
        self.version += 1
        entry.feed.close()
        return len(entry.pool.request_ids())

    def __iter__(self) -> Iterator[PoolEntry]:
        return iter([self._pools[k] for k in sorted(self._pools)])

    def __contains__(self, pool_id: object) -> bool:
        return pool_id in self._pools

    def __len__(self) -> int:
        return len(self._pools)

    def close(self) -> None:
        """Ends every event subscription (server shutdown)."""
        for entry in self._pools.values():
            entry.feed.close()

    def stats(self) -> list[tuple[str, Any]]:
        """(pool_id, PoolCounters) of every pool, for metrics."""
        return [(entry.pool_id, entry.pool.stats()) for entry in self]


def check_pool_id(pool_id: str, field: str = "pool_id", *, qualified: bool = False) -> None:
    """A pool id as clients write it; ``qualified`` also accepts the server's internal
    ``tenant/pool`` form (see :class:`cache_service.tenants.Namespace`)."""
    if qualified and isinstance(pool_id, str) and "/" in pool_id:
        tenant, _, pool_id = pool_id.partition("/")
        if not TENANT_RE.fullmatch(tenant):
            raise InvalidArgument(f"bad tenant part {tenant!r} of a pool id", field=field)
    if not isinstance(pool_id, str) or not POOL_ID_RE.fullmatch(pool_id):
        raise InvalidArgument(f"pool id must be 1-128 characters from [A-Za-z0-9._:-], "
                              f"got {pool_id!r}", field=field)
