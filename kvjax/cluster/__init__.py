"""Growing past one machine: the prefix directory on Redis, the node publisher and the routing
policy. The HTTP servers live in ``kvjax.cluster.node_server`` / ``router_server`` and run as
``python -m kvjax.cluster {redis,node,router}``.

The names that need the Redis client (``pip install 'kvjax[cluster]'``) are re-exported on
first use, so the routing policy and the records it reads import without it: the cluster
replay (``python -m kvjax replay --nodes N``) runs on the core install.
"""

import importlib

from kvjax.cluster.node_view import NodeLoad, NodeView
from kvjax.cluster.redis_process import RedisProcess, find_redis_server
from kvjax.cluster.router import STRATEGIES, Decision, RouterConfig, RoutingPolicy

__all__ = [
    "STRATEGIES",
    "ClusterInfo",
    "Decision",
    "Directory",
    "DirectoryPublisher",
    "NodeLoad",
    "NodeView",
    "RedisProcess",
    "RouterConfig",
    "RoutingPolicy",
    "find_redis_server",
]

_NEEDS_REDIS = {"ClusterInfo": "kvjax.cluster.directory", "Directory": "kvjax.cluster.directory",
                "DirectoryPublisher": "kvjax.cluster.publisher"}  # fmt: skip


def __getattr__(name: str):
    if name in _NEEDS_REDIS:
        return getattr(importlib.import_module(_NEEDS_REDIS[name]), name)
    raise AttributeError(f"module 'kvjax.cluster' has no attribute {name!r}")
