"""Prefix pins in the service: the records that take, renew, drop and expire them, their
TTLs, their owners, and the reaper that expires them.

The pool holds the pin itself (``cache_service.core.pins``: which blocks it keeps out of
eviction); this module keeps what the core knows nothing of, per pool and pin id, in
:class:`PinLease`: the owning session, whether the pin outlives it, and its expiry.

Determinism: ``apply`` reads no clock. The servicer turns ``ttl_seconds`` into an absolute
expiry (Unix time) when it accepts a call and the record carries it (``wal.PinPrefix``,
``wal.RenewPin``); the :class:`PinReaper` turns an expiry that passed into an
``ExpirePin`` record naming the expiry it saw, which drops the pin only if the pin still
has that expiry (a renewal that won the race makes it change nothing). So replaying a log
gives the same pins with the same expiries, and a restarted server expires the ones whose
time passed while it was down.

A pin owned by a session is dropped when the session ends (closed, or the first record of
its expiry) unless it was taken with ``outlive_session``; it then lives to its TTL.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import structlog

from cache_service import convert
from cache_service.core.errors import (
    InvalidArgument,
    KVCacheError,
    NotFound,
    ResourceExhausted,
    qualify,
)
from cache_service.core.pins import PinInfo
from cache_service.tenants import tenant_of
from kvcache_common.api.kvcache.internal.v1 import wal_pb2
from kvcache_common.api.kvcache.v1 import cache_service_pb2 as pb

if TYPE_CHECKING:
    from cache_service.state import ServiceState, WalRecord

_log = structlog.get_logger("cache_service.pins")

#: The longest TTL a pin may ask for (the server's --max-pin-ttl-seconds default).
MAX_PIN_TTL_SECONDS = 24 * 3600.0
#: How often the reaper looks for expired pins (seconds).
REAP_INTERVAL = 0.5


@dataclass
class PinLease:
    """The service's facts about one pin."""

    session_id: str
    outlive_session: bool
    expires_at: float


def check_ttl(ttl: float, limit: float) -> float:
    """``ttl`` if it is a positive finite number of seconds within ``limit``."""
    if not (math.isfinite(ttl) and 0 < ttl <= limit):
        raise InvalidArgument(f"ttl_seconds must be in (0, {limit:g}], got {ttl!r}",
                              field="ttl_seconds")
    return ttl


def pin_to_proto(info: PinInfo, expires_at: float) -> pb.PinInfo:
    """The protocol PinInfo of a core pin and its expiry."""
    return pb.PinInfo(pin_id=info.pin_id, prefix_tokens=info.prefix_tokens,
                      hit_tokens=info.hit_tokens, num_blocks=info.num_blocks,
                      growing=info.growing, expires_at_unix_seconds=expires_at)


class PinRecords:
    """The pin records' handlers of a :class:`ServiceState` (registered in its handler
    table) and the pins' leases, ``state.pin_leases[pool_id][pin_id]``."""

    def __init__(self, state: ServiceState) -> None:
        self.state = state

    def handlers(self) -> dict[str, Callable[[Any], Callable[[], Any]]]:
        """The state's prepare functions of the pin records, by record kind."""
        return {"pin_prefix": self._prepare_pin, "renew_pin": self._prepare_renew,
                "drop_pin": self._prepare_drop, "expire_pin": self._prepare_expire}

    @property
    def leases(self) -> dict[str, dict[str, PinLease]]:
        """Pool id -> pin id -> lease of every live pin."""
        return self.state.pin_leases

    def _lease(self, pool_id: str, pin_id: str) -> PinLease:
        lease = self.leases.get(pool_id, {}).get(pin_id)
        if lease is None:
            raise NotFound(f"unknown pin {pin_id!r:.80} (dropped, expired or never taken)",
                           field="pin_id")
        return lease

    def _timed_entry(self, record: wal_pb2.PinPrefix | wal_pb2.RenewPin) -> Any:
        """The pool entry of a record that sets a pin's lease, after checking the lease:
        NOT_FOUND for an unknown pool, INVALID_ARGUMENT for a TTL beyond the limit or an
        expiry that is not finite."""
        request = record.request
        entry = self.state.registry.get(request.pool_id)
        check_ttl(request.ttl_seconds, self.state.max_pin_ttl_seconds)
        if not math.isfinite(record.expires_at):
            raise InvalidArgument("expires_at must be finite", field="expires_at")
        return entry

    def _prepare_pin(self, record: wal_pb2.PinPrefix) -> Callable[[], pb.PinPrefixResponse]:
        state = self.state
        request = record.request
        entry = self._timed_entry(record)
        sid = request.session_id
        if sid:
            state.live_session(sid, tenant=state.record_tenant_name)
        elif request.outlive_session:
            raise InvalidArgument("outlive_session needs a session_id", field="outlive_session")
        pool = entry.pool
        checked = pool.check_pin(
            request.pin_id, list(request.token_ids) or None,
            block_hashes=list(request.block_hashes) or None,
            cache_salt=request.cache_salt or None, lora_name=request.lora_name or None,
            lora_path=request.lora_path or None, account=sid,
            mm_items=convert.mm_items_from_proto(request.mm_items),
            prompt_embeds_digests=list(request.prompt_embeds_digests))
        self._check_tenant_quota(request, pool, checked.new_charge)
        state.registry.fence(request.pool_id)

        def commit() -> pb.PinPrefixResponse:
            info = pool.add_pin(checked)
            self.leases.setdefault(request.pool_id, {})[request.pin_id] = PinLease(
                sid, request.outlive_session, record.expires_at)
            return pb.PinPrefixResponse(pin=pin_to_proto(info, record.expires_at))
        return commit

    def _check_tenant_quota(self, request: pb.PinPrefixRequest, pool: Any,
                            charge: int) -> None:
        """RESOURCE_EXHAUSTED (naming the prefix's field) if the pin would take the
        pool's tenant beyond the pinned-block quota the record carries: the blocks charged
        to pins over the tenant's pools on this replica plus this pin's charge."""
        limit = self.state.tenant_limits.max_pinned_blocks
        if not limit:
            return
        owner = tenant_of(request.pool_id)
        held = tenant_pinned_blocks(self.state, owner)
        if held + charge > limit:
            pool.refuse_pin()  # a statistic
            raise ResourceExhausted(
                f"tenant {owner!r} has {held} pinned blocks; this pin would add {charge}, "
                f"beyond its limit (max_pinned_blocks) of {limit}",
                field="block_hashes" if request.block_hashes and not request.token_ids
                else "token_ids")

    def _prepare_renew(self, record: wal_pb2.RenewPin) -> Callable[[], pb.RenewPinResponse]:
        state = self.state
        request = record.request
        entry = self._timed_entry(record)
        lease = self._lease(request.pool_id, request.pin_id)
        state.registry.fence(request.pool_id)

        def commit() -> pb.RenewPinResponse:
            lease.expires_at = record.expires_at
            info = entry.pool.pin_info(request.pin_id)
            return pb.RenewPinResponse(pin=pin_to_proto(info, lease.expires_at))
        return commit

    def _prepare_drop(self, request: pb.DropPinRequest) -> Callable[[], pb.DropPinResponse]:
        state = self.state
        entry = state.registry.get(request.pool_id)
        lease = self._lease(request.pool_id, request.pin_id)
        state.registry.fence(request.pool_id)

        def commit() -> pb.DropPinResponse:
            info = self._drop(entry, request.pool_id, request.pin_id)
            return pb.DropPinResponse(pin=pin_to_proto(info, lease.expires_at))
        return commit

    def _prepare_expire(self, record: wal_pb2.ExpirePin
                        ) -> Callable[[], pb.DropPinResponse]:
        state = self.state
        entry = state.registry.get(record.pool_id)
        lease = self.leases.get(record.pool_id, {}).get(record.pin_id)

        def commit() -> pb.DropPinResponse:
            if lease is None or lease.expires_at != record.expires_at:
                return pb.DropPinResponse()  # dropped or renewed meanwhile: nothing to do
            info = self._drop(entry, record.pool_id, record.pin_id)
            return pb.DropPinResponse(pin=pin_to_proto(info, lease.expires_at))
        return commit

    def _drop(self, entry: Any, pool_id: str, pin_id: str) -> PinInfo:
        info: PinInfo = entry.pool.drop_pin(pin_id)
        entry.flush_events()
        pins = self.leases[pool_id]
        del pins[pin_id]
        if not pins:
            del self.leases[pool_id]
        return info

    # -- called by the state's own commits -----------------------------------------------

    def session_ended(self, session_id: str) -> int:
        """Drops the pins the session owns that do not outlive it; how many."""
        dropped = 0
        for pool_id in list(self.leases):
            owned = [pin for pin, lease in self.leases[pool_id].items()
                     if lease.session_id == session_id and not lease.outlive_session]
            if not owned:
                continue
            entry = self.state.registry.entry(pool_id)
            for pin_id in owned:
                self._drop(entry, pool_id, pin_id)
                dropped += 1
        return dropped

    def expiry(self, pool_id: str, pin_id: str) -> float:
        """The pin's expiry (Unix time); NotFound naming pin_id if it has none."""
        return self._lease(pool_id, pin_id).expires_at

    def due(self, now: float) -> list[tuple[str, str, float]]:
        """(pool id, pin id, expiry) of every pin whose expiry is at or before ``now``."""
        registry = self.state.registry
        return [(pool_id, pin_id, lease.expires_at)
                for pool_id, pins in self.leases.items() if pool_id in registry
                for pin_id, lease in pins.items() if lease.expires_at <= now]


def tenant_pinned_blocks(state: ServiceState, tenant: str) -> int:
    """The pinned blocks charged to pins over ``tenant``'s pools in ``state``."""
    return sum(sum(e.pool.pinned_blocks_by_account().values())
               for e in state.registry if tenant_of(e.pool_id) == tenant)


Submit = Callable[["WalRecord"], Awaitable[object]]


class PinReaper:
    """Expires pins whose TTL ran out, one ``ExpirePin`` record each, through ``submit``
    (the servicer's path: logged, applied, events published)."""

    def __init__(self, records: PinRecords, submit: Submit, *,
                 clock: Callable[[], float] = time.time,
                 interval: float = REAP_INTERVAL) -> None:
        self.records = records
        self.submit = submit
        self.clock = clock
        self.interval = interval
        self.expired = 0  # pins expired (a statistic)

    async def expire_due(self) -> int:
        """Expires every pin due now; how many were dropped."""
        from cache_service.state import WalRecord
        dropped = 0
        for pool_id, pin_id, expires_at in self.records.due(self.clock()):
            record = WalRecord(expire_pin=wal_pb2.ExpirePin(
                pool_id=pool_id, pin_id=pin_id, expires_at=expires_at))
            try:
                answer: Any = await self.submit(record)
            except KVCacheError as exc:  # e.g. the pool moved away, a full data dir
                _log.warning("pin_expiry_failed", pool=pool_id, pin=pin_id,
                             error=str(qualify(exc, "expire_pin")))
                continue
            if answer.HasField("pin"):
                dropped += 1
        self.expired += dropped
        return dropped

    async def run(self) -> None:
        """Runs until cancelled."""
        while True:
            await asyncio.sleep(self.interval)
            await self.expire_due()
