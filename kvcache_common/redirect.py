"""Trailing-metadata keys of a cluster redirect, shared by the server and the client.

A replica that does not own a pool answers calls on it with UNAVAILABLE (nothing was
applied) plus these trailing metadata entries naming the owner; a client retries the same
call there. docs/protocol.md ("Cluster mode") describes it for clients in other languages.
"""

from __future__ import annotations

from collections.abc import Iterable

#: ``host:port`` of the replica that owns the pool.
OWNER_ADDRESS_KEY = "x-kvcache-owner"
#: The owner's member id (its name in etcd), for logs.
OWNER_MEMBER_KEY = "x-kvcache-owner-member"


def owner_from_metadata(metadata: Iterable[tuple[str, str | bytes]] | None) -> str | None:
    """The owner address in a call's trailing metadata (pairs or grpc.aio.Metadata), or
    None when the status is not a redirect."""
    for key, value in metadata or ():
        if key == OWNER_ADDRESS_KEY:
            return value.decode() if isinstance(value, bytes) else str(value)
    return None
