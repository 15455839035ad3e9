"""Dev tool (never run by tests): the vLLM oracle plus what vLLM's scheduler does with
copy-on-write copies. Run it with the oracle venv's python and ``vllm_oracle.py``'s
arguments (``oracle_diff.py`` does):

    VLLM_ORACLE=.../vllm_oracle.py ~/.cache/vllm-oracle-venv/bin/python \\
        scripts/oracle/oracle_cow.py --scenario full_mamba --mamba-block-size 32 < trace

``vllm_oracle.py`` drives vLLM's ``KVCacheManager`` alone. A partial prefix hit's copies
(``KVCacheManager.take_kv_cache_block_copies``) are drained by vLLM's scheduler, which
then frees the blocks the manager kept for them (``Scheduler._free_cow_retained_blocks``,
synchronous engine). Without a scheduler those blocks would stay held forever. After
every trace operation (this project's replay applies each one as a batch of its own) this
wrapper drains the copies the same way and adds ``"block_copies": [[src, dst], ...]`` to
the operation's result when there are any. On traces without copies it answers exactly
as ``vllm_oracle.py`` does.

It also does what the scheduler does with a lookup's shared-prefix boundary
(``Scheduler.schedule``: ``request.shared_prefix_boundary`` is set from
``get_computed_blocks``): sparse retention (``--retention-interval 0|N``) keeps the
checkpoint at that junction. ``vllm_oracle.py`` alone leaves it 0.

Two options of vLLM's ``KVCacheManager`` that ``vllm_oracle.py`` does not take are
taken here (and removed before its own arguments are parsed): ``--use-eagle``
(``use_eagle=True``), ``--enable-mamba-shared-prefix-checkpoint`` and ``--watermark W``.

``--num-hash-lookahead-tokens L`` builds the manager with ``num_hash_lookahead_tokens=L``
and gives requests vLLM's lookahead block hasher (``get_request_block_hasher(...,
num_hash_lookahead_tokens=L)``), as vLLM's engine does when EAGLE's lookahead block hashes
are on (its scheduler then builds the manager with ``use_eagle=False``). The bench's
requests get the same hasher. An ``add`` op may carry ``mm_items`` (``[identifier,
offset, length]`` each: ``MultiModalFeatureSpec`` with a ``PlaceholderRange``) and
``prompt_embeds`` (one list of floats per prompt token: a float32 ``prompt_embeds``
tensor), which this project's replay takes too.
It also knows two spec types ``vllm_oracle.py`` does not build: ``rswa`` (vLLM's
``RSWASpec``, window ``--rswa-window N``, default 16; ``--rswa-block-size N``, default
the ``--block-size``) and ``cbuf`` (``CircularBufferSpec``,
ring ``--ring-size N`` rows, default 8), in the scenarios ``rswa``, ``full_rswa``,
``cbuf``, ``full_cbuf`` and ``full_rswa_cbuf``. Their block sizes are resolved as vLLM's
``resolve_kv_cache_block_sizes`` does: the scheduler block size is the lcm of every
group's, the hash block size the gcd of the prefix-cacheable groups' (a ring is not).
"""

from __future__ import annotations

import math
import os
import sys
from pathlib import Path
from typing import Any

ORACLE = Path(os.environ.get(
    "VLLM_ORACLE", Path(__file__).resolve().parents[3] / "shared/tools/vllm-oracle/vllm_oracle.py"))
sys.path.insert(0, str(ORACLE.parent))

import torch  # noqa: E402
import vllm_oracle  # noqa: E402  (found through the path set above)
from vllm.multimodal.inputs import MultiModalFeatureSpec, PlaceholderRange  # noqa: E402

# The spec types added here: scenario -> (group kinds, default enable_caching).
NEW_SCENARIOS = {"rswa": (("rswa",), True), "full_rswa": (("full", "rswa"), True),
                 "cbuf": (("cbuf",), True), "full_cbuf": (("full", "cbuf"), True),
                 "full_rswa_cbuf": (("full", "rswa", "cbuf"), True)}
SPEC_OPTIONS = {"--rswa-window": 16, "--ring-size": 8, "--rswa-block-size": 0}
_BASE_BUILD = vllm_oracle.build_kv_cache_config


def build_kv_cache_config(cfg: vllm_oracle.OracleConfig) -> tuple[Any, int, int]:
    """``vllm_oracle.build_kv_cache_config``, plus the groups of the new spec types."""
    cfg = cfg.resolved()
    kinds, _ = vllm_oracle.SCENARIOS[cfg.scenario]
    if not {"rswa", "cbuf"} & set(kinds):
        return _BASE_BUILD(cfg)
    from vllm.v1.kv_cache_interface import CircularBufferSpec, RSWASpec  # noqa: PLC0415

    common: dict[str, Any] = dict(num_kv_heads=1, head_size=1, dtype=vllm_oracle.torch.float32)
    groups = []
    for i, kind in enumerate(kinds):
        if kind == "full":
            spec: Any = vllm_oracle.FullAttentionSpec(block_size=cfg.block_size, **common)
        elif kind == "rswa":
            spec = RSWASpec(block_size=SPEC_OPTIONS["--rswa-block-size"] or cfg.block_size,
                            rswa_window=SPEC_OPTIONS["--rswa-window"], **common)
        elif kind == "cbuf":
            spec = CircularBufferSpec(block_size=SPEC_OPTIONS["--ring-size"], **common)
        else:  # pragma: no cover
            raise AssertionError(kind)
        groups.append(vllm_oracle.KVCacheGroupSpec(layer_names=[f"layer{i}_{kind}"],
                                                   kv_cache_spec=spec))
    config = vllm_oracle.KVCacheConfig(
        num_blocks=cfg.num_blocks, kv_cache_tensors=[], kv_cache_groups=groups,
        prefix_cache_retention_interval=cfg.retention_interval)
    sizes = [g.kv_cache_spec.block_size for g in groups]
    if len(groups) == 1:
        return config, sizes[0], sizes[0]
    scheduler = math.lcm(*sizes)
    if not cfg.enable_caching:
        return config, scheduler, scheduler
    hashed = [g.kv_cache_spec.block_size for g in groups if g.kv_cache_spec.prefix_cacheable]
    return config, scheduler, math.gcd(*(hashed or sizes))

# Manager options this wrapper adds: flag -> KVCacheManager keyword.
MANAGER_FLAGS = {"--use-eagle": "use_eagle",
                 "--enable-mamba-shared-prefix-checkpoint":
                     "enable_mamba_shared_prefix_checkpoint"}
MANAGER_OPTIONS: dict[str, Any] = {}
LOOKAHEAD = 0  # --num-hash-lookahead-tokens


class SchedulingOracle(vllm_oracle.Oracle):
    """The oracle, draining copy-on-write copies after each operation."""

    def __init__(self, cfg: vllm_oracle.OracleConfig) -> None:
        super().__init__(cfg)
        if LOOKAHEAD:
            MANAGER_OPTIONS["num_hash_lookahead_tokens"] = LOOKAHEAD
            if self.cfg.enable_caching:
                self.block_hasher = vllm_oracle.get_request_block_hasher(
                    self.hash_block_size, self.hash_fn, num_hash_lookahead_tokens=LOOKAHEAD)
        if MANAGER_OPTIONS:
            # The same manager as vllm_oracle.Oracle builds, with the extra options.
            self.manager = vllm_oracle.KVCacheManager(
                kv_cache_config=self.kv_cache_config, max_model_len=self.cfg.max_model_len,
                scheduler_block_size=self.scheduler_block_size,
                hash_block_size=self.hash_block_size,
                enable_caching=bool(self.cfg.enable_caching), **MANAGER_OPTIONS)

    def describe(self) -> dict[str, Any]:
        out: dict[str, Any] = super().describe()
        out.update(MANAGER_OPTIONS)
        kinds = vllm_oracle.SCENARIOS[self.cfg.scenario][0]
        if "rswa" in kinds:
            out["rswa_window"] = SPEC_OPTIONS["--rswa-window"]
            out["rswa_block_size"] = SPEC_OPTIONS["--rswa-block-size"] or self.cfg.block_size
        if "cbuf" in kinds:
            out["ring_size"] = SPEC_OPTIONS["--ring-size"]
        return out

    def op_add(self, op: dict[str, Any]) -> dict[str, Any]:
        if "mm_items" not in op and "prompt_embeds" not in op:
            return super().op_add(op)
        rid = op["req"]
        if rid in self.reqs:
            raise ValueError(f"request {rid!r} already exists")
        mm = [MultiModalFeatureSpec(data=None, modality="image", identifier=ident,
                                    mm_position=PlaceholderRange(offset=off, length=n))
              for ident, off, n in op.get("mm_items", [])]
        embeds = op.get("prompt_embeds")
        request = vllm_oracle.Request(
            request_id=rid, prompt_token_ids=[int(t) for t in op["tokens"]],
            prompt_embeds=None if embeds is None else torch.tensor(embeds,
                                                                   dtype=torch.float32),
            mm_features=mm or None,
            sampling_params=vllm_oracle.SamplingParams(
                max_tokens=int(op.get("max_tokens", 1 << 20))),
            pooling_params=None, block_hasher=self.block_hasher,
            cache_salt=op.get("cache_salt"))
        self.reqs[rid] = vllm_oracle.ReqState(request)
        return {"num_tokens": request.num_tokens,
                "num_block_hashes": len(request.block_hashes)}

    def op_lookup(self, op: dict[str, Any]) -> dict[str, Any]:
        out: dict[str, Any] = super().op_lookup(op)
        self._req(op).request.shared_prefix_boundary = out.get("shared_prefix_boundary", 0)
        return out

    def apply(self, op: dict[str, Any]) -> dict[str, Any]:
        out: dict[str, Any] = super().apply(op)
        copies, retained = self.manager.take_kv_cache_block_copies()
        if copies:
            out["block_copies"] = [[c.src_block_id, c.dst_block_id] for c in copies]
        self.manager.block_pool.free_blocks(retained)
        return out


if __name__ == "__main__":
    for flag, keyword in MANAGER_FLAGS.items():
        if flag in sys.argv:
            sys.argv.remove(flag)
            MANAGER_OPTIONS[keyword] = True
    if "--watermark" in sys.argv:  # KVCacheManager(watermark=W)
        i = sys.argv.index("--watermark")
        MANAGER_OPTIONS["watermark"] = float(sys.argv[i + 1])
        del sys.argv[i:i + 2]
    if "--num-hash-lookahead-tokens" in sys.argv:
        i = sys.argv.index("--num-hash-lookahead-tokens")
        LOOKAHEAD = int(sys.argv[i + 1])
        del sys.argv[i:i + 2]
    for option in SPEC_OPTIONS:  # the new spec types' parameters
        if option in sys.argv:
            i = sys.argv.index(option)
            SPEC_OPTIONS[option] = int(sys.argv[i + 1])
            del sys.argv[i:i + 2]
    vllm_oracle.SCENARIOS.update(NEW_SCENARIOS)
    vllm_oracle.build_kv_cache_config = build_kv_cache_config
    vllm_oracle.Oracle = SchedulingOracle
    sys.exit(vllm_oracle.main())
