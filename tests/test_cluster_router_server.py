"""The router as a real process in front of two real nodes, on a real Redis: the openai client
through it gives a single node's text; routing follows the directory, per namespace; a node
that cannot be reached is skipped; a second router process sees the same state."""

import asyncio
import http.server
import json
import re
import socket
import threading
import uuid

import httpx
import openai
import pytest
from cluster_fixtures import (
    check_bodies_over_the_limit_get_a_413,
    check_unknown_fields_are_ignored,
    decode_tokens,
    hang_up_while_generating,
    speak_for,
    start_router,
    wait_until,
)
from fastapi.testclient import TestClient

from kvjax.cache.block_keys import Namespace, as_namespace, chained_block_keys
from kvjax.cluster.__main__ import main as cluster_main
from kvjax.cluster.directory import ClusterInfo, Directory, tier_mask
from kvjax.cluster.openai_api import CompletionRequest, RequestError
from kvjax.cluster.redis_process import RedisProcess
from kvjax.cluster.router import RouterConfig, RoutingPolicy
from kvjax.cluster.router_server import RouterService, _after_last_event, create_router_app

PROMPT = "You are a terse assistant.\nQ: name a prime number.\nA:"


@pytest.fixture(scope="module")
def router_client(cluster):
    with openai.OpenAI(base_url=f"{cluster.router.url}/v1", api_key="unused", max_retries=0) as client:
        yield client


@pytest.fixture(scope="module")
def node_client(cluster):
    with openai.OpenAI(base_url=f"{cluster.nodes['n1'].url}/v1", api_key="unused", max_retries=0) as client:
        yield client


def post(url, body, **kwargs):
    return httpx.post(f"{url}/v1/completions", json=body, timeout=60, **kwargs)


def pretend_node_holds(directory, node_id, prompt, namespace=None, blocks=None):
    """Write directory entries as if ``node_id`` held the prompt's blocks (the cache's event
    stream is not wired to nodes yet; the router's path is what this exercises)."""
    keys = chained_block_keys(list(prompt.encode()), 16, namespace)[:blocks]
    epoch = speak_for(directory, node_id)
    digest = as_namespace(namespace).digest()
    directory.write_blocks(node_id, epoch, {(digest, key): tier_mask(["device"]) for key in keys})
    return len(keys)


def test_openai_client_through_the_router_gives_a_single_nodes_text(router_client, node_client):
    direct = node_client.completions.create(model="tiny", prompt=PROMPT, max_tokens=16).choices[0].text
    routed = router_client.completions.create(model="tiny", prompt=PROMPT, max_tokens=16).choices[0].text
    chunks = list(router_client.completions.create(model="tiny", prompt=PROMPT, max_tokens=16, stream=True))
    streamed = "".join(choice.text for chunk in chunks for choice in chunk.choices)
    assert routed == direct and streamed == direct
    assert [c.finish_reason for chunk in chunks for c in chunk.choices if c.finish_reason] == ["length"]


def test_the_router_follows_the_directory_within_the_namespace(cluster):
    directory = cluster.directory()
    prompt = f"Shared system prompt {uuid.uuid4().hex} that spans several pages of tokens.\nQ: hi\nA:"
    blocks = pretend_node_holds(directory, "n2", prompt, "tenant-a")
    for _ in range(3):  # affinity, not a lucky turn
        body = {"model": "tiny", "prompt": prompt, "max_tokens": 2, "namespace": "tenant-a"}
        response = post(cluster.router.url, body)
        assert response.status_code == 200
        assert response.headers["x-kvjax-node"] == "n2"
        assert response.headers["x-kvjax-route"] == f"affinity; prefix_blocks={blocks}"
    # the same prompt in another tenant gets no routing signal from tenant-a's blocks
    other = post(cluster.router.url, {"model": "tiny", "prompt": prompt, "max_tokens": 2},
                 headers={"x-kvjax-namespace": "tenant-b"})  # fmt: skip
    assert other.status_code == 200 and other.headers["x-kvjax-route"].startswith("no_prefix")


def test_a_prompt_nobody_holds_returns_to_the_node_that_dropped_it(cluster):
    """A dropped first block (as a node's publisher marks it) sends the prompt back to that
    node through the HTTP router, in its namespace only."""
    directory = cluster.directory()
    prompt = f"Document {uuid.uuid4().hex} that every node has evicted by now.\nQ: gist?\nA:"
    pretend_node_holds(directory, "n2", prompt, "tenant-a")
    keys, digest = chained_block_keys(list(prompt.encode()), 16, "tenant-a"), Namespace("tenant-a").digest()
    epoch = speak_for(directory, "n2")
    directory.write_blocks("n2", epoch, {(digest, key): 0 for key in keys}, dropped={(digest, keys[0]): 1})
    body = {"model": "tiny", "prompt": prompt, "max_tokens": 2, "namespace": "tenant-a"}
    routes = []
    for _ in range(3):  # the drop decides, then n2 holds it again
        response = post(cluster.router.url, body)
        assert response.status_code == 200 and response.headers["x-kvjax-node"] == "n2"
        routes.append(response.headers["x-kvjax-route"])
    assert routes[0] == "returning; prefix_blocks=0"
    assert all(route == routes[0] or route.startswith("affinity") for route in routes[1:])
    other = post(cluster.router.url, {**body, "namespace": "tenant-b"})
    assert other.status_code == 200 and other.headers["x-kvjax-route"].startswith("no_prefix")


def test_requests_follow_the_blocks_a_node_published(cluster):
    """No pretending: the node that served a prompt publishes its blocks (the cache's events),
    and the next request sharing the prompt goes there; another tenant's does not."""
    directory = cluster.directory()
    prompt = f"System prompt {uuid.uuid4().hex}: answer in one word, politely and precisely.\nQ: sky?\nA:"
    first = post(cluster.router.url, {"model": "tiny", "prompt": prompt, "max_tokens": 4, "namespace": "tenant-x"})
    served_by = first.headers["x-kvjax-node"]
    keys = chained_block_keys(list(prompt.encode()), 16, "tenant-x")

    def held():
        return {view.node_id: view.prefix_blocks for view in directory.lookup(Namespace("tenant-x").digest(), keys)}

    assert wait_until(lambda: held()[served_by] == len(keys))
    assert max(blocks for node, blocks in held().items() if node != served_by) == 0
    follow_up = {"model": "tiny", "prompt": prompt + " Blue.\nQ: grass?\nA:", "max_tokens": 4, "namespace": "tenant-x"}
    for _ in range(2):
        response = post(cluster.router.url, follow_up)
        assert response.headers["x-kvjax-node"] == served_by
        assert response.headers["x-kvjax-route"].startswith("affinity; prefix_blocks=")
        assert response.json()["usage"]["prompt_tokens_details"]["cached_tokens"] >= len(keys) * 16
    other_tenant = post(cluster.router.url, {**follow_up, "namespace": "tenant-y"})
    assert other_tenant.headers["x-kvjax-route"].startswith("no_prefix")
    assert other_tenant.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == 0


def test_a_restarted_router_routes_from_the_same_state(cluster, redis_server, tmp_path):
    directory = cluster.directory()
    prompt = f"Another system prompt {uuid.uuid4().hex} that spans several pages.\nQ: hi\nA:"
    pretend_node_holds(directory, "n1", prompt)
    second = start_router(redis_server.url, cluster.prefix, tmp_path, name="router2",
                          extra=("--max-body-bytes", "4096"))  # a new process: no memory  # fmt: skip
    try:
        response = post(second.url, {"model": "tiny", "prompt": prompt, "max_tokens": 2})
        assert response.status_code == 200 and response.headers["x-kvjax-node"] == "n1"
        too_large = post(second.url, {"model": "tiny", "prompt": "x" * 5000, "max_tokens": 2})
        assert too_large.status_code == 413 and "4096" in too_large.json()["error"]["message"]
    finally:
        second.stop()


def test_a_node_that_cannot_be_reached_is_skipped(cluster):
    directory = cluster.directory()
    prompt = f"A prompt {uuid.uuid4().hex} whose blocks a dead address seems to hold.\nQ: hi\nA:"
    directory.register("ghost", "http://127.0.0.1:1", ClusterInfo("tiny", 16))  # nothing listens there
    try:
        pretend_node_holds(directory, "ghost", prompt)
        response = post(cluster.router.url, {"model": "tiny", "prompt": prompt, "max_tokens": 2})
        assert response.status_code == 200 and response.headers["x-kvjax-node"] in {"n1", "n2"}
        metrics = httpx.get(f"{cluster.router.url}/metrics").text
        assert 'kvjax_router_forward_errors_total{node="ghost"} 1.0' in metrics
    finally:
        directory.client.delete(directory.node_key("ghost"))


def test_a_node_that_breaks_off_its_answer_is_skipped(cluster):
    """A node that sends headers and half a body, then dies: the router retries elsewhere."""
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(4)

        def break_off():
            conn, _ = listener.accept()
            with conn:
                conn.recv(65536)
                conn.sendall(b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: 500\r\n\r\n{\"id")

        threading.Thread(target=break_off, daemon=True).start()
        directory = cluster.directory()
        prompt = f"A prompt {uuid.uuid4().hex} whose blocks a failing node seems to hold.\nQ: hi\nA:"
        directory.register("broken", f"http://127.0.0.1:{listener.getsockname()[1]}", ClusterInfo("tiny", 16))
        try:
            pretend_node_holds(directory, "broken", prompt)
            response = post(cluster.router.url, {"model": "tiny", "prompt": prompt, "max_tokens": 2})
            assert response.status_code == 200 and response.headers["x-kvjax-node"] in {"n1", "n2"}
            assert response.json()["choices"][0]["finish_reason"] == "length"
        finally:
            directory.client.delete(directory.node_key("broken"))


class FakeNode:
    """A node in the directory that seems to hold a fresh prompt, served by a socket that reads
    one request, sends ``reply`` (raw HTTP) and hangs up."""

    def __init__(self, cluster, node_id, reply: bytes):
        self.directory, self.node_id = cluster.directory(), node_id
        self.prompt = f"A prompt {uuid.uuid4().hex} whose blocks node {node_id} seems to hold.\nQ: hi\nA:"
        self.listener = socket.socket()
        self.listener.bind(("127.0.0.1", 0))
        self.listener.listen(4)
        threading.Thread(target=self._answer, args=(reply,), daemon=True).start()

    def _answer(self, reply):
        conn, _ = self.listener.accept()
        with conn:
            request = b""
            while b"\r\n\r\n" not in request:  # all of it: a close with unread bytes is a reset
                request += conn.recv(65536)
            head, body = request.split(b"\r\n\r\n", 1)
            length = int(re.search(rb"(?i)content-length: *(\d+)", head).group(1))
            while len(body) < length:
                body += conn.recv(65536)
            conn.sendall(reply)

    def __enter__(self):
        address = f"http://127.0.0.1:{self.listener.getsockname()[1]}"
        self.directory.register(self.node_id, address, ClusterInfo("tiny", 16))
        pretend_node_holds(self.directory, self.node_id, self.prompt)
        return self

    def __exit__(self, *_):
        self.directory.client.delete(self.directory.node_key(self.node_id))
        self.listener.close()


def sse_head():
    return b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"


def chunk(data: bytes) -> bytes:
    return b"%x\r\n%s\r\n" % (len(data), data)


def stream_events(url, prompt):
    """The streamed answer's node and events (parsed JSON, or "[DONE]")."""
    body = {"model": "tiny", "prompt": prompt, "max_tokens": 4, "stream": True}
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=60) as response:
        assert response.status_code == 200
        lines = [line[len("data: ") :] for line in response.iter_lines() if line.startswith("data: ")]
    return response.headers["x-kvjax-node"], [line if line == "[DONE]" else json.loads(line) for line in lines]


def test_a_node_that_answers_a_plain_text_500_is_skipped(cluster):
    """A 500 (a node whose server cancelled the request, a proxy's error page): the client has
    no token of it, so the router sends it to another node instead of passing the 500 on."""
    reply = b"HTTP/1.1 500 Internal Server Error\r\ncontent-type: text/plain\r\ncontent-length: 21\r\n\r\n" \
        b"Internal Server Error"  # fmt: skip
    with FakeNode(cluster, "failing", reply) as fake:
        response = post(cluster.router.url, {"model": "tiny", "prompt": fake.prompt, "max_tokens": 2})
    assert response.status_code == 200 and response.headers["x-kvjax-node"] in {"n1", "n2"}
    assert response.json()["choices"][0]["finish_reason"] == "length"


@pytest.mark.parametrize(
    "reply",
    [
        pytest.param(sse_head(), id="broken-before-its-first-event"),
        pytest.param(sse_head() + chunk(b'data: {"id'), id="broken-within-its-first-event"),
        pytest.param(sse_head() + chunk(b'data: {"error":{"message":"node shut down"}}\n\ndata: [DONE]\n\n')
                     + b"0\r\n\r\n", id="an-error-event-first"),  # fmt: skip
    ],
)
def test_a_stream_that_fails_before_its_first_token_is_sent_to_another_node(cluster, reply):
    with FakeNode(cluster, "cut", reply) as fake:
        node, events = stream_events(cluster.router.url, fake.prompt)
    assert node in {"n1", "n2"} and events[-1] == "[DONE]"
    assert not any("error" in event for event in events[:-1])
    assert [c["finish_reason"] for e in events[:-1] for c in e["choices"] if c["finish_reason"]] == ["length"]


def test_a_stream_broken_after_a_token_ends_with_an_error_event_and_is_not_retried(cluster):
    token = b'data: {"id":"cmpl-1","object":"text_completion","created":0,"model":"tiny","choices":[{"index":0,' \
        b'"text":"A","logprobs":null,"finish_reason":null}]}\n\n'  # fmt: skip
    with FakeNode(cluster, "broke", sse_head() + chunk(token) + chunk(b"data: {")) as fake:
        node, events = stream_events(cluster.router.url, fake.prompt)
    assert node == "broke"  # the client had text from it: not sent again elsewhere
    assert events[0]["choices"][0]["text"] == "A"
    assert events[1:] == [{"error": {"message": "node broke broke off the stream: RemoteProtocolError",
                                     "type": "server_error", "param": None, "code": None}}, "[DONE]"]  # fmt: skip


def test_a_node_that_stays_silent_gets_the_client_a_504_not_a_retry(cluster):
    """A node that takes the request and never answers: past the read timeout the client gets
    a 504 naming it (the router used to wait for good); the request is not sent elsewhere."""
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(4)
        held = []
        threading.Thread(target=lambda: held.append(listener.accept()), daemon=True).start()
        directory = cluster.directory()
        prompt = f"A prompt {uuid.uuid4().hex} whose blocks a silent node seems to hold.\nQ: hi\nA:"
        directory.register("silent", f"http://127.0.0.1:{listener.getsockname()[1]}", ClusterInfo("tiny", 16))
        try:
            pretend_node_holds(directory, "silent", prompt)
            app = create_router_app(RouterService(directory), read_timeout_s=0.5)
            with TestClient(app) as client:
                response = client.post("/v1/completions", json={"model": "tiny", "prompt": prompt, "max_tokens": 2})
            assert response.status_code == 504
            assert response.json()["error"]["message"] == "node silent sent nothing for 0.5 s while answering"
        finally:
            directory.client.delete(directory.node_key("silent"))
            for conn, _ in held:
                conn.close()


@pytest.mark.parametrize("stream", [False, True])
def test_a_client_that_leaves_the_router_cancels_the_nodes_work(cluster, stream):
    """The router closes its request to the node when its client leaves (before the answer, or
    mid-stream), so the node cancels the engine's work; a non-streamed one used to wait on."""
    urls = [node.url for node in cluster.nodes.values()]
    assert wait_until(lambda: sum(httpx.get(f"{url}/health").json()["inflight"] for url in urls) == 0, timeout=60)
    before = sum(decode_tokens(url) for url in urls)
    body = {"model": "tiny", "prompt": f"Q: {uuid.uuid4().hex}\nA:", "max_tokens": 1500, "stream": stream}
    hang_up_while_generating(cluster.router.url, urls, body)
    assert wait_until(lambda: sum(httpx.get(f"{url}/health").json()["inflight"] for url in urls) == 0, timeout=120)
    assert sum(decode_tokens(url) for url in urls) - before < 1000  # cancelled, not run to its 1,500th token


@pytest.fixture
def answering_node():
    """Start HTTP servers that answer every POST with one JSON reply: ``(status, body)`` -> its address."""
    servers = []

    def start(status, body):
        class Handler(http.server.BaseHTTPRequestHandler):
            def do_POST(self):
                self.rfile.read(int(self.headers.get("content-length", 0)))
                data = json.dumps(body).encode()
                self.send_response(status)
                self.send_header("content-type", "application/json")
                self.send_header("content-length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, *args):
                pass

        server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        threading.Thread(target=server.serve_forever, daemon=True).start()
        servers.append(server)
        return f"http://127.0.0.1:{server.server_port}"

    yield start
    for server in servers:
        server.shutdown()
        server.server_close()


def test_a_namespace_header_outside_ascii_is_a_400_not_a_500(directory, answering_node):
    """The router crashed forwarding it (httpx sends header values as ASCII): a plain-text 500."""
    directory.register("n1", answering_node(200, {"ok": True}), ClusterInfo("tiny", 16))
    with TestClient(create_router_app(RouterService(directory)), raise_server_exceptions=False) as client:
        response = client.post("/v1/completions", content=b'{"model": "tiny", "prompt": "Hi", "max_tokens": 2}',
                               headers={"content-type": "application/json",
                                        "x-kvjax-namespace": "tenant-\u00e9".encode()})  # fmt: skip
    assert response.status_code == 400
    error = response.json()["error"]
    assert error["param"] == "namespace" and "send such a namespace in the body's namespace field" in error["message"]


def test_a_salted_request_is_routed_by_the_blocks_of_its_salt(directory, answering_node):
    """The router keys a request's prompt in its tenant and cache_salt, as the nodes key its
    blocks: a salted follow-up goes to the node holding the salted prefix, and no unsalted or
    differently salted holder gets credit for it."""
    prompt = f"A private document {uuid.uuid4().hex} that spans several pages of tokens.\nQ: gist?\nA:"
    for node_id in ("salted", "plain"):
        directory.register(node_id, answering_node(200, {"served_by": node_id}), ClusterInfo("tiny", 16))
    blocks = pretend_node_holds(directory, "salted", prompt, Namespace("tenant-a", salt="user-7"))
    pretend_node_holds(directory, "plain", prompt, "tenant-a")
    body = {"model": "tiny", "prompt": prompt, "max_tokens": 2, "namespace": "tenant-a"}
    with TestClient(create_router_app(RouterService(directory))) as client:
        for extra, node in (({"cache_salt": "user-7"}, "salted"), ({}, "plain"), ({"cache_salt": None}, "plain")):
            for _ in range(2):  # affinity, not a lucky turn
                response = client.post("/v1/completions", json={**body, **extra})
                assert (response.status_code, response.json()) == (200, {"served_by": node}), extra
                assert response.headers["x-kvjax-route"] == f"affinity; prefix_blocks={blocks}", extra
        for other in ({"cache_salt": "user-8"}, {"namespace": "tenant-b", "cache_salt": "user-7"}):
            response = client.post("/v1/completions", json={**body, **other})
            assert response.status_code == 200 and response.headers["x-kvjax-route"].startswith("no_prefix"), other
        bad = client.post("/v1/completions", json={**body, "cache_salt": 7})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "cache_salt"
    assert bad.json()["error"]["message"] == "cache_salt=7 must be a non-empty string"


def test_a_node_whose_address_is_no_url_is_skipped(directory, answering_node):
    """A record whose address httpx refuses as a URL ("http://::1:8001", as a node on an IPv6
    host advertised itself) failed every request routed there with a 500."""
    prompt = f"A prompt {uuid.uuid4().hex} whose blocks a node with a bad address seems to hold.\nQ: hi\nA:"
    directory.register("bad", "http://::1:8001", ClusterInfo("tiny", 16))
    pretend_node_holds(directory, "bad", prompt)
    directory.register("good", answering_node(200, {"served": True}), ClusterInfo("tiny", 16))
    service = RouterService(directory)
    with TestClient(create_router_app(service), raise_server_exceptions=False) as client:
        response = client.post("/v1/completions", json={"model": "tiny", "prompt": prompt, "max_tokens": 2})
    assert (response.status_code, response.json(), response.headers["x-kvjax-node"]) == (200, {"served": True}, "good")
    assert service.forward_errors.labels("bad")._value.get() == 1


def test_when_every_node_refuses_the_client_gets_their_reasons(directory, answering_node):
    """With two nodes and three attempts, the third decision found no node left and its "no
    live node to route to" replaced the reasons the nodes gave."""
    reason = "the engine rejected the request: waiting queue is full (64 requests, max_waiting=64)"
    for node_id in ("f0", "f1"):
        address = answering_node(503, {"error": {"message": reason, "type": "server_error", "param": None,
                                                 "code": None}})  # fmt: skip
        directory.register(node_id, address, ClusterInfo("tiny", 16))
    with TestClient(create_router_app(RouterService(directory, max_attempts=3))) as client:
        response = client.post("/v1/completions", json={"model": "tiny", "prompt": "Hi", "max_tokens": 2})
    assert response.status_code == 503
    message = response.json()["error"]["message"]
    assert message.startswith("no node could serve the request (2 tried: ")
    assert sorted(re.findall(rf"(f\d): 503 {re.escape(reason)}", message)) == ["f0", "f1"]  # the message, not JSON


def test_a_request_too_large_for_one_nodes_pool_goes_to_a_node_that_holds_it(directory, answering_node):
    """A node refuses what its own page pool cannot hold with a 400 (code node_capacity_exceeded):
    a node with a larger pool may serve it, so the router tries it; only when every node tried
    refuses does the client get that 400 (not a 503: no node of this cluster ever serves it)."""
    too_large = {"error": {"message": "a prompt of 1500 tokens + max_tokens=16 needs 1516 tokens; this node's page "
                                      "pool holds 1024 tokens (64 blocks of 16): shorten the prompt to at most 1008 "
                                      "tokens", "type": "invalid_request_error", "param": "prompt",
                           "code": "node_capacity_exceeded"}}  # fmt: skip
    directory.register("small", answering_node(400, too_large), ClusterInfo("tiny", 16))
    large = directory.register("large", answering_node(200, {"served": True}), ClusterInfo("tiny", 16))
    policy = RoutingPolicy(RouterConfig(strategy="round_robin"))
    body = {"model": "tiny", "prompt": "Hi", "max_tokens": 2}
    with TestClient(create_router_app(RouterService(directory, policy, max_attempts=3))) as client:
        answers = [client.post("/v1/completions", json=body) for _ in range(4)]  # round robin: each node first twice
        assert [(a.status_code, a.json(), a.headers["x-kvjax-node"]) for a in answers] == [
            (200, {"served": True}, "large")] * 4
        directory.deregister("large", large)
        refused = client.post("/v1/completions", json=body)
    assert (refused.status_code, refused.json()) == (400, too_large)


def test_every_error_of_the_router_is_an_openai_error_body(directory):
    """Unknown routes and methods answered FastAPI's {"detail": ...}, which OpenAI clients do
    not read; GET /v1/models/{model} (the client's models.retrieve) did not exist."""
    directory.register("n1", "http://127.0.0.1:1", ClusterInfo("tiny", 16))
    with TestClient(create_router_app(RouterService(directory))) as client:
        assert client.get("/v1/models/tiny").json() == {"id": "tiny", "object": "model", "created": 0,
                                                        "owned_by": "kvjax"}  # fmt: skip
        for method, path, status, message, code in [
            ("POST", "/v1/chat/completions", 404, "Invalid URL (POST /v1/chat/completions); this server answers "
             "POST /v1/completions, GET /v1/models, GET /v1/models/{model}, GET /health, GET /metrics", None),
            ("GET", "/v1/completions", 405, "method GET is not allowed on /v1/completions; use POST", None),
            ("GET", "/v1/models/llama", 404, "model='llama' is not served here; the cluster serves 'tiny'",
             "model_not_found"),
            ("POST", "/v1/completions", 404, "model='llama' is not served here; the cluster serves 'tiny'",
             "model_not_found"),
        ]:  # fmt: skip
            response = client.request(method, path, json={"model": "llama", "prompt": "x"})
            assert response.status_code == status, (method, path)
            assert response.json() == {"error": {"message": message, "type": "invalid_request_error",
                                                 "param": "model" if code else None, "code": code}}  # fmt: skip


def test_a_client_that_leaves_while_sending_its_body_is_no_server_error(directory):
    """Starlette's ClientDisconnect reached the catch-all handler: a 500 and an "Exception in
    ASGI application" traceback in the log for each client that hung up mid-upload."""
    directory.register("n1", "http://127.0.0.1:1", ClusterInfo("tiny", 16))
    app = create_router_app(RouterService(directory))
    messages = iter([{"type": "http.request", "body": b'{"model": "ti', "more_body": True}, {"type": "http.disconnect"}])
    sent = []

    async def receive():
        return next(messages)

    async def send(message):
        sent.append(message)

    scope = {"type": "http", "asgi": {"version": "3.0", "spec_version": "2.3"}, "http_version": "1.1",
             "method": "POST", "scheme": "http", "path": "/v1/completions", "raw_path": b"/v1/completions",
             "query_string": b"", "root_path": "", "headers": [(b"content-type", b"application/json")],
             "client": ("127.0.0.1", 1), "server": ("127.0.0.1", 2)}  # fmt: skip
    asyncio.run(app(scope, receive, send))  # raised ClientDisconnect, after a 500
    assert sent[0]["status"] == 499


def test_a_huge_token_id_is_named_as_the_integer_sent(directory):
    """numpy turned [1, 2**63] into float64: the router answered 'token id 9.223372036854776e+18'."""
    directory.register("n1", "http://127.0.0.1:1", ClusterInfo("tiny", 16))
    with TestClient(create_router_app(RouterService(directory))) as client:
        response = client.post("/v1/completions", json={"model": "tiny", "prompt": [1, 2**63]})
    assert response.status_code == 400
    assert response.json()["error"]["param"] == "prompt"
    assert response.json()["error"]["message"].startswith("token id 9223372036854775808 at index 1 is out of range")


def test_a_read_timeout_that_is_not_a_positive_number_is_refused(directory):
    for bad in (0, -1.0, float("inf"), "5"):
        with pytest.raises(ValueError, match=r"read_timeout_s=.* must be a positive finite number of seconds"):
            create_router_app(RouterService(directory), read_timeout_s=bad)
    with pytest.raises(SystemExit, match=r"router: read_timeout_s=0.0 must be a positive finite number"):
        cluster_main(["router", "--redis", "redis://127.0.0.1:1/0", "--read-timeout-s", "0"])


def test_health_lists_the_live_nodes_and_metrics_count_decisions(cluster):
    health = httpx.get(f"{cluster.router.url}/health").json()
    assert health["status"] == "ok" and health["strategy"] == "prefix"
    assert {"n1", "n2"} <= set(health["nodes"])
    assert httpx.get(f"{cluster.router.url}/v1/models").json()["data"][0]["id"] == "tiny"
    post(cluster.router.url, {"model": "tiny", "prompt": "count me", "max_tokens": 1})
    metrics = httpx.get(f"{cluster.router.url}/metrics").text
    assert "kvjax_router_requests_total{" in metrics and "kvjax_router_decision_seconds_bucket" in metrics


@pytest.mark.parametrize(
    "body, status, message",
    [
        ({"model": "llama", "prompt": "x"}, 404, "model='llama' is not served here; the cluster serves 'tiny'"),
        ({"model": "tiny", "prompt": "x", "max_tokens": -1}, 400, "max_tokens=-1 must be an integer >= 1"),
        ({"model": "tiny", "prompt": [1, -5]}, 400, "token id -5 at index 1 is out of range"),
        ({"model": "tiny", "prompt": "x", "max_tokens": 100000}, 400, "max_model_len=2048"),  # the node's answer
    ],
)
def test_bad_requests_get_a_clear_error_from_the_router(cluster, body, status, message):
    response = post(cluster.router.url, body)
    assert response.status_code == status
    assert message in response.json()["error"]["message"]


@pytest.mark.parametrize("body, param, message", [
    ({"model": "tiny", "prompt": "a" * 2040}, "max_tokens",  # with the default max_tokens of 16
     "a prompt of 2040 tokens + max_tokens=16 needs 2056 tokens; max_model_len=2048: lower max_tokens to at most 8"),
    ({"model": "tiny", "prompt": "a" * 3000, "max_tokens": 1}, "prompt",
     "a prompt of 3000 tokens + max_tokens=1 needs 3001 tokens; max_model_len=2048: shorten the prompt to at most "
     "2047 tokens"),
    ({"model": "tiny", "prompt": ""}, "prompt", "prompt is empty (0 tokens); expected at least one token"),
    ({"model": "tiny", "prompt": [65, 300]}, "prompt",
     "token id 300 at index 1 is out of range; expected 0 <= id < 256 (vocab_size=256)"),
])  # fmt: skip
def test_the_engines_refusals_name_the_parameter_on_node_and_router_alike(cluster, body, param, message):
    """They came back with param null and the node's internal request id in the message."""
    for url in (cluster.nodes["n1"].url, cluster.router.url):
        response = post(url, body)
        assert response.status_code == 400
        assert response.json()["error"] == {"message": message, "type": "invalid_request_error", "param": param,
                                            "code": "context_length_exceeded" if "max_model_len" in message
                                            else None}, url  # fmt: skip


def test_a_body_that_is_not_json_is_refused(cluster):
    response = httpx.post(f"{cluster.router.url}/v1/completions", content=b"model=tiny")
    assert response.status_code == 400 and "not valid JSON" in response.json()["error"]["message"]


def test_a_router_without_nodes_says_so(directory):
    service = RouterService(directory)  # an empty prefix: no node ever registered
    with pytest.raises(RequestError, match=f"no node has registered under prefix {directory.prefix!r} yet") as error:
        service.decide(CompletionRequest("tiny", "x", None))
    assert error.value.status == 503
    directory.register("gone", "http://127.0.0.1:1", ClusterInfo("tiny", 16))
    directory.client.delete(directory.node_key("gone"))  # registered once, not live now
    with pytest.raises(RequestError, match=r"no live node to route to \(0 live, excluded: \[\]\)"):
        service.decide(CompletionRequest("tiny", "x", None))


def test_a_router_started_before_redis_is_not_ready_naming_it_until_it_answers(tmp_path):
    with socket.socket() as probe:  # a free port, where Redis will come up later
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    url, prefix = f"redis://127.0.0.1:{port}/0", f"late{uuid.uuid4().hex[:8]}"
    router = start_router(url, prefix, tmp_path, wait=False)
    try:
        # what it prints first says it is not ready, and why; it serves: /health says so too
        first = router.wait_line(timeout_s=60)
        assert "ready" not in first and first["directory"] == url
        assert first["reason"].startswith(f"the directory at {url} cannot be reached: ConnectionError")
        assert first["reason"].endswith("; the router routes once it answers")
        address = first["not_ready"]
        health = httpx.get(f"{address}/health", timeout=30)
        assert health.status_code == 503
        assert health.json()["status"] == "directory unreachable" and health.json()["directory"] == url
        assert health.json()["error"].startswith(f"the directory at {url} cannot be reached: ConnectionError")
        refused = post(address, {"model": "tiny", "prompt": "x", "max_tokens": 1})
        assert refused.status_code == 503
        assert refused.json()["error"]["message"].startswith(f"the directory at {url} cannot be reached")
        assert f"router: the directory at {url} cannot be reached" in router.log_path.read_text()
        with RedisProcess.start(port=port) as server:
            assert router.wait_ready(timeout_s=60).url == address  # ready once Redis answers
            directory = Directory.connect(server.url, prefix=prefix)
            assert httpx.get(f"{router.url}/health").json()["status"] == "no live node"  # Redis answers
            directory.register("n1", "http://127.0.0.1:1", ClusterInfo("tiny", 16))
            health = httpx.get(f"{router.url}/health")
            assert health.status_code == 200 and health.json()["status"] == "ok" and health.json()["directory"] == url
            directory.client.close()
    finally:
        router.stop()


def test_the_directory_names_its_redis_without_the_password():
    assert Directory.connect("redis://:secret@10.0.0.5:6380/2").address == "redis://10.0.0.5:6380/2"
    assert Directory.connect("rediss://user:secret@cache.example:6390/0").address == "rediss://cache.example:6390/0"
    assert Directory.connect("unix:///run/redis.sock?db=1").address == "unix:///run/redis.sock?db=1"
    assert Directory.connect("unix:///run/redis.sock").address == "unix:///run/redis.sock"


def test_an_unknown_strategy_is_refused_at_start(capsys):
    with pytest.raises(SystemExit) as exit_info:
        cluster_main(["router", "--redis", "redis://127.0.0.1:1/0", "--strategy", "fastest"])
    assert exit_info.value.code == 2
    assert "invalid choice: 'fastest'" in capsys.readouterr().err


def test_a_bad_guard_setting_is_refused_at_start():
    with pytest.raises(SystemExit, match=r"router: fair_window=0 must be an int >= 1 \(decisions\)"):
        cluster_main(["router", "--redis", "redis://127.0.0.1:1/0", "--fair-window", "0"])
    with pytest.raises(SystemExit, match=r"router: share_slack_abs=0.0 must be >= 1 \(requests\)"):
        cluster_main(["router", "--redis", "redis://127.0.0.1:1/0", "--share-slack-abs", "0"])
    for command in (["router", "--redis", "redis://127.0.0.1:1/0"], ["node", "--node-id", "n7"]):
        with pytest.raises(SystemExit, match=rf"{command[0]}: --max-body-bytes 0 must be >= 1 \(bytes\)"):
            cluster_main([*command, "--max-body-bytes", "0"])


@pytest.mark.parametrize("data, end", [(b"data: a", 0), (b"data: a\n\n", 9), (b"data: a\n\ndata: b", 9),
                                       (b"data: a\r\n\r\ndata: b", 11), (b"data: a\n\ndata: b\r\n\r\n", 20)])
def test_events_end_at_a_blank_line_with_lf_or_crlf_line_ends(data, end):
    """SSE allows CRLF line ends; the router looked for LF ones only, and held a CRLF-framed
    stream back until it ended."""
    assert _after_last_event(data) == end


def test_the_router_reads_the_cluster_record_again_after_redis_lost_it(directory):
    """Redis lost its data and nodes of another model registered: a router that kept the first
    record for good answered 404 to the model now served (and keyed prompts with the old page
    size) until it was restarted."""
    directory.register("n1", "http://127.0.0.1:1", ClusterInfo("tiny", 16))
    fresh, kept = RouterService(directory, cluster_refresh_s=0), RouterService(directory, cluster_refresh_s=3600)
    assert fresh.cluster().model == kept.cluster().model == "tiny"
    directory.client.delete(*directory.client.keys(f"{directory.prefix}:*"))  # Redis lost this prefix's data
    assert fresh.cluster().model == "tiny"  # no record for now: the last one stays
    directory.register("n2", "http://127.0.0.1:1", ClusterInfo("other", 32))
    assert (fresh.cluster().model, fresh.cluster().page_size) == ("other", 32)
    assert kept.cluster().model == "tiny"  # read again only once it is cluster_refresh_s old
    with pytest.raises(ValueError, match=r"cluster_refresh_s=-1 must be a finite number of seconds >= 0"):
        RouterService(directory, cluster_refresh_s=-1)


def test_text_for_a_tokenizer_the_router_does_not_know_is_routed_by_load(directory, answering_node):
    """Nodes tokenizing with another tokenizer than the byte one: every text prompt got a 500
    from the router; it goes to a node by load now (no affinity: the router cannot key it)."""
    directory.register("n1", answering_node(200, {"served": True}), ClusterInfo("tiny", 16, tokenizer="sentencepiece"))
    service = RouterService(directory)
    with TestClient(create_router_app(service), raise_server_exceptions=False) as client:
        response = client.post("/v1/completions", json={"model": "tiny", "prompt": "Hi there", "max_tokens": 2})
        by_ids = client.post("/v1/completions", json={"model": "tiny", "prompt": [1, 2, 3], "max_tokens": 2})
    assert (response.status_code, response.json(), response.headers["x-kvjax-node"]) == (200, {"served": True}, "n1")
    assert by_ids.status_code == 200
    assert service.untokenized._value.get() == 1  # the token-id prompt was keyed


def test_a_router_out_of_connections_says_so_and_blames_no_node(directory, answering_node, monkeypatch):
    """httpx's PoolTimeout (every one of the router's connections busy) is a TransportError: it
    was counted as the node's failure, the node excluded and the request tried on every other."""
    for node_id in ("p0", "p1"):
        directory.register(node_id, answering_node(200, {"ok": True}), ClusterInfo("tiny", 16))

    async def pool_exhausted(self, request, **kwargs):
        raise httpx.PoolTimeout("no connection free")

    monkeypatch.setattr(httpx.AsyncClient, "send", pool_exhausted)
    service = RouterService(directory)
    with TestClient(create_router_app(service), raise_server_exceptions=False) as client:
        response = client.post("/v1/completions", json={"model": "tiny", "prompt": "Hi", "max_tokens": 2})
    assert response.status_code == 503
    assert "the router is at its limit of connections to nodes" in response.json()["error"]["message"]
    assert all(service.forward_errors.labels(node)._value.get() == 0 for node in ("p0", "p1"))
    assert sum(sample.value for metric in service.routed.collect() for sample in metric.samples
               if sample.name.endswith("_total")) == 1  # decided once, not once per node


def test_unknown_fields_are_ignored_and_counted_by_the_router_as_by_a_node(router_client, cluster):
    """The router refused them with a 400 before any node saw the request; it forwards the
    body as it came, and the node ignores them too."""
    check_unknown_fields_are_ignored(router_client, cluster.router.url, "kvjax_router", PROMPT)


def test_a_body_over_the_limit_is_a_413_from_the_router_too(cluster):
    check_bodies_over_the_limit_get_a_413(cluster.router.url)


def test_the_routers_body_limit_is_the_apps_to_set(directory):
    directory.register("n1", "http://127.0.0.1:1", ClusterInfo("tiny", 16))
    with pytest.raises(ValueError, match=r"max_body_bytes=0 must be a positive integer \(bytes\)"):
        create_router_app(RouterService(directory), max_body_bytes=0)
    with TestClient(create_router_app(RouterService(directory), max_body_bytes=100)) as client:
        response = client.post("/v1/completions", content=b"{" + b" " * 100 + b"}")
    assert response.status_code == 413
    message = response.json()["error"]["message"]
    assert message == "the request body has 102 bytes; this server accepts at most 100 bytes"
