"""Which trie pages have a host or disk copy, kept in step with what the tiers hold.

The prefix trie records a page's copies as Tier bits and finds a page with a copy by its
stable key (``PrefixTrie.locate``); the host pool holds blocks in slots, the disk tier by
key. ``TierIndex`` owns the host side of that link, one entry per host key with its slot,
and the set of disk blocks the trie indexes. It is the one owner of each host block's slot,
LRU order and holds: the host pool is bytes only and the transfer engine never pins.

Rules it keeps:

* a page has the HOST bit exactly when the index has a live host entry for its key; the
  entry owns one host slot from the moment it is made; it is *pending* while the copy is
  being made (an offload or a restore in flight) and *ready* once the bytes are in the slot;
* a page has the DISK bit exactly when ``disk_entries`` holds its (namespace, key) and the
  disk tier holds the block (the disk tier may drop segments on its own when it writes;
  ``reconcile_disk`` clears the bits of what it dropped);
* ``undisked`` lists, LRU first, the host entries whose page has no disk copy: what a
  spill to disk writes;
* every new entry is preceded by ``make_host_room``, which evicts unheld, ready host entries
  (freeing their slots and clearing their HOST bits, so a page left without copies leaves
  the trie): copies whose page stays indexed without them first, then copies of pages that
  one cache of the device's and the host's blocks together would have evicted (``shadow``,
  a ``kvjax.tiers.shadow_cache.ShadowCache``), then by the eviction policy's rank;
* a page that leaves the trie (``forget_dropped``, fed the trie's ``DroppedNode`` records)
  drops its host copy (at the end of the transfer using it, if one does) and keeps its disk
  copy unindexed: a later lookup finds it again by key (``probe_disk``), as it finds what a
  previous process left in the directory;
* the disk tier counts every live host copy as a dependent of the page before it
  (``DiskTier.add_dependents``): a page is found only through its prefix, so a disk making
  room must not drop the last copy of a prefix whose next pages are on host, while blocks
  nothing depends on are there to go instead (a back-pressure spill used to evict the least
  recently used segment, often such a prefix, taking the host copies below it along).

Every host block that becomes live or stops being live is a block event (``events``).
"""

from __future__ import annotations

import collections
import heapq
import itertools
from collections.abc import Iterable

import numpy as np

from kvjax.cache.block_events import EventLog
from kvjax.cache.block_keys import Namespace, chained_block_keys
from kvjax.cache.prefix_trie import DroppedNode, PrefixTrie
from kvjax.cache.trie_node import Node, Tier
from kvjax.tiers.disk_tier import DiskTier
from kvjax.tiers.shadow_cache import ShadowCache

__all__ = ["HostEntry", "TierIndex"]

_HOST, _DISK = int(Tier.HOST), int(Tier.DISK)


class HostEntry:
    """One host block the index knows about (see the module docstring)."""

    __slots__ = ("namespace", "slot", "ready", "busy", "dropped", "handed", "source", "failed", "parent")

    def __init__(self, namespace: bytes, slot: int, ready: bool):
        self.namespace = namespace  # namespace digest
        self.slot = slot  # where the host pool keeps the block's bytes
        self.ready = ready  # the slot holds the block (not only a copy in flight)
        self.busy = 0  # transfers reading it (fetch, spill): never evicted meanwhile
        self.dropped = False  # its page left the trie; discard once no transfer reads it
        self.handed = False  # its slot was handed to another entry (see ``hand_over``)
        self.source: bytes | None = None  # the handed entry whose slot this one took
        self.failed = False  # its copy failed while transfers held it: it goes with the last release
        self.parent: bytes | None = None  # key of the page before it, a disk dependent while it is live


class TierIndex:
    """Host and disk bookkeeping of one trie; see the module docstring. ``host_slots``: the
    host pool's slots (0: no host tier); ``disk`` None: no disk tier."""

    def __init__(self, trie: PrefixTrie, host_slots: int, disk: DiskTier | None, events: EventLog):
        self.trie = trie
        self.disk = disk
        self.events = events
        self.host_capacity = host_slots  # blocks
        self._free_slots: list[int] = []  # freed slots, reused last-freed first
        self._fresh_slots = 0  # slots >= this were never handed out (free too)
        self.host_entries: collections.OrderedDict[bytes, HostEntry] = collections.OrderedDict()
        self.disk_entries: set[tuple[bytes, bytes]] = set()  # (namespace, key) the trie indexes
        # live host entries whose page has no disk copy, LRU first: what a spill writes
        self.undisked: collections.OrderedDict[bytes, None] = collections.OrderedDict()
        self.num_handed = 0  # entries whose slot another entry took (``hand_over``)
        self._handed: list[bytes] = []  # their keys, until ``settle_handed``
        self.lost_blocks = 0  # pages that left the trie when a host copy went (no copy of them or before them)
        # The victim order (see make_host_room), kept lazily: items (policy rank, -page depth,
        # filing order, key, entry, last use when filed), re-filed when popped if their page was
        # used since, dropped when popped if their copy is gone. Every live copy is in the first heap; a copy whose page
        # is on device or on disk too is also in the redundant heap, which goes first.
        self._by_use: list[tuple[float, int, int, bytes, HostEntry, float]] = []
        self._redundant: list[tuple[float, int, int, bytes, HostEntry, float]] = []
        self._filed = itertools.count()
        # The flat cache of device + host blocks whose evictions go first (None: no such
        # order, see make_host_room), and the keys of host copies of pages it evicted, in the
        # order it evicted them (checked lazily: stale keys are skipped when reached).
        self.shadow: ShadowCache | None = None
        self._doomed: collections.deque[bytes] = collections.deque()

    # --- host ------------------------------------------------------------------------------

    @property
    def host_used(self) -> int:
        """Host blocks held or reserved (pending copies included; an entry whose slot was
        handed over counts no more)."""
        return len(self.host_entries) - self.num_handed

    def host_state(self, key: bytes) -> HostEntry | None:
        """The live (not dropped) entry of ``key``, or None."""
        entry = self.host_entries.get(key)
        return None if entry is None or entry.dropped or entry.handed else entry

    def host_room(self, limit: int, exclude: Iterable[bytes] = ()) -> int:
        """How many of ``limit`` blocks ``make_host_room(limit, exclude)`` could fit now: free
        slots, then ready, unheld entries it may evict (none in ``exclude``; counted only as
        far as needed)."""
        free = self.host_capacity - self.host_used
        if free >= limit:
            return limit
        exclude = set(exclude)
        evictable = (1 for key, entry in self.host_entries.items()
                     if entry.ready and not entry.busy and not entry.handed and key not in exclude)  # fmt: skip
        return free + sum(itertools.islice(evictable, limit - free))

    def make_host_room(self, num_blocks: int, exclude: Iterable[bytes] = ()) -> int:
        """Evict ready, unheld host blocks (none in ``exclude``) until ``num_blocks`` more fit;
        return how many fit (<= num_blocks).

        Victims, in this order:

        1. host copies whose page stays indexed without them (on device or on disk too): free
           for the hit rate;
        2. (with a ``shadow``) copies of pages the shadow cache evicted and has not stored
           since, in the order it evicted them. Device and host together hit on what they hold
           between them, so they do best holding what one cache of their total size would: the
           shadow is that cache, without KV, under the cache's policy, fed every admission.
           The device policy's own rank judges host pages on the device's time scale, and a
           page fetched back from host is a miss to it: ranking by it alone held 2% fewer hits
           than one LRU cache of the same total size on the shared Mooncake trace (4% more
           with the shadow; ``bench_policies.py --tiered``);
        3. the others by the policy's rank of their page (``policy.priority`` of its trie node,
           when the copy was filed or its page was last used since), deepest first among equal
           ranks. Under ``lru`` (no shadow then) that rank is the page's last use, not when its
           host copy was made or read: a page hot on device for an hour and then evicted is as
           young on host, so device and host together keep the most recently used pages, as
           one LRU cache of their total size would.

        A page is never older than the pages after it (a use of them is a use of it), so in
        3. leaves go before the pages they hang from: dropping the copy of an off-device page
        without a disk copy drops every page after it too, since a page is found only through
        its prefix (the shadow evicts a page only with every page after it, too).
        """
        short = num_blocks - (self.host_capacity - self.host_used)
        if short > 0:
            for key in self._victims(short, exclude):
                if num_blocks <= self.host_capacity - self.host_used:
                    break
                if key in self.host_entries:  # an earlier eviction may have dropped it
                    self.evict_host(key)
        return max(0, min(num_blocks, self.host_capacity - self.host_used))

    def room_victims(self, num_blocks: int, exclude: Iterable[bytes] = ()) -> tuple[list[bytes], list[bytes]]:
        """(doomed, on disk): the host entries ``make_host_room(num_blocks, exclude)`` would
        evict whose page would then be in no tier (off device, no disk copy), what a disk
        write must save first; and those whose page, off device, keeps a disk copy, which
        that write must not evict to make its room. A page on device is in neither: it stays
        indexed without both copies, so the disk may give its block up for that write (else
        it could be left the last copy of a prefix to evict). Evicts nothing."""
        short = num_blocks - (self.host_capacity - self.host_used)
        if short <= 0:
            return [], []
        doomed, on_disk = [], []
        for key in self._victims(short, exclude):
            located = self.trie.locate(key)
            if located is None:
                continue
            node, index = located
            if node.on_device:
                continue  # stays indexed on device: neither copy below it is its last
            (on_disk if int(node.tiers[index]) & _DISK else doomed).append(key)
        return doomed, on_disk

    def _victims(self, short: int, exclude: Iterable[bytes]) -> list[bytes]:
        """Up to ``short`` evictable entries (ready, unheld, live, not in ``exclude``) in
        eviction order (see ``make_host_room``). Evicts nothing: the heaps and the shadow's
        queue only lose stale items, and the heaps re-file those used since they were filed."""
        exclude = set(exclude)
        chosen: dict[bytes, None] = {}
        for heap in (self._redundant, None, self._by_use):
            if heap is None:
                if self.shadow is not None:
                    self._shadow_victims(short, exclude, chosen)
                continue
            aside = []
            while len(chosen) < short and heap:
                item = heapq.heappop(heap)
                _, depth, _, key, entry, stamp = item
                if self.host_entries.get(key) is not entry or entry.dropped:
                    continue  # stale: that copy is gone
                if not entry.ready or entry.busy or entry.handed or key in exclude:
                    aside.append(item)
                    continue
                located = self.trie.locate(key)
                if located is not None:
                    node, index = located
                    redundant = self._redundant_copy(node, index)
                    if node.last_access > stamp:  # used since it was filed: file it anew
                        self._file(key, entry, node, index, redundant=heap is self._redundant)
                        if redundant and heap is self._by_use:  # on device again (recomputed)
                            self._file(key, entry, node, index, redundant=True)
                        continue
                    if heap is self._redundant and not redundant:
                        continue  # its page lost its other copy: the other heap has it
                aside.append(item)
                chosen.setdefault(key)
            for item in aside:
                heapq.heappush(heap, item)
        return list(chosen)

    def _shadow_victims(self, short: int, exclude: set[bytes], chosen: dict[bytes, None]) -> None:
        """Add to ``chosen`` (up to ``short`` in all) evictable host copies of pages the shadow
        cache evicted and has not stored since, in the order it evicted them."""
        doomed, shadow, entries = self._doomed, self.shadow, self.host_entries
        doomed.extend(key for key in shadow.take_evicted() if key in entries)
        aside = []
        while doomed and len(chosen) < short:
            key = doomed.popleft()
            entry = entries.get(key)
            if entry is None or entry.dropped or entry.handed or not shadow.evicted(key):
                continue  # gone, or the flat cache holds its page again
            aside.append(key)  # until it is evicted: make_host_room may stop short of it
            if entry.ready and not entry.busy and key not in exclude:
                chosen.setdefault(key)
        doomed.extendleft(reversed(aside))

    @staticmethod
    def _redundant_copy(node: Node, index: int) -> bool:
        """Whether page ``index`` of ``node`` stays indexed without its host copy."""
        return node.on_device or bool(int(node.tiers[index]) & _DISK)

    def _file(self, key: bytes, entry: HostEntry, node: Node, index: int, *, redundant: bool = False) -> None:
        """File ``key``'s host copy in the victim order (``redundant``: in the first heap)."""
        rank = self.trie.queue.policy.priority(node, self.trie.clock())
        item = (rank, -(node.first_page + index), next(self._filed), key, entry, node.last_access)
        heapq.heappush(self._redundant if redundant else self._by_use, item)
        if len(self._by_use) + len(self._redundant) > 4 * len(self.host_entries) + 1024:
            live = self.host_entries
            for heap in (self._by_use, self._redundant):  # drop stale items: memory stays O(entries)
                heap[:] = [it for it in heap if live.get(it[3]) is it[4] and not it[4].dropped]
                heapq.heapify(heap)

    def _take_slot(self, key: bytes) -> int:
        if self._free_slots:
            return self._free_slots.pop()
        if self._fresh_slots == self.host_capacity:
            raise RuntimeError(f"no free host slot for {key.hex()[:8]}: make_host_room must come first")
        self._fresh_slots += 1
        return self._fresh_slots - 1

    def slot_of(self, key: bytes) -> int:
        """The host slot of ``key``'s entry."""
        return self.host_entries[key].slot

    def evict_host(self, key: bytes) -> None:
        """Drop the host copy of ``key`` (ready and unheld); its page loses the HOST bit."""
        entry = self.host_entries.pop(key)
        self._free_slots.append(entry.slot)
        self.undisked.pop(key, None)
        if entry.dropped:
            return
        self._host_removed(key, entry)
        located = self.trie.locate(key)
        if located is not None:
            before = self.trie.dropped_pages  # the page and the pages after it may leave the trie
            self.forget_dropped(self.trie.clear_tier(*located, Tier.HOST))
            self.lost_blocks += self.trie.dropped_pages - before

    def add_host(self, key: bytes, namespace: bytes, node: Node, index: int, *, ready: bool) -> None:
        """Record a host copy of page ``index`` of ``node`` (pending until ``host_done``); a
        new entry takes a free slot (``make_host_room`` first)."""
        self._add_host(key, namespace, node, index, ready, None)

    def hand_over(self, source: bytes, key: bytes, namespace: bytes, node: Node, index: int) -> int:
        """A pending host copy of page ``index`` of ``node`` (``key``) in the slot of the host
        copy of ``source``, a page a fetch is bringing to the device now: that copy stays
        indexed (the fetch reads it) but takes no room, and leaves at ``settle_handed``.
        The caller writes the slot only after the fetch read it. Returns the slot."""
        entry = self.host_entries[source]
        entry.handed = True
        self.num_handed += 1
        self._handed.append(source)
        self.undisked.pop(source, None)  # never spilled: its slot is another page's now
        self._add_host(key, namespace, node, index, False, entry.slot)
        self.host_entries[key].source = source
        return entry.slot

    def settle_handed(self) -> None:
        """Host copies whose slot was handed over and that no transfer reads any more leave
        (their page is on device now, unless its fetch failed: then it leaves the trie)."""
        waiting = []
        for key in self._handed:
            entry = self.host_entries.get(key)
            if entry is None or not entry.handed:
                continue  # gone already (dropped and released)
            if entry.busy:
                waiting.append(key)
                continue
            del self.host_entries[key]
            self.num_handed -= 1
            self._host_removed(key, entry)
            located = self.trie.locate(key)
            if located is not None:
                before = self.trie.dropped_pages
                self.forget_dropped(self.trie.clear_tier(*located, Tier.HOST))
                self.lost_blocks += self.trie.dropped_pages - before
        self._handed = waiting

    def _add_host(self, key: bytes, namespace: bytes, node: Node, index: int, ready: bool, slot: int | None) -> None:
        entry = self.host_entries.get(key)
        if entry is not None and entry.handed:
            raise RuntimeError(f"host block {key.hex()[:8]}: its slot was handed over (check is_handed first)")
        if entry is not None and entry.dropped:  # same key, same content: adopt the old copy
            entry.dropped = entry.failed = False
        elif entry is None:
            slot = self._take_slot(key) if slot is None else slot
            self.host_entries[key] = entry = HostEntry(namespace, slot, ready)
        else:
            return  # live already
        self._file(key, entry, node, index)
        if self._redundant_copy(node, index):
            self._file(key, entry, node, index, redundant=True)
        if self.shadow is not None and self.shadow.evicted(key):
            self._doomed.append(key)
            if len(self._doomed) > 2 * self.host_capacity + 1024:  # drop stale keys: memory stays O(entries)
                live = self.host_entries
                self._doomed = collections.deque(k for k in self._doomed if k in live and self.shadow.evicted(k))
        self.trie.set_tier(node, index, Tier.HOST)
        if not int(node.tiers[index]) & _DISK:
            self.undisked[key] = None
        entry.parent = self.trie.parent_key(node, index)
        if entry.parent is not None and self.disk is not None:
            self.disk.add_dependents([entry.parent], namespace)
        if self.events.active:
            self.events.record(namespace, key, entry.parent, "host", "stored")

    def host_done(self, key: bytes, ok: bool) -> None:
        """A pending copy of ``key`` finished: ready if it succeeded (``ok``), else forgotten."""
        entry = self.host_entries.get(key)
        if entry is None or entry.ready:
            return
        if ok:
            entry.ready = True
            self.release_host(key, 0)
            return
        was_dropped = entry.dropped
        if entry.busy:  # held by transfers (none reads it: it is not ready): its slot stays theirs
            entry.dropped = entry.failed = True  # until the last releases it (freed at once, it was
        else:  # taken and written while still held: another page's KV in a slot a fetch reads)
            self._discard(key, entry)
        self.undisked.pop(key, None)
        if was_dropped:
            return
        self._host_removed(key, entry)
        located = self.trie.locate(key)
        if located is not None:
            self.forget_dropped(self.trie.clear_tier(*located, Tier.HOST))

    def is_handed(self, key: bytes) -> bool:
        """Whether ``key``'s host entry gave its slot away (no copy may be added meanwhile)."""
        entry = self.host_entries.get(key)
        return entry is not None and entry.handed

    def awaits_slot(self, key: bytes) -> bool:
        """Whether ``key``'s host entry took a handed slot that a fetch has not read yet: its
        bytes may go there only once that read is done (the copy it waits for writes them)."""
        entry = self.host_entries.get(key)
        return entry is not None and entry.source is not None and not entry.ready

    def is_adoptable(self, key: bytes) -> bool:
        """Whether ``key`` left the trie while a transfer still used its host copy: a new copy
        of it adopts that entry and its slot (``add_host``), taking no free slot."""
        entry = self.host_entries.get(key)
        return entry is not None and entry.dropped and not entry.handed

    def hold_host(self, keys: Iterable[bytes]) -> None:
        """Mark ready host blocks as read by a transfer (not evictable until released)."""
        for key in keys:
            entry = self.host_entries[key]
            entry.busy += 1
            located = self.trie.locate(key)
            if located is not None:  # a fetch or a spill: a device or disk copy once it is done
                self._file(key, entry, *located, redundant=True)
            if key in self.undisked:
                self.undisked.move_to_end(key)

    def release_host(self, key: bytes, count: int = 1) -> None:
        """End ``count`` transfers reading ``key``; a dropped entry goes with the last one."""
        entry = self.host_entries.get(key)
        if entry is None:
            return
        entry.busy -= count
        if entry.dropped and not entry.busy and (entry.ready or entry.failed):
            self._discard(key, entry)

    # --- disk ------------------------------------------------------------------------------

    def add_disk(self, key: bytes, namespace: bytes, node: Node, index: int) -> None:
        """Record a disk copy of page ``index`` of ``node`` (the disk tier holds it)."""
        self.disk_entries.add((namespace, key))
        self.trie.set_tier(node, index, Tier.DISK)
        self.undisked.pop(key, None)
        entry = self.host_state(key)
        if entry is not None:
            self._file(key, entry, node, index, redundant=True)

    def forget_disk(self, key: bytes, namespace: bytes) -> None:
        """The disk tier no longer holds ``key``: clear its page's DISK bit."""
        if (namespace, key) not in self.disk_entries:
            return
        self.disk_entries.discard((namespace, key))
        located = self.trie.locate(key)
        if located is not None:
            self.forget_dropped(self.trie.clear_tier(*located, Tier.DISK))
            if self.host_state(key) is not None:
                self.undisked[key] = None

    def disk_page(self, namespace: bytes, key: bytes) -> tuple[Node, int] | None:
        """(node, index) of the trie page of ``key``'s indexed disk copy now, or None."""
        return self.trie.locate(key) if (namespace, key) in self.disk_entries else None

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
        node = trie.insert_offloaded(parent, buf[start:pos], np.full(len(keys), _DISK, np.uint8), now, keys=keys)
        self.disk_entries.update((digest, key) for key in keys)
        return matched + [(node, len(keys))]

    def reconcile_disk(self) -> int:
        """Clear the DISK bit of every page whose block the disk tier dropped; return count."""
        dropped = self.disk.take_dropped()  # what the tier let go since: not every entry, each spill
        entries = self.disk_entries
        candidates = entries if dropped is None else [block for block in dropped if block in entries]
        gone = [(ns, key) for (ns, key) in candidates if not self.disk.contains(key, ns)]
        for ns, key in gone:
            self.forget_disk(key, ns)
        return len(gone)

    # --- checks ----------------------------------------------------------------------------

    def check_invariants(self, *, disk_exact: bool = True) -> None:
        """Raise RuntimeError unless HOST/DISK bits, host entries, disk entries and the tiers
        agree (see the module docstring). ``disk_exact`` False: a spill or restore is in
        flight, so the disk tier may lag its DISK bits."""
        slots = [entry.slot for entry in self.host_entries.values() if not entry.handed] + self._free_slots
        if sorted(slots) != list(range(self._fresh_slots)) or self._fresh_slots > self.host_capacity:
            raise RuntimeError(f"host slots leak or repeat: {len(self.host_entries)} entries, "
                               f"{len(self._free_slots)} freed, {self._fresh_slots} of {self.host_capacity} used")  # fmt: skip
        if self.disk is not None:
            self.disk.check_invariants()
        host_pages, disk_pages = self._check_page_tiers(disk_exact)
        live = {key for key, entry in self.host_entries.items() if not entry.dropped}
        if host_pages != live:
            raise RuntimeError(f"{len(host_pages ^ live)} host entries and HOST bits disagree")
        undisked = {key for key in live if not self._bits(key) & _DISK and not self.host_entries[key].handed}
        if set(self.undisked) != undisked:
            raise RuntimeError(f"{len(set(self.undisked) ^ undisked)} host blocks are misfiled as with/without "
                               "a disk copy")  # fmt: skip
        if disk_pages != self.disk_entries:
            raise RuntimeError(f"{len(disk_pages ^ self.disk_entries)} disk entries and DISK bits disagree")
        if self.disk is not None:
            dependents = collections.Counter((self.host_entries[key].namespace, self.host_entries[key].parent)
                                             for key in live if self.host_entries[key].parent is not None)  # fmt: skip
            if dependents != collections.Counter(self.disk.dependents()):
                raise RuntimeError("the disk counts other host copies as dependents than the live ones")
        if self.host_used > self.host_capacity:
            raise RuntimeError(f"host holds {self.host_used} blocks; capacity {self.host_capacity}")
        for key, entry in self.host_entries.items():
            if entry.dropped and not (entry.busy or not entry.ready):
                raise RuntimeError(f"host block {key.hex()[:8]} left the trie but was not discarded")

    def _bits(self, key: bytes) -> int:
        node, index = self.trie.locate(key)
        return int(node.tiers[index])

    def _check_page_tiers(self, disk_exact: bool) -> tuple[set, set]:
        """Every HOST/DISK bit is backed by an entry for that very page and, once ready, by the
        tier itself in the page's namespace. Returns (host keys, disk (ns, key)s) seen."""
        trie = self.trie
        host_pages, disk_pages = set(), set()
        for node in trie.nodes():
            if node.tiers is None:
                continue
            digest = trie.namespace_of(node).digest()
            keys = trie.page_keys(node)
            for i, bits in enumerate(node.tiers.tolist()):
                where = f"page {node.first_page + i} ({keys[i].hex()[:8]})"
                if bits & _HOST:
                    entry = self.host_entries.get(keys[i])
                    if entry is None or entry.dropped or trie.locate(keys[i]) != (node, i):
                        raise RuntimeError(f"{where} has the HOST bit but no host entry of its own")
                    if entry.namespace != digest:
                        raise RuntimeError(f"{where}: its host entry is in another namespace")
                    host_pages.add(keys[i])
                if bits & _DISK:
                    if (digest, keys[i]) not in self.disk_entries or trie.locate(keys[i]) != (node, i):
                        raise RuntimeError(f"{where} has the DISK bit but no disk entry of its own")
                    if disk_exact and not self.disk.contains(keys[i], digest):
                        raise RuntimeError(f"{where} has the DISK bit; the disk tier lost it")
                    disk_pages.add((digest, keys[i]))
        return host_pages, disk_pages

    # --- pages leaving the trie ------------------------------------------------------------

    def forget_dropped(self, dropped: list[DroppedNode]) -> None:
        """Pages that left the trie: their host copies go (once no transfer reads them), their
        disk copies stay on disk, unindexed."""
        for node in dropped:
            namespace = node.namespace.digest()
            for key, bits in zip(node.keys, node.tiers.tolist()):
                if bits & _HOST:
                    self._drop_host(key)
                if bits & _DISK:
                    self.disk_entries.discard((namespace, key))

    def _drop_host(self, key: bytes) -> None:
        entry = self.host_entries.get(key)
        if entry is None or entry.dropped:
            return
        self.undisked.pop(key, None)
        self._host_removed(key, entry)
        if entry.busy or not entry.ready:
            entry.dropped = True
        else:
            self._discard(key, entry)

    def _discard(self, key: bytes, entry: HostEntry) -> None:
        """Delete ``entry``; its slot is free again unless it was handed over, or unless it
        took a handed slot and its copy never wrote it (then the entry it was handed from
        takes it back: those bytes are still that page's, and its fetch may be reading them)."""
        del self.host_entries[key]
        source = None if entry.source is None or entry.ready else self.host_entries.get(entry.source)
        if entry.handed:
            self.num_handed -= 1
        elif source is not None and source.handed and source.slot == entry.slot:
            source.handed = False
            self.num_handed -= 1
            if not source.dropped and not self._bits(entry.source) & _DISK:
                self.undisked[entry.source] = None
        else:
            self._free_slots.append(entry.slot)

    def _host_removed(self, key: bytes, entry: HostEntry) -> None:
        """``key``'s host copy stops being live: an event, and the disk loses a dependent."""
        if entry.parent is not None and self.disk is not None:
            self.disk.remove_dependents([entry.parent], entry.namespace)
        entry.parent = None
        if self.events.active:
            self.events.record(entry.namespace, key, None, "host", "removed")

    def promised_dependents(self, keys: Iterable[bytes]) -> list[tuple[bytes, bytes]]:
        """Count the pages of ``keys`` (in the trie: HOST bits whose copies are yet to be made,
        as write-back promises them) as disk dependents of the pages before them, until
        ``release_promised`` of what this returns: making room for their copies must not
        drop the last copy of their prefix either."""
        promised = []
        if self.disk is not None:
            for key in keys:
                located = self.trie.locate(key)
                parent = None if located is None else self.trie.parent_key(*located)
                if parent is not None:
                    promised.append((self.trie.namespace_of(located[0]).digest(), parent))
            for namespace, parent in promised:
                self.disk.add_dependents([parent], namespace)
        return promised

    def release_promised(self, promised: list[tuple[bytes, bytes]]) -> None:
        for namespace, parent in promised:
            self.disk.remove_dependents([parent], namespace)

    def release_dependents(self) -> None:
        """The host tier goes (its cache closes): the disk, which may outlive it, no longer
        counts its copies as dependents."""
        for entry in self.host_entries.values():
            if entry.parent is not None and not entry.dropped and self.disk is not None:
                self.disk.remove_dependents([entry.parent], entry.namespace)
            entry.parent = None
