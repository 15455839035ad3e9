"""The one backoff rule of every retry in the tree.

Unary calls of the cache-service client are retried by gRPC itself (a service-config retry
policy built from a :class:`Backoff`, ``cache_service/client/_channel.py``). What gRPC cannot
retry is driven by hand with the same rule:

* a StepStream step: a bidirectional stream is committed by its first answer, and later
  steps are messages on it, not calls, so the client drops the stream and resends the step
  on a new one (``cache_service/client/_retry.py``);
* the executor's resend of a Step whose outcome is in doubt: it spans the service's restart,
  longer than gRPC's 5 attempts allow (``executor/cache_link.py``);
* the executor's registration while the service is down: unbounded (``executor/server.py``);
* a cluster replica's attempts to reach etcd again: joining, and following the cluster view
  after a lost watch (``cache_service/cluster/etcd.py``).
"""

from __future__ import annotations

import random
from dataclasses import dataclass


@dataclass(frozen=True)
class Backoff:
    """Exponential backoff: ``base * 2**attempt`` seconds, at most ``cap``."""

    base: float
    cap: float

    def delay(self, attempt: int) -> float:
        """Seconds to wait before retry number ``attempt`` (0 = the first retry), with jitter
        in [delay/2, delay] so that clients that failed together do not retry together."""
        return min(self.cap, self.base * 2 ** attempt) * random.uniform(0.5, 1.0)
