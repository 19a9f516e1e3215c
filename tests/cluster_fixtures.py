"""Fixtures for the cluster tests: a real redis-server, and a fresh directory per test.

The server is one per session on a free loopback port (``RedisProcess``: started from the
binary the project's install brings, stopped by pid). Tests stay apart by key prefix, not by
flushing, so a module-scoped node process can keep its registration while other tests run.
No server binary is a failure with the install command, not a skip.
"""

from __future__ import annotations

import itertools
import os

import pytest

from kvjax.cluster.directory import Directory
from kvjax.cluster.redis_process import RedisProcess, find_redis_server

_prefixes = itertools.count()


@pytest.fixture(scope="session")
def redis_server():
    """One redis-server for the session (``.url``, ``.port``, ``.restart()``)."""
    try:
        binary = find_redis_server()
    except FileNotFoundError as error:
        pytest.fail(str(error), pytrace=False)
    server = RedisProcess.start(binary)
    yield server
    server.stop()


@pytest.fixture
def redis_prefix():
    """A key prefix no other test uses."""
    return f"t{os.getpid()}x{next(_prefixes)}"


@pytest.fixture
def directory(redis_server, redis_prefix):
    """A ``Directory`` on the session's server under a fresh prefix (node TTL 2 s)."""
    directory = Directory.connect(redis_server.url, prefix=redis_prefix, node_ttl_s=2.0)
    yield directory
    directory.client.close()
