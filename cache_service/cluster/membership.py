"""Membership: this replica's etcd lease and member key.

The replica registers ``members/<id>`` under a lease of ``ttl`` seconds and renews it every
``ttl / 3`` seconds. :attr:`Membership.valid_until` is the local (monotonic) time up to
which the lease is known to be alive: the send time of the last renewal etcd confirmed plus
the TTL it granted. etcd counts the TTL from when it *received* that renewal, so the lease
never expires in etcd before ``valid_until`` passes here (clock rates assumed equal): while
this returns True, no other replica can have taken over this replica's pools.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Callable, Coroutine
from typing import Any

import structlog

from cache_service.cluster.etcd import ETCD_ERRORS, RETRY_BACKOFF, Etcd, stray_cancel
from cache_service.cluster.keys import KeyLayout

_log = structlog.get_logger("cache_service.cluster")


class Membership:
    """Join, keep alive, leave. ``on_new_lease`` runs after the lease had to be granted
    again (it expired in etcd, e.g. after a partition longer than the TTL)."""

    def __init__(self, etcd: Etcd, keys: KeyLayout, member_id: str, address: str,
                 ttl: int) -> None:
        self.etcd = etcd
        self.keys = keys
        self.member_id = member_id
        self.address = address
        self.ttl = ttl
        self.lease_id = 0
        self.valid_until = 0.0
        self.on_new_lease: Callable[[], Coroutine[Any, Any, None]] | None = None
        self._task: asyncio.Task | None = None
        self._reacting: asyncio.Task | None = None

    def lease_valid(self) -> bool:
        """True while the lease is certainly alive in etcd (see the module docstring)."""
        return time.monotonic() < self.valid_until

    async def join(self, deadline: float) -> None:
        """Grants a lease and puts the member key, retrying over the endpoints until
        ``deadline`` (monotonic); then keeps the lease alive in the background."""
        attempt = 0
        while True:
            client = self.etcd.client
            try:
                await self._grant()
                break
            except ETCD_ERRORS as exc:
                if time.monotonic() > deadline:
                    raise ConnectionError(f"cannot reach etcd at {self.etcd.endpoints}: "
                                          f"{exc}") from None
                _log.warning("etcd_unreachable", endpoint=self.etcd.endpoint, error=str(exc))
                await self.etcd.reconnect(client)
                await asyncio.sleep(RETRY_BACKOFF.delay(attempt))
                attempt += 1
        self._task = asyncio.create_task(self._keep_alive(), name="etcd-keepalive")

    async def _grant(self) -> None:
        started = time.monotonic()
        lease = await self.etcd.client.lease(self.ttl)
        value = json.dumps({"address": self.address, "lease": lease.id}).encode()
        await self.etcd.client.put(self.keys.member(self.member_id), value, lease=lease.id)
        self.lease_id = lease.id
        self.valid_until = started + lease.ttl
        _log.info("member_joined", member=self.member_id, address=self.address,
                  lease=lease.id, ttl=lease.ttl, endpoint=self.etcd.endpoint)

    async def _keep_alive(self) -> None:
        period = self.ttl / 3
        while True:
            started = time.monotonic()
            client = self.etcd.client
            try:
                reply = await asyncio.wait_for(client.refresh_lease(self.lease_id), period)
                if reply is not None and reply.TTL > 0:
                    self.valid_until = started + reply.TTL
                else:
                    # The lease is gone in etcd: our keys (and pool ownerships) went with it.
                    self.valid_until = 0.0
                    _log.warning("lease_lost", member=self.member_id, lease=self.lease_id)
                    await asyncio.wait_for(self._grant(), period)
                    if self.on_new_lease is not None:
                        # In a task of its own: acting on the new lease (placement, which
                        # may wait for etcd) must never hold up its renewals.
                        self._reacting = asyncio.create_task(self.on_new_lease(),
                                                             name="etcd-new-lease")
            except (Exception, asyncio.CancelledError) as exc:  # noqa: BLE001 - never stop
                if isinstance(exc, asyncio.CancelledError) and not stray_cancel():
                    raise
                if not isinstance(exc, ETCD_ERRORS + (asyncio.CancelledError,)):
                    # e.g. a call racing the close of a replaced client
                    _log.exception("keepalive_failed")
                _log.warning("etcd_unreachable", endpoint=self.etcd.endpoint, error=str(exc),
                             lease_valid=self.lease_valid())
                await self.etcd.reconnect(client)
            # A timer, not synchronization: the next renewal is due a third of a TTL later.
            await asyncio.sleep(max(0.0, period - (time.monotonic() - started)))

    async def leave(self) -> None:
        """Stops renewing and revokes the lease: the member key and every ownership key
        of this replica disappear at once, so other replicas take the pools over now."""
        for task in (self._task, self._reacting):
            if task is not None:
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)
        self.valid_until = 0.0
        try:
            await asyncio.wait_for(self.etcd.client.revoke_lease(self.lease_id),
                                   self.etcd.timeout)
            _log.info("member_left", member=self.member_id)
        except ETCD_ERRORS as exc:
            _log.warning("leave_failed", member=self.member_id, error=str(exc))
