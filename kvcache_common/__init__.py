"""What the cache service and the executor share: the generated stubs of both protos
(``kvcache_common.api``), the server bootstrap (``serving``: bind, health and reflection
from ``discovery``, signals, drain), logging with the lifecycle/readiness line (``logs``), the
Prometheus endpoint (``metrics_http``), the health probe (``healthcheck``), the process
launcher (``launch``) and the protobuf enum names (``enums``).

Nothing here imports ``cache_service`` or ``executor``: both depend on this package, never the
other way round (docs/architecture.md, "Layout").
"""
