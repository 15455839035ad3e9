"""The pool's invariants, checked whole (docs/semantics.md#invariants): what tests and fuzzers
assert after every operation, never the service's hot path (a check is O(pool)).

Beyond the block pool's own (:meth:`BlockPool.check_invariants`): every group's block and
id tables agree and belong to registered requests; no block is in two groups' tables or
twice in one; each block's reference count is the number of tables holding it; free plus
used blocks are all blocks but the null one; and with no request registered nothing is
referenced.
"""

from __future__ import annotations

from collections.abc import Mapping

from cache_service.core.kv_cache_manager import KVCacheManager
from cache_service.core.request import Request


def check_pool_invariants(kv: KVCacheManager, requests: Mapping[str, Request],
                          pinned: Mapping[int, int] | None = None) -> None:
    """Raise AssertionError naming the broken invariant (``requests``: the pool's registry
    by id; ``pinned``: block id -> references prefix pins hold on it, core/pins.py)."""
    pins = pinned or {}
    pool = kv.pool
    pool.check_invariants()
    refs: dict[int, int] = {}
    owner_group: dict[int, int] = {}
    for gid, manager in enumerate(kv.coordinator.managers):
        assert set(manager.req_to_blocks) == set(manager.req_to_ids), \
            f"group {gid}: block and id tables out of sync"
        for rid, table in manager.req_to_blocks.items():
            assert rid in requests, \
                f"group {gid}: table of unregistered request {rid!r}"
            ids = manager.req_to_ids[rid]
            assert ids == [b.block_id for b in table], \
                f"group {gid}, request {rid!r}: id table {ids} != blocks"
            seen: set[int] = set()
            for block in table:
                if block.is_null:
                    continue
                assert block.block_id >= 0, \
                    f"a host placeholder (slot {-block.block_id - 1}) in request {rid!r}'s table"
                assert block.block_id not in seen, \
                    f"block {block.block_id} twice in request {rid!r}'s group-{gid} table"
                seen.add(block.block_id)
                assert owner_group.setdefault(block.block_id, gid) == gid, \
                    (f"block {block.block_id} is in tables of groups "
                     f"{owner_group[block.block_id]} and {gid}")
                assert pool.blocks.get(block.block_id) is block, \
                    f"block {block.block_id} in a table is not the pool's block"
                refs[block.block_id] = refs.get(block.block_id, 0) + 1
                if block.block_hash is not None:
                    assert block.group_id == gid, \
                        (f"block {block.block_id} cached for group {block.group_id} "
                         f"but held by group {gid}")
    used = 0
    for block in pool.blocks.values():
        if block.is_null:
            continue
        held = pins.get(block.block_id, 0)
        assert block.ref_cnt == refs.get(block.block_id, 0) + held, \
            (f"block {block.block_id}: ref_cnt {block.ref_cnt} != "
             f"{refs.get(block.block_id, 0)} tables + {held} pins holding it")
        used += block.ref_cnt > 0
    assert pool.get_num_free_blocks() + used == pool.num_blocks - 1, \
        (f"free {pool.get_num_free_blocks()} + used {used} != "
         f"num_blocks - 1 = {pool.num_blocks - 1}")
    if not requests and not pins:
        assert used == 0, f"{used} blocks still referenced with no request registered"
