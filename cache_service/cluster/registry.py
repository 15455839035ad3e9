"""The pool registry of a cluster member: every lookup of a pool passes the fencing check.

Every call on a pool — and every mutation, inside ``ServiceState.apply`` before anything is
logged or changed — looks the pool up here, so :meth:`Placement.check` runs before every
write with no await in between. Before the replica has joined (while it replays its own
write-ahead log at start) there is no placement and lookups are not checked. Kept free of
etcd imports: the server builds it for ``--etcd-endpoints`` before it connects.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

from cache_service.registry import PoolEntry, PoolRegistry

if TYPE_CHECKING:
    from cache_service.cluster.placement import Placement


class ClusterRegistry(PoolRegistry):
    """A :class:`PoolRegistry` whose :meth:`get` checks ownership first."""

    placement: Placement | None = None
    _unfenced = False

    def get(self, pool_id: str, *, field: str = "pool_id") -> PoolEntry:
        if self.placement is not None and not self._unfenced:
            self.placement.check(pool_id, field)
        return super().get(pool_id, field=field)

    def delete(self, pool_id: str) -> int:
        dropped = super().delete(pool_id)
        if self.placement is not None:
            self.placement.forget(pool_id)
        return dropped

    def has(self, pool_id: str) -> bool:
        return pool_id in self._pools

    @contextmanager
    def unfenced(self) -> Iterator[None]:
        """Lookups without the check: dropping a pool this replica no longer owns."""
        self._unfenced = True
        try:
            yield
        finally:
            self._unfenced = False

    def __getstate__(self) -> dict[str, Any]:
        # Snapshots pickle the registry; the placement (etcd client, tasks) is not state.
        state = self.__dict__.copy()
        state.pop("placement", None)
        state.pop("_unfenced", None)
        return state
