"""Replay with host and disk tiers through the real KVCache: hand-computed hits per tier,
properties over random traces, the command line."""

import json

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvjax.__main__ import main
from kvjax.cache.block_keys import chained_block_keys
from kvjax.cache.trie_node import Tier
from kvjax.tools.replay import REPLAY_NAMESPACE, replay_cache, replay_trace, serve_request
from kvjax.tools.replay_bounds import intern_block_paths, unlimited_replay
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
    # Device 1, host 2: [2] evicts A, which write-back copies to the host; [1] finds A there.
    counts = _replay(_trace([1], [2], [1]), 1, host=2)
    assert _tiers(counts) == (0, 1, 0) and counts.hit_tokens == counts.host_hit_tokens == BLOCK
    assert _replay(_trace([1], [2], [1]), 1).hit_blocks == 0  # no host tier: a miss


def test_a_block_spilled_to_disk_hits_from_the_disk_after_the_host_dropped_it():
    # Device 1, host 1, disk 2. A 1-block host spills every block to disk when a step ends
    # (above its high watermark). [3] evicts B to the host, which drops A's host copy (A keeps
    # its disk copy); [1] then hits A on disk, and [2] hits B on disk.
    counts = _replay(_trace([1], [2], [3], [1], [2]), 1, host=1, disk=2)
    assert _tiers(counts) == (0, 0, 2) and counts.disk_hit_tokens == 2 * BLOCK
    # Without the disk, every block leaves the 1-block host before it is asked for again.
    assert _tiers(_replay(_trace([1], [2], [3], [1], [2], [3]), 1, host=1)) == (0, 0, 0)
    # The newest evicted block is still on the host.
    assert _tiers(_replay(_trace([1], [2], [3], [2]), 1, host=1, disk=2)) == (0, 1, 0)


def test_write_back_keeps_the_leading_pages_of_an_evicted_chain_that_host_room_allows():
    # Device 3: [4, 5, 6] evicts the chain 1-12-123 at once. A 1-slot host keeps its first page
    # (a page is worth keeping only with its prefix); 12 and 123 leave the trie.
    counts = _replay(_trace([1, 2, 3], [4, 5, 6], [1, 2, 3]), 3, host=1, disk=4)
    assert _tiers(counts) == (0, 1, 0)
    # Three slots keep the whole chain: one leading run of three host hits.
    assert _tiers(_replay(_trace([1, 2, 3], [4, 5, 6], [1, 2, 3]), 3, host=3)) == (0, 3, 0)


def test_one_leading_run_counts_each_block_on_its_own_tier():
    # Device 2, host 2, disk 4. [3] evicts 12 to the host; [4] evicts 1 and the host, now
    # full, spills its oldest (12) to disk; [5] evicts 3, and host room comes from 12, whose
    # copy goes alone (it is on disk), not from 1, whose loss would drop 12 too. [1, 2] then
    # finds 1 on the host and 12 on the disk: one run, two tiers.
    counts = _replay(_trace([1], [1, 2], [3], [4], [5], [1, 2]), 2, host=2, disk=4)
    assert _tiers(counts) == (1, 1, 1) and counts.hit_blocks == 3  # the device hit is [1, 2]'s 1
    # Leaves first: had the host dropped 1 (its least recently used), 12 would be lost with it.
    assert _tiers(_replay(_trace([1], [1, 2], [3], [4], [5], [1, 2]), 2, host=2)) == (1, 1, 0)


def test_write_through_copies_at_commit_not_at_eviction():
    requests = _trace([1], [2], [1])
    # Host of 1: write-back holds A (copied when [2] evicted it); write-through holds B
    # (copied when it was committed, pushing A's copy out).
    assert _tiers(_replay(requests, 1, host=1)) == (0, 1, 0)
    assert _tiers(_replay(requests, 1, host=1, write_through=True)) == (0, 0, 0)
    assert _tiers(_replay(requests, 1, host=2, write_through=True)) == (0, 1, 0)


def test_the_replay_cache_moves_no_bytes_and_sizes_by_the_trace():
    cache, now = replay_cache(2**31 - 2, host_blocks=2**31 - 2, disk_blocks=2**31 - 2)
    with cache:
        assert cache.pool.kv_pages is None and not cache.host_pool.store_bytes and cache.disk_tier.directory is None
        assert cache.transfer.synchronous and cache.allocator.num_free == 2**31 - 1
        now[0] = 1.0
        handle = cache.admit([1, 2, 3, 0])
        cache.commit(handle, [1, 2, 3])
        cache.release(handle)
        assert cache.allocator.num_used_ids == 4  # what the trace touched, not the pool
        cache.check_invariants()


# --- properties over random traces ----------------------------------------------------------

_paths = st.lists(st.lists(st.integers(0, 3), min_size=1, max_size=5), min_size=1, max_size=20)
_options = st.fixed_dictionaries({"write_through": st.booleans(), "policy": st.sampled_from(["lru", "adaptive"])})


@settings(max_examples=40, deadline=None)
@given(paths=_paths, device=st.integers(1, 6), host=st.integers(0, 8), disk=st.integers(0, 8),
       options=_options)  # fmt: skip
def test_lower_tiers_only_add_hits_up_to_the_unlimited_bound(paths, device, host, disk, options):
    requests = _trace(*paths)
    disk = disk if host else 0  # a disk tier needs a host tier
    tiered = _replay(requests, device, host, disk, **options)
    alone = _replay(requests, device, policy=options["policy"])
    assert alone.hit_blocks <= tiered.hit_blocks <= unlimited_replay(requests, block_tokens=BLOCK).hit_blocks
    assert min(tiered.host_hit_blocks, tiered.disk_hit_blocks, tiered.device_hit_blocks) >= 0
    if host == 0:
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
    argv = ["replay", str(path), "--device-blocks", "1", "--host-blocks", "1", "--disk-blocks", "3",
            "--policy", "lru", "--block-tokens", str(BLOCK), "--json"]  # fmt: skip
    assert main(argv) == 0
    out = capsys.readouterr().out.strip().splitlines()
    summary = json.loads(out[-1])
    # [3] evicts B to the host (A's copy goes, its disk copy stays); [2] hits B on the host
    # (C's write-back takes B's slot once read, and C spills to disk too); [1] finds A on the
    # disk. (With 2 disk blocks, C's spill would push A off the disk.)
    assert (summary["host_block_hit_rate"], summary["disk_block_hit_rate"]) == (0.2, 0.2)
    assert summary["device_block_hit_rate"] == 0.0 and summary["block_hit_rate"] == 0.4
    assert summary["host_token_hit_rate"] == 0.2 and summary["host_blocks"] == 1
    assert any(line.strip().startswith("of which disk") for line in out)


def test_cli_rejects_bad_tier_sizes_in_one_line(tmp_path, capsys):
    with pytest.raises(SystemExit):
        main(["replay", "t.jsonl", "--device-blocks", "2", "--host-blocks", "-1"])
    assert "-1 must be >= 0" in capsys.readouterr().err
    path = tmp_path / "trace.jsonl"
    path.write_text(json.dumps({"timestamp": 0, "input_length": 4, "output_length": 1, "hash_ids": [1]}) + "\n")
    assert main(["replay", str(path), "--device-blocks", "2", "--disk-blocks", "3", "--block-tokens", "4"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "disk_blocks=3 needs host_blocks > 0" in err


def _check_victim_order(requests, device, host, disk, policy, rank):
    """Replay ``requests``; after each, the victim listing must hold every evictable host copy
    once, evict nothing, and list them in the order of ``rank(index, key, node, page,
    redundant)``."""
    cache, now = replay_cache(device, policy=policy, host_blocks=host, disk_blocks=disk)
    index = cache.tiers
    with cache:
        for request, path in zip(requests, intern_block_paths(requests)[0]):
            now[0] = request.timestamp_ms / 1000.0
            serve_request(cache, path[:device])
            live = {key for key, entry in index.host_entries.items() if entry.ready and not entry.busy
                    and not entry.dropped}  # fmt: skip
            before = dict(index.host_entries)
            victims = index._victims(len(live) + 1, ())
            assert index.host_entries == before  # listing evicts nothing
            assert len(victims) == len(set(victims)) and set(victims) == live
            order = []
            for key in victims:
                node, page = index.trie.locate(key)
                redundant = node.on_device or bool(int(node.tiers[page]) & int(Tier.DISK))
                order.append(rank(index, key, node, page, redundant))
            assert order == sorted(order), order
            cache.check_invariants()
    return cache


@settings(max_examples=40, deadline=None)
@given(paths=_paths, device=st.integers(1, 6), host=st.integers(1, 8), disk=st.integers(0, 8))
def test_host_victims_go_redundant_first_then_by_last_use_leaves_first(paths, device, host, disk):
    # The lazy victim heaps against the order computed from scratch, after every request (LRU,
    # so a page's rank is its node's last use): every evictable host copy is listed once,
    # copies whose page is also on device or on disk first, then by last use, deeper first.
    # Under LRU there is no shadow: device and host hold what one LRU cache would.
    cache = _check_victim_order(_trace(*paths), device, host, disk, "lru",
                                lambda index, key, node, page, redundant:
                                (not redundant, node.last_access, -(node.first_page + page)))  # fmt: skip
    assert cache.tiers.shadow is None


@settings(max_examples=40, deadline=None)
@given(paths=_paths, device=st.integers(1, 6), host=st.integers(1, 8), disk=st.integers(0, 8),
       policy=st.sampled_from(["reuse", "segmented", "lfu"]))  # fmt: skip
def test_host_victims_follow_the_flat_cache_of_the_tiers_total_size(paths, device, host, disk, policy):
    # Under any other policy, the copies whose page the shadow (one cache of the device's +
    # the host's blocks under the same policy) evicted go right after the redundant copies,
    # before any copy of a page the shadow still holds.
    cache = _check_victim_order(_trace(*paths), device, host, disk, policy,
                                lambda index, key, node, page, redundant:
                                0 if redundant else 1 if index.shadow.evicted(key) else 2)  # fmt: skip
    assert cache.tiers.shadow.num_blocks == device + 1 + host  # the replay's pool has one more


def test_the_host_evicts_first_what_the_flat_cache_evicted_whatever_the_device_policy_ranks():
    # Device 2 blocks (+1 for the replay's last token), host 4: A, B, C in turn leave A and B
    # on host, A the older. The shadow (7 blocks) then sees A again and a new prompt, so it
    # evicts B (its least recently used) and C's last page: B's copies go first, A's after.
    cache, now = replay_cache(2, policy="reuse", host_blocks=4)
    key = {tuple(path): k for path in ([1, 2], [3, 4])
           for k, path in zip(chained_block_keys(path, 1, REPLAY_NAMESPACE), ([path[0]], path))}  # fmt: skip
    with cache:
        for t, blocks in enumerate(([1, 2], [3, 4], [5, 6])):
            now[0] = float(t)
            serve_request(cache, blocks)
        index = cache.tiers
        assert set(index.host_entries) == set(key.values())
        now[0] = 3.0
        index.shadow.observe(REPLAY_NAMESPACE, np.array([1, 2, 0], np.int32).tobytes())
        index.shadow.observe(REPLAY_NAMESPACE, np.array([7, 8, 9, 0], np.int32).tobytes())
        victims = index._victims(4, ())
        assert victims[:2] == [key[3,], key[3, 4]] and set(victims[2:]) == {key[1,], key[1, 2]}
        assert index.make_host_room(2) == 2 and set(index.host_entries) == {key[1,], key[1, 2]}
        cache.check_invariants()


def test_a_swap_with_a_full_host_keeps_the_evicted_pages_in_the_fetched_ones_slots():
    # Device 4, host 4. [5..8] evicts A to the host (full); A again is fetched from host while
    # its 4 device blocks evict B: B's write-back takes the slots A's fetch has read (A is on
    # device now), so B then hits on host, as in one cache of 8 blocks. Before, A's copies
    # were held by the fetch, B found no host room and left every tier.
    a, b = [1, 2, 3, 4], [5, 6, 7, 8]
    counts = _replay(_trace(a, b, a, b), 4, host=4)
    assert _tiers(counts) == (0, 8, 0)
    assert _replay(_trace(a, b, a, b), 8).hit_blocks == 8  # the flat cache of the same total
