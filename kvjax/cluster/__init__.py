"""Growing past one machine: the prefix directory on Redis, the node publisher and the routing
policy. The HTTP servers live in ``kvjax.cluster.node_server`` / ``router_server`` and run as
``python -m kvjax.cluster {redis,node,router}``."""

from kvjax.cluster.directory import ClusterInfo, Directory, NodeLoad, NodeView
from kvjax.cluster.publisher import DirectoryPublisher
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
