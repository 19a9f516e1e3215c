"""Fixtures for the cluster tests: a real redis-server, a fresh directory per test, and node
and router processes.

The server is one per session on a free loopback port (``RedisProcess``: started from the
binary the project's install brings, stopped by pid). Tests stay apart by key prefix, not by
flushing, so a module-scoped node process can keep its registration while other tests run.
No server binary is a failure with the install command, not a skip.
"""

from __future__ import annotations

import itertools
import json
import os
import re
import socket
import time

import httpx
import openai
import pytest

from kvjax.cluster.directory import Directory
from kvjax.cluster.processes import ServiceProcess
from kvjax.cluster.redis_process import RedisProcess, find_redis_server

_prefixes = itertools.count()


def wait_until(predicate, timeout=10.0, interval=0.05):
    """Poll ``predicate`` until it is true (True) or ``timeout`` seconds passed (False)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(interval)
    return False


def speak_for(directory, node_id):
    """The live epoch of ``node_id``, ``directory`` taking on the node's incarnation so that its
    writes under that epoch count as the node's own (the node's publisher is another client,
    with an incarnation of its own: ``kvjax.cluster.directory``)."""
    epoch, incarnation = directory.client.hmget(directory.node_key(node_id), "epoch", "incarnation")
    directory.incarnation = incarnation.decode()
    return int(epoch)


def decode_tokens(url):
    """Tokens the node's engine computed in decode steps so far."""
    return float(re.search(r"^kvjax_decode_tokens_total (\S+)$", httpx.get(f"{url}/metrics").text, re.M).group(1))


def hang_up_while_generating(url, node_urls, body):
    """POST ``body`` to ``url`` on a raw connection, wait until one of ``node_urls`` has it in
    flight, then close the connection without reading the answer."""
    host, port = url.removeprefix("http://").rsplit(":", 1)
    data = json.dumps(body).encode()
    with socket.create_connection((host, int(port))) as conn:
        conn.sendall(b"POST /v1/completions HTTP/1.1\r\nhost: kvjax\r\ncontent-type: application/json\r\n"
                     b"content-length: %d\r\n\r\n%s" % (len(data), data))  # fmt: skip
        assert wait_until(lambda: sum(httpx.get(f"{u}/health").json()["inflight"] for u in node_urls) == 1, timeout=60)


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


def ignored_fields_total(url, prefix):
    """The server's count of request fields it ignored (``{prefix}_ignored_request_fields_total``)."""
    text = httpx.get(f"{url}/metrics").text
    return float(re.search(rf"^{prefix}_ignored_request_fields_total (\S+)$", text, re.M).group(1))


def check_unknown_fields_are_ignored(client, url, prefix, prompt):
    """Through the official client: fields the server does not know change nothing of the
    answer and are counted; a known field at a value kvjax does not implement is a 400 naming it."""
    before = ignored_fields_total(url, prefix)
    plain = client.completions.create(model="tiny", prompt=prompt, max_tokens=8, temperature=0.8, seed=11)
    extra = client.completions.create(model="tiny", prompt=prompt, max_tokens=8, temperature=0.8, seed=11,
                                      user="u1", suffix=None, logit_bias={},
                                      extra_body={"frobnicate": 1, "vendor_options": {"trace": True}})  # fmt: skip
    assert extra.choices[0].text == plain.choices[0].text and extra.usage.completion_tokens == 8
    assert ignored_fields_total(url, prefix) == before + 2
    with pytest.raises(openai.BadRequestError, match=r"repetition_penalty=1.3 is not supported; kvjax accepts only "
                                                     r"1 or null"):  # fmt: skip
        client.completions.create(model="tiny", prompt=prompt, max_tokens=2, extra_body={"repetition_penalty": 1.3})


def check_bodies_over_the_limit_get_a_413(url):
    """The server read every body whole into memory, however large. Over the limit (8 MiB by
    default): a 413 naming it, whether the body declares its length or comes chunked, and the
    connection serves the next request."""
    limit = 8 * 2**20
    body = b'{"model": "tiny", "prompt": "' + b"a" * limit + b'", "max_tokens": 1}'

    def chunks(data, size=2**16):
        yield from (data[start : start + size] for start in range(0, len(data), size))

    with httpx.Client(base_url=url, timeout=60) as http:
        for content, message in [
            (body, f"the request body has {len(body)} bytes; this server accepts at most {limit} bytes (8 MiB)"),
            (chunks(body), f"the request body passed this server's limit of {limit} bytes (8 MiB) before its end"),
        ]:  # fmt: skip
            response = http.post("/v1/completions", content=content, headers={"content-type": "application/json"})
            assert response.status_code == 413
            assert response.json()["error"]["message"].startswith(message)
            assert response.json()["error"]["type"] == "invalid_request_error"
            served = http.post("/v1/completions", json={"model": "tiny", "prompt": "x", "max_tokens": 2})
            assert served.status_code == 200 and served.json()["usage"]["completion_tokens"] == 2


# --- node and router processes -------------------------------------------------------------


@pytest.fixture(scope="session")
def jax_cache_env(tmp_path_factory):
    """Environment for node processes: CPU, and one persistent compilation cache so every
    node after the first skips most of its compile time."""
    return {"JAX_PLATFORMS": "cpu", "JAX_COMPILATION_CACHE_DIR": str(tmp_path_factory.mktemp("jax-cache")),
            "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0.1"}  # fmt: skip


def start_node(node_id, redis_url, prefix, log_dir, env, extra=()):
    """A node process, not waited for (``.wait_ready()``)."""
    return ServiceProcess(["node", "--node-id", node_id, "--port", "0", "--redis", redis_url, "--prefix", prefix,
                           *extra], log_dir / f"{node_id}.log", env)  # fmt: skip


def start_router(redis_url, prefix, log_dir, strategy="prefix", name="router", wait=True, extra=()):
    router = ServiceProcess(["router", "--port", "0", "--redis", redis_url, "--prefix", prefix, "--strategy", strategy,
                             *extra], log_dir / f"{name}.log")  # fmt: skip
    return router.wait_ready() if wait else router


class Cluster:
    """Two nodes and a prefix router on one prefix of the session's Redis."""

    def __init__(self, redis_url, prefix, nodes, router):
        self.redis_url, self.prefix, self.nodes, self.router = redis_url, prefix, nodes, router

    def directory(self):
        return Directory.connect(self.redis_url, prefix=self.prefix)


@pytest.fixture(scope="session")
def cluster(redis_server, tmp_path_factory, jax_cache_env):
    """Nodes n1 and n2 (the tiny preset, no tiers) and a ``prefix`` router, as real processes,
    shared by every test of the session (JAX import and compilation cost seconds per node)."""
    log_dir = tmp_path_factory.mktemp("cluster-logs")
    prefix = f"cluster{os.getpid()}"
    started = []
    try:
        # The first node fills the compilation cache; the second and the router start together.
        started.append(start_node("n1", redis_server.url, prefix, log_dir, jax_cache_env, ["--no-tiers"]).wait_ready())
        started.append(start_node("n2", redis_server.url, prefix, log_dir, jax_cache_env, ["--no-tiers"]))
        started.append(start_router(redis_server.url, prefix, log_dir, wait=False))
        for process in started[1:]:
            process.wait_ready()
    except BaseException:
        for process in started:
            process.stop()
        raise
    n1, n2, router = started
    yield Cluster(redis_server.url, prefix, {"n1": n1, "n2": n2}, router)
    for process in started:
        process.stop()
