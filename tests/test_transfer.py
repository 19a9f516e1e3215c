"""Transfer engine: bit-exact tier round trips, priorities, budgets, failures, locks, shutdown."""

import errno
import glob
import os
import threading

import jax
import jax.numpy as jnp
import pytest
import tier_cases
from tier_cases import DTYPES, same_bits
from tier_cases import int_keys as keys

from kvjax.tiers import disk_segments
from kvjax.tiers.disk_tier import DiskTier
from kvjax.tiers.host_tier import HostTier
from kvjax.tiers.token_bucket import TokenBucket
from kvjax.tiers.transfer import Link, LinkBudget, Priority, TransferEngine
from pallas_kernels import gather_blocks, scatter_blocks

BLOCK_SHAPE = (2, 2, 1, 4, 8)  # [num_layers, 2, num_kv_heads, page_size, head_dim]
NS = b"N" * 16
WAIT_S = 20  # generous: a loaded 2-core CI box; a hang fails instead of blocking forever


def random_pool(num_blocks, dtype, seed=0):
    """A page pool of random bit patterns (NaNs and infinities included)."""
    return tier_cases.random_blocks(num_blocks, BLOCK_SHAPE, dtype, seed)


def block_bytes(dtype="float32"):
    return tier_cases.block_bytes(BLOCK_SHAPE, dtype)


def tiers(tmp_path, dtype="float32", host_blocks=64, blocks_per_segment=4):
    host = HostTier(BLOCK_SHAPE, dtype, host_blocks * block_bytes(dtype))
    disk = DiskTier(str(tmp_path), BLOCK_SHAPE, dtype, 1 << 24,
                    segment_bytes=blocks_per_segment * block_bytes(dtype))
    return host, disk


def done(future):
    result = future.result(timeout=WAIT_S)
    assert result.ok, result.error
    return result


@pytest.mark.parametrize("dtype", DTYPES)
def test_every_tier_path_is_bit_exact_while_other_transfers_run(tmp_path, dtype):
    pool = random_pool(16, dtype, seed=len(dtype))
    kv_pages = jax.device_put(pool)
    host, disk = tiers(tmp_path, dtype)
    with TransferEngine(host, disk) as engine:
        # Background traffic on every link, never waited for until the end.
        noise = [engine.offload(kv_pages, [12, 13, 14, 15], keys(4, 100), namespace=NS)]
        noise.append(engine.spill(keys(4, 100)))
        noise.append(engine.restore(keys(4, 100), namespace=NS))
        noise.append(engine.fetch(keys(2, 100), priority=Priority.PREFETCH))
        # device -> host -> device
        done(engine.offload(kv_pages, [0, 1, 2, 3], keys(4), namespace=NS))
        direct = done(engine.fetch(keys(4)[::-1])).blocks
        # device -> host -> disk -> host -> device, the host copy dropped in between
        done(engine.offload(kv_pages, [7, 5, 6, 4], keys(4, 4), namespace=NS))
        assert done(engine.spill(keys(4, 4))).done_keys == tuple(keys(4, 4))
        assert host.discard(keys(4, 4)) == 4
        done(engine.restore([keys(8)[i] for i in (6, 4, 7, 5)], namespace=NS))
        via_disk = done(engine.fetch(keys(4, 4))).blocks
        for future in noise:
            future.result(timeout=WAIT_S)
    assert same_bits(direct, pool[[3, 2, 1, 0]])
    assert same_bits(via_disk, pool[[7, 5, 6, 4]])
    ids = jnp.array([9, 8, 11, 10], jnp.int32)
    restored = scatter_blocks(jnp.zeros_like(kv_pages), ids, via_disk)
    assert same_bits(gather_blocks(restored, ids), pool[[7, 5, 6, 4]])


def completion_order(futures):
    order, lock = [], threading.Lock()
    for name, future in futures:
        future.add_done_callback(lambda f, name=name: (lock.acquire(), order.append(name),
                                                       lock.release()))
    return order


def test_demand_fetch_overtakes_queued_prefetches(tmp_path):
    host, disk = tiers(tmp_path)
    host.put(keys(8), random_pool(8, "float32"), namespace=NS)
    disk.put(keys(8), random_pool(8, "float32"), NS)
    host.discard(keys(4, 4))
    with TransferEngine(host, disk, paused=True) as engine:
        futures = [(f"prefetch{i}", engine.fetch(keys(1, i), priority=Priority.PREFETCH))
                   for i in range(4)]
        futures += [(f"restore{i}", engine.restore(keys(1, 4 + i), namespace=NS))
                    for i in range(3)]
        futures.append(("demand", engine.fetch(keys(1, 3), priority=Priority.DEMAND)))
        futures.append(("demand_restore", engine.restore(keys(1, 7), namespace=NS,
                                                         priority=Priority.DEMAND)))
        order = completion_order(futures)
        engine.resume()
        assert all(future.result(timeout=WAIT_S).ok for _, future in futures)
    fetches = [name for name in order if "restore" not in name]
    restores = [name for name in order if "restore" in name]
    assert fetches[0] == "demand" and restores[0] == "demand_restore"
    assert fetches[1:] == [f"prefetch{i}" for i in range(4)]  # FIFO within a priority


def test_budget_holds_back_background_jobs_but_never_a_demand(tmp_path):
    now = [0.0]  # the budget's clock; frozen unless the test moves it
    host, _ = tiers(tmp_path)
    host.put(keys(4), random_pool(4, "float32"), namespace=NS)
    budget = {Link.HOST_TO_DEVICE: LinkBudget(rate_bytes_per_s=block_bytes() / 10,
                                              burst_bytes=block_bytes())}
    with TransferEngine(host, budgets=budget, clock=lambda: now[0]) as engine:
        first = engine.fetch(keys(1), priority=Priority.PREFETCH)
        done(first)  # the full bucket pays for one block
        second = engine.fetch(keys(1, 1), priority=Priority.PREFETCH)
        demand = engine.fetch(keys(1, 2), priority=Priority.DEMAND)
        done(demand)  # runs with an empty bucket, leaving it one block in debt
        assert not second.done() and engine.stats()["host_to_device"]["queued"] == 1
        now[0] = 10.0  # one block's worth of tokens: only pays off the demand's debt
        assert not engine.wait_idle(timeout=0.3) and not second.done()
        now[0] = 20.0
        done(second)


def test_token_bucket_refills_at_its_rate_up_to_its_burst():
    now = [0.0]
    bucket = TokenBucket(rate_bytes_per_s=100.0, burst_bytes=200, clock=lambda: now[0])
    assert bucket.try_take(150) == 0.0 and bucket.tokens == 50.0
    assert bucket.try_take(100) == pytest.approx(0.5)  # 50 missing at 100 B/s
    assert bucket.tokens == 50.0  # a refused take takes nothing
    now[0] = 10.0
    assert bucket.tokens == 200.0  # capped at the burst
    assert bucket.try_take(500) == 0.0 and bucket.tokens == -300.0  # oversized: only when full
    bucket.take(100)  # a demand: never refused, goes further into debt
    assert bucket.tokens == -400.0
    assert bucket.try_take(1) == pytest.approx(4.01)
    with pytest.raises(ValueError, match=r"rate_bytes_per_s=0 and burst_bytes=1 must be > 0"):
        TokenBucket(0, 1)


def test_failures_resolve_the_future_and_never_serve_wrong_blocks(tmp_path, monkeypatch):
    host, disk = tiers(tmp_path)
    pool = random_pool(4, "float32")
    host.put(keys(2), pool[:2], namespace=NS)
    disk.put(keys(2, 2), pool[2:], NS)

    def failing_gather(kv_pages, block_ids):
        raise RuntimeError("device lost")
    with TransferEngine(host, disk, gather_blocks=failing_gather) as engine:
        absent = engine.fetch(keys(1, 9)).result(timeout=WAIT_S)
        assert not absent.ok and absent.error == "not all keys are in the host tier"
        gathered = engine.offload(jax.device_put(pool), [0], keys(1, 5), namespace=NS)
        assert "device lost" in gathered.result(timeout=WAIT_S).error
        partial = engine.restore(keys(3, 1), namespace=NS).result(timeout=WAIT_S)
        assert not partial.ok and partial.done_keys == tuple(keys(2, 2))
        monkeypatch.setattr(host, "get", lambda keys: 1 / 0)
        crashed = engine.fetch(keys(1)).result(timeout=WAIT_S)
        assert not crashed.ok and "ZeroDivisionError" in crashed.error
        monkeypatch.undo()
        monkeypatch.setattr(disk_segments, "_save_payload", _raise_enospc)
        full = engine.spill(keys(2)).result(timeout=WAIT_S)
        assert not full.ok and full.done_keys == () and disk.stats().enospc_errors == 1
        monkeypatch.undo()
        host.discard(keys(2, 2))
        for path in glob.glob(os.path.join(disk.directory, "seg-*", "**", "d", "*"),
                              recursive=True):
            os.truncate(path, 3)  # every OCDBT data file of every segment
        corrupt = engine.restore(keys(2, 2), namespace=NS).result(timeout=WAIT_S)
        assert not corrupt.ok and corrupt.done_keys == ()
        assert not host.contains(keys(1, 2)[0]) and not host.contains(keys(1, 3)[0])
        assert engine.stats()["disk_to_host"]["failed"] == 2
    host.check_invariants()
    disk.check_invariants()


def _raise_enospc(*args, **kwargs):
    raise OSError(errno.ENOSPC, "No space left on device")


def test_blocks_in_flight_are_locked_in_their_tier_and_through_the_hooks(tmp_path):
    host, disk = tiers(tmp_path, host_blocks=2)
    pool = random_pool(4, "float32")
    host.put(keys(2), pool[:2], namespace=NS)
    calls = []
    with TransferEngine(host, disk, paused=True,
                        lock_hook=lambda link, ks: calls.append(("lock", link, ks)),
                        unlock_hook=lambda link, ks, r: calls.append(("unlock", link, ks, r.ok))
                        ) as engine:
        fetch = engine.fetch(keys(1))
        assert calls == [("lock", Link.HOST_TO_DEVICE, tuple(keys(1)))]
        assert host.put(keys(2, 2), pool[2:], namespace=NS) == keys(1, 2)  # only 1 evictable
        assert host.contains(keys(1)[0]) and not host.contains(keys(1, 1)[0])
        engine.resume()
        assert same_bits(done(fetch).blocks, pool[:1])
    assert calls[-1] == ("unlock", Link.HOST_TO_DEVICE, tuple(keys(1)), True)
    assert host.discard(keys(1)) == 1  # unlocked: goes at once instead of at a last unlock
    assert host.bytes_used == block_bytes()


def test_a_failing_lock_hook_raises_and_leaves_no_lock_behind(tmp_path):
    host, _ = tiers(tmp_path)
    host.put(keys(1), random_pool(1, "float32"), namespace=NS)

    def refuse(link, ks):
        raise KeyError("trie node gone")
    with TransferEngine(host, lock_hook=refuse) as engine:
        with pytest.raises(KeyError, match="trie node gone"):
            engine.fetch(keys(1))
        assert engine.stats()["host_to_device"]["queued"] == 0
    assert host.discard(keys(1)) == 1 and host.bytes_used == 0  # not held by a stale lock


def test_close_fails_queued_jobs_releases_their_locks_and_stops_the_workers(tmp_path):
    host, disk = tiers(tmp_path)
    host.put(keys(2), random_pool(2, "float32"), namespace=NS)
    disk.put(keys(1, 5), random_pool(1, "float32"), NS)
    unlocked = []
    engine = TransferEngine(host, disk, paused=True,
                            unlock_hook=lambda link, ks, r: unlocked.append((link, r.error)))
    queued = [engine.fetch(keys(2)), engine.spill(keys(1)),
              engine.restore(keys(1, 5), namespace=NS)]
    engine.close()
    results = [future.result(timeout=WAIT_S) for future in queued]
    assert [r.error for r in results] == ["engine closed"] * 3
    assert sorted(link.value for link, _ in unlocked) == [
        "disk_to_host", "host_to_device", "host_to_disk"]
    assert host.discard(keys(2)) == 2 and host.bytes_used == 0  # no lock left behind
    assert disk.discard(keys(1, 5), NS) == 1 and disk.bytes_used == 0
    late = engine.fetch(keys(1)).result(timeout=WAIT_S)
    assert not late.ok and not any(w.is_alive() for w in engine._workers)
    engine.close()  # idempotent


def test_queued_spills_coalesce_into_one_segment(tmp_path):
    host, disk = tiers(tmp_path, blocks_per_segment=4)
    host.put(keys(5), random_pool(5, "float32"), namespace=NS)
    with TransferEngine(host, disk, paused=True) as engine:
        spills = [engine.spill(keys(1, i)) for i in range(5)]
        engine.resume()
        assert all(done(future).done_keys for future in spills)
    assert disk.stats().written_segments == 2  # 4 blocks per segment: 4 + 1


def test_bad_requests_raise_before_anything_is_queued(tmp_path):
    host, _ = tiers(tmp_path)
    with TransferEngine(host) as engine:
        with pytest.raises(ValueError, match=r"len\(block_ids\)=1 must equal len\(keys\)=2"):
            engine.offload(jnp.zeros((2, *BLOCK_SHAPE)), [0], keys(2), namespace=NS)
        with pytest.raises(ValueError, match=r"priority=0 must be a Priority"):
            engine.fetch(keys(1), priority=0)
        assert all(s["queued"] == 0 and s["jobs"] == 0 for s in engine.stats().values())
    no_disk = TransferEngine(host)
    result = no_disk.spill(keys(1)).result(timeout=WAIT_S)
    assert not result.ok and result.error == "no disk tier"
    no_disk.close()
