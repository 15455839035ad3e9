"""Cluster mode on etcd (``--etcd-endpoints``): many replicas, each pool owned by one.

- :mod:`~cache_service.cluster.keys`: the etcd key layout and rendezvous placement;
- :mod:`~cache_service.cluster.etcd`: the aetcd client, moving over endpoints;
- :mod:`~cache_service.cluster.membership`: lease, keep-alive, leave;
- :mod:`~cache_service.cluster.placement`: ownership view, place / take over, fencing;
- :mod:`~cache_service.cluster.node`: what the server wires in (registry, hooks, fan-out).
"""
