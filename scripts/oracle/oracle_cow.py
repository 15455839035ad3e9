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
"""

from __future__ import annotations

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
    vllm_oracle.Oracle = SchedulingOracle
    sys.exit(vllm_oracle.main())
