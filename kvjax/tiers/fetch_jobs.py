"""Fetch jobs: lower-tier pages brought up into device blocks of waiting sequences.

A ``FetchJob`` covers consecutive pages of one namespace. It first waits for the host copies
it needs: copies still being made (an offload in flight) and pages only on disk, which it
restores into host memory itself. Then it fetches the leading pages that are on host to the
device, and scatters them into the private blocks of every ``Waiter`` consuming it. A job's
result is ``valid``: how many of its leading pages arrived (a failed transfer, a corrupt
disk block or a lack of host room makes it smaller, never wrong).

A ``Waiter`` is one sequence's view: its pages ``first .. first + num_pages - 1`` come from
one or more jobs (a page already in flight for another sequence, e.g. a prefetch, is shared,
not fetched twice). When all its jobs are done the sequence's hit is the leading run of
valid pages; those pages are committed to the trie and the sequence is ready.
"""

from __future__ import annotations

import concurrent.futures

import numpy as np

from kvjax.cache.records import SeqHandle
from kvjax.tiers.transfer import Priority

__all__ = ["FetchJob", "Waiter", "resolved_future"]


class FetchJob:
    """One transfer chain; see the module docstring. ``keys`` are in page order."""

    __slots__ = ("namespace", "keys", "from_disk", "priority", "to_device", "prereqs", "pending",
                 "valid", "chunks", "consumers", "held", "started", "read", "transfers")  # fmt: skip

    def __init__(self, namespace: bytes, keys: list[bytes], from_disk: np.ndarray,
                 priority: Priority, to_device: bool, started: float):  # fmt: skip
        self.namespace = namespace  # digest
        self.keys = keys
        self.from_disk = from_disk  # bool [len(keys)]: restored from disk by this job
        self.priority = priority
        self.to_device = to_device  # False: a prefetch that only restores disk -> host
        self.prereqs = 0  # copies (offloads, the restore) still to finish before the fetch
        self.pending = 0  # host -> device fetches in flight (one per batch of at most the largest bucket)
        self.valid: int | None = None  # leading pages on device; None while running
        self.chunks: dict = {}  # first row -> (blocks, decoded [bucket rows, ...] or None: no bytes); None: failed
        self.consumers: list[tuple[Waiter, int, int, int]] = []  # (waiter, page, row, count)
        self.held: list[bytes] = []  # host keys this job holds against eviction
        self.started = started  # time.monotonic() seconds, for the fetch latency metric
        # done once the job read its host slots (or gave up): then they may be written again
        self.read: concurrent.futures.Future = concurrent.futures.Future()
        # the transfer engine's futures this job waits on (copies down, its restore, its
        # fetches): what ``TierMover`` promotes when a more urgent waiter joins the job
        self.transfers: list[concurrent.futures.Future] = []

    @property
    def tier(self) -> str:
        """Metric label of the slowest source: "disk" if any page came from disk."""
        return "disk" if self.from_disk.any() else "host"


class Waiter:
    """A sequence waiting for pages ``first .. first + num_pages - 1`` (see module docstring)."""

    __slots__ = ("handle", "first", "num_pages", "from_disk", "segments", "outstanding", "prefetch")

    def __init__(self, handle: SeqHandle, first: int, from_disk: np.ndarray, prefetch: bool):
        self.handle = handle
        self.first = first  # device pages mapped at admission (the trie path it locks)
        self.num_pages = len(from_disk)
        self.from_disk = from_disk  # bool [num_pages]: page was only on disk at admission
        self.segments: list[tuple[FetchJob, int, int, int]] = []  # (job, page offset, row, count)
        self.outstanding = 0  # jobs not finished
        self.prefetch = prefetch  # a prefetch's own hold: committed and released when done

    def valid_pages(self) -> int:
        """Leading pages whose KV arrived (all jobs finished)."""
        total = 0
        for job, offset, row, count in sorted(self.segments, key=lambda s: s[1]):
            if offset != total:
                break
            got = min(count, max(0, job.valid - row))
            total += got
            if got < count:
                break
        return total


def resolved_future() -> concurrent.futures.Future:
    future = concurrent.futures.Future()
    future.set_result(None)
    return future
