"""Disk tier: cold KV blocks in orbax-written segments, indexed in memory, rebuilt on reopen.

Blocks arrive in batches; each batch is written as segments of at most `segment_bytes` (one
orbax save per segment, so its ~15 ms fixed cost is paid per segment, not per block). The
index maps (namespace, key) to (segment, row) and is rebuilt from the segments' manifests when
the directory is reopened, so a restarted process serves what the last one spilled.

Failure policy: a write that fails (full disk, read-only directory, any I/O error) drops the
batch from the disk tier, counts the error and starts a back-off (`WriteBackoff`: no write is
tried for 1 s, doubling on each failure in a row up to 60 s; a success resets it): the blocks
`put` gets meanwhile are dropped untried and counted, and one warning per back-off period says
how many. A read that fails or whose checksum does not match is a miss and a metric. Only
damage takes blocks out of the index (a writer deletes their files): a checksum mismatch (that
block), or a read error that shows the segment damaged (missing files, data that does not
parse: `disk_segments.read_error_is_damage`; the whole segment). A read error that says nothing
of the content (permission denied, an I/O error, out of file descriptors or memory,
interrupted) keeps the segment (`kept_read_errors`): its reads back off like writes do, one
warning per period, unless the error was transient (descriptors, memory, an interruption:
`transient_read_errors`), and a read that works again resets it. No I/O error escapes `put`
or `get`.

Capacity: bytes on disk, the directory's whole size: each segment's checkpoint files plus its
manifest, measured once written, and a writer's lock file. Room for a segment's payload is made
before it is written; the rest of its size (orbax's metadata, the manifest: a few KB) is known
once it is written, and room for that is made then, before `put` returns: while a segment is
written the directory may pass the capacity by that much, never after. A segment that would
not fit with every unpinned segment evicted evicts nothing (one found too large once written
is deleted again). Eviction removes whole segments,
never one that a `lock` or a running read pins: first those whose blocks nothing outside them
depends on, then the deepest of a prefix, least recently used first among equals
(`kvjax.tiers.disk_victims`). A block depends on its parent (the key `put` names before it):
a page is found only through its prefix, so evicting the parent would take it along. The
tier knows its own blocks' parents; a caller holding copies elsewhere (the tiered cache's
host copies) names their parents with `add_dependents`. There is no compaction, so a
segment whose blocks were partly discarded keeps its bytes until all its blocks are
discarded or it is evicted. `discard` is not persisted: after a reopen, blocks of
segments still on disk are served again (a key always names the same content).

Blocks a `put` names that the tier holds already are skipped, and their segments kept while
the others are written (a spill saving host pages must not evict one of them for another: its
host copy goes next). When the room the others need is held by those very segments, the put
writes the blocks it names that they hold again, with the others (`rewritten_blocks`): once
that segment is committed, the old ones hold nothing the put named and may go. Meanwhile the
directory holds both, so such a write may pass the capacity by the old segments until it
returns; no block is ever out of the index in between.

Ownership: a tier holds its directory's lock (`kvjax.tiers.disk_lock`) from opening until
`close` (or until it is garbage-collected, or its process exits): exclusive to write, shared
with `read_only=True`. Another tier on a held directory, in this process or another, gets a
`DirectoryInUseError` (a ValueError) naming the directory and the holder, before anything in
the directory is touched; a writer that can neither open nor create the lock file gets a
PermissionError naming it. A closed tier, and a forked child's copy of an open one, delete
nothing there (the lock is no longer, or never was, theirs); the child's `put` and `get`
raise. A writer, alone in the directory, deletes the files of uncommitted segments (a crashed
write's leftovers) when it opens it; a reader writes and deletes nothing
(it may create the empty lock file), so it leaves them, and every segment it drops from its
index (eviction, discard, corruption) stays on disk.

``directory=None`` keeps the index and its segment accounting in memory and writes nothing
(a trace replay): the same capacity, segments and eviction order, no bytes.

Every block the tier comes to hold (a committed write, a segment found when opening) or
stops holding (discard, eviction, a corrupt or unreadable block) is a block event on
``events`` (thread-safe: writes run on a transfer worker).
"""

from __future__ import annotations

import collections
import dataclasses
import errno
import functools
import logging
import os
import threading
import time
from collections.abc import Callable, Sequence

import jax.numpy as jnp
import numpy as np

from kvjax.cache.block_events import EventLog
from kvjax.tiers import disk_segments as seg
from kvjax.tiers.disk_lock import DirectoryInUseError, DirectoryLock
from kvjax.tiers.disk_victims import VictimOrder
from kvjax.tiers.write_backoff import WriteBackoff

__all__ = ["DirectoryInUseError", "DiskRead", "DiskTier", "DiskTierStats"]

_log = logging.getLogger(__name__)
_MAX_DROPPED = 1 << 16  # dropped blocks remembered for take_dropped; past it, a rescan


@dataclasses.dataclass(slots=True)
class DiskTierStats:
    """What this tier did since it opened the directory: counts of blocks, segments (a write's
    unit) and events, each counting only what happened, never what was attempted."""

    capacity_bytes: int  # for the segments and a writer's lock file (a line of text)
    bytes_used: int  # bytes on disk of the segments in the index (skipped segments and files
    #                  that could not be deleted are on disk but not counted)
    segments: int  # segments in the index now
    blocks: int  # blocks in the index now
    recovered_segments: int = 0  # committed segments indexed when opening (some may be evicted at once)
    orphans_removed: int = 0  # crashed writes' leftover entries deleted when opening (writer only)
    orphan_remove_errors: int = 0  # leftover entries whose deletion failed (still on disk)
    skipped_segments: int = 0  # unreadable manifest, another block shape/dtype, codec or model id
    foreign_bytes: int = 0  # on disk now in segments of another block shape/dtype, codec or model
    #                         (writer only): they count against capacity_bytes and go first
    foreign_removed: int = 0  # such segments deleted to make room (writer only)
    codec_mismatch_segments: int = 0  # of those: written with another codec (kvjax.tiers.block_codec)
    put_blocks: int = 0  # blocks in committed segments that `put` wrote (and indexed)
    duplicate_blocks: int = 0  # blocks `put` skipped: the tier held them already
    rejected_blocks: int = 0  # blocks `put` did not store: no room (everything else pinned),
    #                           a failed write, writes backing off, or a read-only tier
    rewritten_blocks: int = 0  # of duplicate_blocks: written again, so that the segment holding
    #                            them could make room for the put's other blocks
    backoff_dropped_blocks: int = 0  # of those: dropped untried while writes were backing off
    written_segments: int = 0  # segments written, committed and indexed
    write_errors: int = 0  # segment writes tried that failed
    enospc_errors: int = 0  # write errors that were a full disk
    backoff_remaining_s: float = 0.0  # seconds before a write is tried again (0: writes allowed)
    hit_blocks: int = 0  # blocks `get` served, checksum-verified
    miss_blocks: int = 0  # blocks `get` did not serve (absent, corrupt, unreadable or backing off)
    corrupt_blocks: int = 0  # checksum mismatch: served as a miss
    read_errors: int = 0  # segment reads that failed (truncated, deleted, ...): their blocks missed
    kept_read_errors: int = 0  # of those: errors that say nothing of the segment's content
    #                            (permission denied, an I/O error, ...): the segment stays; only
    #                            damaged or missing ones leave the index
    transient_read_errors: int = 0  # of those kept: out of file descriptors or memory, interrupted
    #                                 (no back-off: the next read tries again)
    read_backoff_blocks: int = 0  # of miss_blocks: not tried, their segment's reads backing off
    evicted_segments: int = 0  # segments evicted from the index (a writer deletes their files)
    evicted_blocks: int = 0  # live blocks those segments held
    discarded_blocks: int = 0  # blocks `discard` dropped from the index
    remove_errors: int = 0  # segments left the index but some of their files could not be deleted


@dataclasses.dataclass(frozen=True, slots=True)
class DiskRead:
    """Result of `DiskTier.get`: `blocks[i]` is valid only where `hits[i]`."""

    blocks: np.ndarray  # [n, *block_shape], zeros where missed
    hits: np.ndarray  # bool[n]


@dataclasses.dataclass(slots=True)
class _Segment:
    manifest: seg.SegmentManifest
    live_rows: set[int]
    pins: int = 0  # locks, reads in progress, puts naming its blocks
    read_backoff: WriteBackoff | None = None  # after a read failed (not for damage, not transiently)


_STORED, _NO_ROOM, _FAILED = "stored", "no room", "failed"  # what became of a segment write


@dataclasses.dataclass(slots=True)
class _Batch:
    """The blocks of one `put` (rows of `payload`), and what became of them."""

    payload: np.ndarray  # u8[n, block_nbytes]
    namespaces: list[bytes]
    keys: list[bytes]
    parents: list[bytes | None]
    kept: dict[str, list[int]]  # segments it pins -> the rows they held when it began
    duplicates: frozenset[int]  # those rows
    stored: set[int] = dataclasses.field(default_factory=set)  # rows in segments it wrote


class DiskTier:
    """Blocks on disk in checksummed orbax segments, evicted whole: leaves first, then LRU.

    Holds its directory until `close` (see the module docstring); use it as a context manager
    or close it.
    """

    def __init__(self, directory: str | None, block_shape: Sequence[int], dtype, capacity_bytes: int,
                 *, segment_bytes: int = 64 << 20, use_ocdbt: bool = True,
                 sync_data: bool = False, codec: str = "raw", model_id: str = "",
                 events: EventLog | None = None,
                 read_only: bool = False, backoff_s: float = 1.0, max_backoff_s: float = 60.0,
                 clock: Callable[[], float] = time.monotonic):  # fmt: skip
        """Locks `directory` (creating it if needed) and indexes the segments already in it
        (None: in memory, no bytes; see the module docstring). Raises DirectoryInUseError
        when another tier holds it.

        Segments of another block shape, dtype, codec or model id are skipped (counted in
        `skipped_segments`): their bytes would not mean the same KV. A writer counts their
        bytes against `capacity_bytes` (`foreign_bytes`) and deletes them, oldest first,
        before it evicts a segment of its own: they stay until their room is needed (a switch
        back to the other model finds them), and a directory never outgrows its capacity.

        segment_bytes: payload bytes per segment; a segment holds at least one block.
        use_ocdbt: orbax's OCDBT layout (a few files per segment) rather than one file per
          block; about as fast (benchmarks/bench_tiers.py), fewer files and fsyncs, and
          orbax logs a warning on every non-OCDBT save.
        sync_data: fsync block data too, not only the manifest (see
          `disk_segments.make_checkpointer`; without it a power cut costs misses, never
          wrong blocks).
        codec: name of the encoding of a block's bytes (`kvjax.tiers.block_codec`), recorded in
          every manifest; "raw" for blocks stored as the pool holds them.
        model_id: names the model whose KV the blocks are (e.g. a digest of its weights),
          recorded in every manifest: a directory reopened for another model of the same
          shapes would otherwise serve that model's KV as this one's. "": unnamed.
        events: where block events go (a private log by default).
        read_only: serve an existing directory without writing or deleting anything there,
          under a shared lock (other readers may share it, no writer): `put` stores nothing
          (its blocks count as rejected); `discard`, eviction and damaged segments only
          leave the index; segments beyond `capacity_bytes` at opening are left out of it.
        backoff_s, max_backoff_s: the first and the longest pause of writes after a failed
          write (seconds; doubling on each failure in a row, see `WriteBackoff`), and of a
          segment's reads after a failed read of it that was neither damage nor transient.
        clock: seconds, for the back-offs (tests inject a fake one).
        """
        self.block_shape = tuple(int(d) for d in block_shape)
        if not self.block_shape or min(self.block_shape) <= 0:
            raise ValueError(f"{block_shape=} must be a non-empty shape of positive sizes")
        if capacity_bytes < 0 or segment_bytes <= 0:
            raise ValueError(f"{capacity_bytes=} must be >= 0 and {segment_bytes=} > 0")
        self.dtype = jnp.dtype(dtype)
        if not isinstance(codec, str) or not codec:
            raise ValueError(f"{codec=} must be a non-empty codec name")
        if not isinstance(model_id, str):
            raise ValueError(f"{model_id=} must be a str naming the model whose KV the blocks are")
        self.codec = codec
        self.model_id = model_id
        self.block_nbytes = int(np.prod(self.block_shape)) * self.dtype.itemsize
        self.directory = None if directory is None else os.path.abspath(directory)
        self.events = events if events is not None else EventLog()
        self.capacity_bytes = int(capacity_bytes)
        self.blocks_per_segment = max(1, segment_bytes // self.block_nbytes)
        self.use_ocdbt = use_ocdbt
        self._checkpointer = None if directory is None else seg.make_checkpointer(use_ocdbt, sync_data)
        self._lock = threading.RLock()  # index state
        self._write_lock = threading.Lock()  # one segment write at a time
        self._segments: dict[str, _Segment] = {}
        self._order = VictimOrder()  # which segment eviction takes next
        self._dependents: collections.Counter[tuple[bytes, bytes]] = collections.Counter()  # add_dependents
        self._bytes_used = 0  # of the segments in the index, kept with them (summing them per write was O(segments))
        self._pinned_bytes = 0  # of those with pins: what no eviction can free now
        self._reserved_bytes = 0  # the lock file a writer fills (counted against the capacity)
        self._foreign: dict[str, int] = {}  # segments this tier cannot read -> bytes on disk, oldest first (writer)
        self._foreign_bytes = 0  # their sum
        self._dropped: list[tuple[bytes, bytes]] | None = []  # (namespace, key) dropped since take_dropped
        self._blocks: dict[tuple[bytes, bytes], tuple[str, int]] = {}
        self._per_namespace: collections.Counter[bytes] = collections.Counter()  # blocks held per digest
        self._locks: dict[tuple[bytes, bytes], list[str]] = {}  # segments pinned per lock
        self._stats = DiskTierStats(self.capacity_bytes, 0, 0, 0)
        self._next_seq = 0
        self.read_only = bool(read_only)
        self._backoff = WriteBackoff(backoff_s, max_backoff_s, clock)
        self._read_backoff = functools.partial(WriteBackoff, backoff_s, max_backoff_s, clock)  # per segment
        self._closed = False
        self._pid = os.getpid()  # a forked child's copy reads and writes nothing (its lock is the parent's)
        self._dir_lock: DirectoryLock | None = None
        if self.directory is not None:
            if os.path.exists(self.directory) and not os.path.isdir(self.directory):
                raise ValueError(f"disk directory {self.directory} is a file; expected a directory (or a path "
                                 "to create one at)")
            if self.read_only and not os.path.isdir(self.directory):
                raise ValueError(f"disk directory {self.directory} does not exist (read_only=True opens "
                                 "an existing one)")
            if not self.read_only:
                os.makedirs(self.directory, exist_ok=True)
            self._dir_lock = DirectoryLock(self.directory, shared=self.read_only)
            try:
                if not self.read_only:
                    self._reserved_bytes = _file_bytes(self._dir_lock.path)
                self._open_directory()
            except BaseException:
                self._dir_lock.release()
                raise

    # ---- queries -------------------------------------------------------------------------

    @property
    def bytes_used(self) -> int:
        with self._lock:
            return self._bytes_used

    def __len__(self) -> int:
        with self._lock:
            return len(self._blocks)

    def take_dropped(self) -> list[tuple[bytes, bytes]] | None:
        """The ``(namespace, key)`` of every block dropped since the last call (evicted,
        discarded, found corrupt), so a caller's index need not ask about all it holds; None
        when more than ``_MAX_DROPPED`` went since: ask about everything."""
        with self._lock:
            dropped, self._dropped = self._dropped, []
            return dropped

    @property
    def index_lock(self) -> threading.RLock:
        """Held while the index changes (and its block events are recorded): hold it to read
        ``held_blocks`` consistently with the events."""
        return self._lock

    def held_blocks(self) -> list[tuple[bytes, bytes]]:
        """Every (namespace, key) the tier holds now."""
        with self._lock:
            return list(self._blocks)

    def namespaces(self) -> list[bytes]:
        """Digests of the namespaces holding at least one block here, most blocks first."""
        with self._lock:
            return [namespace for namespace, _ in self._per_namespace.most_common()]

    def contains(self, key: bytes, namespace: bytes) -> bool:
        with self._lock:
            return (namespace, key) in self._blocks

    def stats(self) -> DiskTierStats:
        with self._lock:
            return dataclasses.replace(self._stats, bytes_used=self.bytes_used,
                                       segments=len(self._segments), blocks=len(self._blocks),
                                       backoff_remaining_s=self._backoff.remaining_s(),
                                       foreign_bytes=self._foreign_bytes)  # fmt: skip

    # ---- data path -----------------------------------------------------------------------

    def put(self, keys: Sequence[bytes], blocks, namespaces: bytes | Sequence[bytes],
            parents: Sequence[bytes | None] | None = None) -> list[bytes]:
        """Writes blocks `[n, *block_shape]` in committed segments; returns the keys it stored
        that the tier holds when it returns (a put larger than the tier evicts its own first
        segments for its last), in the order given.

        namespaces: one namespace digest for all blocks, or one per block; parents: each
        block's parent key, kept in the manifest (None: unknown): eviction takes a parent only
        after the blocks that depend on it (see Capacity). Blocks already on disk are
        skipped, and never evicted for the others: when nothing else can make room for them,
        they are written again with them (see the module docstring). Blocks whose segment
        does not fit or fails to write are dropped, and so are all blocks while writes back
        off after a failure or when the tier is read-only. ValueError once the tier is closed.
        """
        keys, namespaces = _check_keys(keys, namespaces)
        parents = [None] * len(keys) if parents is None else list(parents)
        if len(parents) != len(keys):
            raise ValueError(f"{len(parents)=} must equal {len(keys)=}")
        blocks = np.asarray(blocks)
        expected = (len(keys), *self.block_shape)
        if blocks.shape != expected or blocks.dtype != self.dtype:
            raise ValueError(f"blocks shape {blocks.shape} dtype {blocks.dtype} must be "
                             f"{expected} {self.dtype}")
        self._check_open()
        payload = np.ascontiguousarray(blocks).reshape(len(keys), -1).view(np.uint8)
        with self._lock:
            rows = []  # rows to write
            kept: dict[str, list[int]] = {}  # segment -> the rows it holds already
            for r in range(len(keys)):
                ref = self._blocks.get((namespaces[r], keys[r]))
                if ref is None:
                    rows.append(r)
                else:
                    kept.setdefault(ref[0], []).append(r)
            self._stats.duplicate_blocks += len(keys) - len(rows)
            if self.read_only:
                if rows and not self._stats.rejected_blocks:
                    _log.warning("disk tier %s is read-only: put stores nothing", self.directory)
                self._stats.rejected_blocks += len(rows)
                return []
            # The blocks it holds already stay while it makes room for the others: a spill
            # saving host pages must not evict one of them for another (its host copy goes next).
            for name in kept:
                self._pin(name)
        batch = _Batch(payload, namespaces, keys, parents, kept, frozenset(r for held in kept.values() for r in held))
        try:
            no_room = self._write_rows(batch, rows)
            if no_room and kept:  # the room is theirs: write what they hold again, with the others
                self._write_rows(batch, sorted(no_room + list(batch.duplicates)))
        finally:
            with self._lock:
                for name in kept:  # those no rewrite let go, and those holding blocks written again
                    self._unpin(name)
                stored = sorted(batch.stored - batch.duplicates)
                self._stats.rejected_blocks += len(rows) - len(stored)
        with self._lock:  # room for a later chunk may have evicted an earlier one
            return [keys[r] for r in stored if (namespaces[r], keys[r]) in self._blocks]

    def get(self, keys: Sequence[bytes], namespace: bytes) -> DiskRead:
        """Reads blocks of one namespace; checksum-verified, misses where absent or broken.
        ValueError once the tier is closed."""
        keys, _ = _check_keys(keys, namespace)
        self._check_open()
        hits = np.zeros(len(keys), bool)
        with self._lock:
            by_segment: dict[str, list[tuple[int, int]]] = {}  # name -> [(index, row)]
            for i, key in enumerate(keys):
                ref = self._blocks.get((namespace, key))
                if ref is not None:
                    by_segment.setdefault(ref[0], []).append((i, ref[1]))
            for name in list(by_segment):
                backoff = self._segments[name].read_backoff
                if backoff is not None and not backoff.allows():  # missed untried, and not used
                    backoff.drop(len(by_segment[name]))
                    self._stats.read_backoff_blocks += len(by_segment.pop(name))
                    continue
                self._pin(name)  # no eviction while its files are read
                self._order.touch(name)
        out = np.zeros((len(keys), self.block_nbytes), np.uint8)
        try:
            for name, wanted in by_segment.items():
                verified = self._read_segment(name, [(keys[i], row) for i, row in wanted],
                                              namespace, out, [i for i, _ in wanted])
                hits[[i for i, _ in wanted]] = verified
        finally:
            with self._lock:
                for name in by_segment:
                    self._unpin(name)
                self._stats.hit_blocks += int(hits.sum())
                self._stats.miss_blocks += len(keys) - int(hits.sum())
        return DiskRead(out.view(self.dtype).reshape(len(keys), *self.block_shape), hits)

    # ---- lifetime ------------------------------------------------------------------------

    def close(self) -> None:
        """Waits for a segment write in progress, then lets go of the directory: another tier
        may open it. The index stays readable (`contains`, `stats`); `put` and `get` raise.
        Idempotent."""
        with self._write_lock, self._lock:
            if self._closed:
                return
            self._closed = True
        if self._dir_lock is not None:
            self._dir_lock.release()

    @property
    def closed(self) -> bool:
        return self._closed

    def __enter__(self) -> DiskTier:
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()

    def discard(self, keys: Sequence[bytes], namespace: bytes) -> int:
        """Forgets blocks; a segment's bytes go when all its blocks are gone. Returns count."""
        keys, _ = _check_keys(keys, namespace)
        with self._lock:
            dropped = 0
            for key in keys:
                ref = self._unindex(namespace, key)
                if ref is not None:
                    dropped += 1
                    self._segments[ref[0]].live_rows.discard(ref[1])
                    self._drop_if_unused(ref[0])
            self._stats.discarded_blocks += dropped
            return dropped

    def lock(self, keys: Sequence[bytes], namespace: bytes) -> bool:
        """Pins the segments holding the keys against eviction; False if any key is absent."""
        keys, _ = _check_keys(keys, namespace)
        with self._lock:
            refs = [self._blocks.get((namespace, key)) for key in keys]
            if any(ref is None for ref in refs):
                return False
            for key, (name, _) in zip(keys, refs):
                self._pin(name)
                self._locks.setdefault((namespace, key), []).append(name)
            return True

    def unlock(self, keys: Sequence[bytes], namespace: bytes) -> None:
        """Releases one `lock` of each key (also after the key was discarded)."""
        keys, _ = _check_keys(keys, namespace)
        with self._lock:
            for key in keys:
                if not self._locks.get((namespace, key)):
                    raise ValueError(f"key={key.hex()} is not locked in the disk tier")
            for key in keys:
                names = self._locks[(namespace, key)]
                self._unpin(names.pop())
                if not names:
                    del self._locks[(namespace, key)]

    def add_dependents(self, parents: Sequence[bytes], namespace: bytes) -> None:
        """Counts one copy held elsewhere (a host tier) of a block after each of ``parents``
        (repeats count again): until ``remove_dependents``, eviction takes a block named here
        only after blocks nothing depends on (see the module docstring). A key need not be
        held here, now or ever. Never persisted."""
        with self._lock:
            for parent in parents:
                self._dependents[(namespace, parent)] += 1
                self._order.hold((namespace, parent))

    def remove_dependents(self, parents: Sequence[bytes], namespace: bytes) -> None:
        """Undoes ``add_dependents`` (ValueError, nothing changed, for a parent not counted)."""
        with self._lock:
            counts = collections.Counter((namespace, parent) for parent in parents)
            for block, count in counts.items():
                if self._dependents[block] < count:
                    raise ValueError(f"key={block[1].hex()} has {self._dependents[block]} dependents, "
                                     f"not {count} to remove")  # fmt: skip
            for block, count in counts.items():
                self._dependents[block] -= count
                if not self._dependents[block]:
                    del self._dependents[block]
                self._order.release(block, count)

    def dependents(self) -> dict[tuple[bytes, bytes], int]:
        """What ``add_dependents`` counts now, per (namespace, parent key)."""
        with self._lock:
            return dict(self._dependents)

    def check_invariants(self) -> None:
        """Raises RuntimeError when the index is inconsistent."""
        with self._lock:
            if self._bytes_used + self._foreign_bytes + self._reserved_bytes > self.capacity_bytes:
                raise RuntimeError(f"{self._bytes_used=} + {self._foreign_bytes=} + {self._reserved_bytes=} "
                                   f"exceeds {self.capacity_bytes=}")
            summed = sum(s.manifest.bytes_on_disk for s in self._segments.values())
            if summed != self._bytes_used:
                raise RuntimeError(f"bytes_used={self._bytes_used} but the indexed segments hold {summed}")
            pinned = sum(s.manifest.bytes_on_disk for s in self._segments.values() if s.pins)
            if pinned != self._pinned_bytes:
                raise RuntimeError(f"pinned bytes={self._pinned_bytes} but the pinned segments hold {pinned}")
            live = {(name, row) for name, s in self._segments.items() for row in s.live_rows}
            if live != set(self._blocks.values()):
                raise RuntimeError("segment live rows and the block index disagree")
            if self._per_namespace != collections.Counter(namespace for namespace, _ in self._blocks):
                raise RuntimeError("blocks counted per namespace disagree with the block index")
            for name, segment in self._segments.items():
                if segment.pins < 0 or (not segment.live_rows and not segment.pins):
                    raise RuntimeError(f"segment {name} {segment.pins=} with no live blocks")
            self._order.check({block: name for block, (name, _) in self._blocks.items()})

    # ---- helpers -------------------------------------------------------------------------

    def _write_rows(self, batch: _Batch, rows: list[int]) -> list[int]:
        """Writes rows of a put in segments of at most `blocks_per_segment`; returns the rows
        not held before (`batch.duplicates`) of segments that found no room."""
        no_room = []
        for start in range(0, len(rows), self.blocks_per_segment):
            chunk = rows[start:start + self.blocks_per_segment]
            new = [r for r in chunk if r not in batch.duplicates]
            if not self._may_write(len(new)):
                continue
            with self._lock:  # segments the put kept whose blocks it names all go into this one
                release = [name for name, held in batch.kept.items() if self._all_in(batch, name, held, chunk)]
            outcome = self._write(batch, chunk, release)
            if outcome == _STORED:
                batch.stored.update(chunk)
                with self._lock:
                    self._stats.rewritten_blocks += len(chunk) - len(new)
            elif outcome == _NO_ROOM:
                no_room += new
        return no_room

    def _all_in(self, batch: _Batch, name: str, held: list[int], chunk: list[int]) -> bool:
        """Whether segment `name` still holds blocks of the put (`held`: rows it held when the
        put began), each of them in `chunk`."""
        still = [r for r in held if self._blocks.get((batch.namespaces[r], batch.keys[r]), ("",))[0] == name]
        return bool(still) and set(still) <= set(chunk)

    def _write(self, batch: _Batch, chunk: list[int], release: list[str]) -> str:
        """Writes rows `chunk` of a put as one segment; their parents count their dependents
        meanwhile, so the room it makes never evicts them (the blocks count as their children
        once indexed)."""
        held = [(batch.namespaces[r], batch.parents[r]) for r in chunk if batch.parents[r] is not None]
        with self._lock:
            for block in held:
                self._order.hold(block)
        try:
            return self._write_segment(batch, chunk, release)
        finally:
            with self._lock:
                for block in held:
                    self._order.release(block)

    def _write_segment(self, batch: _Batch, chunk: list[int], release: list[str]) -> str:
        """Makes room, writes and indexes a segment: `_STORED`, `_NO_ROOM` or `_FAILED`.

        release: segments the put pinned (`batch.kept`) whose blocks it names are all in this
        one: their pins go once it is indexed (they leave `kept`), so their room counts as
        free, but nothing evicts them before: until then they hold the only copy. A segment
        holding such blocks again takes their place in `kept`, pinned until the put returns."""
        contiguous = chunk[-1] - chunk[0] == len(chunk) - 1  # then a view, not a copy
        payload = batch.payload[chunk[0]:chunk[-1] + 1] if contiguous else batch.payload[chunk]
        namespaces, keys = [batch.namespaces[r] for r in chunk], [batch.keys[r] for r in chunk]
        parents, kept = [batch.parents[r] for r in chunk], batch.kept
        with self._lock:
            if not self._evict_until_free(payload.nbytes - self._releasable(release)):
                return _NO_ROOM
            name = seg.segment_name(self._next_seq)
            self._next_seq += 1
        manifest = seg.SegmentManifest(
            name=name, block_shape=self.block_shape, dtype=self.dtype.name,
            block_nbytes=self.block_nbytes, use_ocdbt=self.use_ocdbt,
            namespaces=tuple(namespaces), keys=tuple(keys), checksums=(), bytes_on_disk=0,
            codec=self.codec, parents=tuple(parents), model_id=self.model_id)
        if self.directory is None:  # in memory: the payload's bytes, nothing written
            manifest = dataclasses.replace(manifest, bytes_on_disk=payload.nbytes)
        else:
            with self._write_lock:
                if self._closed:  # closed since `put` began: the lock is gone, write nothing
                    return _FAILED
                try:
                    manifest = seg.write_segment(self._checkpointer, self.directory, manifest, payload)
                except Exception as err:  # noqa: BLE001 - any write failure drops the batch
                    self._write_failed(name, sum(r not in batch.duplicates for r in chunk), err)
                    return _FAILED
            self._write_succeeded()
        with self._lock:
            # Its metadata does not fit (all else pinned meanwhile): it goes again before
            # anything is evicted or indexed for it.
            if self._pinned_bytes - self._releasable(release) + manifest.bytes_on_disk > self._room():
                if self.directory is not None and self._owns_directory():
                    self._stats.remove_errors += not seg.remove_segment(self.directory, name)
                return _NO_ROOM
            self._add_segment(manifest)  # the blocks it holds again leave the released segments
            self._pin(name)  # the new segment is not its own eviction victim
            for old in release:
                if kept.pop(old, None) is not None:
                    self._unpin(old)
            self._evict_until_free(0)  # fits: checked above
            rewritten = [r for r in chunk if r in batch.duplicates]
            if rewritten:  # the put's later segments must not evict them either
                kept[name] = rewritten
            else:
                self._unpin(name)
            self._stats.written_segments += 1
            self._stats.put_blocks += len(keys)
        return _STORED

    def _releasable(self, release: list[str]) -> int:
        """Bytes of the segments in `release` that nothing but the put pins (its one pin)."""
        return sum(self._segments[name].manifest.bytes_on_disk for name in release
                   if name in self._segments and self._segments[name].pins == 1)

    def _may_write(self, num_blocks: int) -> bool:
        """False (the blocks counted as dropped) while writes back off after a failure."""
        with self._lock:
            if self._backoff.allows():
                return True
            self._backoff.drop(num_blocks)
            self._stats.backoff_dropped_blocks += num_blocks
            return False

    def _write_failed(self, name: str, num_blocks: int, err: Exception) -> None:
        """Counts a failed write and starts the next back-off period: the one warning of it."""
        with self._lock:
            self._stats.write_errors += 1
            self._stats.enospc_errors += _is_disk_full(err)
            period = self._backoff.failed()
            failures, dropped = self._backoff.failures, self._backoff.last_dropped
        again = f"; failure {failures} in a row, {dropped} blocks dropped untried since the last" if failures > 1 else ""
        _log.warning("disk tier %s: writing %s failed, dropping its %d blocks: %r; no writes for %g s%s",
                     self.directory, name, num_blocks, err, period, again)

    def _write_succeeded(self) -> None:
        with self._lock:
            failures, dropped = self._backoff.failures, self._backoff.dropped
            self._backoff.succeeded()
        if failures:
            _log.warning("disk tier %s: writes work again after %d failed; %d blocks were dropped untried "
                         "while backing off", self.directory, failures, dropped)

    def _read_segment(self, name: str, wanted: list[tuple[bytes, int]], namespace: bytes,
                      out: np.ndarray, out_index: list[int]) -> list[bool]:
        """Reads (key, row) pairs of a pinned segment into `out`; returns which verified."""
        manifest = self._segments[name].manifest
        keys = [key for key, _ in wanted]
        rows = [row for _, row in wanted]
        if self.directory is None:  # in memory: hits of zeros
            return [True] * len(wanted)
        try:
            verified = seg.read_verified(self._checkpointer, self.directory, manifest,
                                         namespace, keys, rows, out, out_index)
        except Exception as err:  # noqa: BLE001 - unreadable segment: all its blocks miss
            out[out_index] = 0
            self._read_failed(name, err)
            return [False] * len(wanted)
        with self._lock:
            backoff, self._segments[name].read_backoff = self._segments[name].read_backoff, None
        if backoff is not None:
            _log.warning("disk tier %s: segment %s: reads of it work again after %d failed",
                         self.directory, name, backoff.failures)
        for key, row, ok in zip(keys, rows, verified):
            if ok:
                continue
            _log.warning("disk tier: checksum mismatch for key %s in %s", key.hex(), name)
            with self._lock:
                self._stats.corrupt_blocks += 1
                if self._blocks.get((namespace, key)) == (name, row):
                    self._unindex(namespace, key)
                    self._segments[name].live_rows.discard(row)
        return verified

    def _read_failed(self, name: str, err: Exception) -> None:
        """Counts a failed read of (pinned) segment `name`: damage drops it; otherwise it stays,
        and unless the failure was transient its reads back off (one warning per period)."""
        if seg.read_error_is_damage(err):
            _log.warning("disk tier: segment %s unreadable, dropping it: %r", name, err)
            with self._lock:
                self._stats.read_errors += 1
                self._forget_segment(name)
            return
        transient = _is_transient(err)  # out of descriptors or memory, interrupted
        with self._lock:
            self._stats.read_errors += 1
            self._stats.kept_read_errors += 1
            self._stats.transient_read_errors += transient
            segment = self._segments[name]
            if not transient:
                if segment.read_backoff is None:
                    segment.read_backoff = self._read_backoff()
                period = segment.read_backoff.failed()
                failures, missed = segment.read_backoff.failures, segment.read_backoff.last_dropped
        if transient:
            _log.warning("disk tier: reading segment %s failed, keeping it: %r", name, err)
            return
        again = f"; failure {failures} in a row, {missed} blocks missed untried since the last" if failures > 1 else ""
        _log.warning("disk tier %s: reading segment %s failed, keeping it: %r; no reads of it for %g s%s",
                     self.directory, name, err, period, again)

    def _open_directory(self) -> None:
        committed, orphans = seg.scan_directory(self.directory)
        # A leftover that could not be deleted keeps its name: a new segment must not take it
        # (its write would fail, counted as a write error, and start a back-off).
        self._next_seq = max((seq + 1 for seq in map(seg.segment_seq, orphans) if seq is not None), default=0)
        if self.read_only and orphans:
            _log.info("disk tier %s (read-only): leaving %d uncommitted entries", self.directory, len(orphans))
        elif orphans:
            removed = sum(seg.remove_segment(self.directory, entry) for entry in orphans)
            self._stats.orphans_removed = removed
            self._stats.orphan_remove_errors = len(orphans) - removed
        for seq, path in committed:
            self._next_seq = max(self._next_seq, seq + 1)
            try:
                manifest = seg.read_manifest(path)
            except ValueError as err:
                _log.warning("disk tier: skipping segment: %s", err)
                self._stats.skipped_segments += 1
                continue
            if (manifest.block_shape, manifest.dtype) != (self.block_shape, self.dtype.name):
                _log.warning("disk tier: skipping %s: blocks %s %s, this tier holds %s %s",
                             path, manifest.block_shape, manifest.dtype, self.block_shape,
                             self.dtype.name)
            elif manifest.codec != self.codec:
                _log.warning("disk tier: skipping %s: written with codec %r, this tier reads %r",
                             path, manifest.codec, self.codec)
                self._stats.codec_mismatch_segments += 1
            elif manifest.model_id != self.model_id:  # same shapes, another model's KV: never served
                _log.warning("disk tier: skipping %s: KV of model %r, this tier holds model %r's",
                             path, manifest.model_id, self.model_id)
            else:
                self._add_segment(manifest)
                self._stats.recovered_segments += 1
                continue
            self._stats.skipped_segments += 1
            if not self.read_only:  # its room counts: deleted before any segment of this tier's
                self._foreign[manifest.name] = manifest.bytes_on_disk
                self._foreign_bytes += manifest.bytes_on_disk
        self._evict_until_free(0)

    def _add_segment(self, manifest: seg.SegmentManifest) -> None:
        live = set()
        parents = manifest.parents or (None,) * len(manifest.keys)
        self._segments[manifest.name] = _Segment(manifest, live)
        self._order.add_segment(manifest.name)
        self._bytes_used += manifest.bytes_on_disk
        for row, (ns, key, parent) in enumerate(zip(manifest.namespaces, manifest.keys, parents)):
            old = self._blocks.get((ns, key))
            if old is not None:  # a newer copy replaces the older one: still held, no event
                self._order.remove_block((ns, key))
                self._segments[old[0]].live_rows.discard(old[1])
                self._blocks[(ns, key)] = (manifest.name, row)
                self._drop_if_unused(old[0])
            else:
                self._blocks[(ns, key)] = (manifest.name, row)
                self._per_namespace[ns] += 1
                self.events.record(ns, key, parent, "disk", "stored")
            self._order.add_block((ns, key), manifest.name, None if parent is None else (ns, parent))
            live.add(row)

    def _unindex(self, namespace: bytes, key: bytes) -> tuple[str, int] | None:
        """Forget a block (the caller fixes its segment's live rows); None if it was not held."""
        ref = self._blocks.pop((namespace, key), None)
        if ref is not None:
            self._order.remove_block((namespace, key))
        if ref is not None and self._dropped is not None:
            self._dropped.append((namespace, key))
            if len(self._dropped) > _MAX_DROPPED:
                self._dropped = None  # nobody asked for a while: the next caller rescans
        if ref is not None:
            self._per_namespace[namespace] -= 1
            if not self._per_namespace[namespace]:
                del self._per_namespace[namespace]
            self.events.record(namespace, key, None, "disk", "removed")
        return ref

    def _room(self) -> int:
        """Bytes the segments may take: the capacity less the lock file."""
        return self.capacity_bytes - self._reserved_bytes

    def _evict_until_free(self, nbytes: int) -> bool:
        """Evicts unpinned segments until `nbytes` more fit: those nothing outside them depends
        on first, least recently used first among equals (`VictimOrder`). Evicts nothing and
        returns False when they would not fit with every unpinned segment gone."""
        room = self._room()
        if self._pinned_bytes + nbytes > room:
            return False
        while self._foreign and self._bytes_used + self._foreign_bytes + nbytes > room:
            name = next(iter(self._foreign))
            self._foreign_bytes -= self._foreign.pop(name)
            if self._owns_directory() and seg.remove_segment(self.directory, name):
                self._stats.foreign_removed += 1
            else:  # left on disk, no longer counted: trying again per write would fail the same way
                self._stats.remove_errors += 1
        while self._bytes_used + nbytes > room:
            name = self._order.victim(lambda name: not self._segments[name].pins)
            if name is None:
                break
            segment = self._segments[name]
            self._stats.evicted_segments += 1
            self._stats.evicted_blocks += len(segment.live_rows)
            self._drop_segment(name)
        return self._bytes_used + nbytes <= room

    def _pin(self, name: str) -> None:
        segment = self._segments[name]
        segment.pins += 1
        if segment.pins == 1:
            self._pinned_bytes += segment.manifest.bytes_on_disk

    def _unpin(self, name: str) -> None:
        segment = self._segments[name]
        segment.pins -= 1
        if not segment.pins:
            self._pinned_bytes -= segment.manifest.bytes_on_disk
        self._drop_if_unused(name)

    def _drop_if_unused(self, name: str) -> None:
        segment = self._segments[name]
        if not segment.live_rows and not segment.pins:
            self._drop_segment(name)

    def _forget_segment(self, name: str) -> None:
        segment = self._segments[name]
        for row in segment.live_rows:
            self._unindex(segment.manifest.namespaces[row], segment.manifest.keys[row])
        segment.live_rows.clear()  # files go when the last pin is released

    def _drop_segment(self, name: str) -> None:
        segment = self._segments.pop(name)
        self._bytes_used -= segment.manifest.bytes_on_disk
        if segment.pins:  # (never: a pinned segment stays until its last pin goes)
            self._pinned_bytes -= segment.manifest.bytes_on_disk
        for row in segment.live_rows:
            self._unindex(segment.manifest.namespaces[row], segment.manifest.keys[row])
        self._order.remove_segment(name)
        if self.directory is not None and not self.read_only and self._owns_directory():
            self._stats.remove_errors += not seg.remove_segment(self.directory, name)

    def _owns_directory(self) -> bool:
        """Whether this tier may delete files in its directory now: open, in the process that
        opened it (closed, its lock may be another tier's; a forked child's copy never held it)."""
        return not self._closed and os.getpid() == self._pid

    def _check_open(self) -> None:
        if self._closed:
            raise ValueError(f"disk tier {self.directory or '(in memory)'} is closed")
        if os.getpid() != self._pid:
            raise ValueError(f"disk tier {self.directory or '(in memory)'} was opened by pid {self._pid}; "
                             f"this forked process (pid {os.getpid()}) must open its own")


def _file_bytes(path: str) -> int:
    try:
        return os.path.getsize(path)
    except OSError:
        return 0


def _check_keys(keys: Sequence[bytes], namespaces) -> tuple[list[bytes], list[bytes]]:
    keys = list(keys)
    if isinstance(namespaces, bytes):
        namespaces = [namespaces] * len(keys)
    namespaces = list(namespaces)
    if len(namespaces) != len(keys):
        raise ValueError(f"{len(namespaces)=} must be 1 or len(keys)={len(keys)}")
    for value in (*keys, *namespaces):
        if not isinstance(value, bytes) or not value:
            raise ValueError(f"block key or namespace {value!r} must be non-empty bytes")
    if len(set(zip(namespaces, keys))) != len(keys):
        raise ValueError(f"keys contain duplicates: {len(keys)=}")
    return keys, namespaces


def _chain(err: BaseException | None):
    """``err`` and its causes / contexts, outermost first."""
    while err is not None:
        yield err
        err = err.__cause__ or err.__context__


def _errno_in_chain(err: BaseException | None) -> int | None:
    """The errno of the first OSError in an exception's cause/context chain."""
    return next((e.errno for e in _chain(err) if isinstance(e, OSError) and e.errno is not None), None)


def _is_disk_full(err: BaseException) -> bool:
    """A full disk: ENOSPC, or TensorStore's RESOURCE_EXHAUSTED status (which carries no errno)."""
    return _errno_in_chain(err) == errno.ENOSPC or any(
        "RESOURCE_EXHAUSTED" in str(e) or "No space left on device" in str(e) for e in _chain(err))


_TRANSIENT_ERRNOS = frozenset({errno.EMFILE, errno.ENFILE, errno.ENOMEM, errno.EINTR, errno.EAGAIN})
_TRANSIENT_MESSAGES = ("Too many open files", "Cannot allocate memory", "Resource temporarily unavailable",
                       "RESOURCE_EXHAUSTED")


def _is_transient(err: BaseException) -> bool:
    """A read failure that says nothing about the segment: out of file descriptors or memory,
    interrupted (as an OSError, or in the text of a TensorStore error)."""
    return _errno_in_chain(err) in _TRANSIENT_ERRNOS or any(
        message in str(e) for e in _chain(err) for message in _TRANSIENT_MESSAGES)
