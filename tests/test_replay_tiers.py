"""Replay with host and disk tiers: hand-computed hits per tier, tier policies, properties, CLI."""

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvjax.__main__ import main
from kvjax.tools.replay import replay_report, replay_trace
from kvjax.tools.replay_bounds import intern_block_paths, unlimited_replay
from kvjax.tools.replay_tiers import LowerTiers, LruBlockTier, SegmentedBlockTier
from kvjax.tools.trace import TraceRequest

BLOCK = 4  # tokens per hash id in the tiny traces


def _trace(*paths):
    """One request a second; every block full (BLOCK tokens)."""
    return [TraceRequest(1000.0 * i, BLOCK * len(p), 1, tuple(p)) for i, p in enumerate(paths)]


def _replay(requests, device, host=0, disk=0, **options):
    options.setdefault("policy", "lru")
    return replay_trace(requests, device, host_blocks=host, disk_blocks=disk, block_tokens=BLOCK,
                        check_every=1, **options)  # fmt: skip


def _tiers(counts):
    return counts.device_hit_blocks, counts.host_hit_blocks, counts.disk_hit_blocks


def test_a_block_evicted_from_the_device_hits_from_the_host():
    # Device 1, host 2: [2] evicts A to the host; [1] finds A there (host hit) and takes it back.
    counts = _replay(_trace([1], [2], [1]), 1, host=2)
    assert _tiers(counts) == (0, 1, 0) and counts.hit_tokens == counts.host_hit_tokens == BLOCK
    assert _replay(_trace([1], [2], [1]), 1).hit_blocks == 0  # no host tier: a miss


def test_a_block_pushed_out_of_the_host_hits_from_the_disk():
    # Device 1, host 1, disk 2: [3] evicts B to the host, which pushes A to the disk; [1] hits
    # A on the disk and evicts C to the host (B to disk); [2] then hits B on the disk.
    counts = _replay(_trace([1], [2], [3], [1], [2]), 1, host=1, disk=2)
    assert _tiers(counts) == (0, 0, 2) and counts.disk_hit_tokens == 2 * BLOCK
    # Without the disk, every block leaves the 1-block host before it is asked for again.
    assert _tiers(_replay(_trace([1], [2], [3], [1], [2], [3]), 1, host=1)) == (0, 0, 0)
    assert _tiers(_replay(_trace([1], [2], [3], [2]), 1, host=1, disk=2)) == (0, 1, 0)


def test_one_leading_run_counts_each_block_on_its_own_tier():
    # Device 3: [4, 5, 6] evicts the whole chain 1-12-123 (tail last) to a 1-block host, so
    # 1 and 12 go on to the disk and 123 stays on the host: the run hits disk, disk, host.
    counts = _replay(_trace([1, 2, 3], [4, 5, 6], [1, 2, 3]), 3, host=1, disk=4)
    assert _tiers(counts) == (0, 1, 2) and counts.hit_blocks == 3


def test_write_through_fills_the_host_at_use_not_at_eviction():
    requests = _trace([1], [2], [1])
    # Host of 1: write-back holds A (evicted by [2]); write-through holds B (written last).
    assert _tiers(_replay(requests, 1, host=1)) == (0, 1, 0)
    assert _tiers(_replay(requests, 1, host=1, write_through=True)) == (0, 0, 0)
    assert _tiers(_replay(requests, 1, host=2, write_through=True)) == (0, 1, 0)


def test_lru_tier_pushes_out_the_oldest():
    tier = LruBlockTier(2)
    assert (tier.put(1), tier.put(2), tier.put(1), tier.put(3)) == ([], [], [], [2])
    assert tier.blocks() == [1, 3] and LruBlockTier(0).put(7) == [7]


def test_segmented_tier_keeps_reused_blocks_through_a_flood():
    tier = SegmentedBlockTier(2, protected_fraction=0.5)  # protected segment: 1 block
    assert (tier.put(1, reused=True), tier.put(2), tier.put(3)) == ([], [], [2])
    # A second reused block overflows protected: 1 drops back to probation (newest there).
    assert tier.put(4, reused=True) == [3] and tier.blocks() == [1, 4]
    tier.discard(1)
    assert 1 not in tier and len(tier) == 1


def test_tier_checks_catch_a_block_on_two_tiers():
    tiers = LowerTiers(2, 2)
    tiers.host.put(5)
    tiers.disk.put(5)
    with pytest.raises(RuntimeError, match=r"blocks \[5\] are on both host and disk"):
        tiers.check_invariants()


@pytest.mark.parametrize(
    "call, message",
    [
        (lambda: LowerTiers(-1, 0), r"host_blocks=-1 and disk_blocks=0 must be >= 0"),
        (lambda: LowerTiers(1, 1, policy="mru"), r"unknown tier policy 'mru'; valid: \['lru', 'segmented'\]"),
        (lambda: LruBlockTier(-2), r"capacity=-2 must be >= 0 blocks"),
        (lambda: SegmentedBlockTier(-2), r"capacity=-2 must be >= 0 blocks"),
        (lambda: SegmentedBlockTier(4, 1.5), r"protected_fraction=1.5 must be in \[0, 1\]"),
        (lambda: replay_trace(_trace([1]), 1, disk_blocks=-3), r"disk_blocks=-3 must be >= 0"),
    ],
)
def test_bad_arguments_raise_value_error(call, message):
    with pytest.raises(ValueError, match=message):
        call()


# --- properties over random traces ----------------------------------------------------------

_paths = st.lists(st.lists(st.integers(0, 3), min_size=1, max_size=5), min_size=1, max_size=20)
_options = st.fixed_dictionaries({"write_through": st.booleans(),
                                  "tier_policy": st.sampled_from(["lru", "segmented"]),
                                  "policy": st.sampled_from(["lru", "adaptive"])})  # fmt: skip


@settings(max_examples=50, deadline=None)
@given(paths=_paths, device=st.integers(1, 6), host=st.integers(0, 8), disk=st.integers(0, 8),
       options=_options)  # fmt: skip
def test_lower_tiers_only_add_hits_up_to_the_unlimited_bound(paths, device, host, disk, options):
    requests = _trace(*paths)
    tiered = _replay(requests, device, host, disk, **options)
    alone = _replay(requests, device, policy=options["policy"])
    assert tiered.device_hit_blocks == alone.hit_blocks  # the device tier is not disturbed
    assert tiered.device_hit_tokens == alone.hit_tokens
    assert alone.hit_blocks <= tiered.hit_blocks <= unlimited_replay(requests, block_tokens=BLOCK).hit_blocks
    assert min(tiered.host_hit_blocks, tiered.disk_hit_blocks, tiered.device_hit_blocks) >= 0
    if host == 0 and disk == 0:
        assert (tiered.hit_blocks, tiered.evicted_blocks) == (alone.hit_blocks, alone.evicted_blocks)


@settings(max_examples=30, deadline=None)
@given(paths=_paths, device=st.integers(1, 4), options=_options)
def test_a_host_with_room_for_every_block_reaches_the_unlimited_bound(paths, device, options):
    requests = _trace(*paths)
    _, depth = intern_block_paths(requests)
    device = max(device, max(map(len, paths)))  # longer requests would lose their tail
    counts = _replay(requests, device, len(depth), **options)
    unlimited = unlimited_replay(requests, block_tokens=BLOCK)
    assert (counts.hit_blocks, counts.hit_tokens) == (unlimited.hit_blocks, unlimited.hit_tokens)


# --- report and command line ------------------------------------------------------------------


def test_json_reports_every_tier(tmp_path, capsys):
    path = tmp_path / "trace.jsonl"
    path.write_text("".join(json.dumps({"timestamp": r.timestamp_ms, "input_length": r.input_length,
                                        "output_length": 1, "hash_ids": list(r.hash_ids)}) + "\n"
                            for r in _trace([1], [2], [3], [2], [1])))  # fmt: skip
    argv = ["replay", str(path), "--device-blocks", "1", "--host-blocks", "1", "--disk-blocks", "2",
            "--policy", "lru", "--block-tokens", str(BLOCK), "--json"]  # fmt: skip
    assert main(argv) == 0
    out = capsys.readouterr().out.strip().splitlines()
    summary = json.loads(out[-1])
    # [3] pushes A from the host to the disk; [2] hits B on the host; [1] finds A on the disk.
    assert (summary["host_block_hit_rate"], summary["disk_block_hit_rate"]) == (0.2, 0.2)
    assert summary["device_block_hit_rate"] == 0.0 and summary["block_hit_rate"] == 0.4
    assert summary["host_token_hit_rate"] == 0.2 and summary["host_blocks"] == 1
    assert any(line.strip().startswith("of which disk") for line in out)


def test_report_and_cli_reject_bad_tier_sizes(capsys):
    with pytest.raises(SystemExit):
        main(["replay", "t.jsonl", "--device-blocks", "2", "--host-blocks", "-1"])
    assert "-1 must be >= 0" in capsys.readouterr().err
    with pytest.raises(ValueError, match=r"unknown tier policy 'x'"):
        replay_report(_trace([1]), 1, tier_policy="x", block_tokens=BLOCK)
