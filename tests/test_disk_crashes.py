"""Disk tier crashes: a process that dies at any step of a segment write or an eviction
leaves a directory that reopens with only whole, verified blocks, its leftovers removed and
counted. The crash is simulated in process: the step raises, the write's own clean-up is
skipped (a dead process cleans nothing) and the tier is abandoned (its lock let go, as the
kernel does for a dead process) without touching the directory again."""

import contextlib
import json
import os
import shutil

import hypothesis
import hypothesis.strategies as st
import numpy as np
from disk_cases import NS, OTHER_NS
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from kvjax.tiers import disk_segments
from kvjax.tiers.disk_lock import LOCK_FILE
from kvjax.tiers.disk_tier import DiskTier

NAMESPACES = (NS, OTHER_NS)


class Crash(BaseException):
    """The process dies here (a BaseException: nothing in the tier catches it)."""


def _die(*args, **kwargs):
    raise Crash


def _save_then_die(checkpointer, path, payload):
    SAVE(checkpointer, path, payload)
    raise Crash


def _manifest_then_die(directory, name, content):
    WRITE_MANIFEST(directory, name, content)
    raise Crash


def _temporary_manifest_then_die(directory, name, content):
    with open(os.path.join(directory, name + ".json.tmp"), "wb") as f:
        f.write(content[: len(content) // 2])
    raise Crash


SAVE, WRITE_MANIFEST = disk_segments._save_payload, disk_segments._write_manifest
# Where a write or an eviction dies: the function replaced, and what it does instead.
CRASH_POINTS = {
    "before_payload": ("_save_payload", _die),
    "after_payload": ("_save_payload", _save_then_die),
    "temporary_manifest": ("_write_manifest", _temporary_manifest_then_die),
    "after_manifest": ("_write_manifest", _manifest_then_die),
    "evicting": ("remove_segment", _die),  # an eviction, before it deleted anything
}


@contextlib.contextmanager
def crashing_at(point):
    name, replacement = CRASH_POINTS[point]
    original, cleanup = getattr(disk_segments, name), disk_segments._remove_failed_write
    setattr(disk_segments, name, replacement)
    disk_segments._remove_failed_write = lambda *args: None  # a dead process cleans nothing up
    try:
        yield
    finally:
        setattr(disk_segments, name, original)
        disk_segments._remove_failed_write = cleanup


def block(namespace, key):
    return np.full((4,), key[0] + 16 * NAMESPACES.index(namespace), np.int8)


class DiskCrashMachine(RuleBasedStateMachine):
    """Random puts, gets, discards, clean reopens and crashes (a write or an eviction dying at
    one of its steps, then a reopen) in two namespaces. After every reopen the index is exactly
    the committed manifests on disk, every leftover is gone and counted, and a read serves
    each block it hits with its own content."""

    def __init__(self):
        super().__init__()
        self.path = os.path.join(os.environ.get("TMPDIR", "/tmp"), f"kvjax-disk-crash-{os.getpid()}")
        shutil.rmtree(self.path, ignore_errors=True)
        self.tier = self.open()

    def open(self):
        # int8[4] blocks, 2 per segment (a segment takes ~1.4 KB on disk): three or four fit
        return DiskTier(self.path, (4,), "int8", 5000, segment_bytes=8, use_ocdbt=False)

    def teardown(self):
        self.tier.close()
        shutil.rmtree(self.path, ignore_errors=True)

    @rule(ids=st.lists(st.integers(0, 7), min_size=1, max_size=4, unique=True), ns=st.sampled_from(NAMESPACES))
    def put(self, ids, ns):
        ks = [bytes([i]) * 16 for i in ids]
        stored = self.tier.put(ks, np.stack([block(ns, k) for k in ks]), ns)
        assert set(stored) <= set(ks)

    @rule(ids=st.lists(st.integers(0, 7), min_size=1, max_size=4, unique=True), ns=st.sampled_from(NAMESPACES))
    def get(self, ids, ns):
        ks = [bytes([i]) * 16 for i in ids]
        expected = [self.tier.contains(k, ns) for k in ks]
        read = self.tier.get(ks, ns)
        assert read.hits.tolist() == expected
        for k, hit, row in zip(ks, read.hits, read.blocks):
            assert np.array_equal(row, block(ns, k) if hit else np.zeros(4, np.int8))

    @rule(i=st.integers(0, 7), ns=st.sampled_from(NAMESPACES))
    def discard(self, i, ns):
        self.tier.discard([bytes([i]) * 16], ns)

    @rule()
    def reopen(self):
        held = set(self.tier.held_blocks())
        self.tier.close()
        self.reopen_and_check([])
        assert held <= set(self.tier.held_blocks())  # discards are not persisted; nothing is lost

    @rule(point=st.sampled_from(sorted(CRASH_POINTS)), ids=st.lists(st.integers(8, 15), min_size=1, max_size=2,
                                                                     unique=True))  # fmt: skip
    def crash(self, point, ids):
        ks = [bytes([i]) * 16 for i in ids]
        held = set(self.tier.held_blocks())
        before = set(os.listdir(self.path))
        crashed = False
        with crashing_at(point):
            if point == "evicting":  # fill the tier: the put makes room by evicting
                for start in range(8, 16, 2):
                    try:
                        self.tier.put([bytes([start]) * 16, bytes([start + 1]) * 16],
                                      np.stack([block(NS, bytes([start + j]) * 16) for j in (0, 1)]), NS)
                    except Crash:
                        crashed = True
                        break
            else:
                try:
                    self.tier.put(ks, np.stack([block(NS, k) for k in ks]), NS)
                except Crash:
                    crashed = True
        if not crashed:  # nothing was written (every block held already) or nothing evicted
            return
        self.tier.close()  # the dead process's lock goes; nothing else touches the directory
        leftovers = [entry for entry in set(os.listdir(self.path)) - before if not _committed(self.path, entry)]
        self.reopen_and_check(leftovers)
        if point not in ("after_manifest", "evicting"):  # died uncommitted: all held before stays
            assert held <= set(self.tier.held_blocks())  # (a committed segment may evict for room)

    def reopen_and_check(self, leftovers):
        self.tier = self.open()
        stats = self.tier.stats()
        assert (stats.orphans_removed, stats.orphan_remove_errors) == (len(leftovers), 0)
        entries = set(os.listdir(self.path)) - {LOCK_FILE}
        manifests = {entry[: -len(".json")] for entry in entries if entry.endswith(".json")}
        assert entries == manifests | {name + ".json" for name in manifests}  # only whole segments
        on_disk = {}
        for name in manifests:
            manifest = json.loads(open(os.path.join(self.path, name + ".json")).read())
            for row in manifest["blocks"]:
                on_disk[(bytes.fromhex(row["namespace"]), bytes.fromhex(row["key"]))] = name
        assert set(self.tier.held_blocks()) == set(on_disk)
        assert stats.segments == len(manifests)
        for ns in NAMESPACES:
            ks = [k for n, k in on_disk if n == ns]
            if ks:
                read = self.tier.get(ks, ns)
                assert read.hits.all() and all(np.array_equal(row, block(ns, k)) for k, row in zip(ks, read.blocks))

    @invariant()
    def consistent(self):
        self.tier.check_invariants()


def _committed(directory, entry):
    """Whether ``entry`` is half of a committed segment (its manifest and its directory)."""
    stem = entry[: -len(".json")] if entry.endswith(".json") else entry
    return os.path.isfile(os.path.join(directory, stem + ".json")) and os.path.isdir(os.path.join(directory, stem))


TestDiskCrashMachine = DiskCrashMachine.TestCase
TestDiskCrashMachine.settings = hypothesis.settings(max_examples=12, stateful_step_count=10, deadline=None)
