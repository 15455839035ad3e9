"""Paged attention and KV-cache writes (kernels.attention) against the slow reference.

Every case is built so that anything the kernels must never read holds NaN: the null block 0,
block-table entries wholly before a sliding window (set to 0, as vLLM frees them), free blocks and
the unwritten tail of each request's last block. A NaN in an output therefore means a kernel read
where it must not.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kernels import paged_attention, write_kv_cache

from kernel_helpers import assert_close, randn

NAN = float("nan")
# The fixtures used with @given (device) hold no state between examples.
FIXTURES_OK = [HealthCheck.function_scoped_fixture]


@dataclass
class PagedCase:
    """Inputs of one paged_attention call plus each request's keys/values kept contiguous."""

    q: torch.Tensor
    k_cache: torch.Tensor
    v_cache: torch.Tensor
    block_tables: torch.Tensor
    seq_lens: torch.Tensor
    query_start_loc: torch.Tensor
    keys: list[torch.Tensor]    # per request [kv_len, Hkv, D] (cache dtype)
    values: list[torch.Tensor]  # per request [kv_len, Hkv, Dv]
    q_lens: list[int]
    window: int | None

    def run(self, impl: str | None, scale: float = 0.3, softcap: float | None = None) -> torch.Tensor:
        return paged_attention(self.q, self.k_cache, self.v_cache, self.block_tables, self.seq_lens,
                               self.query_start_loc, scale=scale, sliding_window=self.window,
                               softcap=softcap, impl=impl)


def make_case(gen: torch.Generator, device: torch.device, dtype: torch.dtype, q_lens: list[int], kv_lens: list[int], *,
              q_heads: int = 4, kv_heads: int = 2, head_size: int = 32, head_size_v: int | None = None,
              block_size: int = 8, window: int | None = None, pad_rows: int = 0) -> PagedCase:
    """Random paged case; everything a kernel must not read is NaN (see the module docstring)."""
    head_size_v = head_size if head_size_v is None else head_size_v
    blocks_per_req = [math.ceil(n / block_size) for n in kv_lens]
    num_blocks = 1 + sum(blocks_per_req) + 3  # null block 0 and a few free blocks
    width = max(blocks_per_req, default=0) + 1
    k_cache = torch.full((num_blocks, block_size, kv_heads, head_size), NAN, dtype=dtype)
    v_cache = torch.full((num_blocks, block_size, kv_heads, head_size_v), NAN, dtype=dtype)
    block_tables = torch.zeros(len(kv_lens), width, dtype=torch.int32)
    free = (torch.randperm(num_blocks - 1, generator=gen) + 1).tolist()
    keys, values = [], []
    for b, (q_len, kv_len) in enumerate(zip(q_lens, kv_lens)):
        k = randn(kv_len, kv_heads, head_size, generator=gen, dtype=dtype)
        v = randn(kv_len, kv_heads, head_size_v, generator=gen, dtype=dtype)
        keys.append(k)
        values.append(v)
        first_key = 0 if window is None else max(0, kv_len - q_len - window + 1)
        for i in range(blocks_per_req[b]):
            if (i + 1) * block_size <= first_key:
                continue  # wholly before the window: freed, the table points at the null block
            block = free.pop()
            block_tables[b, i] = block
            n = min(block_size, kv_len - i * block_size)
            k_cache[block, :n] = k[i * block_size:i * block_size + n]
            v_cache[block, :n] = v[i * block_size:i * block_size + n]
    starts = [0]
    for q_len in q_lens:
        starts.append(starts[-1] + q_len)
    q = randn(starts[-1] + pad_rows, q_heads, head_size, generator=gen, dtype=dtype)
    return PagedCase(
        q=q.to(device), k_cache=k_cache.to(device), v_cache=v_cache.to(device),
        block_tables=block_tables.to(device), seq_lens=torch.tensor(kv_lens, dtype=torch.int32, device=device),
        query_start_loc=torch.tensor(starts, dtype=torch.int32, device=device),
        keys=keys, values=values, q_lens=list(q_lens), window=window)


def dense_attention(case: PagedCase, scale: float, softcap: float | None = None) -> torch.Tensor:
    """Independent oracle: SDPA-style math over contiguous K/V with an explicit position mask."""
    outs = []
    heads = case.q.shape[1]
    for b, q_len in enumerate(case.q_lens):
        if q_len == 0:
            continue
        start = int(case.query_start_loc[b])
        k, v = case.keys[b].float(), case.values[b].float()
        kv_len = k.shape[0]
        group = heads // k.shape[1]
        k = k.repeat_interleave(group, dim=1).transpose(0, 1)  # [Hq, kv_len, D]
        v = v.repeat_interleave(group, dim=1).transpose(0, 1)
        q = case.q[start:start + q_len].cpu().float().transpose(0, 1)  # [Hq, q_len, D]
        q_pos = torch.arange(kv_len - q_len, kv_len)[:, None]
        k_pos = torch.arange(kv_len)[None, :]
        mask = k_pos <= q_pos
        if case.window is not None:
            mask &= k_pos > q_pos - case.window
        scores = q @ k.transpose(1, 2) * scale
        if softcap is not None:
            scores = softcap * torch.tanh(scores / softcap)
        scores = scores.masked_fill(~mask, float("-inf"))
        outs.append((torch.softmax(scores, -1) @ v).transpose(0, 1))
    return torch.cat(outs).to(case.q.dtype)


# --------------------------------------------------------------------------------------------------
# The oracle itself, and the semantic traps
# --------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("window", [None, 1, 5, 13, 200])
@pytest.mark.parametrize("softcap", [None, 10.0])
def test_reference_matches_dense_attention(gen, window, softcap):
    case = make_case(gen, torch.device("cpu"), torch.float32, [1, 7, 19], [30, 7, 45], window=window)
    out = case.run("reference", softcap=softcap)
    assert_close(out, dense_attention(case, 0.3, softcap), kind="attention")


@pytest.mark.parametrize("impl", ["reference", "torch"])
def test_window_of_one_sees_only_the_current_token(gen, device, impl):
    """W counts the current key: with W = 1 every query returns exactly its own value row."""
    case = make_case(gen, device, torch.float32, [6, 1], [20, 9], q_heads=2, kv_heads=1, window=1)
    out = case.run(impl).cpu()
    expected = torch.cat([case.values[0][-6:], case.values[1][-1:]]).expand(-1, 2, -1)
    torch.testing.assert_close(out, expected)


@pytest.mark.parametrize("impl", ["reference", "torch"])
def test_gqa_maps_query_heads_to_kv_heads_by_repeat(gen, device, impl):
    """Query head h uses KV head h // (Hq / Hkv): with W = 1 head h returns value head h // 2."""
    case = make_case(gen, device, torch.float32, [3], [11], q_heads=4, kv_heads=2, window=1)
    out = case.run(impl).cpu()
    for h in range(4):
        torch.testing.assert_close(out[:, h], case.values[0][-3:, h // 2])


# --------------------------------------------------------------------------------------------------
# torch path vs reference
# --------------------------------------------------------------------------------------------------

@st.composite
def paged_shapes(draw):
    kv_heads = draw(st.sampled_from([1, 2]))
    group = draw(st.sampled_from([1, 2, 3]))
    requests = []
    for _ in range(draw(st.integers(1, 4))):
        q_len = draw(st.sampled_from([0, 1, 1, 2, 9, 24]))
        context = draw(st.integers(0, 40))
        requests.append((q_len, q_len + context if q_len else context))
    if all(q == 0 for q, _ in requests):
        requests.append((1, 1))
    return dict(
        q_lens=[q for q, _ in requests], kv_lens=[k for _, k in requests], kv_heads=kv_heads,
        q_heads=kv_heads * group, head_size=draw(st.sampled_from([8, 16])),
        head_size_v=draw(st.sampled_from([None, 4])), block_size=draw(st.sampled_from([1, 4, 8, 16])),
        window=draw(st.one_of(st.none(), st.integers(1, 50))), pad_rows=draw(st.sampled_from([0, 3])),
        softcap=draw(st.sampled_from([None, 5.0])),
    )


def _check_against_reference(device, dtype, shape, impl):
    gen = torch.Generator().manual_seed(7)
    shape = dict(shape)
    softcap = shape.pop("softcap")
    case = make_case(gen, device, dtype, **shape)
    expected = case.run("reference", softcap=softcap)
    out = case.run(impl, softcap=softcap)
    assert out.dtype == dtype and out.shape == expected.shape
    assert not out.isnan().any()
    assert_close(out, expected, kind="attention")
    pad = shape["pad_rows"]
    if pad:
        assert (out[-pad:] == 0).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@settings(max_examples=25, deadline=None, suppress_health_check=FIXTURES_OK)
@given(shape=paged_shapes())
def test_torch_matches_reference(device, dtype, shape):
    _check_against_reference(device, dtype, shape, "torch")


@pytest.mark.triton
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@settings(max_examples=8, deadline=None, suppress_health_check=FIXTURES_OK)
@given(shape=paged_shapes())
def test_triton_matches_reference(device, triton_impl, dtype, shape):
    _check_against_reference(device, dtype, shape, triton_impl)


def _mixed_case(gen, device, dtype):
    # decode, prefill with a cached prefix, a one-token sequence, a padded request (no queries),
    # fresh prefill; block 4 straddles the window start of the second request (window 11).
    return make_case(gen, device, dtype, [1, 13, 1, 0, 21], [40, 37, 1, 17, 21], q_heads=6, kv_heads=2,
                     head_size=16, block_size=4, window=11, pad_rows=2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_mixed_batch_with_nan_null_block(gen, device, dtype):
    case = _mixed_case(gen, device, dtype)
    assert (case.block_tables[:2, 0] == 0).all()  # out-of-window entries really are the null block
    out = case.run(None)
    assert not out.isnan().any()
    assert_close(out, case.run("reference"), kind="attention")
    assert (out[-2:] == 0).all()


@pytest.mark.parametrize("setting", ["_DECODE_GROUP_BYTES", "_WORKSPACE_CAP_BYTES"])
def test_torch_path_split_decode_groups_and_unpooled_buffers(gen, device, monkeypatch, setting):
    """Tiny limits: every decode request becomes its own group / every gather allocates afresh."""
    import kernels.attention as attention

    monkeypatch.setattr(attention, setting, 1)
    case = make_case(gen, device, torch.float32, [1, 1, 4, 1], [30, 3, 20, 17], window=12)
    out = case.run("torch")
    assert not out.isnan().any()
    assert_close(out, case.run("reference"), kind="attention")


def _prefill_in_chunks(gen, device, impl, splits, *, window, total=37, q_heads=4, kv_heads=2, block_size=8):
    """Run one prompt in chunks (write K/V first, then attend); return outputs of all chunks."""
    head_size = 16
    q = randn(total, q_heads, head_size, generator=gen).to(device)
    k = randn(total, kv_heads, head_size, generator=gen).to(device)
    v = randn(total, kv_heads, head_size, generator=gen).to(device)
    num_blocks = math.ceil(total / block_size) + 2
    k_cache = torch.full((num_blocks, block_size, kv_heads, head_size), NAN, device=device)
    v_cache = torch.full_like(k_cache, NAN)
    table = torch.arange(2, num_blocks, dtype=torch.int32, device=device)[None]
    positions = torch.arange(total, device=device)
    slots = table[0, positions // block_size].long() * block_size + positions % block_size
    outs, done = [], 0
    for end in list(splits) + [total]:
        if end <= done:
            continue
        write_kv_cache(k[done:end], v[done:end], k_cache, v_cache, slots[done:end], impl=impl)
        outs.append(paged_attention(
            q[done:end], k_cache, v_cache, table, torch.tensor([end], dtype=torch.int32, device=device),
            torch.tensor([0, end - done], dtype=torch.int32, device=device), scale=0.25, sliding_window=window,
            impl=impl))
        done = end
    return torch.cat(outs)


@pytest.mark.parametrize("window", [None, 6])
@settings(max_examples=10, deadline=None, suppress_health_check=FIXTURES_OK)
@given(splits=st.lists(st.integers(1, 36), max_size=4).map(sorted))
def test_chunked_prefill_equals_one_shot(device, window, splits):
    # impl None: the device's default path (torch on CPU, Triton on CUDA)
    one_shot = _prefill_in_chunks(torch.Generator().manual_seed(3), device, None, [], window=window)
    chunked = _prefill_in_chunks(torch.Generator().manual_seed(3), device, None, splits, window=window)
    assert_close(chunked, one_shot, kind="attention")


@pytest.mark.parametrize("window", [None, 9])
def test_decode_after_prefill_equals_longer_prefill(device, window):
    """Prefill 30 tokens, then 7 one-token decode steps == one 37-token prefill."""
    longer = _prefill_in_chunks(torch.Generator().manual_seed(5), device, None, [], window=window)
    stepwise = _prefill_in_chunks(torch.Generator().manual_seed(5), device, None, list(range(30, 37)),
                                  window=window)
    assert_close(stepwise, longer, kind="attention")


@pytest.mark.triton
def test_triton_decode_after_chunked_prefill_equals_longer_prefill(device, triton_impl):
    longer = _prefill_in_chunks(torch.Generator().manual_seed(5), device, triton_impl, [], window=9)
    stepwise = _prefill_in_chunks(torch.Generator().manual_seed(5), device, triton_impl, [11, 30, 31, 32],
                                  window=9)
    assert_close(stepwise, longer, kind="attention")


# --------------------------------------------------------------------------------------------------
# KV-cache writes
# --------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("impl", ["reference", "torch"])
@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.bfloat16])
def test_write_kv_cache_places_tokens_and_skips_padding(gen, device, impl, cache_dtype):
    num_blocks, block_size, heads = 5, 4, 2
    k_cache = randn(num_blocks, block_size, heads, 8, generator=gen, dtype=cache_dtype, device=device)
    v_cache = randn(num_blocks, block_size, heads, 6, generator=gen, dtype=cache_dtype, device=device)
    before_k, before_v = k_cache.clone(), v_cache.clone()
    slots = torch.tensor([9, -1, 0, 19, -1, 6], device=device)
    key = randn(6, heads, 8, generator=gen, device=device)
    value = randn(6, heads, 6, generator=gen, device=device)
    write_kv_cache(key, value, k_cache, v_cache, slots, impl=impl)
    expect_k, expect_v = before_k.clone(), before_v.clone()
    for t, slot in enumerate(slots.tolist()):
        if slot >= 0:
            expect_k[slot // block_size, slot % block_size] = key[t].to(cache_dtype)
            expect_v[slot // block_size, slot % block_size] = value[t].to(cache_dtype)
    assert torch.equal(k_cache, expect_k) and torch.equal(v_cache, expect_v)


def test_write_kv_cache_into_strided_cache_view(gen, device):
    """vLLM keeps K and V in one [2, blocks, ...] tensor; the writes must land in the views."""
    kv = torch.zeros(2, 3, 4, 1, 8, device=device)
    key = randn(2, 1, 8, generator=gen, device=device)
    write_kv_cache(key, -key, kv[0], kv[1], torch.tensor([5, 11], device=device))
    assert torch.equal(kv[0, 1, 1], key[0]) and torch.equal(kv[1, 2, 3], -key[1])


# --------------------------------------------------------------------------------------------------
# Bad input: a ValueError naming the field, and nothing written
# --------------------------------------------------------------------------------------------------

def test_write_kv_cache_rejects_bad_input_without_writing(gen):
    k_cache, v_cache = torch.zeros(2, 4, 1, 8), torch.zeros(2, 4, 1, 8)
    key = randn(2, 1, 8, generator=gen)
    with pytest.raises(ValueError, match="slot_mapping"):
        write_kv_cache(key, key, k_cache, v_cache, torch.tensor([1, 8]))  # 8 is past 2 blocks x 4
    with pytest.raises(ValueError, match="key"):
        write_kv_cache(key[:, :, :4], key, k_cache, v_cache, torch.tensor([1, 2]))
    with pytest.raises(ValueError, match="value"):
        write_kv_cache(key, key[:1], k_cache, v_cache, torch.tensor([1, 2]))
    with pytest.raises(ValueError, match="slot_mapping"):
        write_kv_cache(key, key, k_cache, v_cache, torch.tensor([1.0, 2.0]))
    assert (k_cache == 0).all() and (v_cache == 0).all()


@pytest.mark.parametrize(("field", "change"), [
    ("q", lambda a: a.update(q=a["q"][:, :3])),                                     # 3 heads vs 2 KV heads
    ("q", lambda a: a.update(q=a["q"][..., :8])),
    ("seq_lens", lambda a: a.update(seq_lens=torch.tensor([3, 5], dtype=torch.int32))),  # 7 queries, 3 keys
    ("seq_lens", lambda a: a.update(seq_lens=torch.tensor([99, 5], dtype=torch.int32))),
    ("query_start_loc", lambda a: a.update(query_start_loc=torch.tensor([0, 9, 8], dtype=torch.int32))),
    ("block_tables", lambda a: a["block_tables"].__setitem__((0, 0), 999)),
    ("sliding_window", lambda a: a.update(sliding_window=0)),
    ("scale", lambda a: a.update(scale=float("nan"))),
    ("softcap", lambda a: a.update(softcap=-1.0)),
    ("impl", lambda a: a.update(impl="cuda")),
])
def test_paged_attention_rejects_bad_input(gen, field, change):
    case = make_case(gen, torch.device("cpu"), torch.float32, [7, 1], [12, 5])
    args = dict(q=case.q, k_cache=case.k_cache, v_cache=case.v_cache, block_tables=case.block_tables.clone(),
                seq_lens=case.seq_lens, query_start_loc=case.query_start_loc, scale=0.3)
    change(args)
    with pytest.raises(ValueError, match=field):
        paged_attention(**args)


# --------------------------------------------------------------------------------------------------
# Triton kernels (interpreter on CPU; tiny shapes: 2 sequences x ~40 tokens, 2 heads)
# --------------------------------------------------------------------------------------------------

@pytest.mark.triton
@pytest.mark.parametrize(("window", "softcap"), [(None, None), (11, None), (None, 5.0)])
def test_triton_paged_attention_matches_reference(gen, device, triton_impl, window, softcap):
    # a prefill over a cached prefix and a decode; block 2 straddles the window start
    case = make_case(gen, device, torch.float32, [17, 1], [40, 38], q_heads=2, kv_heads=1, head_size=16,
                     block_size=8, window=window, pad_rows=1)
    out = case.run(triton_impl, softcap=softcap)
    assert not out.isnan().any()
    assert_close(out, case.run("reference", softcap=softcap), kind="attention")
    assert (out[-1] == 0).all()


@pytest.mark.triton
def test_triton_paged_attention_bf16_gqa(gen, device, triton_impl):
    case = make_case(gen, device, torch.bfloat16, [1, 20], [33, 20], q_heads=4, kv_heads=2, head_size=16,
                     head_size_v=32, block_size=16, window=25)
    out = case.run(triton_impl)
    assert out.dtype == torch.bfloat16 and not out.isnan().any()
    assert_close(out, case.run("reference"), kind="attention")


@pytest.mark.triton
@pytest.mark.parametrize("num_splits", [2, 3])
def test_triton_split_keys_match_reference(gen, device, triton_impl, num_splits):
    """Keys split across programs and merged by the combine kernel (the long-context decode path)."""
    import kernels.triton_attention as triton_attention  # after conftest set TRITON_INTERPRET

    case = make_case(gen, device, torch.float32, [1, 1, 5], [45, 2, 30], q_heads=2, kv_heads=1, head_size=16,
                     block_size=8, window=27, pad_rows=1)
    out = triton_attention.paged_attention(case.q, case.k_cache, case.v_cache, case.block_tables, case.seq_lens,
                                           case.query_start_loc, scale=0.3, sliding_window=case.window,
                                           softcap=None, num_splits=num_splits)
    assert not out.isnan().any() and (out[-1] == 0).all()
    assert_close(out, case.run("reference"), kind="attention")


@pytest.mark.triton
@pytest.mark.parametrize("key_dtype", [torch.bfloat16, torch.float32])
def test_triton_write_kv_cache_matches_torch(gen, device, triton_impl, key_dtype):
    caches = [randn(4, 8, 2, 16, generator=gen, dtype=torch.bfloat16, device=device) for _ in range(2)]
    mine = [c.clone() for c in caches]
    before = [c.clone() for c in caches]
    slots = torch.tensor([3, -1, 17, 30, 8], device=device)
    key = randn(5, 2, 16, generator=gen, dtype=key_dtype, device=device)
    value = randn(5, 2, 16, generator=gen, dtype=key_dtype, device=device)
    write_kv_cache(key, value, caches[0], caches[1], slots, impl="torch")
    write_kv_cache(key, value, mine[0], mine[1], slots, impl=triton_impl)
    if key_dtype == torch.bfloat16:
        assert torch.equal(mine[0], caches[0]) and torch.equal(mine[1], caches[1])
    else:
        # fp32 -> bf16: the CPU interpreter truncates where torch rounds to nearest; allow one bf16 step.
        for ours, theirs in zip(mine, caches):
            torch.testing.assert_close(ours, theirs, rtol=2.0**-7, atol=0.0)
    untouched = torch.ones(4 * 8, dtype=torch.bool, device=device)
    untouched[slots[slots >= 0]] = False
    for ours, old in zip(mine, before):
        assert torch.equal(ours.flatten(0, 1)[untouched], old.flatten(0, 1)[untouched])


def test_scratch_buffers_survive_switching_inference_mode(gen, device):
    """The torch path reuses per-thread gather buffers; one first made under
    ``torch.inference_mode()`` (as the executor runs) must not break a later call outside it."""
    case = _mixed_case(gen, device, torch.float32)
    with torch.inference_mode():
        inside = case.run("torch")
    outside = case.run("torch")
    assert torch.equal(outside, inside)
