"""``kvcache-ctl``: the operator's command line for a running cache service.

Reads (and never changes) what the service holds: pools with usage and hit rate, one pool's
groups, a request's block tables, a prompt's per-group residency with miss reasons, the
open sessions, the KV event feed, the cluster's members and pool owners (from etcd), and a
live view (``top``). Human tables by default, ``--json`` for scripts. Exit codes are in
:mod:`cache_service.ctl.cli` (and docs/operations.md).
"""

from cache_service.ctl.cli import main

__all__ = ["main"]
