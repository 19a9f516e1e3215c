"""Trace replay: hand-computed hits on tiny traces, a reference LRU model, the yardsticks, CLI."""

import json
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvjax.__main__ import main
from kvjax.cache.policies import POLICIES
from kvjax.tools.replay import DEFAULT_POLICY, replay_report, replay_trace
from kvjax.tools.replay_bounds import (
    intern_block_paths,
    offline_replay,
    reuse_oracle_lru_replay,
    unlimited_replay,
)
from kvjax.tools.trace import TraceRequest

BLOCK = 4  # tokens per hash id in the tiny traces (the Mooncake release uses 512)


def _trace(*paths, tokens_in_last=BLOCK):
    """One request a second; every block full except the last, which holds ``tokens_in_last``."""
    return [TraceRequest(1000.0 * i, BLOCK * (len(p) - 1) + tokens_in_last, 1, tuple(p))
            for i, p in enumerate(paths)]  # fmt: skip


# A, B, C, A, B, C with room for 2: LRU always evicts the block needed next and hits nothing.
# The offline policy at request 2 evicts B (next use 4, A's is 3), hits A, evicts A (never used
# again, C's next use is 5) for B, and hits C: 2 hits. Unlimited: the second round, 3 hits.
CYCLE = _trace([1], [2], [3], [1], [2], [3], tokens_in_last=3)


def test_cyclic_trace_lru_misses_everything():
    counts = replay_trace(CYCLE, 2, policy="lru", block_tokens=BLOCK, check_every=1)
    assert (counts.blocks, counts.hit_blocks, counts.evicted_blocks) == (6, 0, 4)
    assert (counts.tokens, counts.hit_tokens) == (18, 0)


def test_cyclic_trace_offline_hits_two_and_unlimited_three():
    offline = offline_replay(CYCLE, 2, block_tokens=BLOCK)
    assert (offline.hit_blocks, offline.hit_tokens, offline.evicted_blocks) == (2, 6, 2)
    unlimited = unlimited_replay(CYCLE, block_tokens=BLOCK)
    assert (unlimited.hit_blocks, unlimited.hit_tokens, unlimited.evicted_blocks) == (3, 9, 0)
    assert unlimited.block_hit_rate == 0.5 and offline.block_hit_rate == pytest.approx(1 / 3)


def test_reuse_oracle_lru_evicts_dead_blocks_first_but_not_by_next_use():
    # [1], [2], [3], [1] with room for 2: at [3] B is never used again, so the oracle evicts it
    # and hits A (plain LRU evicts A and misses). On CYCLE ([1] [2] [3] [1] [2] [3]) all are
    # reused at [3], so LRU evicts A, then B at [4]; at [5] A is dead and goes, and the last C
    # hits: 1 hit, where the offline policy hits 2 and plain LRU none.
    requests = _trace([1], [2], [3], [1])
    oracle = reuse_oracle_lru_replay(requests, 2, block_tokens=BLOCK)
    assert (oracle.hit_blocks, oracle.hit_tokens, oracle.evicted_blocks) == (1, 4, 1)
    assert replay_trace(requests, 2, policy="lru", block_tokens=BLOCK).hit_blocks == 0
    assert reuse_oracle_lru_replay(CYCLE, 2, block_tokens=BLOCK).hit_blocks == 1
    with pytest.raises(ValueError, match=r"num_blocks=0 must be >= 1"):
        reuse_oracle_lru_replay(CYCLE, 0)


def test_a_block_is_shared_only_under_the_same_prefix():
    # [9, 2] must not hit block 2 of [1, 2, 3]: same id, different prefix.
    requests = _trace([1, 2, 3], [4], [1, 2, 5], [9, 2], tokens_in_last=2)
    # LRU with room for 3: [4] evicts 3; [1, 2, 5] hits 1, 2 (8 tokens) and evicts 4;
    # [9, 2] hits nothing and evicts 5, then 2.
    lru = replay_trace(requests, 3, policy="lru", block_tokens=BLOCK, check_every=1)
    assert (lru.hit_blocks, lru.hit_tokens, lru.evicted_blocks) == (2, 8, 4)
    assert unlimited_replay(requests, block_tokens=BLOCK).hit_blocks == 2
    assert offline_replay(requests, 3, block_tokens=BLOCK).hit_blocks == 2
    paths, depth = intern_block_paths(requests)
    assert paths == [[0, 1, 2], [3], [0, 1, 4], [5, 6]] and depth == [0, 1, 2, 0, 2, 0, 1]


def test_a_fully_cached_request_hits_its_last_block_too():
    requests = _trace([1, 2], [1, 2], tokens_in_last=2)  # 6 tokens: blocks of 4 and 2
    counts = replay_trace(requests, 2, policy="lru", block_tokens=BLOCK, check_every=1)
    assert (counts.hit_blocks, counts.hit_tokens, counts.evicted_blocks) == (2, 6, 0)


def test_a_request_longer_than_the_cache_caches_what_fits():
    requests = _trace([1, 2, 3], [1, 2, 3])
    for policy in sorted(POLICIES):
        counts = replay_trace(requests, 2, policy=policy, block_tokens=BLOCK, check_every=1)
        assert (counts.blocks, counts.hit_blocks) == (6, 2), policy
    assert offline_replay(requests, 2, block_tokens=BLOCK).hit_blocks == 2
    assert unlimited_replay(requests, block_tokens=BLOCK).hit_blocks == 3


def test_hash_ids_beyond_int32_are_fine():
    requests = _trace([2**40, 2**40 + 1], [2**40, 2**40 + 1])
    assert replay_trace(requests, 2, policy="lru", block_tokens=BLOCK).hit_blocks == 2


def test_empty_trace_has_zero_rates():
    counts = replay_trace([], 4)
    assert (counts.requests, counts.block_hit_rate, counts.token_hit_rate) == (0, 0.0, 0.0)


@pytest.mark.parametrize(
    "call, message",
    [
        (lambda: replay_trace(CYCLE, 0), r"device_blocks=0 must be an int in \[1, 2147483646\] \(blocks\)"),
        (lambda: replay_trace(CYCLE, 10**12), r"device_blocks=1000000000000 must be an int in \[1, 2147483646\]"),
        (lambda: replay_trace(CYCLE, 2, host_blocks=-1), r"host_blocks=-1 must be an int in \[0, 2147483646\]"),
        (lambda: replay_trace(CYCLE, 2, disk_blocks=4), r"disk_blocks=4 needs host_blocks > 0"),
        (lambda: replay_trace(CYCLE, 2, check_every=-1), r"check_every=-1 must be >= 0"),
        (lambda: offline_replay(CYCLE, 0), r"num_blocks=0 must be >= 1"),
        (lambda: replay_trace(CYCLE, 2, policy="nope"), r"unknown eviction policy 'nope'"),
        (lambda: replay_trace(CYCLE, 2, warmup_requests=-1), r"warmup_requests=-1 must be an int >= 0"),
        (lambda: offline_replay(CYCLE, 2, warmup_requests=True), r"warmup_requests=True must be an int >= 0"),
        (lambda: unlimited_replay(CYCLE, warmup_requests=1.5), r"warmup_requests=1.5 must be an int >= 0"),
        (lambda: reuse_oracle_lru_replay(CYCLE, 2, warmup_requests="2"), r"warmup_requests='2' must be an int"),
    ],
)
def test_bad_arguments_raise_value_error(call, message):
    with pytest.raises(ValueError, match=message):
        call()


# --- a reference model: leaf-first LRU over chained blocks, one page at a time -------------


def _reference_lru_hits(requests, capacity):
    paths, depth = intern_block_paths(requests)
    parent = {}
    for path in paths:
        parent.update(zip(path[1:], path[:-1]))
    last_use, hits = {}, 0  # cached block -> index of the request that used it last
    for index, path in enumerate(paths):
        run = next((i for i, node in enumerate(path) if node not in last_use), len(path))
        hits += run
        kept = path[:capacity]
        for node in kept:
            if node in last_use:
                continue
            if len(last_use) == capacity:
                has_child = {parent[n] for n in last_use if n in parent}
                leaves = [n for n in last_use if n not in has_child and n not in kept]
                del last_use[min(leaves, key=lambda n: (last_use[n], -depth[n]))]
            last_use[node] = index
        for node in kept:
            last_use[node] = index
    return hits


_paths = st.lists(st.lists(st.integers(0, 3), min_size=1, max_size=6), min_size=1, max_size=25)


@settings(max_examples=60, deadline=None)
@given(paths=_paths, capacity=st.integers(1, 8))
def test_lru_replay_matches_the_reference_model(paths, capacity):
    requests = _trace(*paths)
    counts = replay_trace(requests, capacity, policy="lru", block_tokens=BLOCK, check_every=1)
    assert counts.hit_blocks == _reference_lru_hits(requests, capacity)


@settings(max_examples=40, deadline=None)
@given(paths=_paths, capacity=st.integers(1, 8), policy=st.sampled_from(sorted(POLICIES)))
def test_no_policy_beats_the_offline_policy_or_unlimited_capacity(paths, capacity, policy):
    requests = _trace(*paths)
    online = replay_trace(requests, capacity, policy=policy, block_tokens=BLOCK, check_every=1)
    offline = offline_replay(requests, capacity, block_tokens=BLOCK)
    unlimited = unlimited_replay(requests, block_tokens=BLOCK)
    assert online.hit_blocks <= offline.hit_blocks <= unlimited.hit_blocks
    assert reuse_oracle_lru_replay(requests, capacity, block_tokens=BLOCK).hit_blocks <= unlimited.hit_blocks
    assert online.blocks == offline.blocks == unlimited.blocks


@settings(max_examples=40, deadline=None)
@given(paths=_paths, capacity=st.integers(1, 8), policy=st.sampled_from(sorted(POLICIES)), data=st.data())
def test_a_warm_up_counts_exactly_the_requests_after_it(paths, capacity, policy, data):
    """A replay is causal, so the first k requests run the same with or without the rest: the
    requests after a warm-up of k hit and evict what the whole replay did minus what the first
    k alone did. The offline yardstick looks ahead, so it only counts the same requests."""
    requests = _trace(*paths)
    warm = data.draw(st.integers(0, len(requests) + 2), label="warmup_requests")
    head = requests[:warm]
    for replay in (lambda reqs, **kw: replay_trace(reqs, capacity, policy=policy, block_tokens=BLOCK, **kw),
                   lambda reqs, **kw: unlimited_replay(reqs, block_tokens=BLOCK, **kw)):  # fmt: skip
        whole, first, rest = replay(requests), replay(head), replay(requests, warmup_requests=warm)
        assert rest.requests == len(requests) - len(head)
        for field in ("blocks", "hit_blocks", "tokens", "hit_tokens", "evicted_blocks"):
            assert getattr(rest, field) == getattr(whole, field) - getattr(first, field), field
    for replay in (offline_replay, reuse_oracle_lru_replay):
        rest = replay(requests, capacity, block_tokens=BLOCK, warmup_requests=warm)
        assert (rest.requests, rest.blocks) == (len(requests) - len(head), sum(len(p) for p in paths[warm:]))
        assert rest.hit_blocks <= unlimited_replay(requests, block_tokens=BLOCK, warmup_requests=warm).hit_blocks
    assert offline_replay(requests, capacity, block_tokens=BLOCK, warmup_requests=0) == \
        offline_replay(requests, capacity, block_tokens=BLOCK)  # fmt: skip


# --- the shared Mooncake trace: one full-trace test, the cheap unlimited bound ------------------

_REPO = Path(__file__).resolve().parents[1]
_SHARED_TRACE = next(
    (p for p in (_REPO.parent / "shared/data/mooncake_synthetic_trace.jsonl",
                 _REPO / "shared/data/mooncake_synthetic_trace.jsonl") if p.exists()),
    None,
)  # fmt: skip


@pytest.mark.skipif(_SHARED_TRACE is None, reason="shared/data/mooncake_synthetic_trace.jsonl "
                    "not found next to or inside the repository")  # fmt: skip
def test_shared_trace_unlimited_capacity_hits_63_96_percent_of_blocks():
    from kvjax.tools.trace import load_trace

    requests = load_trace(_SHARED_TRACE)
    paths, depth = intern_block_paths(requests)
    assert (len(requests), sum(map(len, paths)), len(depth)) == (3993, 121877, 43924)  # README
    unlimited = unlimited_replay(requests)
    assert round(unlimited.block_hit_rate, 4) == 0.6396
    assert round(unlimited.token_hit_rate, 3) == 0.651
    # The real cache with room for every distinct block evicts nothing and agrees exactly.
    real = replay_trace(requests, len(depth), policy="lru")
    assert (real.hit_blocks, real.hit_tokens, real.evicted_blocks) == (
        unlimited.hit_blocks, unlimited.hit_tokens, 0)  # fmt: skip


# --- report and command line --------------------------------------------------------------------


def _write(tmp_path, requests):
    path = tmp_path / "trace.jsonl"
    path.write_text("".join(json.dumps({"timestamp": r.timestamp_ms, "input_length": r.input_length,
                                        "output_length": 1, "hash_ids": list(r.hash_ids)}) + "\n"
                            for r in requests))  # fmt: skip
    return path


def test_report_puts_the_policy_next_to_both_yardsticks():
    summary = replay_report(CYCLE, 2, policy="lru", block_tokens=BLOCK).as_dict()
    assert summary["policy"] == "lru" and summary["device_blocks"] == 2
    assert summary["block_hit_rate"] == 0.0 and summary["evicted_blocks"] == 4
    assert summary["offline_block_hit_rate"] == pytest.approx(1 / 3)
    assert summary["unlimited_block_hit_rate"] == 0.5
    assert summary["unlimited_token_hit_rate"] == 0.5


def test_the_offline_yardstick_has_every_tiers_room():
    # at the device's room alone a tiered cache beat its 'bound' (151% of it on the shared trace)
    summary = replay_report(CYCLE, 1, policy="lru", block_tokens=BLOCK, host_blocks=2).as_dict()
    assert summary["offline_blocks"] == 3
    assert summary["offline_block_hit_rate"] == offline_replay(CYCLE, 3, block_tokens=BLOCK).block_hit_rate
    assert summary["block_hit_rate"] <= summary["offline_block_hit_rate"]


@settings(max_examples=40, deadline=None)
@given(paths=_paths, device=st.integers(1, 3), host=st.integers(0, 4), policy=st.sampled_from(sorted(POLICIES)))
def test_no_tiered_replay_beats_its_offline_yardstick(paths, device, host, policy):
    # the yardstick had to cache a request's whole path where the replay keeps only its first
    # device blocks: evicting for that, it lost hits the replay kept (requests past the device)
    summary = replay_report(_trace(*paths), device, policy=policy, block_tokens=BLOCK, host_blocks=host).as_dict()
    assert summary["block_hit_rate"] <= summary["offline_block_hit_rate"] + 1e-12


def test_a_request_longer_than_the_device_does_not_cost_the_yardstick_its_hits():
    summary = replay_report(_trace([0], [1, 0], [0]), 1, policy="lru", block_tokens=BLOCK, host_blocks=1).as_dict()
    assert summary["block_hit_rate"] == summary["offline_block_hit_rate"] == 1 / 4


def test_evicted_blocks_are_those_that_left_every_tier():
    # a tiered replay counted moves from device to host as evictions: 5 here, though nothing was lost
    summary = replay_report(CYCLE, 1, policy="lru", block_tokens=BLOCK, host_blocks=10).as_dict()
    assert summary["evicted_blocks"] == 0 and summary["block_hit_rate"] == summary["unlimited_block_hit_rate"]
    assert replay_report(CYCLE, 1, policy="lru", block_tokens=BLOCK, host_blocks=1).as_dict()["evicted_blocks"] == 4


def test_cli_json_is_the_last_line(tmp_path, capsys):
    trace = _write(tmp_path, CYCLE)
    status = main(["replay", str(trace), "--device-blocks", "2", "--policy", "lru",
                   "--block-tokens", str(BLOCK), "--json"])  # fmt: skip
    out = capsys.readouterr().out.strip().splitlines()
    assert status == 0 and any(line.startswith("offline (farthest use)") for line in out)
    summary = json.loads(out[-1])
    assert (summary["block_hit_rate"], summary["unlimited_block_hit_rate"]) == (0.0, 0.5)
    assert summary["offline_block_hit_rate"] == pytest.approx(1 / 3)
    assert summary["token_hit_rate"] == 0.0


def test_cli_uses_the_default_policy(tmp_path, capsys):
    assert main(["replay", str(_write(tmp_path, CYCLE)), "--device-blocks", "2", "--json"]) == 0
    assert json.loads(capsys.readouterr().out.splitlines()[-1])["policy"] == DEFAULT_POLICY


def test_cli_reports_a_bad_trace_line_and_exits_2(tmp_path, capsys):
    path = tmp_path / "bad.jsonl"
    path.write_text('{"timestamp": 0, "input_length": 5, "output_length": 1}\n')
    assert main(["replay", str(path), "--device-blocks", "2"]) == 2
    assert "bad.jsonl:1: missing field 'hash_ids'" in capsys.readouterr().err


@pytest.mark.parametrize(
    "argv, message",
    [
        (["replay", "t.jsonl", "--device-blocks", "0"], "0 must be >= 1"),
        (["replay", "t.jsonl", "--device-blocks", "x"], "'x' is not an integer"),
        (["replay", "t.jsonl", "--device-blocks", "2", "--policy", "nope"], "invalid choice: 'nope'"),
        (["replay", "t.jsonl"], "--device-blocks"),
    ],
)
def test_cli_rejects_bad_arguments(argv, message, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    assert exit_info.value.code == 2 and message in capsys.readouterr().err
