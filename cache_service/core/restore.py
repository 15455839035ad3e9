"""How the core's objects come back from a snapshot (a pickle of the service state), the
same way in the pure-Python core and in the compiled one, and from one to the other.

Python unpickles an instance with ``cls.__new__(cls)`` and then sets its state, without
``__init__``. A class compiled by mypyc runs ``__init__`` inside its own ``__new__`` (so
that its attributes are always defined), which fails without the constructor's
arguments. Hence, per kind of class:

- The stateful classes (pool, manager, coordinators, managers, block pool, requests,
  prefix log) are marked ``@mypyc_attr(allow_interpreted_subclasses=True)``, under which
  mypyc keeps Python's rule (``__new__`` makes, ``__init__`` initializes); the state then
  goes back attribute by attribute. (Not mypyc's ``serializable``: in mypyc 2.4 it skips
  ``__init__`` also when Python code calls the class. Not an explicit ``__new__``: a
  constructor whose ``__init__`` raises then hands back a half-built object.) In the pure
  core the mark does nothing.
- Dataclasses (some frozen) derive from :class:`RebuiltFromFields`: pickled as a
  constructor call with every field, so no attribute is set on a finished object.

The pickled form is the same in both cores (the class's module path and its attributes),
so a snapshot written by one loads in the other (tests/core/test_restore.py).

A snapshot written by an OLDER release lacks the attributes the classes gained since.
Class-level defaults cover that in the pure core, but the compiled one does not apply a
base class's default to instances of a subclass (the coordinators), so
:func:`fill_added_attributes` gives a restored pool every attribute listed in
``ADDED_ATTRIBUTES`` that it lacks, with the value under which the older release behaved
(requests do the same in ``request._restore_request``). Every attribute added to a
stateful class goes into that table; tests/core/test_restore.py loads pickles written by
the previous release (tests/core/data/) in both cores.
"""

from __future__ import annotations

from dataclasses import fields
from typing import Any

#: Per class name (the class or a base): attributes added after snapshots were first
#: written, with the value an older snapshot's object gets (what that release did).
ADDED_ATTRIBUTES: dict[str, dict[str, Any]] = {
    "Pool": {"_pins": None, "_classes": None, "_lookahead": 0},
    "KVCacheManager": {"host_tier": None},
    "KVCacheCoordinator": {"_gaps": (), "host_view": None},
    "BlockPool": {"hash_lookahead": 0, "host_tier": None},
}


def _fill(obj: Any) -> None:
    for cls in type(obj).__mro__:
        for name, value in ADDED_ATTRIBUTES.get(cls.__name__, {}).items():
            try:
                getattr(obj, name)
            except AttributeError:
                setattr(obj, name, value)


def fill_added_attributes(pool: Any) -> None:
    """Give a pool unpickled from an older release's snapshot (and its manager,
    coordinator and block pool) the attributes ``ADDED_ATTRIBUTES`` lists that it lacks.
    A no-op on a pool of this release. Called where pools are unpickled
    (``registry.PoolEntry.__setstate__``)."""
    _fill(pool)
    manager = pool._manager
    _fill(manager)
    _fill(manager.coordinator)
    _fill(manager.coordinator.pool)


class RebuiltFromFields:
    """A dataclass pickled as its constructor called with every field, in order."""

    __slots__ = ()

    def __reduce__(self) -> tuple[Any, ...]:
        return type(self), tuple(getattr(self, f.name) for f in fields(self))  # type: ignore[arg-type]
