"""Where cluster state lives in etcd, and which replica a pool is placed on.

Key layout (all under ``/kvcache/<cluster-name>/``; docs/deployment.md shows it too):

- ``members/<member-id>`` -> JSON ``{"address": "host:port", "lease": <lease id>}``, put
  under the member's lease: it disappears when the replica leaves or its lease expires.
- ``owners/<pool-id>`` -> JSON ``{"member": ..., "address": ...}``, put under the OWNER's
  lease; its mod revision is the pool's fencing token (a new owner always has a larger one).
  A pool handed over by a leaving replica also names ``"from"`` (that replica) and
  ``"handoff"`` (its hand-over file, relative to the shared data root; see
  :mod:`~cache_service.cluster.handoff`).
- ``pools/<pool-id>`` -> the ``kvcache.v1.RegisterPoolRequest`` the pool was registered
  with (binary protobuf), no lease: it lives until DeletePool, so a new owner can rebuild
  the pool when the old owner is gone.
- ``holders/<pool-id>`` -> the member id of the pool's last owner, no lease: written with
  every ownership, so the next owner knows whose data directory (on shared storage) holds
  the pool's state after that owner died.
- ``syncs/<pool-id>`` -> JSON ``{"owner": ..., "lease": ..., "epoch": ..., "standby": ...}``,
  no lease, written by the pool's owner only in a transaction conditioned on its fencing
  token (replication, :class:`SyncStandby`): the standby that holds every write the owner
  (that member, lease and replication epoch) answered, or ``null`` once the owner answers
  without one. A standby promotes its copy only if this key names it.

Placement is rendezvous (highest-random-weight) hashing of the pool id over the live
members: every replica computes the same owner from the same member set, and a member
leaving moves only the pools it owned.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable
from dataclasses import dataclass


@dataclass(frozen=True)
class KeyLayout:
    """The etcd keys of one cluster."""

    cluster: str

    @property
    def root(self) -> bytes:
        """The prefix of every key of this cluster, ``/kvcache/<cluster>/``."""
        return f"/kvcache/{self.cluster}/".encode()

    def member(self, member_id: str) -> bytes:
        """The key of a live member (under its lease)."""
        return self.root + b"members/" + member_id.encode()

    def owner(self, pool_id: str) -> bytes:
        """The key naming the pool's owner (under the owner's lease)."""
        return self.root + b"owners/" + pool_id.encode()

    def pool(self, pool_id: str) -> bytes:
        """The key of the pool's registration (no lease: outlives its owners)."""
        return self.root + b"pools/" + pool_id.encode()

    def holder(self, pool_id: str) -> bytes:
        """The key naming the replica that last held the pool's state (no lease)."""
        return self.root + b"holders/" + pool_id.encode()

    def sync(self, pool_id: str) -> bytes:
        """The key naming the pool's in-sync standby (no lease; written by the owner)."""
        return self.root + b"syncs/" + pool_id.encode()

    def replication_key(self) -> bytes:
        """The key holding the cluster's replication secret (no lease; created once by the
        first replica that joins): only processes that can read etcd can replicate."""
        return self.root + b"replication-key"

    def parse(self, key: bytes) -> tuple[str, str] | None:
        """``(kind, name)`` of a key under the root (kind: members / owners / pools /
        holders)."""
        if not key.startswith(self.root):
            return None
        kind, _, name = key[len(self.root):].decode().partition("/")
        return (kind, name) if name else None


@dataclass(frozen=True)
class Owner:
    """An ``owners/<pool>`` entry: who owns the pool, under which lease, since when."""

    member: str
    address: str
    lease: int
    token: int  # the key's mod revision: the fencing token
    #: Handed over: the replica that left it, and its hand-over file (relative path).
    source: str | None = None
    handoff: str | None = None

    @staticmethod
    def encode(member: str, address: str, *, source: str | None = None,
               handoff: str | None = None) -> bytes:
        """The value of an ``owners/<pool>`` key (with ``source`` and ``handoff`` for a
        hand-over)."""
        data = {"member": member, "address": address}
        if source is not None and handoff is not None:
            data.update({"from": source, "handoff": handoff})
        return json.dumps(data).encode()

    @classmethod
    def decode(cls, value: bytes, lease: int, token: int) -> Owner:
        """The Owner of an ``owners/<pool>`` value, read with the key's ``lease`` and mod
        revision (``token``)."""
        data = json.loads(value)
        source, handoff = data.get("from"), data.get("handoff")
        return cls(str(data["member"]), str(data["address"]), lease, token,
                   str(source) if source is not None else None,
                   str(handoff) if handoff is not None else None)


@dataclass(frozen=True)
class SyncStandby:
    """A ``syncs/<pool>`` entry: while it stands, every write ``owner`` (under ``lease``,
    replication stream ``epoch``) answered for the pool was acknowledged by ``standby``
    (None: the owner answers without a standby)."""

    owner: str
    lease: int
    epoch: str
    standby: str | None

    def encode(self) -> bytes:
        """The value of a ``syncs/<pool>`` key."""
        return json.dumps({"owner": self.owner, "lease": self.lease, "epoch": self.epoch,
                           "standby": self.standby}).encode()

    @classmethod
    def decode(cls, value: bytes) -> SyncStandby:
        """The entry of a ``syncs/<pool>`` value (raises ValueError/KeyError/TypeError
        when it is malformed)."""
        data = json.loads(value)
        standby = data["standby"]
        return cls(str(data["owner"]), int(data["lease"]), str(data["epoch"]),
                   str(standby) if standby is not None else None)


def rendezvous_owner(pool_id: str, members: Iterable[str]) -> str | None:
    """The member with the highest hash of (member, pool); None without members."""
    best, best_score = None, b""
    for member in members:
        score = hashlib.blake2b(f"{member}\0{pool_id}".encode(), digest_size=8).digest()
        if best is None or (score, member) > (best_score, best):
            best, best_score = member, score
    return best
