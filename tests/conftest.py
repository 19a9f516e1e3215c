import os
import sys

# Tests import the shared case builders as plain modules.
sys.path.insert(0, os.path.dirname(__file__))

# Cluster fixtures (a real redis-server per session, node and router processes).
from cluster_fixtures import cluster, directory, jax_cache_env, redis_prefix, redis_server  # noqa: E402,F401
