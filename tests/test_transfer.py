"""Transfer engine: bit-exact tier round trips through host slots, priorities, budgets,
failures, bucketed batches, shutdown."""

import concurrent.futures
import errno
import glob
import os
import threading
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import tier_cases
from tier_cases import DTYPES, same_bits
from tier_cases import int_keys as keys

from kvjax.tiers import disk_segments, transfer
from kvjax.tiers.disk_tier import DiskTier
from kvjax.tiers.host_pool import HostPool
from kvjax.tiers.token_bucket import TokenBucket
from kvjax.tiers.transfer import Link, LinkBudget, Priority, TransferEngine, bucket_rows
from pallas_kernels import gather_blocks, scatter_blocks

BLOCK_SHAPE = (2, 2, 1, 4, 8)  # [num_layers, 2, num_kv_heads, page_size, head_dim]
NS = b"N" * 16
WAIT_S = 20  # generous: a loaded 2-core CI box; a hang fails instead of blocking forever


def random_pool(num_blocks, dtype, seed=0):
    """A page pool of random bit patterns (NaNs and infinities included)."""
    return tier_cases.random_blocks(num_blocks, BLOCK_SHAPE, dtype, seed)


def block_bytes(dtype="float32"):
    return tier_cases.block_bytes(BLOCK_SHAPE, dtype)


def tiers(tmp_path, dtype="float32", host_slots=64, blocks_per_segment=4):
    host = HostPool(BLOCK_SHAPE, dtype, host_slots)
    disk = DiskTier(str(tmp_path), BLOCK_SHAPE, dtype, 1 << 24, segment_bytes=blocks_per_segment * block_bytes(dtype))
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
        noise = [engine.offload(kv_pages, [12, 13, 14, 15], [40, 41, 42, 43])]
        noise.append(engine.spill(keys(4, 100), [NS] * 4, [40, 41, 42, 43]))
        noise.append(engine.fetch([40, 41], priority=Priority.PREFETCH))
        # device -> host -> device
        done(engine.offload(kv_pages, [0, 1, 2, 3], [0, 1, 2, 3]))
        direct = done(engine.fetch([3, 2, 1, 0])).blocks
        # device -> host -> disk -> host (other slots) -> device
        done(engine.offload(kv_pages, [7, 5, 6, 4], [4, 5, 6, 7]))
        assert done(engine.spill(keys(4, 4), [NS] * 4, [4, 5, 6, 7])).done_keys == tuple(keys(4, 4))
        done(engine.restore([keys(8)[i] for i in (6, 4, 7, 5)], NS, [20, 21, 22, 23]))
        via_disk = done(engine.fetch([21, 23, 20, 22])).blocks
        for future in noise:
            future.result(timeout=WAIT_S)
    assert same_bits(direct, pool[[3, 2, 1, 0]])
    assert same_bits(via_disk, pool[[7, 5, 6, 4]])
    ids = jnp.array([9, 8, 11, 10], jnp.int32)
    restored = scatter_blocks(jnp.zeros_like(kv_pages), ids, via_disk)
    assert same_bits(gather_blocks(restored, ids), pool[[7, 5, 6, 4]])


def test_moves_are_padded_to_their_bucket_with_zero_rows(tmp_path):
    pool = random_pool(8, "float32", seed=3)
    host, _ = tiers(tmp_path)
    assert [bucket_rows(n, (1, 4, 16)) for n in (1, 2, 4, 5, 16)] == [1, 4, 4, 16, 16]
    with pytest.raises(ValueError, match=r"17 blocks exceed the largest transfer bucket 16"):
        bucket_rows(17, (1, 4, 16))
    gathered = []

    def counting_gather(kv_pages, block_ids):
        gathered.append(block_ids.tolist())
        return gather_blocks(kv_pages, block_ids)
    with TransferEngine(host, gather_blocks=counting_gather, buckets=(1, 4, 16)) as engine:
        done(engine.offload(jax.device_put(pool), [5, 2, 7], [0, 1, 2]))
        fetched = done(engine.fetch([2, 0])).blocks
    assert gathered == [[5, 2, 7, -1]]  # one gather, padded with a block id of no block
    assert fetched.shape == (4, *BLOCK_SHAPE)
    assert same_bits(fetched[:2], pool[[7, 5]]) and not np.asarray(fetched[2:]).any()


def test_an_offload_from_a_cpu_pool_reads_it_directly_when_allowed(tmp_path):
    """``direct_cpu_reads``: no gather, the same host bits, and the pool may change right after."""
    pool = random_pool(8, "float32", seed=5)
    host, _ = tiers(tmp_path)
    gathered = []

    def counting_gather(kv_pages, block_ids):
        gathered.append(block_ids.tolist())
        return gather_blocks(kv_pages, block_ids)
    for direct in (True, False):
        kv_pages = jax.device_put(pool)
        with TransferEngine(host, gather_blocks=counting_gather, buckets=(4,), direct_cpu_reads=direct) as engine:
            future = engine.offload(kv_pages, [6, 1, 3], [2, 0, 1])
            kv_pages = scatter_blocks(kv_pages, jnp.array([6, 1, 3], jnp.int32),
                                      jnp.zeros((3, *pool.shape[1:]), pool.dtype))  # donated and overwritten
            done(future)
        assert same_bits(host.read(np.array([2, 0, 1])), pool[[6, 1, 3]])
    assert gathered == [[6, 1, 3, -1]]  # only the engine without direct reads gathered


def completion_order(futures):
    order, lock = [], threading.Lock()
    for name, future in futures:
        future.add_done_callback(lambda f, name=name: (lock.acquire(), order.append(name), lock.release()))
    return order


def test_demand_fetch_overtakes_queued_prefetches(tmp_path):
    host, disk = tiers(tmp_path)
    host.write(np.arange(8), random_pool(8, "float32"))
    disk.put(keys(8), random_pool(8, "float32"), NS)
    with TransferEngine(host, disk, paused=True) as engine:
        futures = [(f"prefetch{i}", engine.fetch([i], priority=Priority.PREFETCH)) for i in range(4)]
        futures += [(f"restore{i}", engine.restore(keys(1, 4 + i), NS, [10 + i])) for i in range(3)]
        futures.append(("demand", engine.fetch([3], priority=Priority.DEMAND)))
        futures.append(("demand_restore", engine.restore(keys(1, 7), NS, [20], priority=Priority.DEMAND)))
        order = completion_order(futures)
        engine.resume()
        assert all(future.result(timeout=WAIT_S).ok for _, future in futures)
    fetches = [name for name in order if "restore" not in name]
    restores = [name for name in order if "restore" in name]
    assert fetches[0] == "demand" and restores[0] == "demand_restore"
    assert fetches[1:] == [f"prefetch{i}" for i in range(4)]  # FIFO within a priority


def test_promote_moves_queued_jobs_ahead_and_a_waiting_offload_when_it_is_queued(tmp_path):
    host, _ = tiers(tmp_path)
    host.write(np.arange(4), random_pool(4, "float32"))
    pool = random_pool(4, "float32")
    gate = concurrent.futures.Future()  # the read an offload follows
    with TransferEngine(host, paused=True) as engine:
        fetches = [(f"prefetch{i}", engine.fetch([i], priority=Priority.PREFETCH)) for i in range(3)]
        offloads = [(f"spill{i}", engine.offload(pool, [i], [10 + i])) for i in range(2)]
        follower = engine.offload(pool, [3], [13], after=[gate])
        order = completion_order([*fetches, *offloads, ("follower", follower)])
        assert engine.promote([fetches[2][1], follower], Priority.DEMAND) == 2
        assert engine.promote([fetches[2][1], fetches[0][1]], Priority.SPILL) == 0  # never lowered
        assert engine.promote([concurrent.futures.Future()], Priority.DEMAND) == 0  # not the engine's
        gate.set_result(None)  # the follower is queued now, at the priority it was raised to
        engine.resume()
        assert all(future.result(timeout=WAIT_S).ok for _, future in [*fetches, *offloads, ("f", follower)])
        assert engine.promote([fetches[1][1]], Priority.DEMAND) == 0  # done: nothing to raise
        with pytest.raises(ValueError, match="priority=0 must be a Priority"):
            engine.promote([fetches[1][1]], 0)
    assert [name for name in order if "prefetch" in name] == ["prefetch2", "prefetch0", "prefetch1"]
    assert [name for name in order if "prefetch" not in name] == ["follower", "spill0", "spill1"]
    assert same_bits(host.read([13]), pool[3:4])


def test_a_promoted_job_stops_waiting_for_its_links_budget(tmp_path):
    now = [0.0]  # the budget's clock, frozen: a background job short of tokens waits for good
    host, _ = tiers(tmp_path)
    host.write(np.arange(4), random_pool(4, "float32"))
    budget = {Link.HOST_TO_DEVICE: LinkBudget(rate_bytes_per_s=block_bytes() / 10, burst_bytes=block_bytes())}
    with TransferEngine(host, budgets=budget, clock=lambda: now[0]) as engine:
        done(engine.fetch([0], priority=Priority.PREFETCH))  # spends the burst
        waiting = [engine.fetch([i], priority=Priority.PREFETCH) for i in (1, 2)]
        assert not engine.wait_idle(timeout=0.2) and not any(f.done() for f in waiting)
        assert engine.promote(waiting[1:], Priority.DEMAND) == 1  # a request now waits on it
        assert same_bits(np.asarray(done(waiting[1]).blocks), host.read([2]))
        assert not waiting[0].done()  # still behind the budget (now in debt)
        now[0] = 30.0
        done(waiting[0])


def test_budget_holds_back_background_jobs_but_never_a_demand(tmp_path):
    now = [0.0]  # the budget's clock; frozen unless the test moves it
    host, _ = tiers(tmp_path)
    host.write(np.arange(4), random_pool(4, "float32"))
    budget = {Link.HOST_TO_DEVICE: LinkBudget(rate_bytes_per_s=block_bytes() / 10, burst_bytes=block_bytes())}
    with TransferEngine(host, budgets=budget, clock=lambda: now[0]) as engine:
        first = engine.fetch([0], priority=Priority.PREFETCH)
        done(first)  # the full bucket pays for one block
        second = engine.fetch([1], priority=Priority.PREFETCH)
        demand = engine.fetch([2], priority=Priority.DEMAND)
        done(demand)  # runs with an empty bucket, leaving it one block in debt
        assert not second.done() and engine.stats()["host_to_device"]["queued"] == 1
        now[0] = 10.0  # one block's worth of tokens: only pays off the demand's debt
        assert not engine.wait_idle(timeout=0.3) and not second.done()
        now[0] = 20.0
        done(second)


def test_a_small_fetch_on_an_idle_link_runs_on_the_callers_thread(tmp_path, monkeypatch):
    """A fetch of at most inline_fetch_bytes, with nothing queued or running on its link, is
    done when fetch returns, copied on the caller's thread; a larger one, and a small one
    behind it or in a paused engine, go to the worker, in order."""
    pool = random_pool(4, "float32", seed=4)
    host, _ = tiers(tmp_path)
    host.write(np.arange(4), pool)
    threads, running, gate, copy = [], threading.Event(), threading.Event(), host.to_device

    def to_device(slots, rows):
        threads.append(threading.current_thread())
        if len(slots) == 3:
            running.set()
            assert gate.wait(WAIT_S)
        return copy(slots, rows)
    monkeypatch.setattr(host, "to_device", to_device)
    caller = threading.current_thread()
    with TransferEngine(host, inline_fetch_bytes=2 * block_bytes()) as engine:
        small = engine.fetch([2, 0])
        assert small.done() and threads == [caller]
        assert same_bits(small.result().blocks, pool[[2, 0]])
        large = engine.fetch([0, 1, 2])  # over the limit: the worker runs it, held at the gate
        assert running.wait(WAIT_S)
        behind = engine.fetch([3])  # small, but the link is busy: queued behind it
        assert not behind.done()
        gate.set()
        assert engine.wait_idle(WAIT_S)  # waits without running anything (result() might)
        assert same_bits(done(large).blocks, pool[[0, 1, 2]]) and same_bits(done(behind).blocks, pool[[3]])
        assert threads[1] is threads[2] is not caller
        assert engine.stats()["host_to_device"]["jobs"] == 3
        prefetch = engine.fetch([1], priority=Priority.PREFETCH)  # never inline: the worker
        assert engine.wait_idle(WAIT_S)
        assert same_bits(done(prefetch).blocks, pool[[1]]) and threads[-1] is not caller
    with TransferEngine(host, paused=True, inline_fetch_bytes=2 * block_bytes()) as engine:
        held = engine.fetch([1])
        assert not held.done()
        engine.resume()
        assert engine.wait_idle(WAIT_S)
        assert same_bits(done(held).blocks, pool[[1]]) and threads[-1] is not caller


def test_a_waiter_runs_its_job_itself_when_it_is_next_on_an_idle_link(tmp_path, monkeypatch):
    """``result()`` and ``transfer.wait_any`` run a queued fetch or restore on the waiting thread when it
    is next in line, nothing runs on its link and its budget pays for it now (the worker would
    run it next); a job behind another, or one its budget does not pay for yet, is left to
    the worker. The budget's clock is frozen and a starved worker sleeps until notified, so
    which thread runs each job is certain."""
    monkeypatch.setattr(transfer, "_POLL_S", 600.0)
    now = [0.0]
    pool = random_pool(4, "float32", seed=6)
    host, disk = tiers(tmp_path)
    host.write(np.arange(4), pool)
    disk.put(keys(2, 50), pool[:2], NS)
    threads, to_device, disk_get = [], host.to_device, disk.get
    monkeypatch.setattr(host, "to_device", lambda *a: threads.append(threading.current_thread()) or to_device(*a))
    monkeypatch.setattr(disk, "get", lambda *a: threads.append(threading.current_thread()) or disk_get(*a))
    caller = threading.current_thread()
    slow = LinkBudget(rate_bytes_per_s=block_bytes() / 1000, burst_bytes=block_bytes())  # a block per 1000 s
    clock = lambda: now[0]
    with TransferEngine(host, budgets={Link.HOST_TO_DEVICE: slow}, clock=clock, inline_fetch_bytes=0) as engine:
        warm = engine.fetch([0], priority=Priority.PREFETCH)
        assert engine.wait_idle(WAIT_S) and threads[-1] is not caller  # the full bucket paid
        first = engine.fetch([1], priority=Priority.PREFETCH)
        second = engine.fetch([2], priority=Priority.PREFETCH)
        with pytest.raises(concurrent.futures.TimeoutError):
            first.result(timeout=0.05)  # next in line, but the budget does not pay yet
        now[0] = 1000.0  # one block's tokens; the starved worker does not look
        with pytest.raises(concurrent.futures.TimeoutError):
            second.result(timeout=0.05)  # paid for, but behind the first
        assert len(threads) == 1 and not first.done() and not second.done()
        assert same_bits(done(first).blocks, pool[[1]]) and threads[-1] is caller
        now[0] = 2000.0
        assert same_bits(done(second).blocks, pool[[2]]) and same_bits(done(warm).blocks, pool[[0]])
        assert engine.stats()["host_to_device"] == {"jobs": 3, "failed": 0, "bytes": 3 * block_bytes(), "queued": 0}
    now[0], threads[:] = 0.0, []
    with TransferEngine(host, disk, budgets={Link.DISK_TO_HOST: slow}, clock=clock) as engine:
        first_restore = engine.restore(keys(1, 50), NS, [10])
        assert engine.wait_idle(WAIT_S) and threads[-1] is not caller  # the full bucket paid
        restore = engine.restore(keys(1, 51), NS, [11])
        transfer.wait_any([restore], 0.05)
        assert not restore.done() and len(threads) == 1  # unpaid: waited, ran nothing
        now[0] = 1000.0
        transfer.wait_any([restore], WAIT_S)
        assert restore.done() and len(threads) == 2 and threads[-1] is caller
        assert done(first_restore).done_keys == tuple(keys(1, 50))
        assert done(restore).done_keys == tuple(keys(1, 51)) and same_bits(host.read(np.array([11])), pool[[1]])


def test_a_cancelled_fetch_does_not_stop_its_link(tmp_path):
    """A caller that cancels a queued fetch gets a cancelled future; the link's worker goes
    on with the next job (resolving a cancelled future raised in the worker and ended it)."""
    pool = random_pool(2, "float32", seed=5)
    host, _ = tiers(tmp_path)
    host.write(np.arange(2), pool)
    with TransferEngine(host, paused=True, inline_fetch_bytes=0) as engine:
        cancelled = engine.fetch([0])
        assert cancelled.cancel()
        engine.resume()
        assert engine.wait_idle(WAIT_S)
        assert same_bits(done(engine.fetch([1])).blocks, pool[[1]])


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
    host.write(np.arange(2), pool[:2])
    disk.put(keys(2, 2), pool[2:], NS)

    def failing_gather(kv_pages, block_ids):
        raise RuntimeError("device lost")
    with TransferEngine(host, disk, gather_blocks=failing_gather) as engine:
        gathered = engine.offload(jax.device_put(pool), [0], [5])
        assert "device lost" in gathered.result(timeout=WAIT_S).error
        absent = engine.restore(keys(3, 1), NS, [8, 9, 10]).result(timeout=WAIT_S)
        assert not absent.ok and absent.error == "not all keys are on disk"
        monkeypatch.setattr(host, "to_device", lambda slots, rows: 1 / 0)
        crashed = engine.fetch([0]).result(timeout=WAIT_S)
        assert not crashed.ok and "ZeroDivisionError" in crashed.error
        monkeypatch.undo()
        monkeypatch.setattr(disk_segments, "_save_payload", _raise_enospc)
        full = engine.spill(keys(2), [NS] * 2, [0, 1]).result(timeout=WAIT_S)
        assert not full.ok and full.done_keys == () and disk.stats().enospc_errors == 1
        monkeypatch.undo()
        for path in glob.glob(os.path.join(disk.directory, "seg-*", "**", "d", "*"), recursive=True):
            os.truncate(path, 3)  # every OCDBT data file of every segment
        host.write(np.array([12, 13]), np.zeros((2, *BLOCK_SHAPE), np.float32))
        corrupt = engine.restore(keys(2, 2), NS, [12, 13]).result(timeout=WAIT_S)
        assert not corrupt.ok and corrupt.done_keys == ()
        assert not np.asarray(host.read(np.array([12, 13]))).any()  # nothing written into the slots
        assert engine.stats()["disk_to_host"]["failed"] == 2
    disk.check_invariants()


def _raise_enospc(*args, **kwargs):
    raise OSError(errno.ENOSPC, "No space left on device")


def test_a_restore_pins_its_disk_segments_until_it_finishes(tmp_path):
    host, disk = tiers(tmp_path, blocks_per_segment=1)
    disk.put(keys(1), random_pool(1, "float32"), NS)
    with TransferEngine(host, disk, paused=True) as engine:
        restore = engine.restore(keys(1), NS, [0])
        assert disk.discard(keys(1), NS) == 1 and disk.bytes_used > 0  # discarded, files kept: pinned
        engine.resume()
        restore.result(timeout=WAIT_S)
    assert disk.bytes_used == 0  # the last pin went with the restore


def test_close_fails_queued_jobs_releases_their_pins_and_stops_the_workers(tmp_path):
    host, disk = tiers(tmp_path)
    disk.put(keys(1, 5), random_pool(1, "float32"), NS)
    engine = TransferEngine(host, disk, paused=True)
    queued = [engine.fetch([0, 1]), engine.spill(keys(1), [NS], [0]), engine.restore(keys(1, 5), NS, [3])]
    engine.close()
    results = [future.result(timeout=WAIT_S) for future in queued]
    assert [r.error for r in results] == ["engine closed"] * 3
    assert disk.discard(keys(1, 5), NS) == 1 and disk.bytes_used == 0  # no pin left behind
    late = engine.fetch([1]).result(timeout=WAIT_S)
    assert not late.ok and not any(w.is_alive() for w in engine._workers)
    engine.close()  # idempotent


def test_queued_spills_coalesce_into_one_segment(tmp_path):
    host, disk = tiers(tmp_path, blocks_per_segment=4)
    host.write(np.arange(5), random_pool(5, "float32"))
    with TransferEngine(host, disk, paused=True) as engine:
        spills = [engine.spill(keys(1, i), [NS], [i]) for i in range(5)]
        engine.resume()
        assert all(done(future).done_keys for future in spills)
    assert disk.stats().written_segments == 2  # 4 blocks per segment: 4 + 1


def test_queued_spills_of_one_key_coalesce_as_they_would_run_one_by_one(tmp_path):
    # found by test_transfer_properties: coalesced into one disk write, two spills of one key
    # (and every spill coalesced with them) failed with "keys contain duplicates"; alone, the
    # second finds the key on disk and is done
    host, disk = tiers(tmp_path, blocks_per_segment=4)
    pool = random_pool(3, "float32", seed=11)
    host.write(np.arange(3), pool)
    with TransferEngine(host, disk, paused=True) as engine:
        first = engine.spill(keys(1), [NS], [0])
        again = engine.spill(keys(2), [NS] * 2, [1, 2])  # keys 0 and 1: key 0 from another slot
        engine.resume()
        assert done(first).done_keys == tuple(keys(1)) and done(again).done_keys == tuple(keys(2))
    read = disk.get(keys(2), NS)
    assert read.hits.all() and same_bits(read.blocks, pool[[0, 2]])  # the first spill's block 0 stays
    assert disk.stats().written_segments == 1


def test_a_synchronous_engine_runs_each_job_at_submit(tmp_path):
    pool = random_pool(4, "float32", seed=9)
    host, disk = tiers(tmp_path)
    engine = TransferEngine(host, disk, synchronous=True)
    offload = engine.offload(jax.device_put(pool), [1, 3], [7, 8])
    assert offload.done() and not engine._workers
    assert same_bits(done(engine.fetch([8, 7])).blocks, pool[[3, 1]])
    engine.close()
    assert engine.fetch([7]).result(timeout=0).error == "engine closed"


def test_bad_requests_raise_before_anything_is_queued(tmp_path):
    host, _ = tiers(tmp_path, host_slots=4)
    with TransferEngine(host) as engine:
        with pytest.raises(ValueError, match=r"len\(block_ids\)=1 must equal len\(slots\)=2"):
            engine.offload(jnp.zeros((2, *BLOCK_SHAPE)), [0], [0, 1])
        with pytest.raises(ValueError, match=r"priority=0 must be a Priority"):
            engine.fetch([0], priority=0)
        with pytest.raises(ValueError, match=r"slots \[4\] must be host slots in \[0, 4\)"):
            engine.fetch([4])
        assert all(s["queued"] == 0 and s["jobs"] == 0 for s in engine.stats().values())
    no_disk = TransferEngine(host)
    result = no_disk.spill(keys(1), [NS], [0]).result(timeout=WAIT_S)
    assert not result.ok and result.error == "no disk tier"
    no_disk.close()


def test_the_remote_link_runs_pulls_by_priority_under_its_budget_and_its_deadlines(tmp_path):
    now = [0.0]
    host, _ = tiers(tmp_path)
    budget = {Link.REMOTE_TO_HOST: LinkBudget(rate_bytes_per_s=100, burst_bytes=1012)}  # demands: 12
    order, far = [], time.monotonic() + WAIT_S

    def pull(name, blocks=None):
        def run(deadline):
            assert deadline == far
            order.append(name)
            return blocks
        return run

    with TransferEngine(host, budgets=budget, clock=lambda: now[0], paused=True) as engine:
        background = engine.pull_remote(pull("prefetch"), 1, 1000, deadline=far, priority=Priority.PREFETCH)
        starved = engine.pull_remote(pull("starved"), 1, 1000, deadline=far, priority=Priority.PREFETCH)
        blocks = np.arange(6, dtype=np.uint8).reshape(2, 3)
        demand = engine.pull_remote(pull("demand", blocks), 2, 3, deadline=far)
        expired = engine.pull_remote(pull("expired"), 1, 3, deadline=time.monotonic() - 1)
        broken = engine.pull_remote(lambda deadline: 1 / 0, 1, 3, deadline=far)
        engine.resume()
        result = done(demand)
        assert result.link is Link.REMOTE_TO_HOST and result.blocks is blocks and result.seconds >= 0
        done(background)
        assert not expired.result(WAIT_S).ok and "queued" in expired.result(WAIT_S).error
        assert not broken.result(WAIT_S).ok and "ZeroDivisionError" in broken.result(WAIT_S).error
        assert not starved.done()  # the budget paid for one background pull only
        now[0] = 10.0
        done(starved)
        assert order == ["demand", "prefetch", "starved"]  # expired never ran; demand first
        stats = engine.stats()["remote_to_host"]
        assert stats == {"jobs": 5, "failed": 2, "bytes": 6, "queued": 0}  # the background pulls brought nothing
        with pytest.raises(ValueError, match="num_blocks=0 must be an int >= 1"):
            engine.pull_remote(pull("x"), 0, 3, deadline=far)


def test_the_remote_link_counts_the_bytes_that_arrived_not_those_asked_for(tmp_path):
    # a fetch whose peer offered nothing, or whose blocks failed their checks, returns None
    # (or the verified leading run): the link counted every byte asked for as delivered
    host, _ = tiers(tmp_path)
    arrived = np.zeros((1, 100), np.uint8)
    with TransferEngine(host) as engine:
        far = time.monotonic() + WAIT_S
        assert done(engine.pull_remote(lambda deadline: None, 4, 100, deadline=far)).blocks is None
        assert done(engine.pull_remote(lambda deadline: arrived, 3, 100, deadline=far)).blocks is arrived
        assert engine.stats()["remote_to_host"] == {"jobs": 2, "failed": 0, "bytes": 100, "queued": 0}


def test_a_pull_waits_no_longer_than_its_deadline_behind_a_hung_one(tmp_path):
    # the link runs one pull at a time: one queued behind a hung pull waited for all of it
    host, _ = tiers(tmp_path)
    release = threading.Event()
    with TransferEngine(host) as engine:
        start = time.monotonic()
        hung = engine.pull_remote(lambda deadline: release.wait(WAIT_S), 1, 8, deadline=start + 0.6)
        queued = engine.pull_remote(lambda deadline: "never ran", 1, 8, deadline=start + 0.3)
        assert queued.result(WAIT_S).error == transfer.PULL_EXPIRED  # at its own deadline:
        assert not hung.done()  # before the pull ahead of it ended (it ends at its later deadline)
        assert hung.result(WAIT_S).error == transfer.PULL_ABANDONED  # the running one, at its deadline
        release.set()  # the hung pull returns at last: its late result is dropped, counted once
        assert engine.wait_idle(WAIT_S)
        assert hung.result(0).error == transfer.PULL_ABANDONED
        assert engine.stats()["remote_to_host"] == {"jobs": 2, "failed": 2, "bytes": 0, "queued": 0}
        on_time = engine.pull_remote(lambda deadline: "pulled", 1, 8, deadline=time.monotonic() + WAIT_S)
        assert done(on_time).blocks == "pulled"  # the link works on
        many = [engine.pull_remote(lambda deadline: "ok", 1, 8, deadline=time.monotonic() + WAIT_S) for _ in range(50)]
        assert all(done(future).blocks == "ok" for future in many)
        watchers = [t for t in threading.enumerate() if t.name == "kvjax-pull-deadlines" or isinstance(t, threading.Timer)]
        assert len(watchers) == 1  # one watcher for every deadline (a Timer thread per pull cost ~0.3 ms each)
        assert not engine._deadline_jobs  # pulls that ended in time leave nothing behind


def test_a_pull_with_a_deadline_the_watcher_cannot_keep_is_refused_and_a_far_one_kills_no_deadline(tmp_path):
    # a NaN deadline sat atop the watcher's heap for good and one of 1e10 s (past the longest
    # wait a lock takes) killed the watcher: either way no later pull expired, and a pull
    # queued behind a hung one waited for all of it
    host, _ = tiers(tmp_path)
    release = threading.Event()
    with TransferEngine(host) as engine:
        for bad in (float("nan"), float("inf"), None, "1"):
            with pytest.raises(ValueError, match=r"deadline=.* must be a finite number of time.monotonic\(\) seconds"):
                engine.pull_remote(lambda deadline: "x", 1, 8, deadline=bad)
        for bad in (0, -8, 2.5, True):
            with pytest.raises(ValueError, match=rf"block_nbytes={bad!r} must be an int >= 1"):
                engine.pull_remote(lambda deadline: "x", 1, bad, deadline=time.monotonic() + WAIT_S)
        assert done(engine.pull_remote(lambda deadline: "far", 1, 8, deadline=time.monotonic() + 1e10)).blocks == "far"
        start = time.monotonic()
        hung = engine.pull_remote(lambda deadline: release.wait(3 * WAIT_S), 1, 8, deadline=start + 0.6)
        queued = engine.pull_remote(lambda deadline: "never ran", 1, 8, deadline=start + 0.3)
        try:  # both by the watcher, the hung pull still running
            assert queued.result(WAIT_S).error == transfer.PULL_EXPIRED
            assert hung.result(WAIT_S).error == transfer.PULL_ABANDONED
        finally:
            release.set()
        assert engine.wait_idle(WAIT_S)


def test_close_fails_an_offload_still_waiting_for_the_reads_it_follows():
    # an offload submitted with after= (the fetches that read its slots first) was neither
    # queued nor failed by close: its future stayed pending for good
    host = HostPool((2, 2, 1, 4, 8), jnp.float32, num_slots=8)
    engine = TransferEngine(host)
    read = concurrent.futures.Future()  # a fetch's read, which only the cache's poll resolves
    offload = engine.offload(jnp.ones((8, 2, 2, 1, 4, 8), jnp.float32), [1], [0], after=[read])
    engine.close(timeout=5)
    assert offload.done() and offload.result(0).error == "engine closed"
    read.set_result(None)  # resolving it later submits nothing
    assert engine.stats()["device_to_host"]["queued"] == 0
    closed = TransferEngine(host)
    closed.close()
    late = closed.offload(jnp.ones((8, 2, 2, 1, 4, 8), jnp.float32), [1], [0], after=[concurrent.futures.Future()])
    assert late.done() and late.result(0).error == "engine closed"
