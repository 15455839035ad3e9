"""Prometheus metrics: gRPC-standard per-RPC series, per-pool gauges, and the /metrics
HTTP endpoint.

The endpoint is served from the server's own asyncio loop (not prometheus-client's
thread), so the per-pool collector reads allocator state on the thread that owns it.
RPC series use the names of go-grpc-prometheus / grpc-ecosystem so that existing
dashboards work: ``grpc_server_started_total``, ``grpc_server_handled_total``,
``grpc_server_handling_seconds``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.process_collector import ProcessCollector

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
        self._children: dict[tuple[str, str, str], tuple[Any, Any]] = {}

    def observe(self, grpc_type: str, service: str, method: str, code: str,
                seconds: float) -> None:
        """Records one finished call (started + handled + latency)."""
        key = (grpc_type, service, method)
        children = self._children.get(key)
        if children is None:  # label lookups are slow; cache the children per method
            children = (self.started.labels(*key), self.seconds.labels(*key))
            self._children[key] = children
        children[0].inc()
        children[1].observe(seconds)
        self.handled.labels(grpc_type, service, method, code).inc()


class PoolCollector:
    """Scrape-time gauges/counters of every pool, read from ``stats_of()``: an iterable of
    (pool_id, core ``PoolCounters``). Prefix-cache counts include re-admissions after
    preemption."""

    def __init__(self, stats_of: Callable[[], Iterable[tuple[str, Any]]]) -> None:
        self._stats_of = stats_of

    def describe(self) -> list:
        return []  # unknown label values up front; avoid a collect() at registration

    def collect(self) -> Iterable:
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
            "preemptions": CounterMetricFamily("kvcache_pool_preemptions", "Preemptions.",
                                               labels=["pool"]),
        }
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
            for name, fam in (*gauges.items(), *counters.items()):
                fam.add_metric([pool_id], float(values[name] if name in values
                                                else getattr(s, name)))
        yield from gauges.values()
        yield from counters.values()
        yield misses


def new_registry(stats_of: Callable[[], Iterable[tuple[str, Any]]]) -> tuple[
        CollectorRegistry, RpcMetrics]:
    """A registry with process metrics, RPC metrics and the pool collector."""
    registry = CollectorRegistry(auto_describe=False)
    ProcessCollector(registry=registry)
    rpc = RpcMetrics(registry)
    registry.register(PoolCollector(stats_of))
    return registry, rpc
