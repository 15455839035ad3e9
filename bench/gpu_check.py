"""The GPU check: one prepared script for a CUDA machine (an H200 with a 15-minute budget).

    PYTHONUNBUFFERED=1 python3 bench/gpu_check.py                 # on the GPU machine (~3-5 min)
    python3 bench/gpu_check.py --dry-run                           # plumbing check on any machine

It runs, in this order, each step guarded so that a failure is recorded and the rest still run:
1. the kernel tests on CUDA: ``pytest tests/kernels`` with ``KERNELS_TEST_DEVICE=cuda`` (the
   Triton kernels compiled for real, checked against the references);
2. device-to-device copy bandwidth (the ceiling for memory-bound kernels; ~4.3 TB/s expected);
   2b. the host tier's batched demotions / promotions (executor/host_tier.py: device <-> pinned
   host) in GB/s vs the host link's nominal peak (PCIe 5 x16, 64 GB/s a direction) and vs a raw
   contiguous pinned copy of the same bytes (``of_copy``);
3. paged decode attention over ~2.1 GB of bf16 K/V (64 requests x 8,192 tokens, 32 q / 8 kv heads,
   head 128, block 16, shuffled block table): GB/s, % of the copy bandwidth (target >= 70%) and of
   4.3 TB/s; plus the same bytes as 8 x 65,536 tokens, and SDPA on contiguous K/V for reference;
4. prefill attention (8 x 4,096 tokens, causal, bf16): TFLOP/s vs 790 (target >= 35%), with SDPA
   on the same data for reference; then (4b) decode and prefill under a few other tile sizes,
   warps and pipeline depths, to pick `_tile_config`'s defaults from data;
5. the Mamba checks from bench/gpu_check_mamba.py ``run(device, dry_run)``.
Every timed kernel is first checked against an independent result (rms error ratio). Prints one
table and writes bench/results/gpu_check.json (or --out). ``--dry-run`` shrinks every shape
to seconds, runs the Triton kernels in the CPU interpreter when there is no GPU, and limits the
test step to a quick subset: it exercises the plumbing, not the hardware. Exit status 0 when
every step ran and every correctness check passed (performance targets are reported, not enforced).
"""

from __future__ import annotations

import argparse
import functools
import os
import subprocess
import sys
import tempfile
import time
import traceback
import xml.etree.ElementTree as ET
from collections.abc import Callable
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
# Run from a checkout, installed or not: `kernels` (imported by the steps) and bench/_common.py
# come from this tree.
sys.path[:0] = [str(REPO), str(REPO / "bench")]

COPY_CEILING_GBPS = 4300.0    # measured H200 device-to-device copy (a 2 GiB bf16 copy on the H200)
BF16_CEILING_TFLOPS = 790.0   # measured H200 bf16 matmul
HOST_LINK_GBPS = 64.0         # nominal PCIe Gen5 x16, one direction (the H200's host link)
DECODE_TARGET = 0.70          # of the copy bandwidth measured in the same run
PREFILL_TARGET = 0.35         # of 790 TFLOP/s


# --------------------------------------------------------------------------------------------------
# helpers
# --------------------------------------------------------------------------------------------------

def _seconds(fn: Callable[[], object], device: torch.device, iters: int) -> float:
    """Median seconds per call after two warm-up calls (CUDA events per call on GPU)."""
    fn()
    fn()
    samples = []
    for _ in range(iters):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            samples.append(start.elapsed_time(end) / 1e3)
        else:
            begin = time.perf_counter()
            fn()
            samples.append(time.perf_counter() - begin)
    samples.sort()
    return samples[len(samples) // 2]


def _rms_ratio(actual: torch.Tensor, expected: torch.Tensor) -> float:
    diff = (actual.float() - expected.float()).pow(2).mean().sqrt()
    return float(diff / expected.float().pow(2).mean().sqrt().clamp(min=1e-12))


def _paged_kv(batch: int, kv_len: int, kv_heads: int, head_size: int, block_size: int, dtype: torch.dtype,
              device: torch.device, seed: int):
    """Random K/V for ``batch`` requests in a paged cache with a shuffled block table (block 0 null)."""
    gen = torch.Generator(device=device).manual_seed(seed)
    per_req = -(-kv_len // block_size)
    num_blocks = 1 + batch * per_req
    k_cache = torch.randn(num_blocks, block_size, kv_heads, head_size, generator=gen, device=device, dtype=dtype)
    v_cache = torch.randn(num_blocks, block_size, kv_heads, head_size, generator=gen, device=device, dtype=dtype)
    k_cache[0] = float("nan")  # the null block: any read of it shows up as NaN
    v_cache[0] = float("nan")
    order = torch.randperm(num_blocks - 1, generator=gen, device=device) + 1
    tables = order.reshape(batch, per_req).to(torch.int32)
    return k_cache, v_cache, tables


def _contiguous(cache: torch.Tensor, table: torch.Tensor, kv_len: int) -> torch.Tensor:
    """One request's K or V as [H, kv_len, D] (for SDPA)."""
    return cache[table.long()].flatten(0, 1)[:kv_len].transpose(0, 1).contiguous()


# --------------------------------------------------------------------------------------------------
# steps
# --------------------------------------------------------------------------------------------------

def run_tests(device: str, dry_run: bool, timeout: int) -> dict:
    """pytest over tests/kernels on ``device``; counts from a JUnit XML report."""
    with tempfile.TemporaryDirectory() as tmp:
        report = Path(tmp) / "junit.xml"
        # dry run: a few quick tests, enough to prove the device option and report parsing work
        targets = ["tests/kernels/test_attention.py", "-k", "window_of_one"] if dry_run else ["tests/kernels"]
        cmd = [sys.executable, "-m", "pytest", *targets, "-q", "-p", "no:cacheprovider", f"--junitxml={report}",
               f"--timeout={timeout}"]
        env = {**os.environ, "KERNELS_TEST_DEVICE": device, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
        begin = time.perf_counter()
        try:
            proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout)
            tail, rc = proc.stdout[-3000:] + proc.stderr[-2000:], proc.returncode
        except subprocess.TimeoutExpired as exc:
            partial = exc.stdout.decode(errors="replace") if isinstance(exc.stdout, bytes) else exc.stdout or ""
            tail, rc = f"pytest timed out after {timeout} s: {partial[-3000:]}", -1
        elapsed = time.perf_counter() - begin
        counts = dict(tests=0, failures=0, errors=0, skipped=0)
        failed: list[str] = []
        if report.exists():
            for suite in ET.parse(report).getroot().iter("testsuite"):
                for key in counts:
                    counts[key] += int(suite.get(key, 0))
            for case in ET.parse(report).getroot().iter("testcase"):
                if case.find("failure") is not None or case.find("error") is not None:
                    failed.append(f"{case.get('classname')}::{case.get('name')}")
    passed = counts["tests"] - counts["failures"] - counts["errors"] - counts["skipped"]
    print(tail, flush=True)
    return dict(check="kernel_tests", device=device, shape=" ".join(targets), seconds=elapsed,
                passed=passed, **counts, failed_tests=failed[:50], returncode=rc,
                ok=rc == 0 and passed > 0)


def check_copy(device: torch.device, dry_run: bool) -> dict:
    """Device-to-device copy bandwidth (the memory roofline) and whether the copy is exact."""
    numel = (1 << 16) if dry_run else (1 << 30)  # 2 GiB of bf16 per buffer
    src = torch.randn(numel, device=device).to(torch.bfloat16)
    dst = torch.empty_like(src)
    seconds = _seconds(lambda: dst.copy_(src), device, 3 if dry_run else 20)
    ok = torch.equal(dst, src)
    moved = 2 * src.numel() * src.element_size()  # read + write, as the 4.3 TB/s figure counts
    gbps = moved / seconds / 1e9
    return dict(check="copy_bandwidth", device=str(device), shape=f"{src.numel() * 2 / 2**30:.2f} GiB bf16",
                ms=seconds * 1e3, value=gbps, unit="GB/s", fraction=gbps / COPY_CEILING_GBPS, ceiling="4.3 TB/s",
                ok=ok)


def check_host_tier(device: torch.device, dry_run: bool) -> list[dict]:
    """The executor's host tier (executor/host_tier.py) on this device: one step's batched
    demotions (device -> pinned host) and promotions (host -> device) of ``n`` blocks of an
    8-layer group with 64 KiB pages (bf16, block 16, 8 KV heads of 128), timed end to end
    (synchronized), in GB/s of pages moved and as a fraction of the nominal host link; plus a
    raw contiguous pinned copy of the same bytes each way for reference. ``ok``: the blocks
    round-trip bit-exactly."""
    from executor.cache import CacheGroup, CacheTensors
    from executor.forward_meta import GroupLayout
    from executor.host_tier import HostTier, TierCopy
    from executor.model import layer_name
    from executor.model_config import ModelConfig

    layers, kv_heads, head, block = (2, 1, 16, 4) if dry_run else (8, 8, 128, 16)
    num_blocks, n = (64, 16) if dry_run else (4096, 512)
    cfg = ModelConfig(vocab_size=64, hidden_size=64, intermediate_size=64, num_heads=kv_heads,
                      num_kv_heads=kv_heads, head_dim=head, max_model_len=64, pattern="F" * layers,
                      dtype="bfloat16")
    group = CacheGroup(tuple(layer_name(i, "full_attention") for i in range(layers)),
                       GroupLayout("attention", block))
    page = 2 * block * kv_heads * head * 2
    cache = CacheTensors(cfg, [group], num_blocks, page, device=device)
    for slot in cache.slots:
        slot.random_(0, 256)
    tier = HostTier(cache, n)
    src = torch.randperm(num_blocks - 1)[:n] + 1
    dst = torch.randperm(num_blocks - 1)[:n] + 1
    demote = [TierCopy(0, int(b), i) for i, b in enumerate(src.tolist())]
    promote = [TierCopy(0, int(b), i) for i, b in enumerate(dst.tolist())]
    want = [s[src.to(device)].clone() for s in cache.slots]

    def sync() -> None:
        tier.flush()
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    def timed(fn: Callable[[], object]) -> float:
        fn()
        sync()
        samples = []
        for _ in range(3 if dry_run else 10):
            begin = time.perf_counter()
            fn()
            sync()
            samples.append(time.perf_counter() - begin)
        return sorted(samples)[len(samples) // 2]

    t_demote = timed(lambda: tier.demote(demote))
    t_promote = timed(lambda: tier.promote(promote))
    ok = all(torch.equal(s[dst.to(device)], w) for s, w in zip(cache.slots, want))
    moved = layers * n * page
    host = torch.empty(moved, dtype=torch.uint8, pin_memory=device.type == "cuda")
    flat = torch.zeros(moved, dtype=torch.uint8, device=device)
    t_d2h = timed(lambda: host.copy_(flat, non_blocking=True))
    t_h2d = timed(lambda: flat.copy_(host, non_blocking=True))
    shape = f"{n} blocks x {layers} layers x {page / 1024:g} KiB = {moved / 2**20:g} MiB"
    rows = []
    for name, seconds, raw in (("host_tier demote (device->host)", t_demote, t_d2h),
                               ("host_tier promote (host->device)", t_promote, t_h2d)):
        gbps = moved / seconds / 1e9
        rows.append(dict(check=name, device=str(device), shape=shape, ms=seconds * 1e3, bytes=moved,
                         value=gbps, unit="GB/s", fraction=gbps / HOST_LINK_GBPS,
                         ceiling=f"{HOST_LINK_GBPS:.0f} GB/s (PCIe 5 x16, nominal)",
                         raw_copy_GBps=moved / raw / 1e9, of_copy=raw / seconds, ok=ok))
    return rows


def check_decode(device: torch.device, dry_run: bool, batch: int, kv_len: int, copy_gbps: float | None) -> list[dict]:
    """Paged decode attention: the Triton kernel against the reference, and its bandwidth
    against the copy's."""
    from kernels import paged_attention
    from kernels._dispatch import load_triton_module

    q_heads, kv_heads, head_size, block_size = (4, 2, 16, 16) if dry_run else (32, 8, 128, 16)
    dtype = torch.bfloat16
    k_cache, v_cache, tables = _paged_kv(batch, kv_len, kv_heads, head_size, block_size, dtype, device, seed=1)
    gen = torch.Generator(device=device).manual_seed(2)
    q = torch.randn(batch, q_heads, head_size, generator=gen, device=device, dtype=dtype)
    seq_lens = torch.full((batch,), kv_len, dtype=torch.int32, device=device)
    starts = torch.arange(batch + 1, dtype=torch.int32, device=device)
    scale = head_size ** -0.5
    triton_attention = load_triton_module("triton_attention")
    auto_splits = triton_attention._decode_splits(batch, batch, kv_heads, tables.shape[1] * block_size, device)

    def paged():
        return paged_attention(q, k_cache, v_cache, tables, seq_lens, starts, scale=scale, impl="triton")

    out = paged()
    # Independent check on two requests: SDPA over their contiguous K/V.
    errors = []
    for b in (0, batch - 1):
        k = _contiguous(k_cache, tables[b], kv_len)
        v = _contiguous(v_cache, tables[b], kv_len)
        expected = torch.nn.functional.scaled_dot_product_attention(
            q[b].float()[:, None], k.float(), v.float(), scale=scale, enable_gqa=True)[:, 0]
        errors.append(_rms_ratio(out[b], expected))
    error = max(errors)
    seconds = _seconds(paged, device, 3 if dry_run else 20)
    moved = 2 * batch * kv_len * kv_heads * head_size * k_cache.element_size() + 2 * q.numel() * q.element_size()
    gbps = moved / seconds / 1e9
    shape = f"{batch} x {kv_len} tok, {q_heads}/{kv_heads} heads x {head_size}, bf16, block {block_size}"
    rows = [dict(check=f"decode_attention (splits {auto_splits})", device=str(device), shape=shape,
                 ms=seconds * 1e3, value=gbps, unit="GB/s", fraction=gbps / COPY_CEILING_GBPS, ceiling="4.3 TB/s",
                 of_copy=(gbps / copy_gbps) if copy_gbps else None, target=f">= {DECODE_TARGET:.0%} of copy",
                 kv_GB=moved / 1e9, splits=auto_splits, rms_error=error,
                 ok=error < 1e-2 and not out.isnan().any().item())]
    for splits in sorted({1, 4} - {auto_splits}):
        # Tuning evidence: the same call with another number of key slices per program.
        def forced(n=splits):
            return triton_attention.paged_attention(q, k_cache, v_cache, tables, seq_lens, starts, scale=scale,
                                                    sliding_window=None, softcap=None, num_splits=n)
        error_n = _rms_ratio(forced(), out)
        t_n = _seconds(forced, device, 3 if dry_run else 20)
        rows.append(dict(check=f"decode_attention (splits {splits})", device=str(device), shape=shape,
                         ms=t_n * 1e3, value=moved / t_n / 1e9, unit="GB/s",
                         fraction=moved / t_n / 1e9 / COPY_CEILING_GBPS, ceiling="4.3 TB/s",
                         of_copy=(moved / t_n / 1e9 / copy_gbps) if copy_gbps else None, splits=splits,
                         rms_error=error_n, ok=error_n < 1e-2))
    if not dry_run and batch <= 64:
        # Reference point: SDPA (flash / efficient kernels) over the same bytes stored contiguously.
        k = torch.randn(batch, kv_heads, kv_len, head_size, device=device, dtype=dtype)
        v = torch.randn_like(k)
        q4 = q[:, :, None]
        t_sdpa = _seconds(lambda: torch.nn.functional.scaled_dot_product_attention(q4, k, v, scale=scale,
                                                                                     enable_gqa=True), device, 20)
        sdpa_gbps = moved / t_sdpa / 1e9
        rows.append(dict(check="decode_sdpa_contiguous (reference)", device=str(device), shape=shape,
                         ms=t_sdpa * 1e3, value=sdpa_gbps, unit="GB/s", fraction=sdpa_gbps / COPY_CEILING_GBPS,
                         ceiling="4.3 TB/s", of_copy=(sdpa_gbps / copy_gbps) if copy_gbps else None, ok=True))
        del k, v
    return rows


def check_prefill(device: torch.device, dry_run: bool) -> list[dict]:
    """Paged prefill attention: the Triton kernel against the reference, timed."""
    from kernels import paged_attention

    batch, length, q_heads, kv_heads, head_size, block_size = (
        (2, 40, 4, 2, 16, 16) if dry_run else (8, 4096, 32, 8, 128, 16))
    dtype = torch.bfloat16
    k_cache, v_cache, tables = _paged_kv(batch, length, kv_heads, head_size, block_size, dtype, device, seed=3)
    gen = torch.Generator(device=device).manual_seed(4)
    q = torch.randn(batch * length, q_heads, head_size, generator=gen, device=device, dtype=dtype)
    seq_lens = torch.full((batch,), length, dtype=torch.int32, device=device)
    starts = torch.arange(batch + 1, dtype=torch.int32, device=device) * length
    scale = head_size ** -0.5

    def paged():
        return paged_attention(q, k_cache, v_cache, tables, seq_lens, starts, scale=scale, impl="triton")

    out = paged()
    k = _contiguous(k_cache, tables[0], length)[None]
    v = _contiguous(v_cache, tables[0], length)[None]
    q0 = q[:length].transpose(0, 1)[None]

    def sdpa():
        return torch.nn.functional.scaled_dot_product_attention(q0, k, v, is_causal=True, scale=scale, enable_gqa=True)

    expected = torch.nn.functional.scaled_dot_product_attention(
        q0.float(), k.float(), v.float(), is_causal=True, scale=scale, enable_gqa=True)
    error = _rms_ratio(out[:length], expected[0].transpose(0, 1))
    seconds = _seconds(paged, device, 2 if dry_run else 10)
    # causal: query i sees i + 1 keys; QK^T and PV are 2 * D FLOPs per (query, key, head) each.
    flops = 4.0 * batch * q_heads * head_size * (length * (length + 1) / 2)
    tflops = flops / seconds / 1e12
    shape = f"{batch} x {length} tok causal, {q_heads}/{kv_heads} heads x {head_size}, bf16"
    rows = [dict(check="prefill_attention", device=str(device), shape=shape, ms=seconds * 1e3, value=tflops,
                 unit="TFLOP/s", fraction=tflops / BF16_CEILING_TFLOPS, ceiling="790 TFLOP/s",
                 target=f">= {PREFILL_TARGET:.0%} of 790", rms_error=error,
                 ok=error < 2e-2 and not out.isnan().any().item())]
    if not dry_run:
        t_sdpa = _seconds(sdpa, device, 10) * batch  # SDPA timed on one sequence, scaled to the batch
        rows.append(dict(check="prefill_sdpa_contiguous (reference)", device=str(device), shape=shape,
                         ms=t_sdpa * 1e3, value=flops / t_sdpa / 1e12, unit="TFLOP/s",
                         fraction=flops / t_sdpa / 1e12 / BF16_CEILING_TFLOPS, ceiling="790 TFLOP/s", ok=True))
    return rows


def sweep_tiles(device: torch.device, dry_run: bool) -> list[dict]:
    """Tuning evidence: decode and prefill under other (BLOCK_M, TILE_N, num_warps, num_stages).

    The defaults in kernels/triton_attention.py `_tile_config` are untuned guesses; these rows say
    which to pick. Each variant is checked against the default's output first.
    """
    from kernels._dispatch import load_triton_module

    triton_attention = load_triton_module("triton_attention")
    if dry_run:
        decode_shape, prefill_shape, heads = (2, 40), (2, 40), (4, 2, 16)
        decode_tiles = prefill_tiles = [(16, 16, 4, 1), (32, 32, 4, 1), (16, 16, 4, 1, "masked")]
    else:
        decode_shape, prefill_shape, heads = (64, 8192), (8, 4096), (32, 8, 128)
        # "masked": every key tile masked (skip_masks=False), to see what the mask-free tiles save
        decode_tiles = [(16, 64, 4, 3), (16, 128, 4, 3), (16, 64, 4, 2), (16, 32, 4, 4), (16, 128, 8, 3),
                        (16, 256, 8, 2), (16, 64, 4, 3, "masked")]
        prefill_tiles = [(128, 64, 8, 3), (128, 64, 4, 3), (64, 64, 4, 3), (128, 128, 8, 2), (128, 32, 8, 3),
                         (64, 128, 4, 3), (128, 64, 8, 3, "masked")]
    q_heads, kv_heads, head_size = heads
    rows = []
    for kind, (batch, length), variants in (("decode", decode_shape, decode_tiles),
                                            ("prefill", prefill_shape, prefill_tiles)):
        k_cache, v_cache, tables = _paged_kv(batch, length, kv_heads, head_size, 16, torch.bfloat16, device, seed=5)
        q_len = 1 if kind == "decode" else length
        gen = torch.Generator(device=device).manual_seed(6)
        q = torch.randn(batch * q_len, q_heads, head_size, generator=gen, device=device, dtype=torch.bfloat16)
        seq_lens = torch.full((batch,), length, dtype=torch.int32, device=device)
        starts = torch.arange(batch + 1, dtype=torch.int32, device=device) * q_len
        baseline = None
        for index, tiles in enumerate(variants):
            call = functools.partial(triton_attention.paged_attention, q, k_cache, v_cache, tables, seq_lens,
                                     starts, scale=head_size ** -0.5, sliding_window=None, softcap=None,
                                     num_splits=1, tiles=tiles[:4], skip_masks="masked" not in tiles)
            out = call()
            baseline = out if baseline is None else baseline
            error = _rms_ratio(out, baseline)
            seconds = _seconds(call, device, 2 if dry_run else 10)
            if kind == "decode":
                moved = 2 * batch * length * kv_heads * head_size * 2
                value, unit, fraction = moved / seconds / 1e9, "GB/s", moved / seconds / 1e9 / COPY_CEILING_GBPS
            else:
                flops = 4.0 * batch * q_heads * head_size * (length * (length + 1) / 2)
                value, unit, fraction = flops / seconds / 1e12, "TFLOP/s", flops / seconds / 1e12 / BF16_CEILING_TFLOPS
            rows.append(dict(check=f"sweep {kind} tiles={tiles}", device=str(device), tiles=list(tiles[:4]),
                             skip_masks="masked" not in tiles,
                             shape=f"{batch} x {length}, splits 1" + (" (the current default)" if index == 0 else ""),
                             ms=seconds * 1e3, value=value, unit=unit, fraction=fraction, rms_error=error,
                             ok=error < 1e-2 and not out.isnan().any().item()))
        del k_cache, v_cache, call  # free this shape's caches before the next one's
    return rows


def run_mamba(device: str, dry_run: bool) -> list[dict]:
    """The Mamba kernel checks of gpu_check_mamba, as rows of this table."""
    import gpu_check_mamba

    rows = gpu_check_mamba.run(device, dry_run)
    for row in rows:  # map its fields onto this table's columns
        if "GBps" in row:
            row.setdefault("value", row["GBps"])
            row.setdefault("unit", "GB/s")
        elif "TFLOPs" in row:
            row.setdefault("value", row["TFLOPs"])
            row.setdefault("unit", "TFLOP/s")
        row.setdefault("fraction", row.get("fraction_of_peak"))
        row.setdefault("rms_error", row.get("rms_error_vs_oracle"))
    return rows


# --------------------------------------------------------------------------------------------------

def _guard(name: str, fn: Callable[[], list[dict] | dict], device: str) -> list[dict]:
    """Run one step; an exception becomes a failed row instead of ending the script."""
    begin = time.perf_counter()
    try:
        result = fn()
        rows = result if isinstance(result, list) else [result]
    except Exception as exc:  # recorded in the results; the other steps still run
        traceback.print_exc()
        rows = [dict(check=name, device=device, error=f"{type(exc).__name__}: {exc}", ok=False)]
    print(f"[{time.strftime('%H:%M:%S')}] {name}: {time.perf_counter() - begin:.1f} s", flush=True)
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return rows


def main(argv: list[str] | None = None) -> int:
    """Runs the GPU checks in order (tests, copy, attention, sweep, Mamba), prints the table;
    answers 1 when a check failed."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dry-run", action="store_true", help="tiny shapes, quick test subset (any machine)")
    parser.add_argument("--skip-tests", action="store_true", help="leave out step 1 (the pytest run)")
    parser.add_argument("--skip-mamba", action="store_true", help="leave out step 5")
    parser.add_argument("--skip-host-tier", action="store_true", help="leave out step 2b (host-tier copies)")
    parser.add_argument("--skip-sweep", action="store_true", help="leave out the tile-size sweep (step 4b)")
    parser.add_argument("--tests-timeout", type=int, default=300, help="seconds for the whole pytest step")
    parser.add_argument("--out", type=Path, default=None,
                        help="write the JSON here instead of bench/results/gpu_check.json (e.g. $OUT/gpu_check.json)")
    args = parser.parse_args(argv)
    dry_run = args.dry_run or not args.device.startswith("cuda")
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        parser.error("--device cuda: torch sees no GPU (use --dry-run on CPU)")
    if not args.device.startswith("cuda"):
        # The Triton kernels can only run in the interpreter on CPU; set before they are imported.
        os.environ["TRITON_INTERPRET"] = "1"
    device = torch.device(args.device)
    print(f"gpu_check: device={device} dry_run={dry_run} torch={torch.__version__}"
          + (f" gpu={torch.cuda.get_device_name(device)}" if device.type == "cuda" else ""), flush=True)

    rows: list[dict] = []
    if not args.skip_tests:
        rows += _guard("kernel_tests", lambda: run_tests(args.device, dry_run, args.tests_timeout), args.device)
    rows += _guard("copy_bandwidth", lambda: check_copy(device, dry_run), args.device)
    if not args.skip_host_tier:
        rows += _guard("host_tier", lambda: check_host_tier(device, dry_run), args.device)
    copy_gbps = next((r.get("value") for r in rows if r["check"] == "copy_bandwidth" and r.get("ok")), None)
    decode_shapes = [(2, 40)] if dry_run else [(64, 8192), (8, 65536)]
    for batch, kv_len in decode_shapes:
        rows += _guard(f"decode_attention {batch}x{kv_len}",
                       functools.partial(check_decode, device, dry_run, batch, kv_len, copy_gbps), args.device)
    rows += _guard("prefill_attention", lambda: check_prefill(device, dry_run), args.device)
    if not args.skip_sweep:
        rows += _guard("tile_sweep", lambda: sweep_tiles(device, dry_run), args.device)
    if not args.skip_mamba:
        rows += _guard("mamba", lambda: run_mamba(args.device, dry_run), args.device)

    _report(rows, dry_run, args.out)
    return 0 if all(r.get("ok") for r in rows) else 1


def _report(rows: list[dict], dry_run: bool, out: Path | None) -> None:
    from _common import print_table, write_results  # bench/_common.py needs rich: import it late

    def pct(x):
        return None if x is None else f"{100 * x:.1f}%"

    def verdict(row):
        return "yes" if row.get("ok") else "NO"

    table = []
    value: str | None
    for r in rows:
        if r["check"] == "kernel_tests":
            value = f"{r.get('passed', 0)} passed / {r.get('failures', 0)} failed / {r.get('errors', 0)} errors"
            table.append([r["check"], r.get("shape"), r.get("seconds"), value, None, None, None, verdict(r)])
            continue
        value = None if r.get("value") is None else f"{r['value']:,.1f} {r['unit']}"
        table.append([r["check"], r.get("shape") or r.get("error") or r.get("note"), r.get("ms"), value,
                      pct(r.get("fraction")), pct(r.get("of_copy")), r.get("rms_error"), verdict(r)])
    title = "GPU check" + (" (DRY RUN: tiny shapes, numbers mean nothing)" if dry_run else "")
    print_table(title, ["check", "shape", "ms (s for tests)", "result", "% of ceiling", "% of copy", "rms err", "ok"],
                table)
    print(f"targets: decode >= {DECODE_TARGET:.0%} of the measured copy bandwidth; "
          f"prefill >= {PREFILL_TARGET:.0%} of {BF16_CEILING_TFLOPS:.0f} TFLOP/s", flush=True)
    payload = dict(dry_run=dry_run, torch=torch.__version__, rows=rows,
                   gpu=torch.cuda.get_device_name() if torch.cuda.is_available() else None)
    print(f"wrote {write_results('gpu_check', payload, out)}")


if __name__ == "__main__":
    sys.exit(main())
