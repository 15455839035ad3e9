"""The pool registry of a cluster member: lookups and writes pass the fencing check.

Every lookup of a pool (:meth:`ClusterRegistry.get`: reads, and the validation of every
write) checks that this replica owns it, so a call on a pool owned elsewhere is answered
with a redirect before any work. The guarantee is :meth:`ClusterRegistry.fence`, which
``ServiceState.apply`` asks for a pool's record after validation, with no await before
the record is logged and applied: no write lands on a pool this replica lost meanwhile.
Commits look pools up unchecked (:meth:`PoolRegistry.entry`, and :meth:`delete` here): a
check that failed there would leave a logged record half applied.

Before the replica has joined (while it replays its own write-ahead log at start) there is
no placement and nothing is checked. Kept free of etcd imports: the server builds it for
``--etcd-endpoints`` before it connects.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

from cache_service.registry import PoolEntry, PoolRegistry

if TYPE_CHECKING:
    from cache_service.cluster.placement import Placement


class ClusterRegistry(PoolRegistry):
    """A :class:`PoolRegistry` whose lookups and fence check ownership first."""

    placement: Placement | None = None
    _unfenced = False

    def _check(self, pool_id: str, field: str = "pool_id") -> None:
        if self.placement is not None and not self._unfenced:
            self.placement.check(pool_id, field)

    def fence(self, pool_id: str) -> None:
        """Raises unless this replica may serve ``pool_id`` now (see :meth:`Placement.check`)."""
        self._check(pool_id)

    def get(self, pool_id: str, *, field: str = "pool_id") -> PoolEntry:
        """The pool's entry, once this replica's ownership of it is checked."""
        self._check(pool_id, field)
        return super().get(pool_id, field=field)

    def delete(self, pool_id: str) -> int:
        """Drops the pool without the ownership check (a commit) and forgets it in the
        placement; answers the requests it still had."""
        with self.unfenced():  # a commit (see the module docstring)
            dropped = super().delete(pool_id)
        if self.placement is not None:
            self.placement.forget(pool_id)
        return dropped

    def has(self, pool_id: str) -> bool:
        """Whether the pool is held here (no ownership check)."""
        return pool_id in self._pools

    @contextmanager
    def unfenced(self) -> Iterator[None]:
        """Lookups without the check: dropping a pool this replica no longer owns."""
        previous, self._unfenced = self._unfenced, True
        try:
            yield
        finally:
            self._unfenced = previous

    def __getstate__(self) -> dict[str, Any]:
        # Snapshots pickle the registry; the placement (etcd client, tasks) is not state.
        state = self.__dict__.copy()
        state.pop("placement", None)
        state.pop("_unfenced", None)
        return state
