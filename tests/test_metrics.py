"""Metrics: exact counters and rates, percentiles, Prometheus text and endpoint, JSON, table."""

import doctest
import importlib.util
import json
import math
import subprocess
import sys
import threading
import urllib.error
import urllib.request

import numpy as np
import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

import kvjax.metrics.registry
from kvjax.metrics.export import summary_table
from kvjax.metrics.registry import Metrics
from kvjax.metrics.specs import METRICS, MISS_CAUSES, SPILL_LINKS, TIERS


class FakeClock:
    def __init__(self, now=100.0):
        self.now = now

    def __call__(self):
        return self.now


def known_run(clock=None):
    """A run with hand-counted events: 3 requests, one spill, one preemption."""
    m = Metrics(clock=clock or FakeClock())
    m.record_hit("device", tokens=64, blocks=4)
    m.record_miss("never_seen", tokens=32, blocks=2)
    m.record_hit("host", tokens=16, blocks=1)
    m.record_miss("evicted", tokens=16, blocks=1)
    m.record_hit("device", tokens=32, blocks=2)
    m.record_spill("device_to_host", blocks=5, num_bytes=5 * 4096)
    m.inc("preemptions")
    m.inc("compilations", 3)
    m.set("pool_occupancy_ratio", 0.75, tier="device")
    m.set("queued_requests", 2)
    for seconds in (0.010, 0.020, 0.030, 0.040):
        m.observe("ttft_seconds", seconds)
    m.observe("fetch_seconds", 0.004, tier="host")
    return m


def test_docstring_examples_hold():
    assert doctest.testmod(kvjax.metrics.registry).failed == 0


def test_counters_hold_exactly_the_recorded_events():
    counters = known_run().to_json()["counters"]
    assert counters["hit_tokens"] == {"device": 96, "host": 16, "disk": 0}
    assert counters["hit_blocks"] == {"device": 6, "host": 1, "disk": 0}
    assert counters["miss_tokens"] == {
        "never_seen": 32, "evicted": 16, "other_namespace": 0, "different_template": 0, "lossy_refused": 0,
        "recomputed": 0,
    }
    assert counters["miss_blocks"]["never_seen"] == 2 and counters["miss_blocks"]["evicted"] == 1
    assert counters["spilled_blocks"] == {"device_to_host": 5, "host_to_disk": 0}
    assert counters["spilled_bytes"] == {"device_to_host": 20480, "host_to_disk": 0}
    assert (counters["preemptions"], counters["compilations"], counters["rejections"]) == (1, 3, 0)


def test_rates_follow_from_the_counters():
    clock = FakeClock(100.0)
    m = known_run(clock)
    clock.now = 110.0
    snapshot = m.to_json()
    rates = snapshot["rates"]
    # 112 hit tokens of 160 looked up; 7 hit blocks of 10.
    assert rates["token_hit_rate"] == 112 / 160
    assert rates["token_hit_rate_by_tier"] == {"device": 96 / 160, "host": 16 / 160, "disk": 0.0}
    assert rates["block_hit_rate"] == 7 / 10
    assert rates["block_hit_rate_by_tier"]["host"] == 1 / 10
    assert snapshot["elapsed_seconds"] == 10.0
    assert rates["spilled_blocks_per_second"] == 0.5
    assert rates["spilled_blocks_per_second_by_link"] == {"device_to_host": 0.5, "host_to_disk": 0.0}


def test_rates_are_none_before_anything_happened():
    rates = Metrics(clock=FakeClock()).to_json()["rates"]
    assert rates["token_hit_rate"] is None and rates["block_hit_rate"] is None
    assert set(rates["token_hit_rate_by_tier"].values()) == {None}
    assert rates["spilled_blocks_per_second"] is None  # no time has passed


def test_latency_snapshot_reports_percentiles_not_just_the_mean():
    samples = np.random.default_rng(0).lognormal(-3.0, 1.0, 2_000)
    m = Metrics()
    for value in samples:
        m.observe("request_seconds", value)
    stats = m.to_json()["latencies"]["request_seconds"]
    expected = np.percentile(samples, [50, 90, 99])
    assert [stats["p50"], stats["p90"], stats["p99"]] == list(expected)  # exact below the cap
    assert stats["count"] == 2_000 and stats["sum"] == pytest.approx(samples.sum())
    assert stats["mean"] == pytest.approx(samples.mean())
    assert (stats["min"], stats["max"]) == (samples.min(), samples.max())


def test_latency_percentiles_stay_within_one_percent_past_the_exact_cap():
    rng = np.random.default_rng(3)
    samples = np.concatenate([rng.lognormal(-6.0, 0.5, 6_000), rng.lognormal(-1.0, 0.3, 2_000)])
    rng.shuffle(samples)
    m = Metrics(exact_samples=500)
    for value in samples:
        m.observe("fetch_seconds", value, tier="disk")
    stats = m.to_json()["latencies"]["fetch_seconds"]["disk"]
    for key, q in (("p50", 50), ("p90", 90), ("p99", 99)):
        truth = np.percentile(samples, q)
        assert abs(stats[key] - truth) <= 0.01 * truth
    assert m.to_json()["latencies"]["fetch_seconds"]["host"]["p50"] is None


BAD_CALLS = [
    (lambda m: m.inc("hits"), r"unknown counter 'hits' for inc\(\); expected one of \[.*'hit_tokens'"),
    (lambda m: m.inc("queued_requests"), r"unknown counter 'queued_requests' for inc\(\)"),
    (lambda m: m.set("preemptions", 1), r"unknown gauge 'preemptions' for set\(\)"),
    (lambda m: m.observe("ttft", 0.1), r"unknown latency 'ttft' for observe\(\); expected one of \["),
    (lambda m: m.record_hit("gpu", 16, 1),
     r"unknown tier 'gpu' for hit_tokens; expected one of \['device', 'host', 'disk'\]"),
    (lambda m: m.record_miss("cold", 16, 1),
     r"unknown cause 'cold' for miss_tokens; expected one of \['never_seen', 'evicted', "
     r"'other_namespace', 'different_template', 'lossy_refused', 'recomputed'\]"),
    (lambda m: m.record_spill("disk_to_host", 1, 10),
     r"unknown link 'disk_to_host' for spilled_blocks; expected one of \['device_to_host', "),
    (lambda m: m.observe("fetch_seconds", 0.1, tier="device"),
     r"unknown tier 'device' for fetch_seconds; expected one of \['host', 'disk'\]"),
    (lambda m: m.inc("hit_tokens", 5), r"hit_tokens needs exactly one label tier=\.\.\., got \{\}"),
    (lambda m: m.inc("preemptions", tier="device"), r"preemptions takes no label, got \{'tier'"),
    (lambda m: m.inc("preemptions", -1), r"preemptions=-1 must be an int >= 0"),
    (lambda m: m.inc("preemptions", 1.5), r"preemptions=1.5 must be an int >= 0"),
    (lambda m: m.inc("preemptions", True), r"preemptions=True must be an int >= 0"),
    (lambda m: m.record_hit("device", 16, -1), r"blocks=-1 must be an int >= 0"),
    (lambda m: m.observe("ttft_seconds", -0.5), r"latency sample -0.5 must be a number of seconds in"),
    (lambda m: m.observe("ttft_seconds", math.nan), r"latency sample nan must be a number of seconds in"),
    (lambda m: m.set("pool_fragmentation_ratio", 1.5), r"pool_fragmentation_ratio=1.5 must be in \[0, 1\]"),
    (lambda m: m.set("queued_requests", -1), r"queued_requests=-1.0 must be finite and >= 0"),
    (lambda m: m.set("running_sequences", math.inf), r"running_sequences=inf must be finite"),
    (lambda m: m.set("running_sequences", "many"), r"running_sequences='many' must be a number"),
]


@pytest.mark.parametrize("call, message", BAD_CALLS)
def test_bad_input_names_the_valid_choices_and_changes_nothing(call, message):
    m = known_run()
    before = m.to_json()
    with pytest.raises(ValueError, match=message):
        call(m)
    assert m.to_json() == before
    m.check_invariants()


def test_numpy_integer_counts_are_accepted():
    m = Metrics()
    m.record_hit("disk", np.int64(8), np.int32(1))
    assert m.to_json()["counters"]["hit_tokens"]["disk"] == 8


def test_concurrent_updates_are_not_lost():
    m = Metrics()

    def worker():
        for _ in range(2_000):
            m.record_hit("device", 3, 1)
            m.observe("inter_token_seconds", 0.001)

    threads = [threading.Thread(target=worker) for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    snapshot = m.to_json()
    assert snapshot["counters"]["hit_tokens"]["device"] == 4 * 2_000 * 3
    assert snapshot["counters"]["hit_blocks"]["device"] == 4 * 2_000
    assert snapshot["latencies"]["inter_token_seconds"]["count"] == 8_000
    m.check_invariants()


needs_prometheus = pytest.mark.skipif(
    importlib.util.find_spec("prometheus_client") is None,
    reason="prometheus_client (an optional dependency) is not installed",
)


def parse(text):
    """Metric families by name, read back with prometheus_client's own parser."""
    from prometheus_client.parser import text_string_to_metric_families

    return {family.name: family for family in text_string_to_metric_families(text)}


@needs_prometheus
def test_prometheus_text_parses_back_with_the_same_values():
    m = known_run()
    families = parse(m.prometheus_text())
    snapshot = m.to_json()
    # The parser strips the "_total" suffix from counter family names.
    assert set(families) >= {"kvjax_" + spec.name for spec in METRICS}
    for spec in METRICS:
        assert families["kvjax_" + spec.name].type == {"latency": "summary"}.get(spec.kind, spec.kind)
    hit_tokens = {s.labels["tier"]: s.value for s in families["kvjax_hit_tokens"].samples}
    assert hit_tokens == {"device": 96, "host": 16, "disk": 0}
    assert {s.name for s in families["kvjax_hit_tokens"].samples} == {"kvjax_hit_tokens_total"}
    ttft = {(s.name, s.labels.get("quantile")): s.value for s in families["kvjax_ttft_seconds"].samples}
    stats = snapshot["latencies"]["ttft_seconds"]
    assert ttft[("kvjax_ttft_seconds", "0.5")] == stats["p50"]
    assert ttft[("kvjax_ttft_seconds", "0.99")] == stats["p99"]
    assert ttft[("kvjax_ttft_seconds_count", None)] == 4
    assert ttft[("kvjax_ttft_seconds_sum", None)] == pytest.approx(0.1)
    fetch = [s for s in families["kvjax_fetch_seconds"].samples if s.labels.get("quantile") == "0.9"]
    assert {s.labels["tier"]: s.value for s in fetch}["host"] == 0.004
    assert math.isnan({s.labels["tier"]: s.value for s in fetch}["disk"])
    assert families["kvjax_token_hit_ratio"].samples[0].value == 112 / 160
    assert families["kvjax_pool_occupancy_ratio"].samples[0].labels == {"tier": "device"}


@needs_prometheus
def test_a_tier_whose_occupancy_was_never_set_has_no_sample():
    # every tier read 0.0 ("there and empty") on a cache without host or disk tiers
    m = known_run()  # the device's occupancy alone is set
    assert m.to_json()["gauges"]["pool_occupancy_ratio"] == {"device": 0.75, "host": None, "disk": None}
    samples = parse(m.prometheus_text())["kvjax_pool_occupancy_ratio"].samples
    assert [(s.labels, s.value) for s in samples] == [({"tier": "device"}, 0.75)]
    rows = table_rows(m.summary_table())
    assert rows["pool_occupancy_ratio (device)"] == ["75.0%"] and "pool_occupancy_ratio (disk)" not in rows
    m.set("pool_occupancy_ratio", 0.0, tier="disk")  # a disk tier that is there and empty
    samples = parse(m.prometheus_text())["kvjax_pool_occupancy_ratio"].samples
    assert {s.labels["tier"]: s.value for s in samples} == {"device": 0.75, "disk": 0.0}
    assert Metrics().to_json()["gauges"]["queued_requests"] == 0.0  # an unlabelled gauge starts at 0


@needs_prometheus
def test_serve_prometheus_answers_on_loopback_and_stops():
    m = known_run()
    server = m.serve_prometheus(port=0)
    try:
        assert server.url.startswith("http://127.0.0.1:") and server.port > 0
        with urllib.request.urlopen(server.url, timeout=10) as response:
            body = response.read().decode()
        m.inc("rejections")
        with urllib.request.urlopen(server.url, timeout=10) as response:
            again = parse(response.read().decode())
    finally:
        server.close()
    assert parse(body)["kvjax_preemptions"].samples[0].value == 1
    assert again["kvjax_rejections"].samples[0].value == 1  # each scrape reads a new snapshot
    with pytest.raises(urllib.error.URLError):
        urllib.request.urlopen(server.url, timeout=2)


@needs_prometheus
def test_bad_port_is_rejected():
    with pytest.raises(ValueError, match=r"port=70000 must be an int in \[0, 65535\]"):
        Metrics().serve_prometheus(port=70000)


def test_missing_prometheus_client_gives_an_install_hint(monkeypatch):
    monkeypatch.setitem(sys.modules, "prometheus_client", None)  # import now raises ImportError
    with pytest.raises(ImportError, match=r"prometheus_client is needed .*pip install"):
        Metrics().prometheus_text()


def test_json_snapshot_round_trips_and_renders_the_same_table():
    clock = FakeClock(0.0)
    m = known_run(clock)
    clock.now = 4.0
    snapshot = m.to_json()
    loaded = json.loads(json.dumps(snapshot, allow_nan=False))
    assert loaded == snapshot
    assert Metrics().summary_table(other=loaded) == Metrics().summary_table(other=m)


def table_rows(table):
    """Row name -> cells, splitting on the two-space column gap."""
    rows = {}
    for line in table.splitlines()[2:]:
        name, *cells = [part.strip() for part in line.split("  ") if part.strip()]
        rows[name] = cells
    return rows


def test_summary_table_shows_one_run():
    table = known_run().summary_table()
    lines = table.splitlines()
    assert lines[0].split() == ["metric", "value"]
    rows = table_rows(table)
    assert rows["token hit rate"] == ["70.0%"]
    assert rows["from host"] == ["10.0%"]
    assert rows["miss_tokens (evicted)"] == ["16"]
    assert rows["spilled_bytes (device_to_host)"] == ["20,480"]
    assert rows["ttft p50 (ms)"] == ["25.000"] and rows["fetch host p99 (ms)"] == ["4.000"]
    assert rows["pool_occupancy_ratio (device)"] == ["75.0%"] and rows["queued_requests"] == ["2"]
    assert "request p50 (ms)" not in rows  # never observed in this run


def test_summary_table_puts_two_runs_side_by_side():
    cached = known_run()
    uncached = Metrics()
    uncached.record_miss("never_seen", tokens=160, blocks=10)
    uncached.observe("ttft_seconds", 0.2)
    table = cached.summary_table(other=uncached, labels=("cached", "uncached"))
    assert table.splitlines()[0].split() == ["metric", "cached", "uncached"]
    rows = table_rows(table)
    assert rows["token hit rate"] == ["70.0%", "0.0%"]
    assert rows["miss_tokens (never_seen)"] == ["32", "160"]
    assert rows["ttft p99 (ms)"][1] == "200.000"
    assert rows["fetch host p50 (ms)"] == ["4.000", "-"]
    widths = {len(line) for line in table.splitlines()[:2]}
    assert len(widths) == 1  # header and rule line up
    with pytest.raises(ValueError, match=r"labels=\('a',\) must name each of the 2 runs"):
        cached.summary_table(other=uncached, labels=("a",))


def test_histogram_options_are_validated_up_front():
    with pytest.raises(ValueError, match=r"exact_samples=-3 must be a non-negative integer"):
        Metrics(exact_samples=-3)


class MetricsMachine(RuleBasedStateMachine):
    """Random updates, valid and invalid, against a plain dict model of the counters."""

    def __init__(self):
        super().__init__()
        self.metrics = Metrics(exact_samples=8)
        self.model = {("hit", t): [0, 0] for t in TIERS} | {("miss", c): [0, 0] for c in MISS_CAUSES}
        self.spilled = {link: 0 for link in SPILL_LINKS}
        self.observed = 0

    @rule(tier=st.sampled_from(TIERS), tokens=st.integers(0, 500), blocks=st.integers(0, 30))
    def hit(self, tier, tokens, blocks):
        self.metrics.record_hit(tier, tokens, blocks)
        self.model[("hit", tier)][0] += tokens
        self.model[("hit", tier)][1] += blocks

    @rule(cause=st.sampled_from(MISS_CAUSES), tokens=st.integers(0, 500), blocks=st.integers(0, 30))
    def miss(self, cause, tokens, blocks):
        self.metrics.record_miss(cause, tokens, blocks)
        self.model[("miss", cause)][0] += tokens
        self.model[("miss", cause)][1] += blocks

    @rule(link=st.sampled_from(SPILL_LINKS), blocks=st.integers(0, 9))
    def spill(self, link, blocks):
        self.metrics.record_spill(link, blocks, blocks * 128)
        self.spilled[link] += blocks

    @rule(seconds=st.floats(0.0, 10.0))
    def observe(self, seconds):
        self.metrics.observe("queue_seconds", seconds)
        self.observed += 1

    @rule(tokens=st.integers(-5, -1))
    def bad_update(self, tokens):
        with pytest.raises(ValueError):
            self.metrics.record_hit("device", tokens, 1)

    @invariant()
    def matches_the_model(self):
        self.metrics.check_invariants()
        snapshot = self.metrics.to_json()
        counters, rates = snapshot["counters"], snapshot["rates"]
        for (kind, key), (tokens, blocks) in self.model.items():
            assert counters[f"{kind}_tokens"][key] == tokens
            assert counters[f"{kind}_blocks"][key] == blocks
        assert counters["spilled_blocks"] == self.spilled
        assert snapshot["latencies"]["queue_seconds"]["count"] == self.observed
        if rates["token_hit_rate"] is not None:
            assert 0.0 <= rates["token_hit_rate"] <= 1.0
            assert sum(rates["token_hit_rate_by_tier"].values()) == pytest.approx(rates["token_hit_rate"])


TestMetricsMachine = MetricsMachine.TestCase
TestMetricsMachine.settings = settings(max_examples=25, stateful_step_count=25, deadline=None)


_ONE_JIT = """
import sys, jax, jax.numpy as jnp, numpy as np
jax.config.update("jax_compilation_cache_dir", sys.argv[1])
jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
jax.config.update("jax_persistent_cache_min_entry_size_bytes", -1)
from kvjax.metrics.compilations import CompileCount
count = CompileCount()
jax.jit(lambda a: jnp.sin(a) * 3 + 1)(np.ones(7, np.float32)).block_until_ready()
print(count.value)
"""


def test_an_executable_loaded_from_the_persistent_cache_counts_once(tmp_path):
    # JAX records its backend-compile event around the load too: adding the cache-hit event
    # counted every load twice (the demo's warm-up count, the engine's metric)
    runs = [subprocess.run([sys.executable, "-c", _ONE_JIT, str(tmp_path)], capture_output=True, text=True,
                           check=True, timeout=120).stdout.split() for _ in range(2)]  # fmt: skip
    assert runs == [["1"], ["1"]]  # compiled, then loaded


def test_a_summary_of_runs_without_values_is_the_header_only():
    assert summary_table([{}]).splitlines() == ["metric  value", "------  -----"]  # it raised TypeError
    with pytest.raises(ValueError, match="summary_table needs at least one snapshot"):
        summary_table([])
