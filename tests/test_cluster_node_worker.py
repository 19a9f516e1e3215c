"""The node's engine thread hands the cache's block event batches and its load to the
directory publisher: events recorded into a real EventLog reach a real Redis, with the
engine of the tiny preset; requests in, answers out (one test steps the engine)."""

import concurrent.futures
import dataclasses
import time

import numpy as np
import pytest
from cluster_fixtures import wait_until
from fastapi.testclient import TestClient

from kvjax.cache.block_events import EventLog
from kvjax.cache.block_keys import Namespace, chained_block_keys
from kvjax.cluster.directory import NodeLoad
from kvjax.cluster.node_server import create_node_app
from kvjax.cluster.node_worker import EngineWorker, cluster_info_of
from kvjax.cluster.openai_api import CompletionRequest, RequestError
from kvjax.cluster.publisher import DirectoryPublisher
from kvjax.cluster.remote_fetch import FetchOutcome, FetchPlan, PeerHint
from kvjax.cluster.remote_offers import OfferRequest, OfferService
from kvjax.serving.engine import Engine
from kvjax.serving.engine_events import FinishEvent
from kvjax.tiers.remote_transport import RemoteTransport

TENANT = Namespace("tenant-a")


@pytest.fixture(scope="module")
def engine():
    with Engine.from_preset("tiny", tiers=False) as engine:
        yield engine


def test_the_cluster_record_says_how_the_engine_keys_prompts(engine):
    assert cluster_info_of(engine, "tiny").to_fields() == {"model": "tiny", "page_size": "16", "tokenizer": "byte",
                                                           "canonicalize": "0"}  # fmt: skip


def test_event_batches_flow_from_the_engine_thread_to_the_directory(engine, directory):
    log = EventLog()
    publisher = DirectoryPublisher(directory, "n1", "http://n1", cluster_info_of(engine, "tiny"), heartbeat_s=0.1)
    publisher.start()
    worker = EngineWorker(engine, publisher, log.subscribe())
    worker.start()
    try:
        keys = chained_block_keys(list(range(64)), 16, TENANT)
        for parent, key in zip([None, *keys], keys):  # one step's batch, as the cache would flush it
            log.record(TENANT.digest(), key, parent, "device", "stored")
        log.flush()
        assert wait_until(lambda: directory.lookup(TENANT.digest(), keys)[0].prefix_blocks == 4)
        for parent, key in ((keys[2], keys[3]), (keys[1], keys[2])):  # evicted from the tail, as a cache does
            log.record(TENANT.digest(), key, parent, "device", "removed")
        log.flush()
        assert wait_until(lambda: directory.lookup(TENANT.digest(), keys)[0].prefix_blocks == 2)
        assert directory.live_nodes()[0].load == NodeLoad(0, 0)
    finally:
        worker.stop()  # stops the publisher too, which drops the node's record
    assert directory.live_nodes() == []


def test_a_subscription_that_fell_behind_is_replaced_by_the_caches_holdings(engine, directory):
    log = EventLog()
    publisher = DirectoryPublisher(directory, "n1", "http://n1", cluster_info_of(engine, "tiny"), heartbeat_s=0.1)
    publisher.start()
    worker = EngineWorker(engine, publisher, log.subscribe(max_batches=1))
    keys = chained_block_keys(list(range(64)), 16, TENANT)
    for parent, key in zip([None, *keys], keys):  # four batches before the engine thread polls: three lost
        log.record(TENANT.digest(), key, parent, "device", "stored")
        log.flush()
    worker.start()
    try:
        # the engine's cache holds none of these blocks: the directory must not claim any either
        assert wait_until(lambda: publisher.counters["resyncs"] == 2)
        assert directory.lookup(TENANT.digest(), keys)[0].prefix_blocks == 0
    finally:
        worker.stop()


def test_a_request_the_engine_refuses_is_answered_and_the_engine_serves_on(engine, directory):
    worker = EngineWorker(engine)
    worker.start()
    try:
        answers = []
        worker.submit("r1", CompletionRequest("tiny", None, (1, 2**31)), answers.append)  # past int32
        assert wait_until(lambda: answers)
        assert isinstance(answers[0], RequestError) and "token id 2147483648 at index 1" in str(answers[0])
        assert worker.alive
    finally:
        worker.stop()


def test_a_request_the_engine_refuses_leaves_no_load_behind_in_the_directory(engine, directory):
    """submit hands the publisher the load with the request counted; the engine thread, which
    published only when its own load changed, refused it and published nothing: the directory
    (each heartbeat too) said one request in flight on an idle node until another came."""
    publisher = DirectoryPublisher(directory, "n1", "http://n1", cluster_info_of(engine, "tiny"), heartbeat_s=0.1)
    publisher.start()
    worker = EngineWorker(engine, publisher, EventLog().subscribe())
    worker.start()
    try:
        answers = []
        worker.submit("r1", CompletionRequest("tiny", "x", None, max_tokens=100_000), answers.append)  # too long
        assert wait_until(lambda: answers) and isinstance(answers[0], RequestError)
        assert wait_until(lambda: directory.live_nodes()[0].load == NodeLoad(0, 0), timeout=3)
    finally:
        worker.stop()


def break_engine(engine, monkeypatch) -> None:
    """Make the engine fail at its next request ("broken on purpose"), as an engine bug would."""
    def broken(*args, **kwargs):
        raise RuntimeError("broken on purpose")

    monkeypatch.setattr(engine, "add_request", broken)


def test_an_engine_that_breaks_answers_the_request_in_hand_and_leaves_the_directory(engine, directory, monkeypatch):
    break_engine(engine, monkeypatch)
    publisher = DirectoryPublisher(directory, "n1", "http://n1", cluster_info_of(engine, "tiny"), heartbeat_s=0.1)
    publisher.start()
    worker = EngineWorker(engine, publisher, EventLog().subscribe())
    worker.start()
    try:
        assert wait_until(lambda: [view.node_id for view in directory.live_nodes()] == ["n1"])
        answers = []
        worker.submit("r1", CompletionRequest("tiny", "hi", None), answers.append)
        assert wait_until(lambda: answers)  # the request whose command broke the engine is answered
        assert isinstance(answers[0], RuntimeError) and "the engine failed: broken on purpose" in str(answers[0])
        assert not worker.alive
        assert wait_until(lambda: directory.live_nodes() == [])  # routers stop choosing it now, not after its TTL
    finally:
        worker.stop()


def test_a_peer_asking_a_node_whose_engine_failed_is_answered_at_once(engine, monkeypatch):
    # nobody took the export any more: the ask held the owner's server thread (and the peer)
    # until the peer's deadline, up to minutes, and then said only that it timed out
    break_engine(engine, monkeypatch)
    worker = EngineWorker(engine)
    worker.start()
    try:
        answers = []
        worker.submit("r1", CompletionRequest("tiny", "hi", None), answers.append)
        assert wait_until(lambda: answers) and not worker.alive
        ask = OfferRequest(None, np.arange(32, dtype=np.int32), 0, 2, "raw", 16384, 10.0)
        with pytest.raises(RuntimeError, match="the engine failed: broken on purpose"):
            worker.export(ask, time.monotonic() + 10.0)
        # over HTTP a 503 (this node cannot serve), as a completion gets, not a 500 and a traceback
        codec = engine.cache.codec
        transport = RemoteTransport()
        try:
            offers = OfferService(transport, worker.export, engine.cache.page_identity, codec.block_nbytes)
            with TestClient(create_node_app(worker, "tiny", "n1", offers)) as client:
                body = dataclasses.replace(ask, codec=engine.cache.page_identity,
                                           block_nbytes=codec.block_nbytes).to_json()  # fmt: skip
                response = client.post("/kv/offer", json=body)
        finally:
            transport.close()
        assert response.status_code == 503 and "the engine failed: broken on purpose" in response.json()["error"]
    finally:
        worker.stop()


def test_a_node_reports_its_throughput_while_it_generates_and_zero_when_idle(engine):
    # Engine.run sets the gauge per run; a node steps its engine itself, so it read 0 forever
    gauge = lambda: engine.metrics.to_json()["gauges"]["generated_tokens_per_second"]  # noqa: E731
    engine.metrics.set("generated_tokens_per_second", 0)
    worker = EngineWorker(engine)
    worker.start()
    try:
        answers = []
        worker.submit("tput", CompletionRequest("tiny", "a prompt", 48), answers.append)
        assert wait_until(lambda: gauge() > 0, timeout=60)
        assert wait_until(lambda: any(isinstance(a, FinishEvent) for a in answers), timeout=60)
        assert wait_until(lambda: gauge() == 0, timeout=30)  # a second with nothing generated
    finally:
        worker.stop()


class _FailingFetch:
    """A remote fetcher whose every fetch ends at once, failed: the worker's bookkeeping of
    reports without a peer (the real pull is tested with processes in test_cluster_remote)."""

    def plan(self, hint, num_local_blocks, num_tokens):
        now = time.monotonic()
        return FetchPlan(hint, num_local_blocks, 1, 0.01, now, now + 0.02)

    def start(self, plan, tokens, namespace):
        future = concurrent.futures.Future()
        future.set_result(None)
        return future

    def finish(self, plan, result):
        return FetchOutcome(plan, None, "failed", 0.0)


def test_remote_fetch_reports_are_kept_only_for_answers_that_carry_them(engine):
    worker = EngineWorker(engine, remote=_FailingFetch())
    worker.start()
    hint = PeerHint("peer", "http://127.0.0.1:9", 8, 0)
    try:
        for request_id, stream, usage in (("plain", False, False), ("stream", True, False), ("usage", True, True)):
            answers = []
            request = CompletionRequest("tiny", "x" * 40, None, max_tokens=1, stream=stream, include_usage=usage)
            worker.submit(request_id, request, answers.append, hint)
            assert wait_until(lambda: any(isinstance(answer, FinishEvent) for answer in answers))
        # a stream without usage never takes its report: none is kept for it (they piled up)
        assert worker.take_remote_report("stream") is None
        assert worker.take_remote_report("plain")["outcome"] == "failed"
        assert worker.take_remote_report("usage")["outcome"] == "failed"
        assert worker.take_remote_report("plain") is None  # taken once
    finally:
        worker.stop()


class _GatedFetch(_FailingFetch):
    """A remote fetcher whose fetch ends only when the test resolves it; records its finishes."""

    def __init__(self):
        self.future, self.finished = concurrent.futures.Future(), []

    def start(self, plan, tokens, namespace):
        return self.future

    def finish(self, plan, result):
        self.finished.append(plan)
        return super().finish(plan, result)


def test_a_request_cancelled_while_its_fetch_is_in_flight_still_counts_the_fetch(engine):
    # the cancel dropped the fetch: its outcome was never counted and a hung peer never marked
    fetch = _GatedFetch()
    worker = EngineWorker(engine, remote=fetch)
    worker.start()
    try:
        answers = []
        worker.submit("gone", CompletionRequest("tiny", "x" * 40, None, max_tokens=1), answers.append,
                      PeerHint("peer", "http://127.0.0.1:9", 8, 0))  # fmt: skip
        assert wait_until(lambda: "gone" in worker._parked)
        worker.cancel("gone")
        assert wait_until(lambda: worker._parked.get("gone") is not None and worker._parked["gone"].cancelled)
        fetch.future.set_result(None)  # the fetch ends after its client went
        assert wait_until(lambda: fetch.finished) and len(fetch.finished) == 1
        assert wait_until(lambda: not worker._parked)
        time.sleep(0.2)
        assert answers == [] and not engine.has_unfinished and worker.take_remote_report("gone") is None
    finally:
        worker.stop()


class _RecordingFetch(_FailingFetch):
    """A remote fetcher that records the fetches it starts."""

    def __init__(self):
        self.started = []

    def start(self, plan, tokens, namespace):
        self.started.append(plan)
        return super().start(plan, tokens, namespace)


def test_a_request_the_node_refuses_fetches_nothing_first(engine):
    """A prompt past max_model_len whose prefix a peer held pulled the peer's pages first, and
    only then got its 400."""
    fetch = _RecordingFetch()
    worker = EngineWorker(engine, remote=fetch)
    worker.start()
    hint = PeerHint("peer", "http://127.0.0.1:9", 8, 0)
    try:
        answers = []
        worker.submit("long", CompletionRequest("tiny", "x" * 3000, None, max_tokens=1), answers.append, hint)
        assert wait_until(lambda: answers)
        assert isinstance(answers[0], RequestError) and answers[0].param == "prompt"
        assert fetch.started == []
        worker.submit("fits", CompletionRequest("tiny", "x" * 40, None, max_tokens=1), answers.append, hint)
        assert wait_until(lambda: isinstance(answers[-1], FinishEvent))
        assert len(fetch.started) == 1  # the same hint, for a request that fits: fetched
    finally:
        worker.stop()


class _RecordingPublisher:
    def __init__(self):
        self.loads = []

    def submit(self, batches, load=None):
        self.loads.append(load)

    def close(self):
        pass


def test_a_request_counts_in_the_node_load_as_soon_as_it_is_handed_over(engine):
    # the load counted only what the engine thread had taken: a node whose engine was stuck
    # looked idle (and the heartbeat wrote that over the router's counts), so it kept getting work
    publisher = _RecordingPublisher()
    stuck = EngineWorker(engine, publisher, events=object())  # never started: its engine takes nothing
    for index in range(3):
        stuck.submit(f"r{index}", CompletionRequest("tiny", "x" * 40, None, max_tokens=1), lambda item: None)
    assert stuck.load == NodeLoad(3, 0) and [load.inflight for load in publisher.loads] == [1, 2, 3]
    worker = EngineWorker(engine)
    worker.start()
    try:
        answers = []
        for index in range(3):
            worker.submit(f"r{index}", CompletionRequest("tiny", "x" * 40, None, max_tokens=1), answers.append)
        assert wait_until(lambda: sum(isinstance(answer, FinishEvent) for answer in answers) == 3)
        assert wait_until(lambda: worker.load == NodeLoad(0, 0))  # taken, then finished: nothing left over
    finally:
        worker.stop()


def test_a_held_worker_runs_the_steps_it_is_let_and_then_holds_its_requests_where_they_are(engine):
    # tests that must signal or probe a node while its requests run hold them this way, on
    # any device (a long generation alone was over before the signal on a fast one)
    worker = EngineWorker(engine)
    worker.start()
    try:
        tokens, finished = [], concurrent.futures.Future()

        def sink(item):
            if isinstance(item, FinishEvent):
                finished.set_result(item)
            elif isinstance(item, Exception):
                finished.set_exception(item)
            else:
                tokens.append(item.token_id)

        worker.hold_steps(3)  # in order with submit: the request runs under it
        worker.submit("held", CompletionRequest("tiny", "Hold me.", None, max_tokens=20), sink)
        assert wait_until(lambda: len(tokens) == 3)  # a prefill step's first token, two decode steps
        assert wait_until(lambda: worker.load.inflight == 1)
        worker.hold_steps(2)
        assert wait_until(lambda: len(tokens) == 5)
        assert not finished.done()
        worker.hold_steps(None)  # run freely
        assert len(finished.result(timeout=60).output_token_ids) == 20 and len(tokens) == 20
        for steps in (-1, 1.5, True, "2"):
            with pytest.raises(ValueError, match=r"steps=.* must be an int >= 0, or null to run freely"):
                worker.hold_steps(steps)
    finally:
        worker.stop()


def test_every_request_is_answered_when_the_engine_thread_stops_or_after_it_stopped(engine, monkeypatch):
    # requests in flight at stop() and requests handed over after the thread ended (the
    # handler checks that the engine runs, then awaits a directory lookup, then submits)
    # were never answered: their handlers waited until their clients gave up
    worker = EngineWorker(engine)
    worker.start()
    answers = {}
    try:
        worker.hold_steps(0)  # in flight, held where it is
        worker.submit("held", CompletionRequest("tiny", "Hold me.", None, max_tokens=20), answers.setdefault("held", [])
                      .append)  # fmt: skip
        assert wait_until(lambda: worker.load.inflight == 1 and worker._not_taken == 0)
    finally:
        worker.stop()
    worker.submit("late", CompletionRequest("tiny", "Too late.", None, max_tokens=2), answers.setdefault("late", [])
                  .append)  # fmt: skip
    for name in ("held", "late"):
        [answer] = answers[name]
        assert isinstance(answer, RequestError) and answer.status == 503 and "shutting down" in str(answer), name
    assert worker.load == NodeLoad(0, 0)
    ask = OfferRequest(None, np.arange(32, dtype=np.int32), 0, 2, "raw", 16384, 10.0)
    with pytest.raises(RuntimeError, match="not running"):
        worker.export(ask, time.monotonic() + 10.0)

    break_engine(engine, monkeypatch)
    failed = EngineWorker(engine)
    failed.start()
    try:
        failed.submit("r1", CompletionRequest("tiny", "hi", None), answers.setdefault("r1", []).append)
        assert wait_until(lambda: answers["r1"]) and not failed.alive
        failed.submit("r2", CompletionRequest("tiny", "hi", None), answers.setdefault("r2", []).append)
        [answer] = answers["r2"]
        assert isinstance(answer, RuntimeError) and "the engine failed: broken on purpose" in str(answer)
        assert failed.load == NodeLoad(0, 0)
    finally:
        failed.stop()
