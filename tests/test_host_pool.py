"""HostPool: slots of one preallocated host array, bit-exact both ways, padded batches, errors;
staging buffers (wrapped by device_put on CPU, copied from where it copies; reused once nothing
views them) under random call sequences and concurrent calls on disjoint slots."""

import gc
import os
import subprocess
import sys
import textwrap
import threading

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tier_cases import DTYPES, block_bytes, random_blocks, same_bits

from kvjax.tiers.host_pool import HostPool

BLOCK_SHAPE = (2, 2, 1, 4, 8)
NUM_SLOTS = 12


@pytest.mark.parametrize("dtype", DTYPES)
def test_device_host_device_round_trip_is_bit_exact(dtype):
    blocks = random_blocks(5, BLOCK_SHAPE, dtype, seed=1)  # NaN payloads and infinities included
    pool = HostPool(BLOCK_SHAPE, dtype, num_slots=8)
    pool.write(np.array([6, 0, 3, 1, 7]), jax.device_put(blocks))
    assert same_bits(pool.to_device(np.array([0, 6, 7])), blocks[[1, 0, 4]])
    assert same_bits(pool.read(np.array([3, 1])), blocks[[2, 3]])


@pytest.mark.parametrize("dtype", DTYPES)
def test_rows_written_straight_from_a_source_keep_their_bits(dtype):
    source = random_blocks(6, BLOCK_SHAPE, dtype, seed=4)
    pool = HostPool(BLOCK_SHAPE, dtype, num_slots=8)
    pool.write_rows(np.array([7, 0, 3]), source, np.array([5, 1, 5]))  # a row may go to two slots
    assert same_bits(pool.read(np.array([0, 3, 7])), source[[1, 5, 5]])
    with pytest.raises(ValueError, match=r"rows \[6\] must index the 6 rows of source"):
        pool.write_rows(np.array([1]), source, np.array([6]))
    with pytest.raises(ValueError, match=r"with one row per slot; got 1 rows for 2 slots"):
        pool.write_rows(np.array([1, 2]), source, np.array([0]))
    assert same_bits(pool.read(np.array([0, 3, 7])), source[[1, 5, 5]])  # nothing changed


def test_writes_copy_into_the_pool_and_padding_rows_are_zero():
    blocks = random_blocks(3, BLOCK_SHAPE, "float32", seed=2)
    pool = HostPool(BLOCK_SHAPE, "float32", num_slots=4)
    source = blocks.copy()
    pool.write(np.array([2, 3]), source[:3])  # a padded batch: the third row is ignored
    source[:] = 0  # the caller's later writes do not reach the pool
    padded = pool.to_device(np.array([3, 2]), num_rows=4)
    assert padded.shape == (4, *BLOCK_SHAPE)
    assert same_bits(padded[:2], blocks[[1, 0]]) and not np.asarray(padded[2:]).any()
    assert pool.capacity_bytes == 4 * pool.block_nbytes == 4 * 2 * 2 * 1 * 4 * 8 * 4


def test_a_pool_without_bytes_keeps_slots_and_no_array():
    pool = HostPool(BLOCK_SHAPE, "bfloat16", num_slots=1 << 30, store_bytes=False)  # 2**30 slots, no memory
    pool.write(np.array([5, 9]), jnp.ones((2, *BLOCK_SHAPE), jnp.bfloat16))
    assert pool.to_device(np.array([5])) is None
    assert pool.read(np.array([5])).shape == (1, *BLOCK_SHAPE)
    assert pool.capacity_bytes == (1 << 30) * pool.block_nbytes


def test_bad_input_raises_and_changes_nothing():
    pool = HostPool(BLOCK_SHAPE, "float32", num_slots=2)
    pool.write(np.array([0]), np.ones((1, *BLOCK_SHAPE), np.float32))
    before = pool.read(np.array([0, 1]))
    with pytest.raises(ValueError, match=r"slot 2 is out of range; expected 0 <= slot < 2"):
        pool.write(np.array([1, 2]), np.zeros((2, *BLOCK_SHAPE), np.float32))
    with pytest.raises(ValueError, match=r"blocks \(1, 2, 2, 1, 4, 4\) float32 must be \[>= 1, \*\(2, 2, 1, 4, 8\)\] float32"):
        pool.write(np.array([1]), np.zeros((1, 2, 2, 1, 4, 4), np.float32))
    with pytest.raises(ValueError, match=r"blocks \(1, 2, 2, 1, 4, 8\) int32 must be"):
        pool.write(np.array([1]), np.zeros((1, *BLOCK_SHAPE), np.int32))
    with pytest.raises(ValueError, match=r"num_rows=1 must be >= 2 slots"):
        pool.to_device(np.array([0, 1]), num_rows=1)
    with pytest.raises(ValueError, match=r"slots must be a 1-D array of ints"):
        pool.read(np.array([0.5]))
    with pytest.raises(ValueError, match=r"num_slots=-1 must be an int >= 0"):
        HostPool(BLOCK_SHAPE, "float32", num_slots=-1)
    with pytest.raises(ValueError, match=r"block_shape=\(2, 0\) must be a non-empty shape of positive sizes"):
        HostPool((2, 0), "float32", num_slots=1)
    with pytest.raises(ValueError, match=r"copy_threads=0 must be an int in \[1, 8\]"):
        HostPool(BLOCK_SHAPE, "float32", num_slots=1, copy_threads=0)
    with pytest.raises(ValueError, match=r"split_min_bytes=-1 must be an int >= 0"):
        HostPool(BLOCK_SHAPE, "float32", num_slots=1, split_min_bytes=-1)
    assert same_bits(pool.read(np.array([0, 1])), before)


# ---- staging buffers -----------------------------------------------------------------------
# A staging buffer is lent to one fetch and reused only once nothing views it. The two
# properties below run in this process (CPU: device_put wraps each staging buffer, so the
# fetched array lies in it) and in a child process with two CPU devices, where fetched blocks
# land sharded over both and device_put copies
# (test_staging_buffers_are_reused_where_device_put_copies).

def _steps():
    """Random writes, padded fetches and drops of fetched arrays (some keeping a host view);
    few distinct row counts, so row counts repeat and dropped buffers are reused."""
    slots = st.lists(st.integers(0, NUM_SLOTS - 1), min_size=1, max_size=5, unique=True)
    write = st.tuples(st.just("write"), slots, st.integers(0, 2**16))
    fetch = st.tuples(st.just("fetch"), slots, st.sampled_from([0, 0, 1, 3]))  # padding rows
    drop = st.tuples(st.just("drop"), st.booleans(), st.integers(0, 2**16))  # (keep a host view, which)
    return st.lists(st.one_of(write, fetch, drop), min_size=1, max_size=25)


def check_fetches_keep_their_bits(steps, dtype, make_pool):
    """Every fetched array held until the end, and every host view of one that outlives it,
    keeps the slots' bits as of its fetch and zero padding rows, whatever was written, fetched
    (with any row count, reusing buffers of dropped fetches) or dropped after it."""
    pool = make_pool(dtype)
    model = {slot: np.zeros(BLOCK_SHAPE, random_blocks(1, BLOCK_SHAPE, dtype).dtype) for slot in range(NUM_SLOTS)}
    fetched = []
    for kind, slots, arg in steps:
        if kind == "write":
            blocks = random_blocks(len(slots), BLOCK_SHAPE, dtype, seed=arg)
            pool.write(np.array(slots), jax.device_put(blocks) if arg % 2 else blocks)
            model.update(zip(slots, blocks))
        elif kind == "fetch":
            expected = np.zeros((len(slots) + arg, *BLOCK_SHAPE), model[0].dtype)
            expected[: len(slots)] = [model[slot] for slot in slots]
            fetched.append((pool.to_device(np.array(slots), len(slots) + arg), expected))
        elif fetched:  # drop one; its buffer may serve the next fetch of as many rows
            device_rows, expected = fetched.pop(arg % len(fetched))
            if slots:  # keep only a host view (on CPU: of the staging buffer itself)
                fetched.append((np.asarray(device_rows), expected))
            del device_rows
            gc.collect()  # jax lets go of a wrapped host array lazily, at its next call or a collection
    for device_rows, expected in fetched:
        assert same_bits(device_rows, expected)
    assert same_bits(pool.read(np.arange(NUM_SLOTS)), np.stack([model[s] for s in range(NUM_SLOTS)]))
    return pool


def check_concurrent_calls_on_disjoint_slots(num_threads, rounds, dtype, make_pool):
    """Threads write, fetch (sharing row counts, so staging buffers) and read their own slots
    at once; each sees exactly its own bits."""
    pool = make_pool(dtype)
    owned = np.array_split(np.random.default_rng(num_threads).permutation(NUM_SLOTS), num_threads)
    barrier, errors = threading.Barrier(num_threads), []

    def worker(index, slots):
        try:
            barrier.wait()
            for round_ in range(rounds):
                blocks = random_blocks(len(slots), BLOCK_SHAPE, dtype, seed=1000 * index + round_)
                pool.write(slots, blocks)
                padded = pool.to_device(slots, num_rows=NUM_SLOTS)
                assert same_bits(np.asarray(padded)[: len(slots)], blocks)
                assert not np.asarray(padded)[len(slots):].view(np.uint8).any()
                assert same_bits(pool.read(slots), blocks)
        except Exception as err:  # noqa: BLE001 - reported by the main thread
            errors.append(err)

    threads = [threading.Thread(target=worker, args=(i, slots)) for i, slots in enumerate(owned)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    assert not errors, errors
    return pool


def _unsharded(copy_threads):
    """Pools whose every gather of 2 rows or more is split over ``copy_threads`` threads."""
    return lambda dtype: HostPool(BLOCK_SHAPE, dtype, NUM_SLOTS, copy_threads=copy_threads, split_min_bytes=0)


@settings(max_examples=60, deadline=None)
@given(steps=_steps(), dtype=st.sampled_from(DTYPES), copy_threads=st.integers(1, 4))
def test_fetched_blocks_keep_their_bits_under_random_writes_and_fetches(steps, dtype, copy_threads):
    check_fetches_keep_their_bits(steps, dtype, _unsharded(copy_threads))


@settings(max_examples=15, deadline=None)
@given(num_threads=st.integers(2, 4), rounds=st.integers(1, 8), dtype=st.sampled_from(DTYPES),
       copy_threads=st.integers(1, 4))
def test_concurrent_calls_on_disjoint_slots_see_their_own_bits(num_threads, rounds, dtype, copy_threads):
    check_concurrent_calls_on_disjoint_slots(num_threads, rounds, dtype, _unsharded(copy_threads))


def test_a_large_gather_is_split_over_copy_threads_and_a_small_one_is_not(monkeypatch):
    """A gather of at least split_min_bytes runs in copy_threads parts, the caller's first and
    the others on copy threads, all done before to_device returns; below it, one part."""
    blocks = random_blocks(NUM_SLOTS, BLOCK_SHAPE, "float32", seed=7)
    four_blocks = 4 * block_bytes(BLOCK_SHAPE, "float32")
    pool = HostPool(BLOCK_SHAPE, "float32", NUM_SLOTS, copy_threads=3, split_min_bytes=four_blocks)
    pool.write(np.arange(NUM_SLOTS), blocks)
    parts, take = [], np.take

    def recording_take(source, indices, *args, **kwargs):
        parts.append((threading.current_thread(), len(indices)))
        return take(source, indices, *args, **kwargs)
    monkeypatch.setattr(np, "take", recording_take)
    slots = np.array([6, 1, 4, 0, 7, 2, 5])
    assert same_bits(pool.to_device(slots, 8)[:7], blocks[slots])
    caller = threading.current_thread()
    assert sorted(n for _, n in parts) == [2, 2, 3]  # 7 rows in 3 parts
    assert [n for t, n in parts if t is caller] == [2]  # the first part; the others on copy threads
    parts.clear()
    assert same_bits(pool.to_device(slots[:3]), blocks[slots[:3]])  # 3 blocks: under the threshold
    assert parts == [(caller, 3)]


_SHARDED_SCRIPT = textwrap.dedent("""
    import jax, numpy as np
    from hypothesis import given, settings, strategies as st
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
    import test_host_pool as cases
    from kvjax.tiers.host_pool import HostPool

    assert len(jax.devices()) == 2, jax.devices()
    # Sharded over the page axis of [rows, *BLOCK_SHAPE]: device_put copies each shard.
    sharding = NamedSharding(Mesh(np.array(jax.devices()), ("d",)), P(None, None, None, None, "d"))
    pools = []

    def sharded(dtype):
        pools.append(HostPool(cases.BLOCK_SHAPE, dtype, cases.NUM_SLOTS, sharding=sharding))
        return pools[-1]

    @settings(max_examples=40, deadline=None)
    @given(steps=cases._steps(), dtype=st.sampled_from(cases.DTYPES))
    def sequences(steps, dtype):
        cases.check_fetches_keep_their_bits(steps, dtype, sharded)

    @settings(max_examples=10, deadline=None)
    @given(num_threads=st.integers(2, 4), rounds=st.integers(2, 8), dtype=st.sampled_from(cases.DTYPES))
    def concurrent(num_threads, rounds, dtype):
        cases.check_concurrent_calls_on_disjoint_slots(num_threads, rounds, dtype, sharded)

    sequences()
    concurrent()
    assert any(pool._staging or pool._returned for pool in pools), "no staging buffer was ever kept for reuse"
    print("ok")
""")


def test_staging_buffers_are_reused_where_device_put_copies():
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=2", JAX_PLATFORMS="cpu",
               PYTHONPATH=os.pathsep.join([os.path.dirname(__file__), *sys.path]))
    result = subprocess.run([sys.executable, "-c", _SHARDED_SCRIPT], env=env, capture_output=True, text=True,
                            timeout=600)
    assert result.returncode == 0 and result.stdout.strip().endswith("ok"), result.stderr[-3000:]


def test_a_fetch_on_cpu_lies_in_its_staging_buffer_reused_only_once_nothing_views_it():
    """On CPU the gather is the only copy: the fetched array lies in its staging buffer. While
    the array, or a host view of it, lives, no fetch reuses the buffer and its bits stay; once
    the last is gone the next fetches of as many rows reuse it (warm memory, no new buffer per
    fetch); no row count compiles anything."""
    compilations = []
    listener = lambda event, *_, **__: compilations.append(event) if "backend_compile" in event else None
    blocks = random_blocks(NUM_SLOTS, BLOCK_SHAPE, "bfloat16", seed=7)
    pool = HostPool(BLOCK_SHAPE, "bfloat16", NUM_SLOTS)
    pool.write(np.arange(NUM_SLOTS), blocks)
    jax.monitoring.register_event_duration_secs_listener(listener)
    try:
        for rows in (3, 4, 7, 16):
            pool.to_device(np.arange(3), rows).block_until_ready()
        held = pool.to_device(np.array([0, 1, 2]), 4)
        address = held.unsafe_buffer_pointer()
        view = np.asarray(held)  # a host view of the staging buffer
        del held
        later = []
        for round_ in range(6):  # rewrite and refetch other slots through rows=4 buffers
            pool.write(np.array([0, 1, 2]), random_blocks(3, BLOCK_SHAPE, "bfloat16", seed=100 + round_))
            later.append(pool.to_device(np.array([3 + round_]), 4))
            gc.collect()
        earlier = {address, *(array.unsafe_buffer_pointer() for array in later)}
        assert len(earlier) == 7  # each fetch while the others were held: a buffer of its own
        assert same_bits(view[:3], blocks[:3]) and not view[3:].view(np.uint16).any()
        del view, later
        gc.collect()
        assert len(pool._returned) <= 4  # seven let go at once: only the latest wait for a fetch
        reused = set()
        for slot in range(4):  # all free now: one is kept and serves every fetch of 4 rows
            fetched = pool.to_device(np.array([slot]), 4)
            reused.add(fetched.unsafe_buffer_pointer())
            del fetched
            gc.collect()
        assert len(reused) == 1 and reused <= earlier
    finally:
        jax.monitoring.unregister_event_duration_listener(listener)
    assert compilations == []
