"""Which trie pages have a host or disk copy, kept in step with what the tiers hold.

The prefix trie records a page's copies as Tier bits; the tiers hold blocks by chained key
(see ``block_keys``). ``TierIndex`` links the two: per host key an entry with the page it
backs, per disk (namespace, key) the page. Rules it keeps:

* a page has the HOST bit exactly when the index has a live host entry for its key; the
  entry is *pending* while the copy is being made (an offload or a restore in flight) and
  *ready* once the host tier holds it;
* a page has the DISK bit exactly when the index has a disk entry for it and the disk tier
  holds the block (the disk tier may drop segments on its own when it writes;
  ``reconcile_disk`` clears the bits of what it dropped);
* ``undisked`` lists, LRU first, the host entries whose page has no disk copy: what a
  spill to disk writes;
* the host tier never evicts on its own: every put is preceded by ``make_host_room``, which
  evicts unlocked, ready host entries in LRU order (clearing their HOST bits, so a page left
  without copies leaves the trie);
* a page that leaves the trie drops its host copy (at the end of the transfer using it, if
  one does) and keeps its disk copy unindexed: a later lookup finds it again by key
  (``probe_disk``), as it finds what a previous process left in the directory.

Pages are referenced by ``PageRef`` (a node and an absolute page index); the trie's
``on_split`` hook moves the references of pages that a split puts into the new head node.
"""

from __future__ import annotations

import collections
import itertools
from collections.abc import Iterable

import numpy as np

from kvjax.cache.block_keys import Namespace, chained_block_keys
from kvjax.cache.prefix_trie import PrefixTrie
from kvjax.cache.trie_node import Node, Tier
from kvjax.tiers.disk_tier import DiskTier
from kvjax.tiers.host_tier import HostTier

__all__ = ["HostEntry", "PageRef", "TierIndex"]

_HOST, _DISK = int(Tier.HOST), int(Tier.DISK)


class PageRef:
    """A trie page: ``page`` pages from the start of its sequence, last seen in ``node``."""

    __slots__ = ("node", "page")

    def __init__(self, node: Node, index: int):
        self.node = node
        self.page = node.first_page + index

    def resolve(self) -> tuple[Node, int] | None:
        """(node, index in node) of the page now, or None if it left the trie."""
        node = self.node
        index = self.page - node.first_page
        if node.parent is None or not 0 <= index < node.num_pages:
            return None
        return node, index


class HostEntry:
    """One host block the index knows about (see the module docstring)."""

    __slots__ = ("namespace", "ref", "ready", "busy", "dropped")

    def __init__(self, namespace: bytes, ref: PageRef, ready: bool):
        self.namespace = namespace  # namespace digest
        self.ref = ref
        self.ready = ready  # the host tier holds the block (not only a copy in flight)
        self.busy = 0  # transfers reading it (fetch, spill): never evicted meanwhile
        self.dropped = False  # its page left the trie; discard once no transfer reads it


class TierIndex:
    """Host and disk bookkeeping of one trie; see the module docstring."""

    def __init__(self, trie: PrefixTrie, host: HostTier, disk: DiskTier | None):
        self.trie = trie
        self.host = host
        self.disk = disk
        self.host_capacity = host.capacity_bytes // host.block_nbytes  # blocks
        self.host_entries: collections.OrderedDict[bytes, HostEntry] = collections.OrderedDict()
        self.disk_entries: dict[tuple[bytes, bytes], PageRef] = {}
        # live host entries whose page has no disk copy, LRU first: what a spill writes
        self.undisked: collections.OrderedDict[bytes, None] = collections.OrderedDict()
        self.lost_blocks = 0  # host blocks evicted with no disk copy (their pages left)
        trie.on_drop = self._on_drop
        trie.on_split = self._on_split

    # --- host ------------------------------------------------------------------------------

    @property
    def host_used(self) -> int:
        """Host blocks held or reserved (pending copies included)."""
        return len(self.host_entries)

    def host_state(self, key: bytes) -> HostEntry | None:
        """The live (not dropped) entry of ``key``, or None."""
        entry = self.host_entries.get(key)
        return None if entry is None or entry.dropped else entry

    def make_host_room(self, num_blocks: int, exclude: Iterable[bytes] = ()) -> int:
        """Evict ready, unlocked host blocks (LRU first, none in ``exclude``) until
        ``num_blocks`` more fit; return how many fit (<= num_blocks)."""
        short = num_blocks - (self.host_capacity - self.host_used)
        if short > 0:
            exclude = set(exclude)
            victims = list(itertools.islice(
                (key for key, e in self.host_entries.items()
                 if e.ready and not e.busy and key not in exclude), short))  # fmt: skip
            for key in victims:
                if key in self.host_entries and num_blocks > self.host_capacity - self.host_used:
                    self.evict_host(key)
        return max(0, min(num_blocks, self.host_capacity - self.host_used))

    def evict_host(self, key: bytes) -> None:
        """Drop the host copy of ``key`` (ready and unlocked); its page loses the HOST bit."""
        entry = self.host_entries.pop(key)
        self.host.discard([key])
        self.undisked.pop(key, None)
        if entry.dropped:
            return
        located = entry.ref.resolve()
        if located is not None:
            node, index = located
            if not node.on_device and not int(node.tiers[index]) & _DISK:
                self.lost_blocks += 1
            self.trie.clear_tier(node, index, Tier.HOST)

    def add_host(self, key: bytes, namespace: bytes, node: Node, index: int, *, ready: bool) -> None:
        """Record a host copy of page ``index`` of ``node`` (pending until ``host_done``)."""
        entry = self.host_entries.get(key)
        if entry is not None and entry.dropped:  # same key, same content: adopt the old copy
            entry.dropped = False
            entry.ref = PageRef(node, index)
        elif entry is None:
            self.host_entries[key] = HostEntry(namespace, PageRef(node, index), ready)
        self.trie.set_tier(node, index, Tier.HOST)
        if not int(node.tiers[index]) & _DISK:
            self.undisked[key] = None

    def host_done(self, key: bytes) -> None:
        """A pending copy of ``key`` finished: ready if the host tier holds it, else forgotten."""
        entry = self.host_entries.get(key)
        if entry is None or entry.ready:
            return
        if self.host.contains(key):
            entry.ready = True
            self.release_host(key, 0)
            return
        del self.host_entries[key]
        self.undisked.pop(key, None)
        located = None if entry.dropped else entry.ref.resolve()
        if located is not None:
            self.trie.clear_tier(*located, Tier.HOST)

    def hold_host(self, keys: Iterable[bytes]) -> None:
        """Mark ready host blocks as read by a transfer (not evictable until released)."""
        for key in keys:
            entry = self.host_entries[key]
            entry.busy += 1
            self.host_entries.move_to_end(key)  # a use: most recently used
            if key in self.undisked:
                self.undisked.move_to_end(key)

    def release_host(self, key: bytes, count: int = 1) -> None:
        """End ``count`` transfers reading ``key``; a dropped entry goes with the last one."""
        entry = self.host_entries.get(key)
        if entry is None:
            return
        entry.busy -= count
        if entry.dropped and not entry.busy and entry.ready:
            del self.host_entries[key]
            self.host.discard([key])

    # --- disk ------------------------------------------------------------------------------

    def add_disk(self, key: bytes, namespace: bytes, node: Node, index: int) -> None:
        """Record a disk copy of page ``index`` of ``node`` (the disk tier holds it)."""
        self.disk_entries[(namespace, key)] = PageRef(node, index)
        self.trie.set_tier(node, index, Tier.DISK)
        self.undisked.pop(key, None)

    def forget_disk(self, key: bytes, namespace: bytes) -> None:
        """The disk tier no longer holds ``key``: clear its page's DISK bit."""
        ref = self.disk_entries.pop((namespace, key), None)
        located = None if ref is None else ref.resolve()
        if located is not None:
            self.trie.clear_tier(*located, Tier.DISK)
            if self.host_state(key) is not None:
                self.undisked[key] = None

    def has_unindexed_disk_blocks(self) -> bool:
        """Whether the disk holds blocks no trie page indexes (from a previous process, or
        whose pages left the trie): only then is a lookup by key worth its hashing."""
        return self.disk is not None and len(self.disk) > len(self.disk_entries)

    def probe_disk(self, ns: Namespace, buf: bytes, end: int, matched: list[tuple[Node, int]],
                   now: float) -> list[tuple[Node, int]]:  # fmt: skip
        """Extend a trie walk of ``buf[:end]`` (``matched``) by the next pages that the disk
        holds under their chained keys: they join the trie as an off-device node (DISK)."""
        trie, page_bytes, page_size = self.trie, self.trie.page_bytes, self.trie.page_size
        start = sum(k for _, k in matched) * page_bytes
        parent_key = trie.page_keys(matched[-1][0])[matched[-1][1] - 1] if matched else None
        digest, keys, pos = ns.digest(), [], start
        while pos + page_bytes <= end:
            page = np.frombuffer(buf, "<i4", page_size, pos)
            [key] = chained_block_keys(page, page_size, ns, parent_key)
            if not self.disk.contains(key, digest):
                break
            keys.append(key)
            parent_key, pos = key, pos + page_bytes
        if not keys:
            return matched
        if matched and matched[-1][1] < matched[-1][0].num_pages:
            node, k = matched[-1]
            matched[-1] = (trie.split(node, k), k)
        parent = matched[-1][0] if matched else trie.root(ns, create=True)
        node = trie.insert_offloaded(parent, buf[start:pos], np.full(len(keys), _DISK, np.uint8), now)
        node.keys = keys
        for i, key in enumerate(keys):
            self.disk_entries[(digest, key)] = PageRef(node, i)
        return matched + [(node, len(keys))]

    def reconcile_disk(self) -> int:
        """Clear the DISK bit of every page whose block the disk tier dropped; return count."""
        gone = [(ns, key) for (ns, key) in self.disk_entries if not self.disk.contains(key, ns)]
        for ns, key in gone:
            self.forget_disk(key, ns)
        return len(gone)

    # --- pages leaving the trie ------------------------------------------------------------

    def _on_split(self, head: Node) -> None:
        keys = self.trie.page_keys(head)
        namespace = None
        for index, bits in enumerate(head.tiers.tolist()):
            if bits & _HOST:
                entry = self.host_entries.get(keys[index])
                if entry is not None and not entry.dropped:
                    entry.ref = PageRef(head, index)
            if bits & _DISK:
                namespace = namespace or self.trie.namespace_of(head).digest()
                self.disk_entries[(namespace, keys[index])] = PageRef(head, index)

    def _on_drop(self, node: Node) -> None:
        keys = self.trie.page_keys(node)
        namespace = None
        for index, key in enumerate(keys):
            bits = int(node.tiers[index])
            if bits & _HOST:
                entry = self.host_entries.get(key)
                if entry is not None and not entry.dropped:
                    self.undisked.pop(key, None)
                    if entry.busy or not entry.ready:
                        entry.dropped = True
                    else:
                        del self.host_entries[key]
                        self.host.discard([key])
            if bits & _DISK:
                namespace = namespace or self.trie.namespace_of(node).digest()
                self.disk_entries.pop((namespace, key), None)  # stays on disk, unindexed
