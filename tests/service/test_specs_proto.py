"""Layer specs <-> LayerSpec messages: both directions agree for every layer kind (what a
client registers is what the server builds and echoes back), and a bad message is refused
naming its field."""

from __future__ import annotations

from typing import cast

import pytest
from hypothesis import given
from hypothesis import strategies as st

from cache_service.client import layers
from cache_service.core.errors import InvalidArgument
from cache_service.specs_proto import layer_spec_from_proto, layer_spec_to_proto
from kvcache_common.api.kvcache.v1 import cache_service_pb2 as pb

sizes = st.sampled_from([1, 2, 16, 64])


@st.composite
def layer_messages(draw: st.DrawFn) -> pb.LayerSpec:
    block = draw(sizes)
    heads, head = draw(sizes), draw(sizes)
    kind = draw(st.sampled_from(["full", "sliding", "chunked", "mamba", "rswa", "ring"]))
    if kind == "full":
        return layers.full_attention("l", block_size=block, num_kv_heads=heads,
                                     head_size=head, head_size_v=draw(st.sampled_from([0, 8])))
    if kind == "sliding":
        return layers.sliding_window("l", block_size=block, num_kv_heads=heads,
                                     head_size=head, sliding_window=draw(sizes))
    if kind == "rswa":
        return layers.rswa("l", block_size=block, num_kv_heads=heads, head_size=head,
                           rswa_window=draw(sizes))
    if kind == "ring":
        return layers.circular_buffer("l", block_size=block, num_kv_heads=heads,
                                      head_size=head)
    if kind == "chunked":
        return layers.chunked_local("l", block_size=block, num_kv_heads=heads,
                                    head_size=head, attention_chunk_size=draw(sizes))
    return layers.mamba("l", block_size=block, shapes=[(heads, head), (head,)],
                        dtypes=["float32", "bfloat16"],
                        mamba_cache_mode=draw(st.sampled_from(["none", "align"])))


@given(layer_messages())
def test_a_message_and_its_spec_map_to_each_other(message: pb.LayerSpec) -> None:
    spec = layer_spec_from_proto(message, "layers[0]")
    echoed = layer_spec_to_proto("l", spec)
    assert layer_spec_from_proto(echoed, "layers[0]") == spec
    assert echoed.kind == message.kind and echoed.block_size == message.block_size
    assert layers.from_spec("l", spec) == echoed  # the client's name for the same mapping


@pytest.mark.parametrize(("message", "field"), [
    (pb.LayerSpec(kind=pb.LAYER_KIND_FULL_ATTENTION, block_size=0, num_kv_heads=1,
                  head_size=1), "layers[3].block_size"),
    (pb.LayerSpec(kind=pb.LAYER_KIND_FULL_ATTENTION, block_size=16, num_kv_heads=1,
                  head_size=1, sliding_window=4), "layers[3].sliding_window"),
    (pb.LayerSpec(kind=cast(pb.LayerKind, 99), block_size=16), "layers[3].kind"),
    (pb.LayerSpec(kind=pb.LAYER_KIND_MAMBA, block_size=16), "layers[3].mamba_states"),
    (pb.LayerSpec(kind=pb.LAYER_KIND_RSWA, block_size=16, num_kv_heads=1, head_size=1),
     "layers[3].rswa_window"),
    (pb.LayerSpec(kind=pb.LAYER_KIND_FULL_ATTENTION, block_size=16, num_kv_heads=1,
                  head_size=1, rswa_window=8), "layers[3].rswa_window"),
    (pb.LayerSpec(kind=pb.LAYER_KIND_CIRCULAR_BUFFER, block_size=8, num_kv_heads=1,
                  head_size=1, rswa_window=8), "layers[3].rswa_window"),
])
def test_a_bad_message_is_refused_naming_its_field(message: pb.LayerSpec, field: str) -> None:
    with pytest.raises(InvalidArgument) as exc:
        layer_spec_from_proto(message, "layers[3]")
    assert exc.value.field == field
