"""Server bootstrap: ``kvcache-server`` / ``python -m cache_service``.

One asyncio event loop runs the gRPC server (grpc.aio), the /metrics endpoint and owns every
pool, so allocator state needs no locks. Lifecycle:

1. listen (``--port 0`` picks a free port), health SERVING, then log ONE JSON line
   ``{"event": "serving", "port": ..., "metrics_port": ...}`` at any ``--log-level`` — it
   means "health is SERVING", as the executor's does; supervisors and tests wait for it. A
   port in use ends the process at once: exit code 2 and one line on stderr;
2. on SIGTERM/SIGINT: health goes NOT_SERVING, event streams end, new calls get
   UNAVAILABLE ("retry elsewhere"), in-flight calls get ``drain_seconds`` to finish, then the
   server stops (cancelling health watchers and anything still running); exit code 0.
"""

from __future__ import annotations

import asyncio
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import grpc
import structlog

from cache_service.core._variant import build_info as core_build_info
from cache_service.durability import (
    DataDir,
    new_instance_id,
    open_data_dir,
    read_data_dir,
)
from cache_service.errors import DataDirError
from cache_service.fairness import keep_heap_frozen
from cache_service.interceptors import CallInterceptor
from cache_service.leases import LeaseKeeper
from cache_service.metrics import ClusterCollector, DurabilityCollector, new_registry
from cache_service.registry import PoolRegistry
from cache_service.servicer import CacheServicer
from cache_service.settings import Settings, parse_settings
from cache_service.state import ServiceState, WalRecord, replay_record
from cache_service.tenants import TenantsFileError
from kvcache_common.api.kvcache.v1 import cache_service_pb2 as pb
from kvcache_common.api.kvcache.v1 import cache_service_pb2_grpc as pb_grpc
from kvcache_common.cli import exit_with_error, setting_name
from kvcache_common.listen import ports_in_use
from kvcache_common.logs import configure_logging, lifecycle
from kvcache_common.serving import ListenError, start_server

SERVICE_NAME = pb.DESCRIPTOR.services_by_name["CacheService"].full_name
PROG = "kvcache-server"

log = structlog.get_logger("cache_service.server")


def grpc_options(settings: Settings) -> list[tuple[str, int]]:
    """Channel arguments set explicitly (message sizes, keepalive, ping policy, streams per
    connection); docs/deployment.md explains each choice."""
    return [
        ("grpc.max_receive_message_length", settings.max_message_bytes),
        ("grpc.max_send_message_length", settings.max_message_bytes),
        # The server pings idle connections to find dead peers (and keeps NATs open).
        ("grpc.keepalive_time_ms", settings.keepalive_time_ms),
        ("grpc.keepalive_timeout_ms", settings.keepalive_timeout_ms),
        ("grpc.keepalive_permit_without_calls", 1),
        # Enforcement of client pings: faster than this without data is a strike, and
        # after max_ping_strikes the connection gets GOAWAY(too_many_pings). Set
        # explicitly because the default (5 min) surprises clients with keepalive on.
        ("grpc.http2.min_ping_interval_without_data_ms", settings.min_ping_interval_ms),
        ("grpc.http2.max_ping_strikes", 2),
        ("grpc.http2.max_pings_without_data", 0),
        # One connection cannot open unbounded concurrent calls (each holds a task and
        # its request); further streams wait for a slot at the HTTP/2 level.
        ("grpc.max_concurrent_streams", settings.max_concurrent_streams),
        ("grpc.so_reuseport", 0),
    ]


def new_state(settings: Settings, instance_id: str, *, cluster: bool = True) -> ServiceState:
    """An empty service state with this run's limits; in cluster mode (unless ``cluster``
    is False: a read-only look at another replica's directory) its registry fences pool
    lookups by ownership."""
    registry_class = PoolRegistry
    if settings.etcd_endpoints and cluster:  # pool lookups check ownership (fencing)
        from cache_service.cluster.registry import ClusterRegistry
        registry_class = ClusterRegistry
    return ServiceState(registry_class(settings.event_buffer, instance_id=instance_id,
                                       max_total_blocks=settings.max_total_blocks),
                        lease_ttl_seconds=settings.lease_ttl_seconds,
                        max_ops_per_step=settings.max_ops_per_step,
                        max_tokens_per_step=settings.max_tokens_per_step)


def open_state(settings: Settings) -> tuple[ServiceState, DataDir | None]:
    """The service state: empty and in memory without ``--data-dir`` (says so in one log
    line), else recovered from the directory, which then logs every accepted record."""
    directory = settings.state_dir
    if directory is None:
        lifecycle().info("in_memory", detail="no --data-dir: pools, requests and sessions "
                         "live in memory only and a restart loses them (pools come back "
                         "with new incarnations)")
        # Every start is a new instance: its pools get new incarnations.
        return new_state(settings, new_instance_id()), None
    data_dir, state = open_data_dir(
        directory, new_state=lambda instance_id: new_state(settings, instance_id),
        apply=replay_record, fsync=settings.fsync, fsync_interval=settings.fsync_interval_ms / 1000,
        snapshot_every=settings.snapshot_every)
    # Settings are not state: this run's flags win over the ones the snapshot was taken with.
    state.lease_ttl_seconds = settings.lease_ttl_seconds
    state.max_pin_ttl_seconds = settings.max_pin_ttl_seconds
    state.max_ops_per_step = settings.max_ops_per_step
    state.max_tokens_per_step = settings.max_tokens_per_step
    state.registry.max_total_blocks = settings.max_total_blocks
    state.durability = data_dir
    rec = data_dir.recovery
    lifecycle().info("recovered", data_dir=str(directory), fsync=settings.fsync,
                     pools=len(state.registry), sessions=len(state.sessions),
                     snapshot_index=rec.snapshot_index, records_replayed=rec.records_replayed,
                     records_rejected=rec.records_rejected,
                     torn_bytes_dropped=rec.torn_bytes_dropped,
                     snapshot_seconds=round(rec.snapshot_seconds, 3),
                     replay_seconds=round(rec.replay_seconds, 3),
                     cpu_seconds=round(rec.cpu_seconds, 3),
                     replay_records_per_second=round(rec.replay_rate))
    return state, data_dir


def read_peer_state(settings: Settings, directory: Path, pool_id: str) -> bytes:
    """Pool ``pool_id`` as another replica's data directory holds it (``export_pool``),
    read without writing there (cluster mode, shared storage: a dead replica's pools are
    taken over from it). A pool that replica dropped (it saw the pool owned elsewhere, e.g.
    it came back after its lease expired) is answered as it was just before the drop: the
    drop is that replica giving the pool up, never a deletion for its successor (a client's
    DeletePool removes the pool's etcd keys first, so nobody takes a deleted pool over)."""
    before_drop: list[bytes] = []

    def apply(state: ServiceState, payload: bytes) -> None:
        record = WalRecord.FromString(payload)
        if (record.WhichOneof("mutation") == "delete_pool"
                and record.delete_pool.pool_id == pool_id and pool_id in state.registry):
            before_drop[:] = [state.export_pool(pool_id)]
        state.apply(record)

    state = read_data_dir(directory, new_state=lambda instance_id: new_state(
        settings, instance_id, cluster=False), apply=apply)
    if pool_id not in state.registry and before_drop:
        return before_drop[0]
    return state.export_pool(pool_id)


async def serve(settings: Settings) -> int:
    """Runs the server until SIGTERM/SIGINT; returns the exit code."""
    busy = ports_in_use(settings.host, settings.port, settings.metrics_port)
    if busy:  # "--port: ...": named as the user set it (flag or environment variable)
        flag, _, why = busy.partition(": ")
        return exit_with_error(PROG, f"{setting_name(settings, flag[2:].replace('-', '_'))}: "
                               f"{why}", 2)
    # Everything read from files comes first: a mistake there touches no data directory.
    try:
        tenants = settings.tenant_table()
    except TenantsFileError as exc:
        return exit_with_error(PROG, f"{setting_name(settings, 'auth_tokens_file')}: "
                               f"{exc}", 2)
    creds = None
    if settings.tls_cert is not None and settings.tls_key is not None:
        pem: dict[str, bytes] = {}
        for name in ("tls_key", "tls_cert"):
            path = getattr(settings, name)
            try:
                pem[name] = path.read_bytes()
            except OSError as exc:
                return exit_with_error(PROG, f"{setting_name(settings, name)}: cannot read "
                                       f"{path}: {exc.strerror or exc}", 2)
        creds = grpc.ssl_server_credentials([(pem["tls_key"], pem["tls_cert"])])
    try:
        state, data_dir = open_state(settings)
    except DataDirError as exc:  # the directory, its log or its snapshot
        # A start error like any other: one line on stderr naming the setting, exit 2.
        where = "shared_data_root" if settings.shared_data_root is not None else "data_dir"
        return exit_with_error(PROG, f"{setting_name(settings, where)}: {exc}", 2)
    registry = state.registry
    leases = LeaseKeeper(state.lease_ttl_seconds)
    node = None
    if settings.etcd_endpoints:  # cluster mode: the registry checks pool ownership
        from cache_service.cluster.node import ClusterNode
        node = ClusterNode(settings, state, leases=leases, read_peer=read_peer_state)
    prom_registry, rpc_metrics = new_registry(registry.stats, lambda: state.counters)
    prom_registry.register(DurabilityCollector(state))
    if node is not None:
        prom_registry.register(ClusterCollector(node))
    interceptor = CallInterceptor(rpc_metrics, tenants,
                                  unauthenticated=settings.unauthenticated_tenant())
    servicer = CacheServicer(state, max_peek_tokens=settings.max_peek_tokens, leases=leases,
                             cluster=node, step_observer=rpc_metrics.observe_step)
    if node is not None and node.replicator is not None:
        node.replicator.gate = servicer.gate  # a standby's snapshot waits for sliced calls
    try:
        listener = await start_server(
            service_name=SERVICE_NAME,
            add_servicers=lambda server: _add_servicers(server, servicer, node),
            host=settings.host, port=settings.port, options=grpc_options(settings),
            interceptors=[interceptor], credentials=creds,
            # Cluster mode: SERVING once a member, so readiness implies it can own pools.
            serving=node is None, metrics=prom_registry, metrics_port=settings.metrics_port)
    except ListenError as exc:
        _close_quietly(data_dir)
        return exit_with_error(PROG, str(exc), 2)
    if node is not None:
        try:
            await node.join(listener.port)
        except (TimeoutError, ConnectionError) as exc:
            await listener.server.stop(0)
            _close_quietly(data_dir)
            return exit_with_error(PROG, f"{setting_name(settings, 'etcd_endpoints')}: "
                                   f"cannot join the cluster, etcd at "
                                   f"{settings.etcd_endpoints} is unreachable ({exc})", 2)
        await listener.mark_serving()  # the servicer acts as a member from here on
    reaper = asyncio.create_task(servicer.reaper.run(), name="lease-reaper")
    pin_reaper = asyncio.create_task(servicer.pin_reaper.run(), name="pin-reaper")
    freezer = asyncio.create_task(keep_heap_frozen(), name="gc-freezer")
    core = core_build_info()  # which allocator core runs: pure Python or mypyc-compiled
    lifecycle().info("core", variant=core["variant"], reason=core["reason"])
    lifecycle().info("serving", host=settings.host, port=listener.port,
                     metrics_port=listener.metrics_port, tls=settings.tls_cert is not None,
                     auth=tenants is not None,
                     tenants=len(tenants.tenants) if tenants is not None else 1,
                     lease_ttl_seconds=settings.lease_ttl_seconds,
                     member=node.membership.member_id if node and node.membership else None)

    await listener.wait()
    reaper.cancel()  # no lease expires while draining: clients cannot renew then
    pin_reaper.cancel()
    freezer.cancel()

    def refuse_new() -> None:
        # New calls now get UNAVAILABLE at once; open Step streams end at their next
        # message; event subscriptions end cleanly.
        interceptor.start_draining()
        servicer.draining = True
        registry.close()

    async def wait_idle(grace_seconds: float) -> None:
        if node is not None and data_dir is not None:
            # Shared data root: seal the log and hand each pool to its successor first,
            # so pools move at once instead of after the drain.
            await node.hand_over(data_dir.seal, servicer.gate.wait_idle)
        await interceptor.wait_idle(grace_seconds)
        if node is not None:
            # After the drain, so that no write races the successor's takeover.
            await node.leave()

    def close() -> None:
        if data_dir is not None:
            # A final snapshot: the next start loads it instead of replaying the log.
            data_dir.close(state)

    await listener.shutdown(settings.drain_seconds, refuse_new=refuse_new,
                            wait_idle=wait_idle, close=close)
    return 0


def _add_servicers(server: grpc.aio.Server, servicer: CacheServicer, node: Any) -> None:
    pb_grpc.add_CacheServiceServicer_to_server(servicer, server)
    if node is not None:  # cluster mode: replica-to-replica services too
        node.add_servicers(server)


def _close_quietly(data_dir: DataDir | None) -> None:
    """Releases a data directory opened before a later start error (no final snapshot:
    nothing was served)."""
    if data_dir is not None:
        data_dir.close()


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point: parse flags/env, configure logging, serve."""
    settings = parse_settings(argv)
    configure_logging(settings.log_level)
    return asyncio.run(serve(settings))


if __name__ == "__main__":
    sys.exit(main())
