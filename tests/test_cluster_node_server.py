"""A node as a real process: the official openai client, streamed and not, health, metrics,
bad input, and namespaces on the node's own cache."""

import asyncio
import json
import logging
import time
import uuid

import httpx
import openai
import pytest
from cluster_fixtures import (
    check_bodies_over_the_limit_get_a_413,
    check_unknown_fields_are_ignored,
    decode_tokens,
    hang_up_while_generating,
    wait_until,
)
from fastapi.testclient import TestClient

from kvjax.cluster.drain import NodeDrain
from kvjax.cluster.node_server import create_node_app, start_worker
from kvjax.serving.engine import Engine

PROMPT = "You are a terse assistant.\nQ: what is a KV cache?\nA:"


@pytest.fixture(scope="module")
def node_url(cluster):
    return cluster.nodes["n1"].url


@pytest.fixture(scope="module")
def client(node_url):
    with openai.OpenAI(base_url=f"{node_url}/v1", api_key="unused", max_retries=0) as client:
        yield client


def streamed(client, **kwargs):
    chunks = list(client.completions.create(model="tiny", stream=True, **kwargs))
    text = "".join(choice.text for chunk in chunks for choice in chunk.choices)
    finish = [choice.finish_reason for chunk in chunks for choice in chunk.choices if choice.finish_reason]
    return text, finish, chunks


def test_openai_client_non_streamed(client):
    completion = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=12, temperature=0)
    choice = completion.choices[0]
    assert completion.object == "text_completion" and completion.model == "tiny"
    assert choice.finish_reason == "length" and isinstance(choice.text, str)
    assert completion.usage.prompt_tokens == len(PROMPT.encode())
    assert completion.usage.completion_tokens == 12


def test_openai_client_streamed_gives_the_same_text(client):
    whole = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=12).choices[0].text
    text, finish, chunks = streamed(client, prompt=PROMPT, max_tokens=12, stream_options={"include_usage": True})
    assert text == whole and finish == ["length"]
    assert len(chunks) > 2  # text arrives in pieces, not only at the end
    assert chunks[-1].usage.completion_tokens == 12 and chunks[-1].choices == []


def test_a_repeated_prompt_hits_the_cache_within_its_namespace_only(client):
    prompt = f"System prompt {uuid.uuid4().hex}, long enough to fill a few pages of sixteen tokens.\nQ: hi\nA:"

    def cached_tokens(tenant):
        completion = client.completions.create(model="tiny", prompt=prompt, max_tokens=2,
                                               extra_body={"namespace": tenant})  # fmt: skip
        return completion.usage.prompt_tokens_details.cached_tokens

    assert cached_tokens("tenant-a") == 0
    assert cached_tokens("tenant-a") == (len(prompt.encode()) - 1) // 16 * 16  # whole pages; the last token is computed
    assert cached_tokens("tenant-b") == 0  # the same prompt in another tenant shares nothing


def test_token_id_prompts_are_served(client):
    completion = client.completions.create(model="tiny", prompt=list(PROMPT.encode()), max_tokens=4)
    assert completion.usage.prompt_tokens == len(PROMPT.encode())


def test_health_models_and_metrics(node_url):
    health = httpx.get(f"{node_url}/health").json()
    assert health["status"] == "ok" and health["node_id"] == "n1" and health["directory"] == "registered"
    assert httpx.get(f"{node_url}/v1/models").json()["data"][0]["id"] == "tiny"
    metrics = httpx.get(f"{node_url}/metrics")
    assert metrics.headers["content-type"].startswith("text/plain")
    assert "kvjax_ttft_seconds" in metrics.text and "kvjax_node_inflight_requests" in metrics.text
    assert "kvjax_node_directory_resyncs_total" in metrics.text
    occupancy = [line.split(" ")[0] for line in metrics.text.splitlines() if line.startswith("kvjax_pool_occupancy")]
    assert occupancy == ['kvjax_pool_occupancy_ratio{tier="device"}']  # the node has no tiers: no 0.0 for them


def test_the_openai_client_retrieves_the_model_and_hears_of_an_unknown_one(client):
    assert client.models.retrieve("tiny").id == "tiny"
    with pytest.raises(openai.NotFoundError) as error:
        client.models.retrieve("llama")
    assert error.value.code == "model_not_found"
    with pytest.raises(openai.NotFoundError) as error:
        client.completions.create(model="llama", prompt="x")
    assert error.value.code == "model_not_found" and error.value.param == "model"
    with pytest.raises(openai.NotFoundError, match=r"Invalid URL \(POST /v1/chat/completions\)"):
        client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}])


@pytest.mark.parametrize(
    "body, status, message",
    [
        (b"{not json", 400, "the request body is not valid JSON"),
        (b'{"model": "llama", "prompt": "x"}', 404, "model='llama' is not served here; this node serves 'tiny'"),
        (b'{"model": "tiny", "prompt": "x", "best_of": 3}', 400, "best_of=3 is not supported"),
        (b'{"model": "tiny", "prompt": [1, 999]}', 400, "token id 999 at index 1 is out of range"),
        (b'{"model": "tiny", "prompt": "x", "max_tokens": 100000}', 400, "max_model_len=2048"),
        # each of these used to stop the node's engine for good, the request itself unanswered
        (b'{"model": "tiny", "prompt": "x", "max_tokens": 1000000000000}', 400, "max_model_len=2048"),
        (b'{"model": "tiny", "prompt": [1, 2147483648]}', 400, "token id 2147483648 at index 1 is out of range"),
        (b'{"model": "tiny", "prompt": [' + b"1, " * 40 + b'4294967296]}', 400, "token id 4294967296 at index 40"),
        (b"[" * 100_000, 400, "nests JSON too deeply"),
    ],
)
def test_bad_requests_get_a_clear_error(node_url, body, status, message):
    response = httpx.post(f"{node_url}/v1/completions", content=body, headers={"content-type": "application/json"},
                          timeout=30)  # fmt: skip
    assert response.status_code == status
    assert message in response.json()["error"]["message"]
    assert httpx.get(f"{node_url}/health").json()["status"] == "ok"  # and the node serves on


def test_a_top_k_past_int32_samples_from_the_whole_vocabulary(client):
    completion = client.completions.create(model="tiny", prompt="x", max_tokens=2, temperature=1.0, seed=3,
                                           extra_body={"top_k": 2**63})  # fmt: skip
    assert completion.usage.completion_tokens == 2


def test_the_openai_client_sees_a_bad_request_error(client):
    with pytest.raises(openai.BadRequestError, match="max_tokens=0 must be an integer >= 1"):
        client.completions.create(model="tiny", prompt="x", max_tokens=0)


def test_a_client_that_leaves_mid_stream_cancels_its_request(node_url):
    with httpx.stream("POST", f"{node_url}/v1/completions", json={"model": "tiny", "prompt": PROMPT,
                                                                 "max_tokens": 1500, "stream": True}) as response:
        next(response.iter_lines())
    # the node goes back to idle instead of generating 1,500 tokens for nobody
    assert wait_until(lambda: httpx.get(f"{node_url}/health").json()["inflight"] == 0, timeout=20)


def test_a_client_that_leaves_a_non_streamed_request_cancels_it(node_url):
    """uvicorn does not cancel a handler whose client left: the node used to generate all
    1,500 tokens for nobody (a client's timeout and retries made that 3x)."""
    assert wait_until(lambda: httpx.get(f"{node_url}/health").json()["inflight"] == 0, timeout=60)
    before = decode_tokens(node_url)
    hang_up_while_generating(node_url, [node_url], {"model": "tiny", "prompt": PROMPT, "max_tokens": 1500})
    assert wait_until(lambda: httpx.get(f"{node_url}/health").json()["inflight"] == 0, timeout=120)
    assert decode_tokens(node_url) - before < 1000  # cancelled, not run to its 1,500th token


@pytest.fixture(scope="module")
def small_pool():
    """A node (in this process) whose page pool, 64 blocks of 16 tokens, holds less than its
    max_model_len of 2,048, with 40 of its blocks hard-pinned by a cached prompt."""
    with Engine.from_preset("tiny", tiers=False, cache_options={"num_blocks": 64}) as engine:
        pinned = list(b"pinned system prompt. " * 30)[:640]
        engine.add_request("pin", tokens=pinned, max_new_tokens=1)
        engine.finish()
        assert engine.cache.pin(pinned) == 640
        worker = start_worker(engine, node_id="small", address="http://small", model="tiny")
        try:
            with TestClient(create_node_app(worker, "tiny", "small")) as client:
                client.worker = worker  # for an app of its own (test_a_finished_stream_...)
                yield client
        finally:
            worker.stop()


@pytest.mark.parametrize("body, param, message", [
    ({"prompt": "a" * 1100, "max_tokens": 1}, "prompt",
     "a prompt of 1100 tokens + max_tokens=1 needs 1101 tokens; this node's page pool holds 1024 tokens (64 blocks "
     "of 16): shorten the prompt to at most 1023 tokens"),
    ({"prompt": "a" * 1100, "max_tokens": 100}, "prompt",  # the length to shorten to leaves room for max_tokens
     "a prompt of 1100 tokens + max_tokens=100 needs 1200 tokens; this node's page pool holds 1024 tokens (64 "
     "blocks of 16): shorten the prompt to at most 924 tokens"),
    ({"prompt": "b" * 900, "max_tokens": 300}, "max_tokens",
     "a prompt of 900 tokens + max_tokens=300 needs 1200 tokens; this node's page pool holds 1024 tokens (64 "
     "blocks of 16): lower max_tokens to at most 124"),
])  # fmt: skip
def test_a_request_larger_than_the_pool_is_a_400_naming_both_lengths(small_pool, body, param, message):
    """It used to be a 503 (which a router retries on every node), or stopped mid-generation
    with its tokens thrown away."""
    for stream in (False, True):
        response = small_pool.post("/v1/completions", json={"model": "tiny", **body, "stream": stream})
        assert response.status_code == 400
        assert response.json()["error"] == {"message": message, "type": "invalid_request_error", "param": param,
                                            "code": "node_capacity_exceeded"}  # fmt: skip


def test_a_request_stopped_for_pool_room_keeps_its_text_and_ends_as_length(small_pool):
    """The pins leave 24 blocks: 200 prompt tokens + 400 fit the pool, not what is free. The
    answer so far used to be a 503 (non-streamed) or end with finish_reason "rejected"."""
    body = {"model": "tiny", "prompt": "c" * 200, "max_tokens": 400}
    response = small_pool.post("/v1/completions", json=body)
    assert response.status_code == 200
    completion = response.json()
    assert completion["choices"][0]["finish_reason"] == "length"
    assert 0 < completion["usage"]["completion_tokens"] < 400
    streamed = small_pool.post("/v1/completions", json={**body, "prompt": "d" * 200, "stream": True})
    events = [json.loads(e[len("data: ") :]) for e in streamed.text.split("\n\n") if e and e != "data: [DONE]"]
    assert not any("error" in event for event in events)
    assert [c["finish_reason"] for e in events for c in e["choices"] if c["finish_reason"]] == ["length"]


def test_every_chunk_of_a_stream_has_the_same_created_and_a_usage_field(small_pool, monkeypatch):
    """``created`` was stamped per chunk, so a stream that crossed a second changed it; with
    include_usage, OpenAI's other chunks carry "usage": null. A clock that moves a second at
    every reading makes the first deterministic."""
    seconds = iter(range(1_000_000_000, 2_000_000_000))
    monkeypatch.setattr(time, "time", lambda: next(seconds))
    body = {"model": "tiny", "prompt": "e" * 20, "max_tokens": 8, "stream": True}
    for include_usage in (True, False):
        response = small_pool.post("/v1/completions", json={**body, "stream_options": {"include_usage": include_usage}})
        chunks = [json.loads(e[len("data: ") :]) for e in response.text.split("\n\n") if e and e != "data: [DONE]"]
        assert len(chunks) > 2 and len({chunk["created"] for chunk in chunks}) == 1
        if include_usage:
            assert [chunk["usage"] for chunk in chunks[:-1]] == [None] * (len(chunks) - 1)
            assert chunks[-1]["usage"]["completion_tokens"] == 8
        else:
            assert not any("usage" in chunk for chunk in chunks)


def test_a_finished_stream_leaves_the_drain_on_the_event_loop(small_pool):
    """The drain's state lives on the event loop; a stream's last close ran as a plain
    background function, on a worker thread, where it could race a SIGTERM's drain."""

    class Spy(NodeDrain):
        def close(self, request_id):
            on_loop.append(_on_loop())
            super().close(request_id)

    def _on_loop():
        try:
            asyncio.get_running_loop()
            return True
        except RuntimeError:
            return False

    on_loop = []
    with TestClient(create_node_app(small_pool.worker, "tiny", "small", drain=Spy("small"))) as client:
        response = client.post("/v1/completions", json={"model": "tiny", "prompt": "f" * 20, "max_tokens": 4,
                                                        "stream": True})  # fmt: skip
        assert response.status_code == 200 and response.text.endswith("data: [DONE]\n\n")
    assert len(on_loop) >= 2 and all(on_loop), on_loop  # the stream's own close, then the background one


def test_stop_strings_end_the_answer_and_the_stream_sends_nothing_past_them(small_pool):
    """``stop`` was refused unless empty (a string always). Through the official client: the
    answer ends before the earliest stop string with finish_reason "stop", and a stream's
    deltas add up to that answer, whether the stop string comes as a string or in a list."""
    client = openai.OpenAI(base_url=f"{small_pool.base_url}/v1", api_key="unused", max_retries=0,
                           http_client=small_pool)  # fmt: skip
    prompt = "Q: what does a cache hold?\nA:"
    whole = client.completions.create(model="tiny", prompt=prompt, max_tokens=24).choices[0].text
    stop = whole[len(whole) // 2 : len(whole) // 2 + 3]  # several tokens long, begun after the first delta
    answer = whole[: whole.find(stop)]
    for given in (stop, [stop, "never \u2603 here"]):
        completion = client.completions.create(model="tiny", prompt=prompt, max_tokens=24, stop=given)
        assert (completion.choices[0].text, completion.choices[0].finish_reason) == (answer, "stop")
        assert completion.usage.completion_tokens < 24
        text, finish, _ = streamed(client, prompt=prompt, max_tokens=24, stop=given)
        assert (text, finish) == (answer, ["stop"])


def test_a_cache_salt_shares_cached_blocks_only_with_requests_of_the_same_salt(small_pool):
    """vLLM's cache_salt (a 400 before): through the official client, a salted prompt hits only
    for the same tenant and salt; unsalted requests and other salts share nothing with it."""
    client = openai.OpenAI(base_url=f"{small_pool.base_url}/v1", api_key="unused", max_retries=0,
                           http_client=small_pool)  # fmt: skip
    prompt = f"Private notes {uuid.uuid4().hex}: long enough for a few pages of sixteen.\nQ: hi\nA:"
    whole_pages = (len(prompt.encode()) - 1) // 16 * 16  # the last token is always computed

    def cached_tokens(**extra_body):
        completion = client.completions.create(model="tiny", prompt=prompt, max_tokens=2, extra_body=extra_body)
        return completion.usage.prompt_tokens_details.cached_tokens

    assert cached_tokens(namespace="tenant-a", cache_salt="user-7") == 0
    assert cached_tokens(namespace="tenant-a", cache_salt="user-7") == whole_pages
    assert cached_tokens(namespace="tenant-a", cache_salt="user-8") == 0
    assert cached_tokens(namespace="tenant-a") == 0  # unsalted: another namespace
    assert cached_tokens(namespace="tenant-b", cache_salt="user-7") == 0  # the salt alone crosses no tenant
    assert cached_tokens(namespace="tenant-a") == whole_pages  # the unsalted copy, now cached
    assert cached_tokens(namespace="tenant-a", cache_salt="user-8") == whole_pages
    bad = small_pool.post("/v1/completions", json={"model": "tiny", "prompt": prompt, "cache_salt": ""})
    assert bad.status_code == 400 and bad.json()["error"] == {
        "message": "cache_salt='' must be a non-empty string", "type": "invalid_request_error",
        "param": "cache_salt", "code": None}  # fmt: skip


def test_unknown_fields_are_ignored_and_counted_as_vllm_does(client, node_url):
    check_unknown_fields_are_ignored(client, node_url, "kvjax_node", PROMPT)


def test_a_body_over_the_limit_is_a_413_naming_it(node_url):
    check_bodies_over_the_limit_get_a_413(node_url)


def test_ignored_fields_are_named_in_the_log_and_the_limit_is_the_apps_to_set(small_pool, caplog):
    app = create_node_app(small_pool.worker, "tiny", "small", max_body_bytes=1000)
    with TestClient(app) as client, caplog.at_level(logging.WARNING, logger="kvjax.cluster.http_front"):
        answer = client.post("/v1/completions", json={"model": "tiny", "prompt": "g" * 20, "max_tokens": 2,
                                                      "frobnicate": 1})  # fmt: skip
        assert answer.status_code == 200
        body = json.dumps({"model": "tiny", "prompt": "g" * 1000}).encode()
        too_large = client.post("/v1/completions", content=body, headers={"content-type": "application/json"})
    assert "The following fields were present in the request but ignored: ['frobnicate']" in caplog.text
    assert too_large.status_code == 413 and len(body) > 1000
    assert too_large.json()["error"]["message"] == f"the request body has {len(body)} bytes; this server accepts " \
        "at most 1000 bytes"  # fmt: skip
