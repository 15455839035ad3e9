"""Mamba-2 SSD: chunked prefill scan over packed sequences, and the single-token state update.

Math, per head h with group g = h // (H // G), fp32:
    dt'_t = clamp(softplus(dt_t + dt_bias)),  a_t = dt'_t * A_h  (log decay, <= 0)
    S_t = exp(a_t) * S_{t-1} + dt'_t * x_t (outer) B_t[g]         (S is [P, N])
    y_t = S_t C_t[g] + D * x_t
The prefill evaluates this in chunks of Q tokens: a masked Q x Q "attention" inside each chunk,
chunk-end states passed from chunk to chunk, and the carried state's contribution to every token.
Chunks never cross a sequence boundary (a sequence's last chunk is short), so the result depends on
Q only through rounding. ssm_states [num_slots, H, P, N] give each sequence's start state (see
kernels.mamba_state for the padding / has_initial_state rules) and receive its final state.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from kernels._dispatch import run_impl, select_impl
from kernels.mamba_state import start_states, store_states
from kernels.validation import check_packed_batch, check_state_indices, check_tensor

DEFAULT_DT_LIMIT: tuple[float, float] = (0.0, float("inf"))

# Bound on the [chunks, H, Q, Q] intra-chunk temporaries (elements): memory stays flat in T, and
# at ~4 MiB they stay in cache (25-30% faster at 4,096 tokens than one 25 MiB slice).
_MAX_DECAY_ELEMENTS = 1 << 20


def process_dt(dt: Tensor, dt_bias: Tensor | None, softplus: bool,
               dt_limit: tuple[float, float] = DEFAULT_DT_LIMIT) -> Tensor:
    """fp32 step size: dt (+ bias), softplus if asked, clamp to dt_limit unless it is the default."""
    step = dt.float()
    if dt_bias is not None:
        step = step + dt_bias.float()
    if softplus:
        step = F.softplus(step)
    if tuple(dt_limit) != DEFAULT_DT_LIMIT:
        step = step.clamp(min=dt_limit[0], max=dt_limit[1])
    return step


def _check_ssd(x: object, dt: object, A: object, B: object, C: object, ssm_states: object,
               D: object, dt_bias: object, dt_limit: object) -> None:
    check_tensor("x", x, (None, None, None))
    assert isinstance(x, Tensor)
    rows, heads, head_dim = x.shape
    check_tensor("dt", dt, (rows, heads))
    check_tensor("A", A, (heads,))
    check_tensor("B", B, (rows, None, None))
    assert isinstance(B, Tensor)
    groups, state_size = B.shape[1], B.shape[2]
    if groups == 0 or heads % groups:
        raise ValueError(f"B: group count {groups} must divide the head count {heads}")
    check_tensor("C", C, (rows, groups, state_size))
    check_tensor("ssm_states", ssm_states, (None, heads, head_dim, state_size))
    if D is not None and isinstance(D, Tensor) and D.dim() == 2:
        check_tensor("D", D, (heads, head_dim))
    else:
        check_tensor("D", D, (heads,), optional=True)
    check_tensor("dt_bias", dt_bias, (heads,), optional=True)
    if not (isinstance(dt_limit, tuple) and len(dt_limit) == 2 and dt_limit[0] <= dt_limit[1]):
        raise ValueError(f"dt_limit: expected (low, high) with low <= high, got {dt_limit!r}")


def ssd_scan(x: Tensor, dt: Tensor, A: Tensor, B: Tensor, C: Tensor, ssm_states: Tensor,
             query_start_loc: Tensor, state_indices: Tensor, has_initial_state: Tensor, *,
             D: Tensor | None = None, dt_bias: Tensor | None = None, dt_softplus: bool = True,
             dt_limit: tuple[float, float] = DEFAULT_DT_LIMIT, chunk_size: int = 64,
             impl: str | None = None) -> Tensor:
    """Mamba-2 prefill: x [T, H, P], dt [T, H], A [H], B/C [T, G, N] -> y [T, H, P] (no z gate).

    Reads the start state and writes the final state of every non-padding sequence in ssm_states.
    """
    _check_ssd(x, dt, A, B, C, ssm_states, D, dt_bias, tuple(dt_limit))
    if not isinstance(chunk_size, int) or chunk_size < 1:
        raise ValueError(f"chunk_size: expected a positive int, got {chunk_size!r}")
    check_packed_batch(query_start_loc, state_indices, has_initial_state, x.shape[0], ssm_states.shape[0])
    which = select_impl(impl, x, dt, A, B, C, ssm_states, query_start_loc, state_indices,
                        has_initial_state, D, dt_bias)
    args = (x, dt, A, B, C, ssm_states, query_start_loc, state_indices, has_initial_state)
    kwargs: dict[str, Any] = dict(D=D, dt_bias=dt_bias, dt_softplus=dt_softplus, dt_limit=tuple(dt_limit),
                  chunk_size=chunk_size)
    return run_impl(which, "ssd_scan", "triton_ssd", _ssd_scan_torch, *args, **kwargs)


def ssd_state_update(x: Tensor, dt: Tensor, A: Tensor, B: Tensor, C: Tensor, ssm_states: Tensor,
                     state_indices: Tensor, *, D: Tensor | None = None, dt_bias: Tensor | None = None,
                     dt_softplus: bool = True, dt_limit: tuple[float, float] = DEFAULT_DT_LIMIT,
                     impl: str | None = None) -> Tensor:
    """Mamba-2 decode: x [B, H, P], dt [B, H], B/C [B, G, N]; updates the slots in place -> [B, H, P]."""
    _check_ssd(x, dt, A, B, C, ssm_states, D, dt_bias, tuple(dt_limit))
    check_state_indices(state_indices, x.shape[0], ssm_states.shape[0])
    which = select_impl(impl, x, dt, A, B, C, ssm_states, state_indices, D, dt_bias)
    args = (x, dt, A, B, C, ssm_states, state_indices)
    kwargs: dict[str, Any] = dict(D=D, dt_bias=dt_bias, dt_softplus=dt_softplus, dt_limit=tuple(dt_limit))
    return run_impl(which, "ssd_state_update", "triton_ssd", _ssd_state_update_torch, *args, **kwargs)


# ---------------------------------------------------------------------------------------------
# Vectorized torch implementations
# ---------------------------------------------------------------------------------------------

def _skip(D: Tensor | None, x: Tensor) -> Tensor | float:
    """D * x with D [H] or [H, P] against x [..., H, P] (0 when D is absent)."""
    if D is None:
        return 0.0
    d = D.float()
    return (d[:, None] if d.dim() == 1 else d) * x


def _ssd_scan_torch(x: Tensor, dt: Tensor, A: Tensor, B: Tensor, C: Tensor, ssm_states: Tensor,
                    query_start_loc: Tensor, state_indices: Tensor, has_initial_state: Tensor, *,
                    D: Tensor | None, dt_bias: Tensor | None, dt_softplus: bool,
                    dt_limit: tuple[float, float], chunk_size: int) -> Tensor:
    tokens, heads, head_dim = x.shape
    groups, state_size = B.shape[1:]
    per_group = heads // groups
    batch = state_indices.shape[0]
    device = x.device
    q = chunk_size

    # Logical chunks: chunk j of a sequence holds its tokens jQ .. jQ+Q-1; the short tail is
    # zero-padded with dt = 0, which neither decays nor adds to the state. Chunks are numbered
    # step-major over the sequences sorted by chunk count (longest first), so the chunks at step j
    # of every sequence still running form one contiguous range: state passing works on slices.
    starts = query_start_loc.long()
    lengths = starts[1:] - starts[:-1]
    chunks_per_seq = (lengths + q - 1) // q
    order = torch.sort(chunks_per_seq, descending=True, stable=True).indices
    rank = torch.empty_like(order)
    rank[order] = torch.arange(batch, device=device)
    max_chunks = int(chunks_per_seq.max()) if batch else 0
    running = (chunks_per_seq[None, :] > torch.arange(max_chunks, device=device)[:, None]).sum(1)
    offsets = torch.cumsum(running, 0) - running                            # first chunk id of step j
    num_chunks = int(running.sum()) if max_chunks else 0
    seq_of_token = torch.repeat_interleave(torch.arange(batch, device=device), lengths, output_size=tokens)
    pos = torch.arange(tokens, device=device) - starts[seq_of_token]
    slot_of_token = (offsets[pos // q] + rank[seq_of_token]) * q + pos % q

    def chunked(t: Tensor) -> Tensor:
        buf = torch.zeros((num_chunks * q, *t.shape[1:]), dtype=torch.float32, device=device)
        buf[slot_of_token] = t.float()
        return buf.view(num_chunks, q, *t.shape[1:])

    step = chunked(process_dt(dt, dt_bias, dt_softplus, dt_limit))         # [K, Q, H]
    xc = chunked(x)                                                          # [K, Q, H, P]
    bc, cc = chunked(B).transpose(1, 2), chunked(C).transpose(1, 2)          # [K, G, Q, N]
    log_decay = torch.cumsum(step * A.float(), dim=1)                        # [K, Q, H]

    # Within-chunk part, per head: y_l = sum_{s<=l} (C_l . B_s) exp(c_l - c_s) dt_s x_s. Done in
    # slices of chunks to bound the [k, H, Q, Q] temporaries.
    y = torch.empty(num_chunks, heads, q, head_dim, device=device)
    causal = torch.ones(q, q, device=device).tril()
    per_slice = max(1, _MAX_DECAY_ELEMENTS // (heads * q * q))
    for lo in range(0, num_chunks, per_slice):
        hi = min(num_chunks, lo + per_slice)
        cum = log_decay[lo:hi].transpose(1, 2)                               # [k, H, Q]
        # zero the upper triangle before exp (no overflow there) and mask it after: the same
        # result as exp(-inf) above the diagonal, several times faster on CPU
        weights = (cum[..., :, None] - cum[..., None, :]).mul_(causal).exp_().mul_(causal)
        weights.mul_(step[lo:hi].transpose(1, 2)[..., None, :])
        scores = torch.matmul(cc[lo:hi], bc[lo:hi].transpose(-1, -2))       # [k, G, Q, Q]
        weights.view(hi - lo, groups, per_group, q, q).mul_(scores[:, :, None])
        y[lo:hi] = torch.matmul(weights, xc[lo:hi].transpose(1, 2))

    # Each chunk's own end state, per group as one GEMM: local[k, g] = B^T (w * x) -> [N, R*P].
    to_end = torch.exp(log_decay[:, -1:] - log_decay) * step                 # [K, Q, H]
    xw = (xc * to_end[..., None]).view(num_chunks, q, groups, per_group * head_dim).transpose(1, 2)
    local = torch.matmul(bc.transpose(-1, -2), xw)                           # [K, G, N, R*P]

    # Pass states along the chunks (local[k] becomes the state after chunk k) and add each chunk's
    # carried-in state to its tokens as we go: carried[k] = C_k S_entering -> [G, Q, R*P].
    first = start_states(ssm_states, state_indices, has_initial_state & (state_indices >= 0))[order]
    first = first.view(batch, groups, per_group, head_dim, state_size).permute(0, 1, 4, 2, 3)
    first = first.reshape(batch, groups, state_size, per_group * head_dim)
    carried = torch.empty(num_chunks, groups, q, per_group * head_dim, device=device)
    decay = torch.exp(log_decay[:, -1]).view(num_chunks, groups, 1, per_group, 1)
    prev = first
    for off, n in zip(offsets.tolist(), running.tolist()):
        torch.matmul(cc[off:off + n], prev[:n], out=carried[off:off + n])
        here = local[off:off + n].view(n, groups, state_size, per_group, head_dim)
        here.addcmul_(prev[:n].view(n, groups, state_size, per_group, head_dim), decay[off:off + n])
        prev = local[off:off + n]
    has_chunks = chunks_per_seq[order] > 0
    final = first.clone()
    if num_chunks:
        sorted_counts = chunks_per_seq[order][has_chunks]
        final[has_chunks] = local[offsets[sorted_counts - 1] + torch.arange(batch, device=device)[has_chunks]]

    # y = diagonal part + exp(c_l) * carried, assembled token-major [K, Q, G, R, P] in one pass.
    diag = y.view(num_chunks, groups, per_group, q, head_dim).permute(0, 3, 1, 2, 4)
    carried = carried.view(num_chunks, groups, q, per_group, head_dim).permute(0, 2, 1, 3, 4)
    scale = torch.exp(log_decay).view(num_chunks, q, groups, per_group, 1)
    y = torch.empty(num_chunks, q, groups, per_group, head_dim, device=device)
    torch.addcmul(diag, carried, scale, out=y)
    y = y.view(num_chunks * q, heads, head_dim)[slot_of_token]

    final = final.view(batch, groups, state_size, per_group, head_dim).permute(0, 1, 3, 4, 2)
    unsorted = torch.empty_like(final)
    unsorted[order] = final
    store_states(ssm_states, state_indices, unsorted.reshape(batch, heads, head_dim, state_size))
    return (y + _skip(D, x.float())).to(x.dtype)


def _ssd_state_update_torch(x: Tensor, dt: Tensor, A: Tensor, B: Tensor, C: Tensor,
                            ssm_states: Tensor, state_indices: Tensor, *, D: Tensor | None,
                            dt_bias: Tensor | None, dt_softplus: bool,
                            dt_limit: tuple[float, float]) -> Tensor:
    rows, heads, head_dim = x.shape
    groups, state_size = B.shape[1:]
    per_group = heads // groups
    state = start_states(ssm_states, state_indices, state_indices >= 0)     # [B, H, P, N]
    step = process_dt(dt, dt_bias, dt_softplus, dt_limit)                    # [B, H]
    decay = torch.exp(step * A.float()).reshape(rows * heads, 1, 1)
    xs = (x.float() * step[..., None]).reshape(rows * heads, head_dim, 1)
    b = B.float()[:, :, None, :].expand(rows, groups, per_group, state_size).reshape(rows * heads, 1, state_size)
    c = C.float()[:, :, None, :].expand(rows, groups, per_group, state_size).reshape(rows * heads, state_size, 1)
    # decay * S + (dt * x) (outer) B, per (row, head), in place on the gathered copy
    state = state.view(rows * heads, head_dim, state_size).mul_(decay).baddbmm_(xs, b)
    y = torch.bmm(state, c).view(rows, heads, head_dim)
    store_states(ssm_states, state_indices, state.view(rows, heads, head_dim, state_size))
    return (y + _skip(D, x.float())).to(x.dtype)
