"""Failures with a real Redis and real node processes behind a real router: a node killed
mid-run, a node restarted, Redis restarted, a node that stalls (SIGSTOP) so its records lag,
two tenants sending identical prompts, and a node stopped by SIGTERM while it serves.

The module runs its own redis-server (restarting the session's would disturb the other
tests' cluster), three nodes of the tiny preset with a 2 s heartbeat TTL, and a prefix
router. Tests share the processes and run in file order: f3 is killed in the first test and
stays dead, f2 is restarted in the second and stopped in the last.
"""

import concurrent.futures
import os
import signal
import uuid

import httpx
import pytest
from cluster_fixtures import start_node, start_router, wait_until

from kvjax.cache.block_keys import Namespace, chained_block_keys
from kvjax.cluster.directory import Directory
from kvjax.cluster.redis_process import RedisProcess

NODE_TTL_S = 2.0
PAGE_SIZE = 16  # the tiny preset's
MARGIN_S = 3.0  # a busy 2-core machine: heartbeats and expiries run late by this much at worst


class FailureCluster:
    """The module's processes: ``redis``, ``nodes`` by id, ``router``."""

    def __init__(self, redis_server, prefix, log_dir, env):
        self.redis, self.prefix, self.log_dir, self.env = redis_server, prefix, log_dir, env
        self.nodes, self.router = {}, None

    def start_node(self, node_id):
        return start_node(node_id, self.redis.url, self.prefix, self.log_dir, self.env,
                          ["--no-tiers", "--node-ttl", str(NODE_TTL_S)])  # fmt: skip

    def directory(self):
        return Directory.connect(self.redis.url, prefix=self.prefix, node_ttl_s=NODE_TTL_S)

    def live(self):
        return {view.node_id: view for view in self.directory().live_nodes()}


@pytest.fixture(scope="module")
def failures(tmp_path_factory, jax_cache_env):
    log_dir = tmp_path_factory.mktemp("failure-logs")
    server = RedisProcess.start()
    cluster = FailureCluster(server, f"fail{os.getpid()}", log_dir, jax_cache_env)
    try:
        for node_id in ("f1", "f2", "f3"):  # the compilation cache is warm: they start together
            cluster.nodes[node_id] = cluster.start_node(node_id)
        cluster.router = start_router(server.url, cluster.prefix, log_dir, wait=False)
        for process in [*cluster.nodes.values(), cluster.router]:
            process.wait_ready()
        yield cluster
    finally:
        for process in [*cluster.nodes.values(), cluster.router]:
            if process is not None:
                if process.process.poll() is None:
                    os.kill(process.pid, signal.SIGCONT)  # a stalled node could not stop cleanly
                process.stop()
        server.stop()


def post(url, prompt, *, namespace=None, max_tokens=4, headers=None, timeout=120):
    body = {"model": "tiny", "prompt": prompt, "max_tokens": max_tokens}
    if namespace is not None:
        body["namespace"] = namespace
    return httpx.post(f"{url}/v1/completions", json=body, headers=headers, timeout=timeout)


def prompt(label):
    return f"System prompt {label} {uuid.uuid4().hex}: answer briefly, in plain words, and politely.\nQ: why?\nA:"


def held_blocks(cluster, text, namespace=None):
    """Per live node, the leading blocks of ``text`` the directory says it holds."""
    keys = chained_block_keys(list(text.encode()), PAGE_SIZE, namespace)
    digest = (Namespace(namespace) if namespace else Namespace()).digest()
    return {view.node_id: view.prefix_blocks for view in cluster.directory().lookup(digest, keys)}, len(keys)


def routed_to(metrics_text, node_id):
    """Requests the router sent to ``node_id`` and forwards that failed there (summed)."""
    return sum(float(line.split()[-1]) for line in metrics_text.splitlines()
               if f'node="{node_id}"' in line and not line.startswith("#"))  # fmt: skip


def served_and_published(cluster, node_id, text, namespace=None):
    """Serve ``text`` on ``node_id`` directly and wait until the directory says it holds it."""
    assert post(cluster.nodes[node_id].url, text, namespace=namespace).status_code == 200
    assert wait_until(lambda: held_blocks(cluster, text, namespace)[0].get(node_id) == held_blocks(
        cluster, text, namespace)[1], timeout=10)  # fmt: skip


def test_a_node_killed_mid_run_loses_no_request_and_leaves_within_its_ttl(failures):
    router = failures.router.url
    prompts = [prompt(f"kill-{i}") for i in range(9)]  # nobody holds them: fair turns over f1, f2, f3
    with concurrent.futures.ThreadPoolExecutor(len(prompts)) as pool:
        futures = [pool.submit(post, router, text, max_tokens=200) for text in prompts]
        victim = failures.nodes["f3"]
        assert wait_until(lambda: httpx.get(f"{victim.url}/health").json()["inflight"] > 0, timeout=30)
        victim.kill()  # SIGKILL: no deregistration, requests cut off mid-answer
        responses = [future.result() for future in futures]
    assert [r.status_code for r in responses] == [200] * len(prompts)  # retried on f1 / f2
    assert all(r.json()["usage"]["completion_tokens"] == 200 for r in responses)
    assert {r.headers["x-kvjax-node"] for r in responses} <= {"f1", "f2"}
    metrics = httpx.get(f"{router}/metrics").text
    assert 'kvjax_router_forward_errors_total{node="f3"}' in metrics
    # the router stops choosing f3 once its record expires, within the TTL of its last heartbeat
    assert wait_until(lambda: "f3" not in failures.live(), timeout=NODE_TTL_S + MARGIN_S)
    before = routed_to(httpx.get(f"{router}/metrics").text, "f3")
    after = [post(router, prompt("after-kill")) for _ in range(4)]
    assert all(r.status_code == 200 for r in after) and {r.headers["x-kvjax-node"] for r in after} <= {"f1", "f2"}
    assert routed_to(httpx.get(f"{router}/metrics").text, "f3") == before  # not even tried


def test_a_restarted_node_never_uses_its_old_epochs_entries(failures):
    text = prompt("restart")
    served_and_published(failures, "f2", text, "tenant-r")
    old_epoch = failures.live()["f2"].epoch
    failures.nodes["f2"].kill()
    failures.nodes["f2"] = failures.start_node("f2").wait_ready()
    assert failures.live()["f2"].epoch > old_epoch
    # the old process's entries are still in Redis, under the old epoch, and count for nothing
    directory = failures.directory()
    first_key = chained_block_keys(list(text.encode()), PAGE_SIZE, "tenant-r")[0]
    entry = directory.client.hget(directory.block_key(Namespace("tenant-r").digest(), first_key), "f2")
    assert entry is not None and entry.decode().startswith(f"{old_epoch}/")  # "{epoch}/{incarnation}:{mask}"
    assert held_blocks(failures, text, "tenant-r")[0]["f2"] == 0
    response = post(failures.router.url, text, namespace="tenant-r")
    assert response.status_code == 200 and response.headers["x-kvjax-route"].startswith("no_prefix")
    assert response.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == 0


def test_a_restarted_redis_is_rebuilt_from_the_nodes_and_routing_recovers(failures):
    text = prompt("redis")
    served_and_published(failures, "f1", text, "tenant-q")
    failures.redis.restart()  # empty: no records, no entries
    # each node's next heartbeat finds its record gone, registers a new epoch, writes what it holds
    assert wait_until(lambda: set(failures.live()) == {"f1", "f2"}, timeout=NODE_TTL_S + MARGIN_S)
    assert wait_until(lambda: held_blocks(failures, text, "tenant-q")[0].get("f1") == held_blocks(
        failures, text, "tenant-q")[1], timeout=MARGIN_S)  # fmt: skip
    response = post(failures.router.url, text, namespace="tenant-q")
    assert response.status_code == 200 and response.headers["x-kvjax-node"] == "f1"
    assert response.headers["x-kvjax-route"].startswith("affinity")
    assert response.json()["usage"]["prompt_tokens_details"]["cached_tokens"] > 0


def test_a_stalled_node_leaves_the_routing_set_and_comes_back_with_its_blocks(failures):
    """SIGSTOP f1: its heartbeats and block events stop. A request routed to it before its
    record expired waits, and is answered once it resumes; after the TTL the router sends
    the prompt elsewhere; resumed, f1 registers a new epoch and publishes its holdings."""
    text = prompt("stall")
    served_and_published(failures, "f1", text, "tenant-s")
    epoch = failures.live()["f1"].epoch
    stalled = failures.nodes["f1"]
    os.kill(stalled.pid, signal.SIGSTOP)
    try:
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            waiting = pool.submit(post, failures.router.url, text, namespace="tenant-s")
            assert wait_until(lambda: "f1" not in failures.live(), timeout=NODE_TTL_S + MARGIN_S)
            elsewhere = post(failures.router.url, text, namespace="tenant-s")
            assert elsewhere.status_code == 200 and elsewhere.headers["x-kvjax-node"] == "f2"
            assert not waiting.done()
            os.kill(stalled.pid, signal.SIGCONT)
            first = waiting.result(timeout=60)
    finally:
        os.kill(stalled.pid, signal.SIGCONT)
    assert first.status_code == 200 and first.headers["x-kvjax-node"] == "f1"
    assert first.json()["choices"][0]["text"] == elsewhere.json()["choices"][0]["text"]
    assert wait_until(lambda: "f1" in failures.live(), timeout=NODE_TTL_S + MARGIN_S)
    assert failures.live()["f1"].epoch > epoch
    assert wait_until(lambda: held_blocks(failures, text, "tenant-s")[0].get("f1") == held_blocks(
        failures, text, "tenant-s")[1], timeout=MARGIN_S)  # fmt: skip


def test_identical_prompts_of_two_tenants_share_no_hit_and_no_routing_signal(failures):
    text = prompt("tenants")
    first = post(failures.router.url, text, namespace="tenant-a")
    holder = first.headers["x-kvjax-node"]
    total = held_blocks(failures, text, "tenant-a")[1]
    assert wait_until(lambda: held_blocks(failures, text, "tenant-a")[0][holder] == total)
    assert set(held_blocks(failures, text, "tenant-b")[0].values()) == {0}  # tenant-b's keys differ
    # the same prompt from tenant-b (namespace set by a gateway's header): no signal, no hit
    other = post(failures.router.url, text, headers={"x-kvjax-namespace": "tenant-b"})
    assert other.status_code == 200 and other.headers["x-kvjax-route"].startswith("no_prefix")
    assert other.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    assert other.json()["choices"][0]["text"] == first.json()["choices"][0]["text"]
    again = post(failures.router.url, text, namespace="tenant-a")
    assert again.headers["x-kvjax-node"] == holder and again.headers["x-kvjax-route"].startswith("affinity")
    assert again.json()["usage"]["prompt_tokens_details"]["cached_tokens"] > 0


def test_a_node_stopped_by_sigterm_while_serving_loses_no_request_and_exits_cleanly(failures):
    """SIGTERM f2 (last: it stays stopped) with requests in flight through the router, and more
    sent while it drains: those it had finish there, the rest go to f1, and none fails."""
    router, stopping = failures.router.url, failures.nodes["f2"]
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        first = [pool.submit(post, router, prompt(f"term-{i}"), max_tokens=100) for i in range(4)]
        assert wait_until(lambda: httpx.get(f"{stopping.url}/health").json()["inflight"] > 0, timeout=30)
        stopping.process.send_signal(signal.SIGTERM)
        assert wait_until(lambda: "f2" not in failures.live())  # routers stop choosing it
        later = [pool.submit(post, router, prompt(f"term-later-{i}"), max_tokens=100) for i in range(4)]
        responses = [future.result() for future in first + later]
    assert stopping.process.wait(timeout=60) == 0
    assert [r.status_code for r in responses] == [200] * len(responses)
    assert all(r.json()["usage"]["completion_tokens"] == 100 for r in responses)
    assert "f2" in {r.headers["x-kvjax-node"] for r in responses[:4]}  # in flight at SIGTERM: finished there
    assert {r.headers["x-kvjax-node"] for r in responses[4:]} == {"f1"}
