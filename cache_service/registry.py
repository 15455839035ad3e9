"""The server's registry of pools: idempotent registration, description diffs, deletion.

A pool is registered from a :class:`PoolDescription` (layer specs + size + options). The
same description under the same id answers the existing pool; another description names
the first differing field (``layers[2].sliding_window``) in an ``AlreadyExists`` error.
Each pool has its own :class:`~cache_service.event_feed.EventFeed`; pools share nothing.
No gRPC here.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from cache_service.core.errors import AlreadyExists, InvalidArgument, NotFound
from cache_service.core.grouping import get_kv_cache_config
from cache_service.core.pool import Pool, PoolOptions
from cache_service.core.prefix_index import PrefixIndex, namespace_of
from cache_service.core.specs import KVCacheConfig, KVCacheSpec, SizingLimits
from cache_service.event_feed import EventFeed

POOL_ID_RE = re.compile(r"[A-Za-z0-9._:-]{1,128}")

# Core spec attribute -> the protocol field that carries it (for diff messages).
_SPEC_FIELD_NAMES = {"shapes": "mamba_states", "dtypes": "mamba_states"}
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

    @property
    def config(self) -> KVCacheConfig:
        return self.pool.config

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
            return f"options.{f.name}"
    if old.hybrid != new.hybrid:
        return "options.hybrid"
    if old.skip_capacity_check != new.skip_capacity_check:
        return "options.skip_capacity_check"
    return None


def build_pool(desc: PoolDescription) -> Pool:
    """A fresh allocator for a description (raises ConfigError/InvalidArgument)."""
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
    return Pool(config, opts)


class PoolRegistry:
    """Pools by id. Not thread-safe by design: the server's event loop owns it."""

    def __init__(self, event_buffer: int = 10000) -> None:
        self._pools: dict[str, PoolEntry] = {}
        self._event_buffer = event_buffer
        #: Every pool's cached prefixes in one map (PeekPrefix answers from it).
        self.index = PrefixIndex()
        #: Bumped by every registration and deletion (lets callers cache lookups by id).
        self.version = 0

    def register(self, pool_id: str, desc: PoolDescription) -> tuple[PoolEntry, bool]:
        """The pool ``pool_id``, created if new; ``(entry, created)``."""
        check_pool_id(pool_id)
        existing = self._pools.get(pool_id)
        if existing is not None:
            diff = first_difference(existing.description, desc)
            if diff is None:
                return existing, False
            raise AlreadyExists(f"pool {pool_id!r} exists with a different description "
                                f"(first difference: {diff})", field=diff)
        entry = PoolEntry(pool_id, desc, build_pool(desc), EventFeed(self._event_buffer))
        self._pools[pool_id] = entry
        self.index.attach(pool_id, entry.pool, namespace_of(entry.pool))
        self.version += 1
        return entry, True

    def get(self, pool_id: str, *, field: str = "pool_id") -> PoolEntry:
        """The pool, or NotFound naming ``field``."""
        entry = self._pools.get(pool_id)
        if entry is None:
            raise NotFound(f"unknown pool {pool_id!r}", field=field)
        return entry

    def delete(self, pool_id: str) -> int:
        """Drops a pool; answers how many requests it still had. Subscribers' feeds close."""
        entry = self.get(pool_id)
        del self._pools[pool_id]
        self.index.detach(pool_id)
        self.version += 1
        entry.feed.close()
        return len(entry.pool.request_ids())

    def __iter__(self) -> Iterator[PoolEntry]:
        return iter([self._pools[k] for k in sorted(self._pools)])

    def __len__(self) -> int:
        return len(self._pools)

    def close(self) -> None:
        """Ends every event subscription (server shutdown)."""
        for entry in self._pools.values():
            entry.feed.close()

    def stats(self) -> list[tuple[str, Any]]:
        """(pool_id, PoolCounters) of every pool, for metrics."""
        return [(entry.pool_id, entry.pool.stats()) for entry in self]


def check_pool_id(pool_id: str, field: str = "pool_id") -> None:
    if not isinstance(pool_id, str) or not POOL_ID_RE.fullmatch(pool_id):
        raise InvalidArgument(f"pool id must be 1-128 characters from [A-Za-z0-9._:-], "
                              f"got {pool_id!r}", field=field)
