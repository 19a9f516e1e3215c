"""Disk directory ownership: one writing DiskTier per directory (in this process or another),
read-only readers that share it, close, and a KVCache that closes the tier it opened."""

import dataclasses
import gc
import os
import re
import signal
import socket
import subprocess
import sys
import textwrap

import pytest
from disk_cases import BLOCK_SHAPE, NS, make_tier, random_blocks, segment_dirs
from tier_cases import int_keys as keys
from tier_cases import same_bits

from kvjax.tiers.disk_lock import LOCK_FILE
from kvjax.tiers.disk_tier import DirectoryInUseError, DiskTier
from kvjax.tiers.kv_cache import KVCache, KVCacheConfig
from kvjax.tiers.page_pool import PoolConfig

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# A second process: "try" opens the directory once per mode ("rw", "ro"), printing the
# error's type and message or "opened" (and closing) for each; "hold" opens it (writing one
# segment if it may), says "ready" and waits, never closing it.
CHILD = textwrap.dedent("""
    import sys
    import numpy as np
    from kvjax.tiers.disk_tier import DiskTier
    action, directory = sys.argv[1], sys.argv[2]
    for read_only in (mode == "ro" for mode in sys.argv[3].split(",")):
        try:
            tier = DiskTier(directory, (2, 2, 4, 8), "float32", 1 << 20, read_only=read_only)
        except Exception as err:
            print(f"{type(err).__name__}: {err}", flush=True)
            continue
        if action == "try":
            print("opened", flush=True)
            tier.close()
            continue
        if not read_only:
            tier.put([b"c" * 16], np.ones((1, 2, 2, 4, 8), np.float32), b"N" * 16)
        print("ready", flush=True)
        sys.stdin.read()
""")


def child(action, directory, modes):
    env = {**os.environ, "PYTHONPATH": REPO, "JAX_PLATFORMS": "cpu"}
    return subprocess.Popen([sys.executable, "-c", CHILD, action, str(directory), modes],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env)  # fmt: skip


def child_says(directory, modes="rw") -> list[str]:
    """What another process gets opening ``directory`` in each of ``modes``, one line each."""
    out, _ = child("try", directory, modes).communicate(timeout=120)
    return out.splitlines()


def held_by(directory, read_only=False) -> subprocess.Popen:
    proc = child("hold", directory, "ro" if read_only else "rw")
    assert proc.stdout.readline().strip() == "ready"
    return proc


def kill(proc) -> None:
    proc.send_signal(signal.SIGKILL)  # no close(), no exit handlers: only the kernel lets go
    proc.wait(timeout=60)


def test_a_second_tier_in_this_process_is_refused_before_touching_anything(tmp_path):
    tier = make_tier(tmp_path)
    tier.put(keys(2), random_blocks(2), NS)
    (tmp_path / "seg-000000000009.json.tmp").write_text("{")  # what a crashed write leaves
    listing = sorted(os.listdir(tmp_path))
    pattern = (rf"^disk directory {re.escape(str(tmp_path))} is in use by this process \(pid {os.getpid()}\): "
               r"a DiskTier holds it; close\(\) that one first or use another directory$")  # fmt: skip
    for read_only in (False, True):
        with pytest.raises(DirectoryInUseError, match=pattern):
            make_tier(tmp_path, read_only=read_only)
    assert issubclass(DirectoryInUseError, ValueError)
    assert sorted(os.listdir(tmp_path)) == listing  # the leftover is still there
    tier.close()
    with make_tier(tmp_path) as reopened:  # now the directory is free
        assert reopened.stats().orphans_removed == 1 and len(reopened) == 2


def test_another_process_gets_a_one_line_error_naming_the_holder(tmp_path):
    with make_tier(tmp_path):
        record = (tmp_path / LOCK_FILE).read_text()
        assert re.fullmatch(rf"pid={os.getpid()} host={re.escape(socket.gethostname())} since=\S+Z\n", record)
        for message in child_says(tmp_path, "rw,ro"):  # a writer, a reader
            assert re.fullmatch(
                rf"DirectoryInUseError: disk directory {re.escape(str(tmp_path))} is in use by pid {os.getpid()} "
                rf"on host {re.escape(socket.gethostname())} since \S+Z \(lock file "
                rf"{re.escape(str(tmp_path / LOCK_FILE))}\); one DiskTier writes a directory at a time: "
                r"close that one or use another directory", message)  # fmt: skip
    assert (tmp_path / LOCK_FILE).read_text() == ""  # the holder's record goes with the lock
    assert child_says(tmp_path, "rw,ro") == ["opened", "opened"]


def test_a_holder_that_dies_without_closing_frees_the_directory(tmp_path):
    proc = held_by(tmp_path)
    try:
        with pytest.raises(DirectoryInUseError, match=rf"is in use by pid {proc.pid} on host "):
            make_tier(tmp_path)
        assert len(segment_dirs(tmp_path)) == 1
    finally:
        kill(proc)
    with make_tier(tmp_path) as tier:  # its record is stale; only a held lock counts
        assert tier.stats().recovered_segments == 1 and tier.contains(b"c" * 16, NS)


def test_read_only_readers_share_a_directory_and_keep_writers_out(tmp_path):
    blocks = random_blocks(8)
    with make_tier(tmp_path) as writer:
        writer.put(keys(8), blocks, NS)  # segments 0-3 and 4-7
    (tmp_path / "seg-000000000009.json.tmp").write_text("{")
    listing = sorted(os.listdir(tmp_path))
    proc = held_by(tmp_path, read_only=True)  # a reader in another process
    try:
        with pytest.raises(DirectoryInUseError, match=r"is in use by another process that opened it read-only"):
            make_tier(tmp_path)
        reader = make_tier(tmp_path, read_only=True)
        small = make_tier(tmp_path, read_only=True, capacity=writer.bytes_used - 1)  # one segment fits
    finally:
        kill(proc)
    with pytest.raises(DirectoryInUseError, match=r"in use by this process .*: a read-only DiskTier holds it"):
        make_tier(tmp_path)
    read = reader.get(keys(8), NS)
    assert read.hits.all() and same_bits(read.blocks, blocks)
    assert reader.put(keys(2, start=8), random_blocks(2), NS) == []
    assert reader.discard(keys(4), NS) == 4 and len(reader) == 4  # a whole segment, from the index only
    stats = small.stats()
    assert (stats.recovered_segments, stats.evicted_segments, stats.segments) == (2, 1, 1)
    assert (reader.stats().rejected_blocks, reader.stats().orphans_removed) == (2, 0)
    assert sorted(os.listdir(tmp_path)) == listing  # nothing written, nothing deleted
    reader.close()
    small.close()
    with make_tier(tmp_path) as writer:
        assert writer.stats().orphans_removed == 1 and len(writer) == 8


def test_read_only_needs_an_existing_directory(tmp_path):
    missing = tmp_path / "missing"
    with pytest.raises(ValueError, match=rf"^disk directory {re.escape(str(missing))} does not exist "
                                         r"\(read_only=True opens an existing one\)$"):  # fmt: skip
        make_tier(missing, read_only=True)
    assert not missing.exists()


@pytest.mark.parametrize("read_only", [False, True])
def test_a_file_where_the_directory_should_be_is_named(tmp_path, read_only):
    path = tmp_path / "not_a_dir"
    path.write_bytes(b"kept")
    with pytest.raises(ValueError, match=rf"^disk directory {re.escape(str(path))} is a file; expected a directory"):
        make_tier(path, read_only=read_only)
    assert path.read_bytes() == b"kept"


def test_a_closed_tier_refuses_reads_and_writes_but_keeps_its_figures(tmp_path):
    with make_tier(tmp_path) as tier:
        tier.put(keys(2), random_blocks(2), NS)
    assert tier.closed
    tier.close()  # idempotent
    for call in (lambda: tier.put(keys(1, start=5), random_blocks(1), NS), lambda: tier.get(keys(1), NS)):
        with pytest.raises(ValueError, match=rf"^disk tier {re.escape(str(tmp_path))} is closed$"):
            call()
    assert tier.contains(keys(1)[0], NS) and tier.stats().put_blocks == 2
    memory = DiskTier(None, BLOCK_SHAPE, "float32", 1 << 20)
    with DiskTier(None, BLOCK_SHAPE, "float32", 1 << 20):  # in memory: nothing to lock
        memory.close()
    with pytest.raises(ValueError, match=r"^disk tier \(in memory\) is closed$"):
        memory.get(keys(1), NS)


def test_a_closed_tier_deletes_nothing_in_the_directory_it_let_go(tmp_path):
    # discard (or the unpin of a read still running at close) of a closed tier deleted the
    # segment files of the tier that holds the directory now
    blocks = random_blocks(2)
    old = make_tier(tmp_path)
    old.put(keys(2), blocks, NS)
    assert old.lock(keys(1), NS)
    old.close()
    with make_tier(tmp_path) as owner:
        assert old.discard(keys(2), NS) == 2  # its index forgets them ...
        old.unlock(keys(1), NS)  # ... and lets go of the pin, its segment's last
        read = owner.get(keys(2), NS)  # ... but the files are the owner's now
        assert read.hits.all() and same_bits(read.blocks, blocks)
        old.check_invariants()


@pytest.mark.filterwarnings("ignore:.*fork")  # the child only touches the tier, then exits
def test_a_forked_child_neither_keeps_the_lock_nor_touches_the_directory(tmp_path):
    tier = make_tier(tmp_path)
    tier.put(keys(1), random_blocks(1), NS)
    said_r, said_w = os.pipe()  # child -> parent
    go_r, go_w = os.pipe()  # parent -> child
    pid = os.fork()
    if pid == 0:  # the child: as little as possible (the parent has threads)
        code = 1
        try:
            os.close(said_r)
            os.close(go_w)
            tier.discard(keys(1), NS)  # its copy of the index only
            try:
                tier.put(keys(1, start=1), random_blocks(1), NS)
            except ValueError as err:
                code = 0 if f"opened by pid {os.getppid()}" in str(err) else 2
            os.write(said_w, bytes([code]))
            os.read(go_r, 1)  # lives on until the parent has checked
        finally:
            os._exit(code)
    os.close(said_w)
    os.close(go_r)
    try:
        assert os.read(said_r, 1) == b"\0"  # the child's put was refused (b"": it died trying)
        assert tier.get(keys(1), NS).hits.all() and len(segment_dirs(tmp_path)) == 1  # files kept
        tier.close()
        make_tier(tmp_path).close()  # the child, alive, does not hold the directory
        assert child_says(tmp_path) == ["opened"]
    finally:
        os.close(go_w)  # the child's read returns: it exits
        os.waitpid(pid, 0)
        os.close(said_r)


def test_a_writer_that_cannot_open_the_lock_file_is_refused(tmp_path, monkeypatch):
    # going on unlocked, it could write beside a writer that holds the lock
    make_tier(tmp_path).close()
    real_open = os.open

    def refuse_lock_file(path, *args, **kwargs):
        if str(path).endswith(LOCK_FILE):
            raise PermissionError(13, "Permission denied", path)
        return real_open(path, *args, **kwargs)
    monkeypatch.setattr(os, "open", refuse_lock_file)
    with pytest.raises(PermissionError, match=rf"disk directory {re.escape(str(tmp_path))}: its lock file can be "
                                              r"neither opened nor created \(Permission denied\); a writing DiskTier "
                                              r"needs it \(read_only=True serves"):  # fmt: skip
        make_tier(tmp_path)
    with make_tier(tmp_path, read_only=True) as reader:  # a reader serves it unlocked
        assert reader.stats().recovered_segments == 0


def test_a_tier_nobody_closed_lets_go_when_it_is_collected(tmp_path):
    tier = make_tier(tmp_path)
    del tier
    gc.collect()
    make_tier(tmp_path).close()


POOL = PoolConfig(num_blocks=8, num_layers=1, num_kv_heads=1, page_size=4, head_dim=8, dtype="float32")


def test_a_cache_closes_the_disk_tier_it_opened_and_leaves_a_given_one_open(tmp_path):
    config = KVCacheConfig(pool=POOL, host_bytes=8 * POOL.bytes_per_block, disk_dir=str(tmp_path / "own"),
                           disk_bytes=1 << 24)  # fmt: skip
    with KVCache(config) as cache, pytest.raises(DirectoryInUseError, match=r"in use by this process"):
        KVCache(config)
    assert cache.disk_tier.closed
    KVCache(config).close()
    given = DiskTier(str(tmp_path / "given"), POOL.block_shape, POOL.dtype, 1 << 24)
    with KVCache(KVCacheConfig(pool=POOL, host_bytes=8 * POOL.bytes_per_block), disk_tier=given):
        pass
    assert not given.closed
    given.close()


def test_a_cache_opens_its_disk_tier_for_its_model_and_refuses_a_given_one_of_another(tmp_path):
    config = KVCacheConfig(pool=POOL, host_bytes=8 * POOL.bytes_per_block, disk_dir=str(tmp_path / "own"),
                           disk_bytes=1 << 24, model_id="weights-a")  # fmt: skip
    with KVCache(config) as cache:
        assert cache.disk_tier.model_id == "weights-a"
    with pytest.raises(ValueError, match=r"model_id=3 must be a str naming the model"):
        KVCacheConfig(pool=POOL, model_id=3)
    with DiskTier(str(tmp_path / "given"), POOL.block_shape, POOL.dtype, 1 << 24, model_id="weights-b") as given:
        with pytest.raises(ValueError, match=r"^disk_tier holds KV of model_id='weights-b'; this cache's is "
                                             r"'weights-a'$"):  # fmt: skip
            KVCache(dataclasses.replace(config, disk_dir=None, disk_bytes=0), disk_tier=given)


def test_a_disk_tier_keyed_by_no_model_says_what_it_risks(tmp_path, caplog):
    # a hand-built cache names no model unless told: a restart with other weights of the same
    # shapes would read this directory's KV as its own, so opening one says so, once
    config = KVCacheConfig(pool=POOL, host_bytes=8 * POOL.bytes_per_block, disk_dir=str(tmp_path / "d"),
                           disk_bytes=1 << 24)  # fmt: skip
    with caplog.at_level("WARNING", logger="kvjax.tiers.kv_cache"):
        KVCache(config).close()
        unnamed = [r.getMessage() for r in caplog.records if "keyed by no model_id" in r.getMessage()]
        assert len(unnamed) == 1 and str(tmp_path / "d") in unnamed[0] and "model_digest" in unnamed[0]
        caplog.clear()
        KVCache(dataclasses.replace(config, model_id="weights-a")).close()
        KVCache(dataclasses.replace(config, disk_dir=None, disk_bytes=0)).close()  # host only: nothing kept
    assert not [r for r in caplog.records if "keyed by no model_id" in r.getMessage()]
