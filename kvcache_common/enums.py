"""Protobuf enum values <-> the lower-case names the core, the client and the docs use.

Read from the generated descriptors, so a value added to the proto is known here with no
second table to update: ``LAYER_KIND_SLIDING_WINDOW`` <-> ``"sliding_window"``,
``HASH_ALGO_SHA256_CBOR`` <-> ``"sha256_cbor"``. The ``*_UNSPECIFIED`` value (0) has no name
(``""``); callers decide what it defaults to.
"""

from __future__ import annotations

from typing import Generic, TypeVar, cast

from google.protobuf.internal.enum_type_wrapper import EnumTypeWrapper

from kvcache_common.api.kvcache.v1 import cache_service_pb2 as pb

E = TypeVar("E", bound=int)


class EnumNames(Generic[E]):
    """Both directions of one enum, without its common prefix."""

    def __init__(self, enum: type[E], prefix: str) -> None:
        self._to_name: dict[int, str] = {}
        self._to_value: dict[str, E] = {}
        # The generated stubs declare an enum as an int subclass (so that message fields
        # can be typed with it); at run time it is an EnumTypeWrapper of plain ints.
        wrapper = cast(EnumTypeWrapper, enum)
        for value_desc in wrapper.DESCRIPTOR.values:
            if value_desc.number == 0:
                continue
            name = value_desc.name.removeprefix(prefix).lower()
            self._to_name[value_desc.number] = name
            self._to_value[name] = cast(E, value_desc.number)

    def name(self, value: int) -> str:
        """The lower-case name of ``value``; ``""`` for UNSPECIFIED or an unknown value."""
        return self._to_name.get(value, "")

    def value(self, name: str) -> E:
        """The enum value called ``name``; KeyError naming the known names otherwise."""
        try:
            return self._to_value[name]
        except KeyError:
            raise KeyError(f"{name!r} is not one of {sorted(self._to_value)}") from None

    def names(self) -> list[str]:
        """Every known name, in enum order."""
        return list(self._to_value)


LAYER_KINDS = EnumNames(pb.LayerKind, "LAYER_KIND_")
MAMBA_CACHE_MODES = EnumNames(pb.MambaCacheMode, "MAMBA_CACHE_MODE_")
HASH_ALGOS = EnumNames(pb.HashAlgo, "HASH_ALGO_")
MISS_REASONS = EnumNames(pb.MissReason, "MISS_REASON_")
