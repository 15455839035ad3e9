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
"""

from __future__ import annotations

from dataclasses import fields
from typing import Any


class RebuiltFromFields:
    """A dataclass pickled as its constructor called with every field, in order."""

    __slots__ = ()

    def __reduce__(self) -> tuple[Any, ...]:
        return type(self), tuple(getattr(self, f.name) for f in fields(self))  # type: ignore[arg-type]
