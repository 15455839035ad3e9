"""What ``kvcache-ctl`` shows, as plain data (``--json`` prints it) and as rich tables.

Every ``*_data`` function turns client results into JSON-ready dicts; every ``*_table``
function renders such dicts. The live view (``top``) reuses :func:`pool_row`.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

from rich import box
from rich.table import Table

from cache_service.client import Event, PoolInfo, PoolStats, RequestState
from kvcache_common.api.kvcache.v1 import cache_service_pb2 as pb
from kvcache_common.enums import HASH_ALGOS, LAYER_KINDS, MISS_REASONS

Row = dict[str, Any]

#: Short names of the layer kinds, for narrow columns.
SHORT_KINDS = {"full_attention": "full", "sliding_window": "swa", "mamba": "mamba",
               "chunked_local_attention": "chunked", "cross_attention": "cross"}


def _table(title: str, **kwargs: Any) -> Table:
    """A compact table (80 columns go a long way) with its title on the left."""
    return Table(title=title, title_justify="left", box=box.SIMPLE_HEAD, **kwargs)


def hit_rate(stats: PoolStats) -> float:
    """Prefix-cache hit tokens / queried tokens since registration (0 before any query)."""
    return stats.prefix_cache_hits / stats.prefix_cache_queries if stats.prefix_cache_queries \
        else 0.0


def pool_row(info: PoolInfo, stats: PoolStats) -> Row:
    """One pool's usage. ``used`` counts blocks held by requests; ``free`` includes cached
    blocks no request holds (they are evictable); the null block counts nowhere."""
    usable = stats.num_blocks - 1
    return {"pool": info.pool_id, "blocks": stats.num_blocks,
            "used": usable - stats.num_free_blocks, "cached": stats.num_cached_blocks,
            "free": stats.num_free_blocks, "usage": stats.usage,
            "requests": stats.num_requests, "hit_rate": hit_rate(stats),
            "prefix_cache_queries": stats.prefix_cache_queries,
            "prefix_cache_hits": stats.prefix_cache_hits, "evictions": stats.evictions,
            "allocation_failures": stats.allocation_failures,
            "preemptions": stats.preemptions,
            "groups": [g.kind for g in info.groups],
            "last_event_sequence": stats.last_event_sequence}


def pools_table(rows: Sequence[Row]) -> Table:
    """One row per pool (the rows of :func:`pool_row`)."""
    table = _table(f"pools ({len(rows)})")
    for name in ("pool", "blocks", "used", "cached", "free", "usage", "hit", "reqs",
                 "evict", "groups"):
        table.add_column(name, justify="left" if name in ("pool", "groups") else "right",
                         no_wrap=name in ("pool", "groups"))
    for r in rows:
        table.add_row(r["pool"], str(r["blocks"]), str(r["used"]), str(r["cached"]),
                      str(r["free"]), f"{r['usage']:.1%}", f"{r['hit_rate']:.1%}",
                      str(r["requests"]), str(r["evictions"]), _kinds(r["groups"]))
    return table


def _kinds(kinds: Iterable[str]) -> str:
    """``['full_attention', 'full_attention', 'mamba']`` -> ``full_attention x2, mamba``."""
    counts: dict[str, int] = {}
    for kind in kinds:
        counts[kind] = counts.get(kind, 0) + 1
    return ", ".join(SHORT_KINDS.get(k, k) + ("" if n == 1 else f" x{n}")
                     for k, n in counts.items())


def pool_data(info: PoolInfo, stats: PoolStats) -> Row:
    """A pool's configuration, counters and per-group rows."""
    opts = info.raw.options
    groups = []
    for g in info.groups:
        cached = stats.num_cached_blocks_per_group
        groups.append({
            "group": g.index, "kind": g.kind, "layers": len(g.layer_names),
            "block_size": g.block_size, "sliding_window": g.sliding_window,
            "attention_chunk_size": g.attention_chunk_size,
            "mamba_cache_mode": g.mamba_cache_mode,
            "page_size_bytes": g.page_size_bytes,
            "cached_blocks": cached[g.index] if g.index < len(cached) else 0})
    return {**pool_row(info, stats), "incarnation": info.incarnation,
            "page_size_bytes": info.page_size_bytes,
            "scheduler_block_size": info.scheduler_block_size,
            "hash_block_size": info.hash_block_size,
            "max_model_len": opts.max_model_len,
            "enable_caching": opts.enable_caching if opts.HasField("enable_caching") else True,
            "hash_algo": HASH_ALGOS.name(opts.hash_algo) or "sha256",
            "session_block_quota": opts.session_block_quota,
            "group_stats": groups}


def pool_tables(data: Row) -> list[Table]:
    """The pool's fields table and its groups table."""
    head = _table(f"pool {data['pool']}", show_header=False)
    head.add_column("field")
    head.add_column("value", justify="right")
    for key in ("blocks", "used", "cached", "free", "usage", "requests", "hit_rate",
                "prefix_cache_queries", "prefix_cache_hits", "evictions",
                "allocation_failures", "preemptions", "max_model_len", "enable_caching",
                "hash_algo", "scheduler_block_size", "hash_block_size", "page_size_bytes",
                "session_block_quota", "incarnation", "last_event_sequence"):
        value = data[key]
        text = f"{value:.1%}" if key in ("usage", "hit_rate") else str(value)
        head.add_row(key.replace("_", " "), text)
    groups = _table("groups")
    for name in ("group", "kind", "layers", "block size", "window", "page bytes", "cached"):
        groups.add_column(name, justify="left" if name == "kind" else "right",
                          no_wrap=name == "kind")
    for g in data["group_stats"]:
        span = g["sliding_window"] or g["attention_chunk_size"]
        kind = g["kind"] + (f" ({g['mamba_cache_mode']})" if g["mamba_cache_mode"] else "")
        groups.add_row(str(g["group"]), kind, str(g["layers"]), str(g["block_size"]),
                       str(span) if span else "-", str(g["page_size_bytes"]),
                       str(g["cached_blocks"]))
    return [head, groups]


def request_data(pool_id: str, request_id: str, info: PoolInfo, state: RequestState) -> Row:
    """A request's status, token counts and block table per group, for ``kvcache-ctl request``."""
    kinds = [g.kind for g in info.groups]
    return {"pool": pool_id, "request": request_id, "status": state.status,
            "num_tokens": state.num_tokens, "num_computed_tokens": state.num_computed_tokens,
            "num_placeholder_tokens": state.num_placeholder_tokens,
            "num_block_hashes": state.num_block_hashes,
            "num_preemptions": state.num_preemptions,
            "tables": [{"group": i, "kind": kinds[i] if i < len(kinds) else "",
                        "blocks": sum(1 for b in t if b), "block_ids": t}
                       for i, t in enumerate(state.block_ids)]}


def request_tables(data: Row) -> list[Table]:
    """The request's fields table and its block table per group."""
    head = _table(f"request {data['request']} in pool {data['pool']}", show_header=False)
    head.add_column("field")
    head.add_column("value", justify="right")
    for key in ("status", "num_tokens", "num_computed_tokens", "num_placeholder_tokens",
                "num_block_hashes", "num_preemptions"):
        head.add_row(key.removeprefix("num_").replace("_", " "), str(data[key]))
    tables = _table("block tables (0 = the null block)")
    for name in ("group", "kind", "blocks", "block ids"):
        tables.add_column(name, justify="right" if name in ("group", "blocks") else "left")
    for t in data["tables"]:
        tables.add_row(str(t["group"]), t["kind"], str(t["blocks"]),
                       " ".join(map(str, t["block_ids"])) or "-")
    return [head, tables]


def peek_data(response: pb.PeekPrefixResponse, num_tokens: int) -> list[Row]:
    """Each pool's hit and per-group reach and miss reason of a PeekPrefix answer."""
    out = []
    for hit in response.hits:
        out.append({"pool": hit.pool_id, "prompt_tokens": num_tokens,
                    "hit_tokens": hit.hit_tokens, "groups": [{
                        "group": g.group_idx, "kind": LAYER_KINDS.name(g.kind),
                        "tokens": g.tokens, "blocks": g.blocks,
                        "miss_reason": MISS_REASONS.name(g.miss_reason),
                        "evicted_removals_ago": g.evicted_removals_ago,
                        "checkpoint_tokens": list(g.checkpoint_tokens)}
                        for g in hit.groups]})
    return out


def peek_tables(rows: Sequence[Row]) -> list[Table]:
    """One table per pool of :func:`peek_data`'s rows: reach and miss reason per group."""
    tables = []
    for r in rows:
        t = _table(f"pool {r['pool']}: {r['hit_tokens']} of {r['prompt_tokens']} prompt "
                  "tokens cached (a lookup's hit)")
        for name in ("group", "kind", "reach tokens", "blocks", "miss reason"):
            t.add_column(name, justify="right" if name in ("group", "reach tokens", "blocks")
                         else "left")
        for g in r["groups"]:
            reason = g["miss_reason"]
            if reason == "evicted":
                reason += f" ({g['evicted_removals_ago']} removals ago)"
            if g["checkpoint_tokens"]:
                reason += " checkpoints at " + ", ".join(map(str, g["checkpoint_tokens"][-4:]))
            t.add_row(str(g["group"]), g["kind"], str(g["tokens"]), str(g["blocks"]), reason)
        tables.append(t)
    return tables


def sessions_data(response: pb.ListSessionsResponse) -> list[Row]:
    """One row per session of a ListSessions answer, with its pools."""
    return [{"session": s.session_id_prefix, "client_name": s.client_name,
             "lease_remaining_seconds": round(s.lease_remaining_seconds, 3),
             "last_sequence": s.last_sequence, "expiring": s.expiring,
             "pools": [{"pool": p.pool_id, "requests": p.num_requests,
                        "request_ids": list(p.request_ids), "blocks_held": p.blocks_held,
                        "block_quota": p.block_quota} for p in s.pools]}
            for s in response.sessions]


def sessions_table(rows: Sequence[Row], show_requests: bool) -> Table:
    """One line per (session, pool); ``show_requests`` adds the request ids."""
    table = _table(f"sessions ({len(rows)}; ids shortened to 8 characters)")
    for name in ("session", "client", "lease left", "last seq", "pool", "requests",
                 "blocks / quota") + (("request ids",) if show_requests else ()):
        table.add_column(name, justify="right" if name in (
            "lease left", "last seq", "requests", "blocks / quota") else "left",
            no_wrap=name in ("session", "client", "pool"))
    for s in rows:
        lease = "expiring" if s["expiring"] else f"{s['lease_remaining_seconds']:.1f} s"
        pools = s["pools"] or [{"pool": "-", "requests": 0, "request_ids": [],
                                "blocks_held": 0, "block_quota": 0}]
        for i, p in enumerate(pools):
            quota = f"{p['blocks_held']} / {p['block_quota']}" if p["block_quota"] else "-"
            cells = [s["session"], s["client_name"] or "-", lease, str(s["last_sequence"])] \
                if i == 0 else ["", "", "", ""]
            cells += [p["pool"], str(p["requests"]), quota]
            if show_requests:
                cells.append(" ".join(p["request_ids"]) or "-")
            table.add_row(*cells)
    return table


def event_data(pool_id: str, e: Event) -> Row:
    """One event as a JSON-ready row (the pool and incarnation included)."""
    return {"pool": pool_id, "sequence": e.sequence, "incarnation": e.incarnation,
            "kind": e.kind, "group": e.group_idx, "group_kind": e.spec_kind,
            "block_hashes": e.block_hashes, "parent_block_hash": e.parent_block_hash,
            "start_token": e.start_token, "num_tokens": len(e.token_ids or ()),
            "block_size": e.block_size, "lora_name": e.lora_name,
            "prefix_lengths": e.prefix_lengths or []}


def event_line(row: Row) -> str:
    """One event as one readable line."""
    seq = f"#{row['sequence']:<6}"
    hashes = " ".join(f"{h:016x}" for h in row["block_hashes"][:3])
    if len(row["block_hashes"]) > 3:
        hashes += f" ... (+{len(row['block_hashes']) - 3})"
    if row["kind"] == "block_stored":
        end = row["start_token"] + row["num_tokens"]
        lora = f" lora={row['lora_name']}" if row["lora_name"] else ""
        return (f"{seq} stored   g{row['group']} {row['group_kind']:<15} "
                f"{len(row['block_hashes'])} block(s) tokens {row['start_token']}..{end}"
                f"{lora}  {hashes}")
    if row["kind"] == "block_removed":
        return f"{seq} removed  g{row['group']}  {hashes}"
    return f"{seq} cleared  every cached block"
