"""Prometheus metrics: gRPC-standard per-RPC series, per-pool gauges, and the /metrics
HTTP endpoint.

The endpoint is served from the server's own asyncio loop (not prometheus-client's
thread), so the per-pool collector reads allocator state on the thread that owns it.
RPC series use the names of go-grpc-prometheus / grpc-ecosystem so that existing
dashboards work: ``grpc_server_started_total`` (when a call starts),
``grpc_server_handled_total`` and ``grpc_server_handling_seconds`` (when it ends), and
``grpc_server_msg_received_total`` / ``grpc_server_msg_sent_total`` per message — the only
series that show the traffic of a long-lived stream (an executor's StepStream) while it runs.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.process_collector import ProcessCollector

from cache_service.tenants import tenant_of

# Sub-millisecond resolution: a batched Step is expected to take 0.2-2 ms.
_LATENCY_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.002, 0.005, 0.01, 0.025, 0.05, 0.1,
                    0.25, 0.5, 1.0, 2.5, 5.0, 10.0)


class RpcMetrics:
    """Per-RPC counters and latency histogram with the gRPC-standard names and labels."""

    def __init__(self, registry: CollectorRegistry) -> None:
        labels = ["grpc_type", "grpc_service", "grpc_method"]
        self.started = Counter("grpc_server_started_total", "RPCs started on the server.",
                               labels, registry=registry)
        self.handled = Counter("grpc_server_handled_total", "RPCs completed on the server, "
                               "by status code.", labels + ["grpc_code"], registry=registry)
        self.seconds = Histogram("grpc_server_handling_seconds", "Response latency of RPCs "
                                 "handled by the server.", labels, buckets=_LATENCY_BUCKETS,
                                 registry=registry)
        self.received = Counter("grpc_server_msg_received_total", "RPC stream messages received "
                                "on the server.", labels, registry=registry)
        self.sent = Counter("grpc_server_msg_sent_total", "RPC stream messages sent by the "
                            "server.", labels, registry=registry)
        self.undecodable_messages = Counter(
            "kvcache_undecodable_messages_total", "Request messages that did not parse "
            "(answered INVALID_ARGUMENT).", ["grpc_service", "grpc_method"], registry=registry)
        # Per pool (the gRPC series above cannot tell pools apart): what kvcache-ctl top and
        # the dashboard show as a pool's Steps/s and Step latency.
        self.pool_step_seconds = Histogram(
            "kvcache_pool_step_seconds", "Time to apply one Step (or one StepStream "
            "message) of a pool, durability wait included.", ["pool"],
            buckets=_LATENCY_BUCKETS, registry=registry)
        self._children: dict[tuple[str, str, str], tuple[Any, Any, Any, Any]] = {}
        self._handled: dict[tuple[str, str, str, str], Any] = {}
        self._pool_steps: dict[str, Any] = {}

    def of(self, grpc_type: str, service: str, method: str) -> tuple[Any, Any, Any, Any]:
        """(started, seconds, received, sent) children of one method (label lookups are slow:
        cached per method)."""
        key = (grpc_type, service, method)
        children = self._children.get(key)
        if children is None:
            children = (self.started.labels(*key), self.seconds.labels(*key),
                        self.received.labels(*key), self.sent.labels(*key))
            self._children[key] = children
        return children

    def observe_step(self, pool_id: str, seconds: float) -> None:
        """Records one applied Step of ``pool_id`` (the internal id)."""
        child = self._pool_steps.get(pool_id)
        if child is None:
            child = self._pool_steps[pool_id] = self.pool_step_seconds.labels(pool_id)
        child.observe(seconds)

    def undecodable(self, service: str, method: str) -> None:
        """Counts one request message that did not parse."""
        self.undecodable_messages.labels(service, method).inc()

    def observe(self, grpc_type: str, service: str, method: str, code: str,
                seconds: float) -> None:
        """Records one finished call (handled + latency; ``started`` counts at its start)."""
        self.of(grpc_type, service, method)[1].observe(seconds)
        key = (grpc_type, service, method, code)
        handled = self._handled.get(key)
        if handled is None:  # a label lookup takes a lock and builds a key: once per code
            handled = self._handled[key] = self.handled.labels(*key)
        handled.inc()


class ScrapeTimeCollector:
    """A collector whose series are known only at scrape time: it describes nothing up
    front (an empty describe keeps the registry from calling collect() at registration)."""

    def describe(self) -> list:
        """Nothing up front (the label values are unknown until a scrape)."""
        return []


class PoolCollector(ScrapeTimeCollector):
    """Scrape-time gauges/counters of every pool, read from ``stats_of()``: an iterable of
    (pool_id, core ``PoolCounters``). Prefix-cache counts include re-admissions after
    preemption."""

    def __init__(self, stats_of: Callable[[], Iterable[tuple[str, Any]]]) -> None:
        self._stats_of = stats_of

    def collect(self) -> Iterable:
        """Every pool's gauges and counters, read now."""
        gauges = {
            "usage": GaugeMetricFamily("kvcache_pool_usage_ratio",
                                       "Fraction of usable blocks in use.", labels=["pool"]),
            "num_blocks": GaugeMetricFamily("kvcache_pool_blocks",
                                            "Blocks in the pool (with the null block).",
                                            labels=["pool"]),
            "num_free_blocks": GaugeMetricFamily("kvcache_pool_free_blocks",
                                                 "Free blocks (cached ones included).",
                                                 labels=["pool"]),
            "num_cached_blocks": GaugeMetricFamily("kvcache_pool_cached_blocks",
                                                   "Blocks in the prefix-cache map.",
                                                   labels=["pool"]),
            "num_requests": GaugeMetricFamily("kvcache_pool_requests",
                                              "Registered requests.", labels=["pool"]),
            "hit_rate": GaugeMetricFamily("kvcache_pool_prefix_cache_hit_ratio",
                                          "Prefix-cache hit tokens / queried tokens.",
                                          labels=["pool"]),
            "account_block_quota": GaugeMetricFamily(
                "kvcache_pool_session_block_quota", "Blocks one session may hold in the "
                "pool (0 = no quota).", labels=["pool"]),
            "max_account_blocks": GaugeMetricFamily(
                "kvcache_pool_max_session_blocks", "Blocks held by the pool's most "
                "demanding session (pools with a quota).", labels=["pool"]),
            "num_pinned_blocks": GaugeMetricFamily(
                "kvcache_pool_pinned_blocks", "Distinct blocks held by prefix pins.",
                labels=["pool"]),
            "num_pins": GaugeMetricFamily("kvcache_pool_pins", "Live prefix pins.",
                                          labels=["pool"]),
            "host_tier_used_blocks": GaugeMetricFamily(
                "kvcache_host_tier_used_blocks", "Host tier slots holding a block, over "
                "all groups (0 without a host tier).", labels=["pool"]),
        }
        counters = {
            "prefix_cache_queries": CounterMetricFamily(
                "kvcache_pool_prefix_cache_queries", "Prefix-cache queried tokens.",
                labels=["pool"]),
            "prefix_cache_hits": CounterMetricFamily(
                "kvcache_pool_prefix_cache_hits", "Prefix-cache hit tokens.", labels=["pool"]),
            "evictions": CounterMetricFamily("kvcache_pool_evictions",
                                             "Cached blocks evicted.", labels=["pool"]),
            "allocation_failures": CounterMetricFamily(
                "kvcache_pool_allocation_failures", "Allocations answered 'no room'.",
                labels=["pool"]),
            "preemptions": CounterMetricFamily(
                "kvcache_pool_preemptions", "Preempt ops applied (a scheduler's preemptions and "
                "any admission roll-backs it sends as preempts).",
                labels=["pool"]),
            "quota_refusals": CounterMetricFamily(
                "kvcache_pool_session_quota_refusals", "Allocations answered 'no room' "
                "because of the session block quota.", labels=["pool"]),
            "pin_refusals": CounterMetricFamily(
                "kvcache_pool_pin_refusals", "PinPrefix calls refused by max_pinned_blocks, "
                "a session's or the tenant's pinned-block quota.", labels=["pool"]),
            "host_demotions": CounterMetricFamily(
                "kvcache_host_demotions", "Blocks demoted from the device to the host tier "
                "(device -> host copies planned).", labels=["pool"]),
            "host_promotions": CounterMetricFamily(
                "kvcache_host_promotions", "Blocks promoted from the host tier to the device "
                "(host -> device copies planned).", labels=["pool"]),
            "host_evictions": CounterMetricFamily(
                "kvcache_host_evictions", "Blocks that fell out of the host tier (its LRU) "
                "or were dropped by a ResetHostTierOp.", labels=["pool"]),
        }
        tenant_pools = GaugeMetricFamily("kvcache_tenant_pools", "Pools a tenant holds.",
                                         labels=["tenant"])
        tenant_blocks = GaugeMetricFamily("kvcache_tenant_blocks", "Blocks (num_blocks "
                                          "summed) over a tenant's pools.", labels=["tenant"])
        tenant_pinned = GaugeMetricFamily("kvcache_tenant_pinned_blocks", "Pinned blocks "
                                          "charged to pins over a tenant's pools (what its "
                                          "max_pinned_blocks bounds).", labels=["tenant"])
        families: list[tuple[str, GaugeMetricFamily | CounterMetricFamily]] = [
            *gauges.items(), *counters.items()]
        per_tenant: dict[str, list[int]] = {}
        misses = CounterMetricFamily(
            "kvcache_pool_prefix_misses", "Explained prefix lookups (PeekPrefix / Step "
            "lookup with explain) by group and miss reason (none = no miss).",
            labels=["pool", "group", "reason"])
        for pool_id, s in self._stats_of():
            for (group, reason), n in sorted(s.miss_reasons.items()):
                misses.add_metric([pool_id, str(group), reason], float(n))
            queries = s.prefix_queries + s.preempted_prefix_queries
            hits = s.prefix_hits + s.preempted_prefix_hits
            values = {"prefix_cache_queries": queries, "prefix_cache_hits": hits,
                      "hit_rate": hits / queries if queries else 0.0}
            for name, fam in families:
                fam.add_metric([pool_id], float(values[name] if name in values
                                                else getattr(s, name)))
            held = per_tenant.setdefault(tenant_of(pool_id), [0, 0, 0])
            held[0] += 1
            held[1] += s.num_blocks
            held[2] += sum(s.pinned_blocks_by_account.values())
        for tenant, (pools, blocks, pinned) in sorted(per_tenant.items()):
            tenant_pools.add_metric([tenant], float(pools))
            tenant_blocks.add_metric([tenant], float(blocks))
            tenant_pinned.add_metric([tenant], float(pinned))
        yield from gauges.values()
        yield tenant_pools
        yield tenant_blocks
        yield tenant_pinned
        yield from counters.values()
        yield misses


class SessionCollector(ScrapeTimeCollector):
    """Scrape-time session counters, read from ``counters_of()`` (the state's
    ``SessionCounters``)."""

    _SERIES = (
        ("opened", "kvcache_sessions_opened", "Sessions opened."),
        ("closed", "kvcache_sessions_closed", "Sessions closed by their client."),
        ("expired", "kvcache_sessions_expired", "Sessions whose lease ran out."),
        ("requests_expired", "kvcache_session_requests_expired",
         "Requests freed because their session's lease ran out."),
        ("retries_answered", "kvcache_step_retries_answered",
         "Retried calls (same session and sequence) answered from the stored response."),
    )

    def __init__(self, counters_of: Callable[[], Any]) -> None:
        self._counters_of = counters_of

    def collect(self) -> Iterable:
        """The session counters, read now."""
        counters = self._counters_of()
        for attr, name, doc in self._SERIES:
            fam = CounterMetricFamily(name, doc)
            fam.add_metric([], float(getattr(counters, attr)))
            yield fam


class DurabilityCollector(ScrapeTimeCollector):
    """Scrape-time durability series of a state (``cache_service.state.ServiceState``):
    failed log writes, the last logged record, background snapshots by result. Read with
    ``getattr`` so that an in-memory server (no log, no snapshotter) exports zeros."""

    def __init__(self, state: Any) -> None:
        self._state = state

    def collect(self) -> Iterable:
        """Failed log writes, the last logged index and background snapshots by result, read
        now (zeros without a data dir)."""
        durability = self._state.durability
        errors = CounterMetricFamily("kvcache_wal_errors", "Write-ahead log appends and "
                                     "syncs that failed (disk full, I/O error); each failed "
                                     "its call.")
        errors.add_metric([], float(getattr(self._state, "wal_errors", 0)))
        yield errors
        wal = getattr(durability, "wal", None)
        last = GaugeMetricFamily("kvcache_wal_last_index", "Index of the last record in the "
                                 "write-ahead log (0 without --data-dir).")
        last.add_metric([], float(getattr(wal, "last_index", 0) or 0))
        yield last
        snapshotter = getattr(durability, "snapshotter", None)
        snapshots = CounterMetricFamily("kvcache_snapshots", "Background snapshots by "
                                        "result (written, failed).", labels=["result"])
        for result, attr in (("written", "completed"), ("failed", "failed")):
            snapshots.add_metric([result], float(getattr(snapshotter, attr, 0) or 0))
        yield snapshots


class ClusterCollector(ScrapeTimeCollector):
    """Scrape-time cluster-mode series of a ``cache_service.cluster.node.ClusterNode``: whether
    this replica's etcd lease is certainly alive (0 = it cannot reach etcd, or could not
    renew in time, and serves no pool), the members and the pools it owns as it sees them."""

    def __init__(self, node: Any) -> None:
        self._node = node

    def collect(self) -> Iterable:
        """Whether the etcd lease is certainly alive, and the members and owned pools as this
        replica sees them, read now."""
        node = self._node
        valid = GaugeMetricFamily("kvcache_cluster_etcd_lease_valid", "1 while this "
                                  "replica's etcd lease is certainly alive, else 0 (etcd "
                                  "unreachable).")
        valid.add_metric([], 1.0 if node.membership.lease_valid() else 0.0)
        yield valid
        members = GaugeMetricFamily("kvcache_cluster_members", "Live members as this "
                                    "replica's view of etcd has them.")
        members.add_metric([], float(len(node.placement.members)))
        yield members
        owned = GaugeMetricFamily("kvcache_cluster_owned_pools", "Pools this replica owns "
                                  "(and may serve).")
        owned.add_metric([], float(len(node.placement.owned)))
        yield owned
        replicator = getattr(node, "replicator", None)
        if replicator is not None:
            degraded = GaugeMetricFamily(
                "kvcache_replication_degraded", "1 while some pool this replica owns has "
                "no live standby (writes are answered without one after the replication "
                "timeout), else 0.")
            degraded.add_metric([], 1.0 if replicator.degraded else 0.0)
            yield degraded
            lag = GaugeMetricFamily("kvcache_replication_lag_records", "Records this "
                                    "replica logged that a standby has not acknowledged "
                                    "yet.", labels=["standby"])
            for member, link in replicator.links.items():
                lag.add_metric([member], float(max(0, replicator.index - link.acked)))
            yield lag


def new_registry(stats_of: Callable[[], Iterable[tuple[str, Any]]],
                 counters_of: Callable[[], Any] | None = None) -> tuple[
        CollectorRegistry, RpcMetrics]:
    """A registry with process metrics, RPC metrics, the pool collector and (given
    ``counters_of``) the session collector."""
    registry = CollectorRegistry(auto_describe=False)
    ProcessCollector(registry=registry)
    rpc = RpcMetrics(registry)
    registry.register(PoolCollector(stats_of))
    if counters_of is not None:
        registry.register(SessionCollector(counters_of))
    return registry, rpc
