"""Dev tool (never run by tests): a pytest plugin that runs vLLM 0.33's own KV-cache unit tests
(``tests/v1/core`` of the ``vllm==0.33.0`` sdist) against this project's core.

Loaded by ``scripts/oracle/vllm_unit_tests.py`` with ``-p vllm_ut_adapter`` under the oracle
venv's pytest. It always records every test's outcome (JSON lines into ``$VLLM_UT_RESULTS``);
with ``VLLM_UT_ADAPT=1`` it also replaces, before the test modules are imported, the names
they import from ``vllm.v1.core`` (``BlockPool``, the single-type managers,
``KVCacheManager``) by thin adapters over ``cache_service.core``: each translates vLLM's
constructor arguments and config objects into ours and hands the test our object. Anything
the adapter cannot translate raises :class:`NotRunnable` naming the missing feature, so the
report can group "not runnable" tests by what they need. vLLM's own ``Request`` objects
are passed to our core as they are: the pure core (``KVCACHE_CORE=pure``) reads them by
their attributes (``request_id``, ``block_hashes``, ``num_tokens``...), which vLLM's share.

Classification of a test run against us (``outcome`` in the records):
``passed``; ``failed`` (an ``AssertionError``: a behavioural divergence or an adapter
mismatch the assertion exposed); ``not_runnable`` (a :class:`NotRunnable`, or any other
exception: the test reached a surface the adapter or our core does not have; ``feature``
names it). ``touched`` says whether the test built any adapted object at all.
"""

from __future__ import annotations

import json
import os
import traceback
from typing import Any

import pytest

ADAPT = os.environ.get("VLLM_UT_ADAPT") == "1"
RESULTS = os.environ.get("VLLM_UT_RESULTS")
_touched = [0]


class NotRunnable(Exception):
    """The test needs ``feature``, which our core (or this adapter) does not have."""

    def __init__(self, feature: str) -> None:
        super().__init__(feature)
        self.feature = feature


def _touch() -> None:
    _touched[0] += 1


# -- config translation ------------------------------------------------------------------
def _dtype(dtype: Any) -> str:
    return str(dtype).removeprefix("torch.")


def to_our_spec(spec: Any) -> Any:
    """vLLM's ``KVCacheSpec`` -> ours (NotRunnable for a type we lack)."""
    from cache_service.core import specs as ours  # noqa: PLC0415

    name = type(spec).__name__
    attn = dict(block_size=spec.block_size, num_kv_heads=getattr(spec, "num_kv_heads", 1),
                head_size=getattr(spec, "head_size", 1), dtype=_dtype(getattr(spec, "dtype", "")))
    if getattr(spec, "page_size_padded", None):
        attn["page_size_padded"] = spec.page_size_padded
    if name == "FullAttentionSpec":
        return ours.FullAttentionSpec(**attn, sliding_window=spec.sliding_window,
                                      attention_chunk_size=spec.attention_chunk_size)
    if name == "SlidingWindowSpec":
        return ours.SlidingWindowSpec(**attn, sliding_window=spec.sliding_window)
    if name == "ChunkedLocalAttentionSpec":
        return ours.ChunkedLocalAttentionSpec(**attn,
                                              attention_chunk_size=spec.attention_chunk_size)
    if name == "RSWASpec":
        return ours.RSWASpec(**attn, rswa_window=spec.rswa_window)
    if name == "CircularBufferSpec":
        return ours.CircularBufferSpec(**attn)
    if name == "MambaSpec":
        shapes = tuple(spec.shapes)
        shapes = (shapes,) if shapes and isinstance(shapes[0], int) else tuple(map(tuple, shapes))
        dtypes = spec.dtypes if isinstance(spec.dtypes, (tuple, list)) else (spec.dtypes,)
        return ours.MambaSpec(block_size=spec.block_size, shapes=shapes,
                              dtypes=tuple(_dtype(d) for d in dtypes),
                              page_size_padded=spec.page_size_padded,
                              mamba_type=str(spec.mamba_type),
                              mamba_cache_mode=spec.mamba_cache_mode,
                              num_speculative_blocks=spec.num_speculative_blocks)
    raise NotRunnable(f"spec type {name}")


def to_our_config(config: Any) -> Any:
    """vLLM's ``KVCacheConfig`` -> ours."""
    from cache_service.core import specs as ours  # noqa: PLC0415

    groups = tuple(ours.KVCacheGroupSpec(layer_names=tuple(g.layer_names),
                                         spec=to_our_spec(g.kv_cache_spec))
                   for g in config.kv_cache_groups)
    return ours.KVCacheConfig(num_blocks=config.num_blocks, groups=groups)


def _refuse(kwargs: dict[str, Any], defaults: dict[str, Any], features: dict[str, str]) -> None:
    """NotRunnable for any keyword set away from the value we support."""
    for key, value in kwargs.items():
        if key in defaults and value != defaults[key]:
            raise NotRunnable(features.get(key, key))
        if key not in defaults:
            raise NotRunnable(f"argument {key}")


_CP = "decode/prefill context parallel"


# -- adapters ------------------------------------------------------------------------------
def make_adapters() -> dict[str, Any]:
    """The adapter classes, by the vLLM name they replace."""
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks  # noqa: PLC0415

    from cache_service.core import block_pool as our_pool  # noqa: PLC0415
    from cache_service.core import kv_cache_manager as our_kvm  # noqa: PLC0415
    from cache_service.core import single_type_managers as our_stm  # noqa: PLC0415

    class BlockPool(our_pool.BlockPool):
        """vLLM's ``BlockPool(num_gpu_blocks, enable_caching, hash_block_size, ...)``."""

        def __init__(self, num_gpu_blocks: int, enable_caching: bool, hash_block_size: int,
                     enable_kv_cache_events: bool = False, *, num_groups: int = 1,
                     enable_events: bool | None = None, **kwargs: Any) -> None:
            # Built by a test (vLLM's signature) or by our coordinator (ours: the
            # coordinator module's BlockPool is this class too, so a KVCacheManager's pool
            # answers vLLM's method signatures).
            _touch()
            _refuse(kwargs, {"metrics_collector": None}, {"metrics_collector": "metrics collector"})
            super().__init__(num_gpu_blocks, enable_caching, hash_block_size,
                             num_groups=num_groups,
                             enable_events=enable_kv_cache_events or bool(enable_events))

        def cache_full_blocks(self, request: Any, blocks: Any, *args: Any, **kw: Any) -> None:
            if args and not isinstance(args[0], int):  # our core's call: hashes given
                return super().cache_full_blocks(request, blocks, *args, **kw)
            names = ("num_cached_blocks", "num_full_blocks", "block_size", "kv_cache_group_id",
                     "block_mask")
            a = dict(zip(names, args), **kw)
            # Ours takes the request's hashes already viewed at block_size.
            hashes = our_stm.hash_view(request.block_hashes, self.hash_block_size,
                                       a["block_size"])
            return super().cache_full_blocks(request, blocks, hashes, a["num_cached_blocks"],
                                             a["num_full_blocks"], a["block_size"],
                                             a["kv_cache_group_id"], a.get("block_mask"))

        def cache_partial_block(self, request: Any, block: Any, num_tokens: int,
                                group_id: int | None = None, *,
                                kv_cache_group_id: int | None = None) -> Any:
            gid = group_id if group_id is not None else kv_cache_group_id
            assert gid is not None
            return super().cache_partial_block(request, block, num_tokens, gid)

        def get_cached_block(self, block_hash: Any, group_ids: Any = None, *,
                             kv_cache_group_ids: Any = None) -> Any:
            return super().get_cached_block(
                block_hash, group_ids if group_ids is not None else kv_cache_group_ids)

        def __getattr__(self, name: str) -> Any:
            if name in ("free_block_queue", "blocks", "cached_block_hash_to_block"):
                raise NotRunnable(f"vLLM BlockPool internal {name}")
            raise AttributeError(name)

    def manager_adapter(base: Any) -> type:
        class Adapted(base):
            def __init__(self, kv_cache_spec: Any, block_pool: Any, enable_caching: bool,
                         kv_cache_group_id: int, scheduler_block_size: int,
                         **kwargs: Any) -> None:
                _touch()
                cap = kwargs.pop("max_admission_blocks_per_request", None)
                _refuse(kwargs, {"dcp_world_size": 1, "pcp_world_size": 1,
                                 "needs_kv_cache_zeroing": False},
                        {"dcp_world_size": _CP, "pcp_world_size": _CP,
                         "needs_kv_cache_zeroing": "needs_kv_cache_zeroing (Mamba block "
                                                   "zeroing)"})
                if not isinstance(block_pool, our_pool.BlockPool):
                    raise NotRunnable("a vLLM BlockPool built outside the adapter")
                super().__init__(to_our_spec(kv_cache_spec), block_pool, kv_cache_group_id,
                                 enable_caching=enable_caching, admission_cap=cap)
                self.cache_hit_alignment_tokens = scheduler_block_size
                self.req_to_blocks = _TablesWithIds(self.req_to_ids)

            def cache_blocks(self, request: Any, num_tokens: int,
                             retention_interval: int | None = None, *,
                             replay_boundaries: Any = ()) -> None:
                # vLLM's coordinator passes the retention and the replay boundaries on
                # every call; ours sets the first once and derives the second itself.
                self.retention_interval = retention_interval
                super().cache_blocks(request, num_tokens)

            def remove_skipped_blocks(self, request_id: str, processed_computed_tokens: int,
                                      num_prompt_tokens: int | None = None) -> None:
                super().remove_skipped_blocks(request_id, processed_computed_tokens)
                if num_prompt_tokens is not None and hasattr(self, "remove_gap_blocks"):
                    self.remove_gap_blocks(request_id, processed_computed_tokens,
                                           num_prompt_tokens)

            def __getattr__(self, name: str) -> Any:
                if name.startswith("_"):
                    raise NotRunnable(f"vLLM manager internal {name}")
                raise AttributeError(name)

            @classmethod
            def find_longest_cache_hit(cls, block_hashes: Any, max_length: int,
                                       kv_cache_group_ids: Any, block_pool: Any,
                                       kv_cache_spec: Any, drop_eagle_block: bool = False,
                                       alignment_tokens: int | None = None,
                                       dcp_world_size: int = 1, pcp_world_size: int = 1,
                                       **kwargs: Any) -> Any:
                if dcp_world_size != 1 or pcp_world_size != 1:
                    raise NotRunnable(_CP)
                if kwargs:
                    raise NotRunnable(f"argument {sorted(kwargs)[0]}")
                spec = to_our_spec(kv_cache_spec)
                return base.find_longest_cache_hit(
                    block_hashes, max_length, list(kv_cache_group_ids), block_pool, spec,
                    alignment_tokens if alignment_tokens is not None else spec.block_size,
                    drop_eagle_block)

        Adapted.__name__ = Adapted.__qualname__ = base.__name__
        return Adapted

    class KVCacheManager(our_kvm.KVCacheManager):
        """vLLM's ``KVCacheManager(kv_cache_config, max_model_len, ...)`` over ours; results
        in vLLM's ``KVCacheBlocks`` container (plain data over our blocks)."""

        def __init__(self, kv_cache_config: Any, max_model_len: int,
                     scheduler_block_size: int | None = None, hash_block_size: int | None = None,
                     max_in_flight_tokens: int | None = None, enable_caching: bool = True,
                     use_eagle: bool = False, num_hash_lookahead_tokens: int = 0,
                     enable_kv_cache_events: bool = False, watermark: float = 0.0,
                     enable_mamba_shared_prefix_checkpoint: bool = False,
                     **kwargs: Any) -> None:
            _touch()
            _refuse(kwargs, {"num_prefill_lookahead": 0, "log_stats": False,
                             "log_stats_ignored": None, "dcp_world_size": 1,
                             "pcp_world_size": 1, "metrics_collector": None},
                    {"num_prefill_lookahead": "num_prefill_lookahead",
                     "dcp_world_size": _CP, "pcp_world_size": _CP,
                     "metrics_collector": "metrics collector"})
            config = to_our_config(kv_cache_config)
            sbs, hbs = our_kvm.resolve_block_sizes(config, enable_caching, scheduler_block_size,
                                                   hash_block_size)
            super().__init__(config, max_model_len=max_model_len, scheduler_block_size=sbs,
                             hash_block_size=hbs, max_in_flight_tokens=max_in_flight_tokens,
                             enable_caching=enable_caching, enable_events=enable_kv_cache_events,
                             watermark=watermark, use_eagle=use_eagle,
                             prefix_cache_retention_interval=getattr(
                                 kv_cache_config, "prefix_cache_retention_interval", None),
                             enable_mamba_shared_prefix_checkpoint=(
                                 enable_mamba_shared_prefix_checkpoint),
                             num_hash_lookahead_tokens=num_hash_lookahead_tokens)
            self.block_pool = self.pool
            self.kv_cache_config = kv_cache_config
            # vLLM's names for the coordinator's parts the tests read.
            self.coordinator.single_type_managers = tuple(  # type: ignore[attr-defined]
                self.coordinator.managers)
            self.coordinator.enable_partial_hash_hits = (  # type: ignore[attr-defined]
                self.coordinator.partial_hits)

        def get_computed_blocks(self, request: Any, *args: Any, **kwargs: Any) -> Any:
            blocks, hit, boundary = super().get_computed_blocks(request, *args, **kwargs)
            return KVCacheBlocks(tuple(blocks)), hit, boundary

        def allocate_slots(self, request: Any, num_new_tokens: int,
                           num_new_computed_tokens: int = 0, new_computed_blocks: Any = None,
                           *args: Any, **kwargs: Any) -> Any:
            hit = None if new_computed_blocks is None else tuple(new_computed_blocks.blocks)
            out = super().allocate_slots(request, num_new_tokens, num_new_computed_tokens,
                                         hit, *args, **kwargs)
            return None if out is None else KVCacheBlocks(tuple(out))

        def get_blocks(self, request_id: str) -> Any:
            return KVCacheBlocks(tuple(super().get_blocks(request_id)))

        def get_block_ids(self, request_id: str) -> Any:
            return tuple(super().get_block_ids(request_id))

        def create_kv_cache_blocks(self, blocks: Any) -> Any:
            return KVCacheBlocks(tuple(blocks))

    adapters: dict[str, Any] = {"BlockPool": BlockPool, "KVCacheManager": KVCacheManager}
    for name in ("FullAttentionManager", "SlidingWindowManager", "ChunkedLocalAttentionManager",
                 "MambaManager", "RSWAManager", "CircularBufferManager", "CrossAttentionManager"):
        adapters[name] = manager_adapter(getattr(our_stm, name))
    return adapters


class _TablesWithIds(dict):
    """``req_to_blocks`` for tests that assign a table directly (vLLM keeps no parallel id
    list; our managers do): an assignment also sets the ids."""

    def __init__(self, ids: dict[str, list[int]]) -> None:
        super().__init__()
        self._ids = ids

    def __setitem__(self, key: str, blocks: Any) -> None:
        super().__setitem__(key, blocks)
        self._ids[key] = [b.block_id for b in blocks]


def _request_fields() -> None:
    """The fields our core reads from a request that vLLM's ``Request`` names otherwise
    (its ``lora_request`` holds the LoRA name, path and int id)."""
    from vllm.v1.request import Request  # noqa: PLC0415

    def lora(attr: str) -> Any:
        return property(lambda self: getattr(self.lora_request, attr, None))

    Request.lora_name = lora("lora_name")
    Request.lora_path = lora("lora_path")
    Request.lora_id = lora("lora_int_id")

    def mm_items(self: Any) -> Any:
        if getattr(self, "mm_features", None):
            raise NotRunnable("multimodal items on a vLLM Request (adapter maps none)")
        return ()

    Request.mm_items = property(mm_items)


def install() -> None:
    """Replace the names in every ``vllm.v1.core`` module the tests import them from."""
    import vllm.v1.core.block_pool as vbp  # noqa: PLC0415
    import vllm.v1.core.kv_cache_coordinator as vkc  # noqa: PLC0415
    import vllm.v1.core.kv_cache_manager as vkm  # noqa: PLC0415
    import vllm.v1.core.single_type_kv_cache_manager as vstm  # noqa: PLC0415

    _request_fields()
    from cache_service.core import coordinator as our_coordinator  # noqa: PLC0415

    adapters = make_adapters()
    our_coordinator.BlockPool = adapters["BlockPool"]  # type: ignore[attr-defined]
    for name, cls in adapters.items():
        for module in (vbp, vkm, vstm, vkc):
            if hasattr(module, name):
                setattr(module, name, cls)
    # Coordinators and the spec->manager map build vLLM objects; a test that uses them is
    # driving vLLM's own composition, which we do not adapt.
    for name in dir(vkc):
        if name.endswith("Coordinator") and name != "KVCacheCoordinator":
            setattr(vkc, name, _not_runnable(f"vLLM coordinator class {name}"))
    vkc.get_kv_cache_coordinator = _not_runnable("vLLM get_kv_cache_coordinator")


def _not_runnable(feature: str) -> Any:
    def refuse(*_args: Any, **_kwargs: Any) -> Any:
        raise NotRunnable(feature)
    return refuse


# -- pytest hooks ---------------------------------------------------------------------------
def pytest_configure(config: pytest.Config) -> None:
    """Install the adapters before any test module is imported."""
    if ADAPT:
        install()


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Both passes skip vLLM's GPU cleanup after each test (this machine has no GPU; vLLM's
    conftest lets CPU-only tests opt out with this marker)."""
    for item in items:
        item.add_marker(pytest.mark.skip_global_cleanup)


def pytest_runtest_setup(item: pytest.Item) -> None:
    """Start counting the adapted objects this test builds."""
    _touched[0] = 0


def _feature(excinfo: pytest.ExceptionInfo[BaseException]) -> str:
    exc = excinfo.value
    if isinstance(exc, NotRunnable):
        return exc.feature
    cause = exc
    while cause is not None:  # a NotRunnable wrapped by another exception
        if isinstance(cause, NotRunnable):
            return cause.feature
        cause = cause.__cause__ or cause.__context__  # type: ignore[assignment]
    frames = traceback.extract_tb(excinfo.tb)
    where = frames[-1] if frames else None
    loc = f" at {os.path.basename(where.filename)}:{where.name}" if where else ""
    msg = str(exc).splitlines()[0][:90] if str(exc) else ""
    return f"{type(exc).__name__}: {msg}{loc}"


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Any:
    """Record each test's outcome once (its first failing phase, else its call phase)."""
    outcome = yield
    report = outcome.get_result()
    if RESULTS is None:
        return
    if report.when != "call" and not (report.failed or report.skipped):
        return
    record: dict[str, Any] = {"nodeid": item.nodeid, "when": report.when,
                              "touched": _touched[0] > 0}
    if report.skipped:
        record["outcome"] = "skipped"
        record["feature"] = str(report.longrepr[-1] if isinstance(report.longrepr, tuple)
                                else report.longrepr)[:120]
    elif report.passed:
        record["outcome"] = "passed"
    elif call.excinfo is not None and call.excinfo.errisinstance(AssertionError):
        record["outcome"] = "failed"
        record["feature"] = _feature(call.excinfo)
    else:
        record["outcome"] = "not_runnable"
        record["feature"] = _feature(call.excinfo) if call.excinfo else "unknown"
    with open(RESULTS, "a") as f:
        f.write(json.dumps(record) + "\n")
