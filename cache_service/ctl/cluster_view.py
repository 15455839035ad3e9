"""``kvcache-ctl cluster``: the cluster as etcd holds it (read only).

One consistent listing of ``/kvcache/<cluster>/`` (see :mod:`cache_service.cluster.keys`):
the live members, and per registered pool its owner, the owner's fencing token (the mod
revision of ``owners/<pool>``), the member whose data directory last held it, and the
member rendezvous placement picks among the live ones (where it goes if the owner leaves).
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

from rich.table import Table

from cache_service.cluster.keys import KeyLayout, Owner, rendezvous_owner


class EtcdUnreachable(Exception):
    """No endpoint answered."""


def _parse_endpoints(endpoints: str) -> list[tuple[str, int]]:
    from cache_service.cluster.etcd import parse_endpoints

    return parse_endpoints(endpoints)


async def _listing(endpoints: str, timeout: float, keys: KeyLayout) -> list[Any]:
    import aetcd

    from cache_service.cluster.etcd import ETCD_ERRORS

    errors = []
    for host, port in _parse_endpoints(endpoints):
        client = aetcd.Client(host=host, port=port, timeout=int(max(1, timeout)))
        try:
            return list(await asyncio.wait_for(client.get_prefix(keys.root), timeout))
        except ETCD_ERRORS as exc:
            errors.append(f"{host}:{port}: {type(exc).__name__}")
        finally:
            try:
                await asyncio.wait_for(client.close(), timeout)
            except ETCD_ERRORS + (RuntimeError, ValueError):
                pass
    raise EtcdUnreachable("no etcd endpoint answered (" + "; ".join(errors) + ")")


def cluster_data(endpoints: str, cluster: str, timeout: float) -> dict[str, Any]:
    """Members and pools of ``cluster``; raises ValueError (bad endpoints) or
    EtcdUnreachable."""
    keys = KeyLayout(cluster)
    members: dict[str, dict[str, Any]] = {}
    owners: dict[str, Owner] = {}
    holders: dict[str, str] = {}
    pools: set[str] = set()
    for kv in asyncio.run(_listing(endpoints, timeout, keys)):
        parsed = keys.parse(kv.key)
        if parsed is None:
            continue
        kind, name = parsed
        if kind == "members":
            members[name] = {"member": name, "address": json.loads(kv.value)["address"],
                             "lease": f"{kv.lease:x}"}
        elif kind == "owners":
            owners[name] = Owner.decode(kv.value, kv.lease, kv.mod_revision)
        elif kind == "holders":
            holders[name] = kv.value.decode()
        elif kind == "pools":
            pools.add(name)
    rows = []
    for pool in sorted(pools | set(owners)):
        owner = owners.get(pool)
        rows.append({"pool": pool, "owner": owner.member if owner else None,
                     "address": owner.address if owner else None,
                     "fencing_token": owner.token if owner else None,
                     "owner_lease": f"{owner.lease:x}" if owner else None,
                     "last_holder": holders.get(pool),
                     "placement": rendezvous_owner(pool, members),
                     "registered": pool in pools})
    return {"cluster": cluster, "members": sorted(members.values(), key=lambda m: m["member"]),
            "pools": rows}


def cluster_tables(data: dict[str, Any]) -> list[Table]:
    """The members table and the pools table of :func:`cluster_data`'s answer."""
    members = Table(title=f"cluster {data['cluster']}: {len(data['members'])} member(s)",
                    title_justify="left")
    for name in ("member", "address", "lease"):
        members.add_column(name)
    for m in data["members"]:
        members.add_row(m["member"], m["address"], m["lease"])
    pools = Table(title=f"pools ({len(data['pools'])}); fencing token = mod revision of "
                  "owners/<pool>", title_justify="left")
    for name in ("pool", "owner", "address", "fencing token", "last holder", "placement"):
        pools.add_column(name, justify="right" if name == "fencing token" else "left")
    for p in data["pools"]:
        owner = p["owner"] or "[red]none (failing over)[/red]"
        pools.add_row(p["pool"], owner, p["address"] or "-", str(p["fencing_token"] or "-"),
                      p["last_holder"] or "-", p["placement"] or "-")
    return [members, pools]
