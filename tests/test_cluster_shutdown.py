"""A node or router that must stop serving, as a real process on a real Redis.

Stopped by SIGTERM while it serves: it leaves the directory, refuses new requests with a 503,
lets the requests in flight finish, and exits 0; a request it must cut ends with an error
event (a stream) or a JSON 503 (which routers retry), never a cut connection or a plain-text
500. Taken over by a newer process of its node id: it refuses requests with a 503 naming the
takeover and says so on /health. A router stopped by SIGTERM drains the same way: a stream
it passes on finishes, new requests get a 503, and it exits 0. The drain's wait and cut, in
process.

Nodes of their own (each test stops or supersedes one), started together. Whatever the
device's speed, the requests are still in flight while a test signals and probes: the nodes
hold them (``--step-control``: a few engine steps, then nothing until the test lets them go),
and no timing is asserted.
"""

import asyncio
import concurrent.futures
import contextlib
import json
import signal
import uuid

import httpx
import pytest
from cluster_fixtures import start_node, start_router, wait_until

from kvjax.cluster.__main__ import main as cluster_main
from kvjax.cluster.directory import Directory
from kvjax.cluster.drain import Drain, NodeDrain
from kvjax.cluster.openai_api import RequestError

MAX_TOKENS = 48
FIRST_STEPS = 4  # engine steps a held node runs: a stream's first tokens, never its end


@pytest.fixture(scope="module")
def nodes(redis_server, tmp_path_factory, jax_cache_env):
    """g1 drains for up to 120 s, g2 for 600 s (only a second signal cuts it), both with a
    long node TTL, so that a node missing from the directory deregistered rather than expired;
    g3 heartbeats every 2/3 s, so that it soon sees a takeover. g4 serves alone behind two
    routers (on a prefix of their own): "router" drains for up to 120 s, "router2" for 600 s."""
    log_dir = tmp_path_factory.mktemp("shutdown-logs")
    prefix, routed = f"shutdown{uuid.uuid4().hex[:8]}", f"routed{uuid.uuid4().hex[:8]}"
    settings = {"g1": (prefix, ["--node-ttl", "60", "--drain-s", "120", "--step-control"]),
                "g2": (prefix, ["--node-ttl", "60", "--drain-s", "600", "--step-control"]),
                "g3": (prefix, ["--node-ttl", "2"]), "g4": (routed, ["--step-control"])}  # fmt: skip
    started = {node_id: start_node(node_id, redis_server.url, node_prefix, log_dir, jax_cache_env,
                                   ["--no-tiers", *extra]) for node_id, (node_prefix, extra) in settings.items()}
    for name, drain_s in (("router", "120"), ("router2", "600")):
        started[name] = start_router(redis_server.url, routed, log_dir, name=name, wait=False,
                                     extra=["--drain-s", drain_s])  # fmt: skip
    try:
        for process in started.values():
            process.wait_ready()
        yield started, Directory.connect(redis_server.url, prefix=prefix)
    finally:
        for process in started.values():
            process.stop()


def body(max_tokens, stream):
    prompt = f"Shutdown {uuid.uuid4().hex}: say something long.\nA:"
    return {"model": "tiny", "prompt": prompt, "max_tokens": max_tokens, "stream": stream,
            "stream_options": {"include_usage": True}} if stream else \
        {"model": "tiny", "prompt": prompt, "max_tokens": max_tokens}  # fmt: skip


def read_stream(url, request_body, started: concurrent.futures.Future):
    """The stream's events (parsed JSON, or "[DONE]"); ``started`` is set at the first one."""
    events = []
    with httpx.stream("POST", f"{url}/v1/completions", json=request_body, timeout=120) as response:
        assert response.status_code == 200
        for line in response.iter_lines():
            if line.startswith("data: "):
                data = line[len("data: ") :]
                events.append(data if data == "[DONE]" else json.loads(data))
                if not started.done():
                    started.set_result(None)
    return events


def live(directory):
    return {view.node_id for view in directory.live_nodes()}


def hold_steps(url, steps):
    """Let the node at ``url`` run ``steps`` more engine steps, then hold (None: run freely)."""
    response = httpx.post(f"{url}/test/steps", json={"steps": steps}, timeout=30)
    assert response.status_code == 200, response.text


def health(url):
    """The server's /health body; {} while it cannot be reached."""
    try:
        return httpx.get(f"{url}/health", timeout=30).json()
    except httpx.TransportError:
        return {}


@contextlib.contextmanager
def stream_at_its_first_tokens(node_url, url, workers=1):
    """(pool, stream): a stream of MAX_TOKENS sent to ``url`` (the node or a router in front of
    it) whose first tokens came, the node ``node_url`` then holding its requests in place
    (``hold_steps``) until the test lets them go; ``pool`` has room for ``workers`` calls."""
    hold_steps(node_url, FIRST_STEPS)
    with concurrent.futures.ThreadPoolExecutor(workers) as pool:
        started = concurrent.futures.Future()
        stream = pool.submit(read_stream, url, body(MAX_TOKENS, stream=True), started)
        started.result(timeout=120)
        yield pool, stream


def assert_finished(events):
    """A stream that ran to its MAX_TOKENS: no error event, one finish, then ``[DONE]``."""
    assert events[-1] == "[DONE]" and not any("error" in event for event in events[:-1])
    assert [c["finish_reason"] for e in events[:-1] for c in e["choices"] if c["finish_reason"]] == ["length"]
    assert events[-2]["usage"]["completion_tokens"] == MAX_TOKENS


def assert_cut(events, cut, message):
    """A stream cut after its first tokens (an error event naming why, then ``[DONE]``) and a
    non-streamed request cut as a JSON 503 with the same message."""
    assert events[-2:] == [{"error": {"message": message, "type": "server_error", "param": None, "code": None}},
                           "[DONE]"]  # fmt: skip
    assert all("choices" in event for event in events[:-2]) and len(events) > 2  # tokens came before the cut
    assert cut.status_code == 503 and cut.headers["content-type"] == "application/json"
    assert cut.json()["error"]["message"] == message  # a JSON 503, which a router retries elsewhere


def test_a_stream_in_flight_at_sigterm_finishes_then_the_node_exits_and_has_left_the_directory(nodes):
    processes, directory = nodes
    node = processes["g1"]
    with stream_at_its_first_tokens(node.url, node.url) as (_, stream):
        node.process.send_signal(signal.SIGTERM)
        assert wait_until(lambda: health(node.url).get("status") == "draining", timeout=30)
        assert not stream.done()
        hold_steps(node.url, None)  # the rest of the stream, while the node drains
        events = stream.result()
    assert node.process.wait(timeout=60) == 0  # it stopped; SIGTERM did not kill it
    assert_finished(events)
    assert "g1" not in live(directory)  # dropped its record (its TTL is 60 s)
    assert json.loads(node.process.stdout.readline()) == {"stopped": node.url}
    assert "g1: SIGTERM: draining 1 open request(s)" in node.log_path.read_text()


def test_a_draining_node_refuses_new_requests_and_a_second_signal_cuts_those_in_flight(nodes):
    processes, directory = nodes
    node = processes["g2"]
    with stream_at_its_first_tokens(node.url, node.url, workers=2) as (pool, stream):
        plain = pool.submit(httpx.post, f"{node.url}/v1/completions", json=body(MAX_TOKENS, stream=False), timeout=120)
        assert wait_until(lambda: health(node.url)["inflight"] == 2, timeout=30)
        node.process.send_signal(signal.SIGTERM)
        assert wait_until(lambda: health(node.url).get("status") == "draining", timeout=30)
        assert httpx.get(f"{node.url}/health", timeout=30).status_code == 503
        refused = httpx.post(f"{node.url}/v1/completions", json=body(4, stream=False), timeout=30)
        assert refused.status_code == 503
        assert refused.json()["error"]["message"] == ("node g2 is shutting down (SIGTERM) and takes no new "
                                                      "requests; send it to another node")  # fmt: skip
        assert wait_until(lambda: "g2" not in live(directory))  # routers stop choosing it
        assert not stream.done() and not plain.done()  # still running, not cut
        node.process.send_signal(signal.SIGTERM)  # the second: cut them now
        events, cut = stream.result(), plain.result()
    assert node.process.wait(timeout=60) == 0
    assert_cut(events, cut, "node g2 shut down before the request finished (cut at a second signal); no more "
                            "tokens come")  # fmt: skip


def test_a_node_whose_id_a_newer_process_took_over_serves_nothing_more(nodes):
    processes, directory = nodes
    node = processes["g3"]
    assert httpx.post(f"{node.url}/v1/completions", json=body(2, stream=False), timeout=60).status_code == 200
    old_epoch = httpx.get(f"{node.url}/health").json()["epoch"]
    # what a second process started with --node-id g3 does first (a Directory of a 60 s TTL,
    # so that the newer record outlives g3's next heartbeat)
    newer = Directory(directory.client, prefix=directory.prefix, node_ttl_s=60.0)
    epoch = newer.register("g3", "http://127.0.0.1:9", newer.cluster_info())
    try:
        assert wait_until(lambda: httpx.get(f"{node.url}/health").status_code == 503)
        health = httpx.get(f"{node.url}/health").json()
        message = (f"node g3 was taken over by a newer process of the same node id (epoch {epoch} at "
                   f"http://127.0.0.1:9; this process had epoch {old_epoch}) and serves no more requests; stop it, "
                   "or start it with another --node-id")  # fmt: skip
        assert health["status"] == "superseded" and health["directory"] == "superseded"
        assert health["error"] == message
        refused = httpx.post(f"{node.url}/v1/completions", json=body(2, stream=True), timeout=60)
        assert refused.status_code == 503 and refused.json()["error"]["message"] == message
        assert {view.node_id: view.address for view in directory.live_nodes()}["g3"] == "http://127.0.0.1:9"
    finally:
        newer.deregister("g3", epoch)


def test_a_router_stopped_by_sigterm_finishes_the_stream_it_passes_on_refuses_new_requests_and_exits_0(nodes):
    processes, _ = nodes
    node, router = processes["g4"], processes["router"]
    assert wait_until(lambda: health(router.url).get("status") == "ok", timeout=30)  # it routes to g4
    with stream_at_its_first_tokens(node.url, router.url) as (_, stream):  # its first tokens came through the router
        router.process.send_signal(signal.SIGTERM)
        assert wait_until(lambda: health(router.url).get("status") == "draining", timeout=30)
        draining = httpx.get(f"{router.url}/health", timeout=30)
        assert draining.status_code == 503 and draining.json()["open_requests"] == 1
        refused = httpx.post(f"{router.url}/v1/completions", json=body(4, stream=False), timeout=30)
        assert refused.status_code == 503
        assert refused.json()["error"]["message"] == ("router is shutting down (SIGTERM) and takes no new requests; "
                                                      "send it to another router")  # fmt: skip
        assert not stream.done()
        hold_steps(node.url, None)  # the rest of the stream, while the router drains
        events = stream.result()
    assert router.process.wait(timeout=60) == 0  # it stopped; SIGTERM did not kill it
    assert_finished(events)
    assert json.loads(router.process.stdout.readline()) == {"stopped": router.url}
    assert "router: SIGTERM: draining 1 open request(s)" in router.log_path.read_text()
    assert health(node.url)["status"] == "ok"  # its node serves on


def test_a_second_signal_to_a_draining_router_cuts_what_it_passes_on_and_tells_the_clients_why(nodes):
    processes, _ = nodes
    node, router = processes["g4"], processes["router2"]
    assert wait_until(lambda: health(router.url).get("status") == "ok", timeout=30)
    try:
        with stream_at_its_first_tokens(node.url, router.url, workers=2) as (pool, stream):
            plain = pool.submit(httpx.post, f"{router.url}/v1/completions", json=body(MAX_TOKENS, stream=False),
                                timeout=120)  # fmt: skip
            assert wait_until(lambda: health(node.url)["inflight"] == 2, timeout=30)  # both reached the node
            router.process.send_signal(signal.SIGTERM)
            assert wait_until(lambda: health(router.url).get("status") == "draining", timeout=30)
            assert not stream.done() and not plain.done()
            router.process.send_signal(signal.SIGTERM)  # the second: cut them now
            events, cut = stream.result(), plain.result()
    finally:
        hold_steps(node.url, None)
    assert router.process.wait(timeout=60) == 0
    assert_cut(events, cut, "router shut down before the request finished (cut at a second signal); no more "
                            "tokens come")  # fmt: skip


# --- the drain in process --------------------------------------------------------------------


def test_a_cut_ends_the_wait_and_the_stream_a_router_relays_and_says_why():
    async def scenario():
        drain, never, received, cancelled = Drain("router", 600, elsewhere="send it elsewhere"), asyncio.Event(), [], []
        got_first = asyncio.Event()

        async def chunks():  # a node that sends one chunk, then nothing
            yield b"first"
            await never.wait()

        async def answer():  # a node that does not answer
            try:
                await never.wait()
            except asyncio.CancelledError:
                cancelled.append("answer")
                raise

        async def relay():
            async for chunk in drain.until_cut(chunks()):
                received.append(chunk)
                got_first.set()

        assert await drain.unless_cut(asyncio.sleep(0, "answered")) == "answered"  # no cut: the work's result
        drain.open("plain")
        drain.open("stream")
        waiting, relaying = asyncio.ensure_future(drain.unless_cut(answer())), asyncio.ensure_future(relay())
        await got_first.wait()
        running = asyncio.ensure_future(drain.run("SIGTERM"))
        drain.cut_now()
        await running
        results = await asyncio.gather(waiting, relaying, return_exceptions=True)
        return drain, results, received, cancelled

    drain, results, received, cancelled = asyncio.run(scenario())
    assert results == [drain.cut, drain.cut] and drain.cut.status == 503
    assert str(drain.cut) == "router shut down before the request finished (cut at a second signal); " \
        "no more tokens come"  # fmt: skip
    assert received == [b"first"] and cancelled == ["answer"]


def test_requests_still_open_after_the_grace_are_cut_and_told_why():
    async def scenario():
        drain, events, cancelled, left = NodeDrain("n7", grace_s=0), asyncio.Queue(), [], []
        drain.open("r1", lambda error: (events.put_nowait(error), cancelled.append("r1")))
        await drain.run("SIGTERM", lambda: left.append("n7"))
        return drain, events.get_nowait(), cancelled, left

    drain, told, cancelled, left = asyncio.run(scenario())
    assert isinstance(told, RequestError) and told.status == 503 and told is drain.cut
    assert str(told) == "node n7 shut down before the request finished (still open 0 s after SIGTERM); " \
        "no more tokens come"  # fmt: skip
    assert cancelled == ["r1"] and left == ["n7"]
    with pytest.raises(RequestError, match=r"node n7 is shutting down \(SIGTERM\) and takes no new requests"):
        drain.open("r2")


def test_a_drain_ends_when_the_last_open_request_is_answered_and_cuts_nothing():
    async def scenario():
        drain, events = NodeDrain("n7", grace_s=600), asyncio.Queue()
        drain.open("r1", events.put_nowait)
        running = asyncio.ensure_future(drain.run("SIGTERM", lambda: None))
        await asyncio.sleep(0)
        assert not running.done() and drain.draining
        drain.close("r1")  # answered
        await running
        return drain, events

    drain, events = asyncio.run(scenario())
    assert drain.cut is None and events.empty() and drain.num_open == 0


@pytest.mark.parametrize("grace_s", [-1, float("inf"), float("nan"), "5", True])
def test_a_grace_that_is_not_a_finite_number_of_seconds_is_refused(grace_s):
    with pytest.raises(ValueError, match=r"grace_s=.* must be a finite number of seconds >= 0"):
        NodeDrain("n7", grace_s)


def test_a_bad_drain_setting_is_refused_in_one_line_before_compiling():
    with pytest.raises(SystemExit, match=r"node: --drain-s: grace_s=-1.0 must be a finite number of seconds >= 0"):
        cluster_main(["node", "--node-id", "n7", "--drain-s", "-1"])
    with pytest.raises(SystemExit, match=r"router: --drain-s: grace_s=-1.0 must be a finite number of seconds >= 0"):
        cluster_main(["router", "--redis", "redis://127.0.0.1:1/0", "--drain-s", "-1"])
