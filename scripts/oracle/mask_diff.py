"""Dev tool (never run by tests): ``cache_service.core.retention.reachable_block_mask``
against vLLM 0.33's ``SlidingWindowManager`` / ``MambaManager.reachable_block_mask`` on
random arguments. Run with the oracle venv's python and this checkout on PYTHONPATH:

    PYTHONPATH=. ~/.cache/vllm-oracle-venv/bin/python scripts/oracle/mask_diff.py [N]
"""

from __future__ import annotations

import os
import random
import sys
import types
from typing import Any

os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
os.environ.setdefault("KVCACHE_CORE", "pure")

import torch  # noqa: E402
from vllm.v1.core.single_type_kv_cache_manager import (  # noqa: E402
    MambaManager,
    SlidingWindowManager,
)
from vllm.v1.kv_cache_interface import MambaSpec as VMambaSpec  # noqa: E402
from vllm.v1.kv_cache_interface import SlidingWindowSpec as VSlidingWindowSpec  # noqa: E402

try:  # the core's only third-party import; the oracle venv lacks it, a no-op stands in
    import mypy_extensions  # noqa: F401
except ImportError:
    stub = types.ModuleType("mypy_extensions")
    stub.mypyc_attr = lambda *a, **k: (lambda cls: cls)  # type: ignore[attr-defined]
    sys.modules["mypy_extensions"] = stub

from cache_service.core.retention import reachable_block_mask  # noqa: E402
from cache_service.core.specs import KVCacheSpec, MambaSpec, SlidingWindowSpec  # noqa: E402


def main() -> int:
    n = int(sys.argv[1]) if len(sys.argv) > 1 else 20000
    rng = random.Random(0)
    bad = 0
    for _ in range(n):
        bs = rng.choice([1, 2, 4, 8, 16])
        alignment = rng.choice([None, bs, 2 * bs, 4 * bs, 3 * bs, max(1, bs // 2)])
        retention = rng.choice([None, 0, bs * rng.randint(1, 12)])
        start = rng.randint(0, 40)
        end = start + rng.randint(0, 40)
        boundaries = [rng.randint(0, 60 * bs) for _ in range(rng.randint(0, 3))]
        eagle = rng.random() < 0.5
        final = rng.choice([None, rng.randint(0, 80)])
        if rng.random() < 0.6:
            window = rng.randint(1, 12 * bs)
            ours_spec: KVCacheSpec = SlidingWindowSpec(block_size=bs,
                                                       sliding_window=window)
            theirs_spec: Any = VSlidingWindowSpec(block_size=bs, sliding_window=window,
                                                  num_kv_heads=1, head_size=1,
                                                  dtype=torch.float32)
            cls: Any = SlidingWindowManager
        else:
            eagle, final = False, None  # not arguments vLLM's Mamba rule reads
            ours_spec = MambaSpec(block_size=bs, shapes=((1,),), dtypes=("float32",),
                                  mamba_cache_mode="align")
            theirs_spec = VMambaSpec(block_size=bs, shapes=((1,),), dtypes=(torch.float32,),
                                     mamba_cache_mode="align")
            cls = MambaManager
        theirs = cls.reachable_block_mask(
            start_block=start, end_block=end, alignment_tokens=alignment,
            kv_cache_spec=theirs_spec, use_eagle=eagle, retention_interval=retention,
            reachable_boundaries=boundaries, final_segment_end_block=final)
        ours = reachable_block_mask(ours_spec, start, end, alignment, use_eagle=eagle,
                                    retention_interval=retention,
                                    reachable_boundaries=boundaries,
                                    final_segment_end_block=final)
        if ours != theirs:
            bad += 1
            if bad <= 5:
                print(cls.__name__, dict(bs=bs, alignment=alignment, retention=retention,
                                         start=start, end=end, boundaries=boundaries,
                                         eagle=eagle, final=final), ours, theirs)
    print(f"{n} masks compared, {bad} differ")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
