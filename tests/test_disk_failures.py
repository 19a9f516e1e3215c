"""Disk tier failures that must not cost more than they did: writes back off after a failure,
counters count only what happened, and KVCache.flush says whether its pages reached disk."""

import doctest
import errno
import logging
import os
import re
import shutil

import numpy as np
import pytest
from disk_cases import NS, dir_bytes, make_tier, random_blocks, segment_dirs, unreadable, unwritable
from tier_cases import int_keys as keys
from tier_cases import same_bits

from kvjax.tiers import disk_segments, write_backoff
from kvjax.tiers.disk_lock import LOCK_FILE
from kvjax.tiers.disk_tier import DiskTier
from kvjax.tiers.kv_cache import KVCache, KVCacheConfig
from kvjax.tiers.page_pool import PoolConfig

LOGGER = "kvjax.tiers.disk_tier"


class FailingWrites:
    """Stands in for orbax's save: counts tries and fails with ``error`` while it is set."""

    def __init__(self, monkeypatch, error=None):
        self.error, self.tries = error or OSError(errno.EROFS, "Read-only file system"), 0
        self._save = disk_segments._save_payload
        monkeypatch.setattr(disk_segments, "_save_payload", self)

    def __call__(self, *args):
        self.tries += 1
        if self.error is not None:
            raise self.error
        self._save(*args)


def warnings_of(caplog):
    return [r.getMessage() for r in caplog.records if r.name == LOGGER and r.levelno == logging.WARNING]


def test_failed_writes_back_off_doubling_to_the_cap_and_a_success_resets(tmp_path, monkeypatch, caplog):
    now = [0.0]
    tier = make_tier(tmp_path, blocks_per_segment=2, backoff_s=1.0, max_backoff_s=4.0, clock=lambda: now[0])
    writes = FailingWrites(monkeypatch)
    caplog.set_level(logging.WARNING, LOGGER)
    next_key = iter(range(1000))

    def put(n):
        return tier.put(keys(n, start=next(next_key) * 10), random_blocks(n), NS)

    assert put(4) == []  # the first segment fails, the second is dropped untried
    assert (writes.tries, tier.stats().backoff_remaining_s) == (1, 1.0)
    periods = []
    for start, period in ((1.0, 2.0), (3.0, 4.0), (7.0, 4.0)):  # doubling, then the 4 s cap
        now[0] = start - 0.5
        assert put(1) == [] and writes.tries == len(periods) + 1  # still backing off: untried
        now[0] = start
        assert put(1) == [] and writes.tries == len(periods) + 2  # tried again, failed again
        assert tier.stats().backoff_remaining_s == period
        periods.append(period)
    stats = tier.stats()
    assert (stats.write_errors, stats.backoff_dropped_blocks, stats.rejected_blocks) == (4, 2 + 3, 4 + 2 * 3)
    messages = warnings_of(caplog)
    assert len(messages) == 4  # one per back-off period
    assert re.fullmatch(rf"disk tier {re.escape(str(tmp_path))}: writing seg-\d+ failed, dropping its 2 blocks: "
                        r"OSError\(30, 'Read-only file system'\); no writes for 1 s", messages[0])  # fmt: skip
    assert messages[1].endswith("; no writes for 2 s; failure 2 in a row, 3 blocks dropped untried since the last")
    assert messages[3].endswith("; no writes for 4 s; failure 4 in a row, 1 blocks dropped untried since the last")
    writes.error = None
    now[0] = 10.5
    assert put(1) == [] and writes.tries == 4
    now[0] = 11.0
    stored = put(2)
    assert len(stored) == 2 and writes.tries == 5 and tier.stats().backoff_remaining_s == 0
    assert warnings_of(caplog)[-1] == (f"disk tier {tmp_path}: writes work again after 4 failed; 1 blocks were "
                                       "dropped untried while backing off")  # fmt: skip
    writes.error = OSError(errno.EIO, "I/O error")
    put(1)
    assert tier.stats().backoff_remaining_s == 1.0  # a success reset the period
    tier.check_invariants()


def test_a_read_only_directory_fails_one_write_per_period_and_keeps_serving(tmp_path, monkeypatch, caplog):
    now = [0.0]
    tier = make_tier(tmp_path, blocks_per_segment=1, clock=lambda: now[0])
    tier.put(keys(1), random_blocks(1), NS)
    caplog.set_level(logging.WARNING, LOGGER)
    with unwritable(tmp_path, monkeypatch):
        for batch in range(10):  # a serving loop spilling a batch per step
            assert tier.put(keys(3, start=10 * batch + 1), random_blocks(3), NS) == []
        assert tier.get(keys(1), NS).hits.all()
    stats = tier.stats()
    assert (stats.write_errors, stats.backoff_dropped_blocks, stats.rejected_blocks) == (1, 29, 30)
    assert len(warnings_of(caplog)) == 1 and len(segment_dirs(tmp_path)) == 1


def refuse_to_remove(monkeypatch, stuck: set[str]) -> None:
    """``shutil.rmtree`` of the disk segments refuses the paths in ``stuck`` (permissions)."""
    rmtree = shutil.rmtree

    def refuse(path, *args, **kwargs):
        if str(path) in stuck:
            raise PermissionError(errno.EACCES, "Permission denied", str(path))
        rmtree(path, *args, **kwargs)
    monkeypatch.setattr(disk_segments.shutil, "rmtree", refuse)


def test_orphans_and_segments_whose_files_stay_are_counted_apart(tmp_path, monkeypatch):
    with make_tier(tmp_path, blocks_per_segment=1, use_ocdbt=False) as tier:
        tier.put(keys(3), random_blocks(3), NS)
        segment_size, lock_size = tier.bytes_used // 3, os.path.getsize(tmp_path / LOCK_FILE)
    for name in ("seg-000000000007", "seg-000000000008"):  # written, never committed
        shutil.copytree(segment_dirs(tmp_path)[0], tmp_path / name)
    refuse_to_remove(monkeypatch, {str(tmp_path / "seg-000000000008"), segment_dirs(tmp_path)[0]})  # orphan, seg 0
    tier = make_tier(tmp_path, capacity=3 * segment_size + lock_size, blocks_per_segment=1, use_ocdbt=False)
    stats = tier.stats()
    assert (stats.orphans_removed, stats.orphan_remove_errors) == (1, 1)
    assert os.path.isdir(tmp_path / "seg-000000000008") and not os.path.exists(tmp_path / "seg-000000000007")
    assert tier.put(keys(1, start=3), random_blocks(1), NS) == keys(1, start=3)  # evicts segment 0
    stats = tier.stats()
    assert (stats.evicted_segments, stats.remove_errors, stats.segments) == (1, 1, 3)
    assert os.path.isdir(segment_dirs(tmp_path)[0]) and not os.path.exists(segment_dirs(tmp_path)[0] + ".json")
    tier.discard(keys(2, start=1), NS)  # segments 1 and 2 go, their files too
    assert tier.stats().remove_errors == 1 and tier.stats().discarded_blocks == 2
    tier.close()


def test_a_new_segment_never_takes_the_name_of_a_leftover_that_stayed(tmp_path, monkeypatch):
    # the next segment was numbered after the committed ones only: its write met the leftover
    # of its name, failed (FileExistsError), counted as a write error and started a back-off
    with make_tier(tmp_path, blocks_per_segment=1) as tier:
        tier.put(keys(1), random_blocks(1), NS)
    stuck = [str(tmp_path / "seg-000000000001"), str(tmp_path / "seg-000000000002.orbax-checkpoint-tmp-7")]
    for path in stuck:
        shutil.copytree(segment_dirs(tmp_path)[0], path)
    refuse_to_remove(monkeypatch, set(stuck))
    tier = make_tier(tmp_path, blocks_per_segment=1)
    assert tier.stats().orphan_remove_errors == 2
    assert tier.put(keys(2, start=1), random_blocks(2, seed=1), NS) == keys(2, start=1)
    stats = tier.stats()
    assert (stats.write_errors, stats.written_segments, stats.backoff_remaining_s) == (0, 2, 0)
    assert all(os.path.isdir(path) for path in stuck)
    read = tier.get(keys(3), NS)
    assert read.hits.all() and same_bits(read.blocks[1:], random_blocks(2, seed=1))
    tier.close()


POOL = PoolConfig(num_blocks=8, num_layers=1, num_kv_heads=1, page_size=4, head_dim=8, dtype="float32")


@pytest.mark.parametrize("leftover", ["manifest_tmp", "orbax_tmp"])
def test_a_failed_write_leaves_no_temporary_files_on_a_full_disk(tmp_path, monkeypatch, leftover):
    # each failed write left its temporary files: space on a full disk, counted nowhere
    now = [0.0]
    tier = make_tier(tmp_path, clock=lambda: now[0])
    tier.put(keys(1), random_blocks(1), NS)
    before = sorted(os.listdir(tmp_path))
    full = OSError(errno.ENOSPC, "No space left on device")
    if leftover == "manifest_tmp":  # the temporary manifest is written, its rename fails
        def no_rename(*args):
            raise full
        monkeypatch.setattr(disk_segments.os, "replace", no_rename)
    else:  # orbax's temporary directory is made, its write fails
        def half_saved(checkpointer, path, payload):
            os.makedirs(path + ".orbax-checkpoint-tmp-1733")
            raise full
        monkeypatch.setattr(disk_segments, "_save_payload", half_saved)
    for attempt in range(3):
        now[0] = 1000.0 * attempt  # past each back-off
        assert tier.put(keys(1, start=10 + attempt), random_blocks(1), NS) == []
    assert sorted(os.listdir(tmp_path)) == before
    assert (tier.stats().write_errors, tier.stats().enospc_errors) == (3, 3)


def test_a_full_disk_reported_by_tensorstore_counts_as_enospc(tmp_path, monkeypatch):
    tier = make_tier(tmp_path)
    FailingWrites(monkeypatch, ValueError('RESOURCE_EXHAUSTED: Error writing "payload/c/0/0" in OCDBT database'))
    assert tier.put(keys(1), random_blocks(1), NS) == []
    assert (tier.stats().write_errors, tier.stats().enospc_errors) == (1, 1)


def test_a_write_never_replaces_an_entry_of_its_segments_name(tmp_path):
    # another writer's segment (one that went around the lock) is not deleted as a failed write's
    tier = make_tier(tmp_path)
    foreign = tmp_path / "seg-000000000000"
    foreign.mkdir()
    (foreign / "data").write_text("another writer's")
    assert tier.put(keys(1), random_blocks(1), NS) == []
    assert (foreign / "data").read_text() == "another writer's" and tier.stats().write_errors == 1


@pytest.mark.parametrize("error", [OSError(errno.EMFILE, "Too many open files"),
                                   ValueError("RESOURCE_EXHAUSTED: Too many open files")])  # fmt: skip
def test_a_read_that_fails_for_want_of_descriptors_keeps_the_segment(tmp_path, monkeypatch, error):
    blocks = random_blocks(2)
    tier = make_tier(tmp_path)
    tier.put(keys(2), blocks, NS)
    files = sorted(os.listdir(tmp_path))
    read_verified = disk_segments.read_verified

    def out_of_descriptors(*args):
        raise error
    monkeypatch.setattr(disk_segments, "read_verified", out_of_descriptors)
    assert tier.get(keys(2), NS).hits.tolist() == [False, False]
    monkeypatch.setattr(disk_segments, "read_verified", read_verified)
    read = tier.get(keys(2), NS)  # the segment stayed, on disk and in the index
    assert read.hits.all() and same_bits(read.blocks, blocks) and sorted(os.listdir(tmp_path)) == files
    stats = tier.stats()
    assert (stats.read_errors, stats.transient_read_errors, stats.blocks) == (1, 1, 2)
    monkeypatch.setattr(disk_segments, "read_verified", lambda *args: (_ for _ in ()).throw(FileNotFoundError()))
    assert tier.get(keys(2), NS).hits.tolist() == [False, False]  # a missing file: the segment goes
    assert tier.stats().blocks == 0 and not segment_dirs(tmp_path)


@pytest.mark.parametrize("use_ocdbt", [False, True])
def test_a_read_refused_for_want_of_permission_keeps_the_segment(tmp_path, monkeypatch, caplog, use_ocdbt):
    # the refusal was taken for damage: the segment left the index and its files were deleted,
    # good blocks lost to a permission that was put right a minute later
    now = [0.0]
    blocks = random_blocks(4)
    tier = make_tier(tmp_path, use_ocdbt=use_ocdbt, clock=lambda: now[0])
    tier.put(keys(4), blocks, NS)
    files, size = sorted(os.listdir(tmp_path)), dir_bytes(tmp_path)
    tier.take_dropped()
    caplog.set_level(logging.WARNING, LOGGER)
    with unreadable(segment_dirs(tmp_path)[0], monkeypatch):
        assert tier.get(keys(4), NS).hits.tolist() == [False] * 4
        assert tier.get(keys(2), NS).hits.tolist() == [False] * 2  # its reads back off: not tried
    stats = tier.stats()
    assert (stats.read_errors, stats.kept_read_errors, stats.transient_read_errors) == (1, 1, 0)
    assert (stats.blocks, stats.segments, stats.corrupt_blocks, stats.evicted_segments) == (4, 1, 0, 0)
    assert (stats.miss_blocks, stats.read_backoff_blocks) == (6, 2)
    assert tier.take_dropped() == [] and sorted(os.listdir(tmp_path)) == files and dir_bytes(tmp_path) == size
    [warning] = warnings_of(caplog)
    assert "keeping it" in warning and "Permission denied" in warning and warning.endswith("no reads of it for 1 s")
    assert not tier.get(keys(4), NS).hits.any()  # readable again, but still backing off
    now[0] = 1.0
    read = tier.get(keys(4), NS)
    assert read.hits.all() and same_bits(read.blocks, blocks)
    assert warnings_of(caplog)[-1].endswith("reads of it work again after 1 failed")
    tier.check_invariants()
    tier.close()
    with make_tier(tmp_path, use_ocdbt=use_ocdbt) as reopened:
        read = reopened.get(keys(4), NS)
        assert read.hits.all() and same_bits(read.blocks, blocks)


def _raised_during(error: BaseException, context: BaseException) -> BaseException:
    """``error`` as if raised while handling ``context``."""
    error.__context__ = context
    return error


@pytest.mark.parametrize("error, kept", [
    (PermissionError(errno.EACCES, "Permission denied"), True),
    (OSError(errno.EIO, "Input/output error"), True),
    (ValueError("PERMISSION_DENIED: Error reading local file \"x/payload/c/0/0\": Failed to open: Permission denied "
                "[os_error_code='13']"), True),
    (ValueError("UNKNOWN: Error reading local file \"x/payload/c/0/0\": Input/output error [os_error_code='5']"), True),
    # orbax's fallback read of a directory it may not list names no structure: the cause decides
    (_raised_during(FileNotFoundError("No structure could be identified for the checkpoint at x."),
                    ValueError("PERMISSION_DENIED: Error opening \"zarr3\" driver")), True),
    (RuntimeError("an error that names no cause"), True),
    (FileNotFoundError(errno.ENOENT, "No such file or directory"), False),
    (ValueError("NOT_FOUND: Error opening \"zarr3\" driver: Metadata at \"payload/zarr.json\" does not exist"), False),
    (ValueError("DATA_LOSS: Error reading shard entry in local file \"x/payload/c/0/0\": Digest mismatch"), False),
    (ValueError("OUT_OF_RANGE: Error reading Byte range [0, 2415) of local file \"x/d/0c1e\""), False),
    (disk_segments.DamagedSegmentError("segment x payload is (3, 512), expected (4, 512)"), False),
])  # fmt: skip
def test_only_a_read_error_that_shows_damage_drops_the_segment(tmp_path, monkeypatch, error, kept):
    blocks = random_blocks(2)
    now = [0.0]
    tier = make_tier(tmp_path, clock=lambda: now[0])
    tier.put(keys(2), blocks, NS)
    with monkeypatch.context() as patch:
        patch.setattr(disk_segments, "read_verified", lambda *args: (_ for _ in ()).throw(error))
        assert tier.get(keys(2), NS).hits.tolist() == [False, False]
    stats = tier.stats()
    assert (stats.read_errors, stats.kept_read_errors, stats.blocks) == (1, int(kept), 2 * kept)
    assert bool(segment_dirs(tmp_path)) == kept
    if kept:
        now[0] = 1.0  # past the back-off
        read = tier.get(keys(2), NS)
        assert read.hits.all() and same_bits(read.blocks, blocks)
    tier.check_invariants()


def test_flush_is_true_only_when_every_host_page_reached_disk(tmp_path, monkeypatch):
    now = [0.0]
    disk = DiskTier(str(tmp_path), POOL.block_shape, POOL.dtype, 1 << 24, clock=lambda: now[0])
    config = KVCacheConfig(pool=POOL, host_bytes=8 * POOL.bytes_per_block, write_policy="write_through")
    writes = FailingWrites(monkeypatch, OSError(errno.ENOSPC, "No space left on device"))
    tokens = np.arange(13, dtype=np.int32)
    with KVCache(config, disk_tier=disk) as cache:
        handle = cache.admit(tokens)
        cache.commit(handle, tokens)  # three full pages: host copies start
        cache.release(handle)
        assert not cache.flush(30.0)  # the write failed
        assert writes.tries == 1 and disk.stats().enospc_errors == 1
        writes.error = None
        assert not cache.flush(30.0)  # backing off: nothing was tried
        assert writes.tries == 1 and len(disk) == 0 and cache.stats.host_blocks == 3
        now[0] = 1.0
        assert cache.flush(30.0) and len(disk) == 3 and writes.tries == 2
        assert cache.flush(30.0)  # nothing left to copy
        cache.check_invariants()
    disk.close()


def test_flush_without_a_disk_tier_has_nothing_to_copy():
    config = KVCacheConfig(pool=POOL, host_bytes=8 * POOL.bytes_per_block, write_policy="write_through")
    with KVCache(config) as cache:
        tokens = np.arange(9, dtype=np.int32)
        cache.commit(cache.admit(tokens), tokens)
        assert cache.flush(30.0) and cache.stats.host_blocks == 2


@pytest.mark.parametrize("bad", [{"backoff_s": 0.0}, {"backoff_s": 2.0, "max_backoff_s": 1.0}])
def test_back_off_bounds_are_checked(tmp_path, bad):
    with pytest.raises(ValueError, match=r"back-off must satisfy 0 < initial_s=.* <= max_s="):
        make_tier(tmp_path, **bad)
    assert not os.path.exists(tmp_path / "kvjax-disk.lock")


def test_write_backoff_docstring_example_runs():
    assert doctest.testmod(write_backoff).failed == 0
