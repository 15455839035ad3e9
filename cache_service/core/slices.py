"""Sliced computations: long work written as a generator that yields between slices, so that
its caller (the servicer's event loop) can serve other pools in between.

Every ``*_in_slices`` method of the core and of the service state is one: it checks its
input before the first yield, yields after about the slice it was given, and returns its
answer as the generator's value; the caller lets nothing else touch what it works on until
the generator ends. Run in one piece (:func:`run_to_end`), each gives exactly the answer
and the errors of its unsliced twin, which is written as exactly that.
"""

from __future__ import annotations

from collections.abc import Generator
from typing import TypeVar

T = TypeVar("T")


def run_to_end(work: Generator[None, None, T]) -> T:
    """Runs a sliced computation to its end in one piece; its value."""
    while True:
        try:
            next(work)
        except StopIteration as done:
            value: T = done.value
            return value
