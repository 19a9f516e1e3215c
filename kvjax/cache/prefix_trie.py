"""Prefix trie: a radix trie over page-sized chunks of token ids, one root per namespace.

Each node covers a run of whole pages (a compressed edge). Its ``label`` holds the pages'
token ids as little-endian int32 bytes, so a lookup compares a whole edge with one
``bytes.startswith`` (a memcmp) and never hashes a page; exact comparison also means a match
can never be a false positive. Children are keyed by the bytes of their first page.

Per-node fields (locks, pins, heat, tiers) are described in ``kvjax.cache.trie_node``.

Invariants (``check_invariants`` verifies them all):
- closure: a node's lock count, hard pins and soft-pin expiry are never above its parent's,
  and a node on device has a parent on device, because every sequence and every pin holds a
  whole path from the root. So every unlocked, unpinned device page can be reached by
  evicting leaves, and ``num_evictable`` is exactly what eviction can free.
- a node is either wholly on device (``on_device``: every page has a block) or wholly off
  it (a host/disk copy of every page remains); splits keep that true.
- split(node, k) keeps the original object as the DEEPER part, so whoever remembers the
  deepest node of its path (a sequence handle, a pin) still reaches the whole path by
  walking parents.
- lossy pages (``Node.lossy``): a device page is lossy when its KV was fetched from a lossy
  copy; with ``lossy_offload`` (the tiers' codec is lossy) every page off device is lossy,
  since each of its copies is. Splits, extensions and truncations keep each page's flag;
  ``attach`` and ``replace`` (an exact recompute taking over an unlocked lossy device copy)
  set it from the new blocks.
- every page with a HOST or DISK bit is findable by its stable key (``locate``): the trie
  keeps that map itself through splits and drops, so the tier layer names pages by key.

Nothing here calls out. Operations that drop pages with host/disk copies from the trie
(``evict_tail``, ``clear_tier``) return them as ``DroppedNode`` records; the tier layer
that owns those copies acts on the records (see ``kvjax.tiers.kv_cache``).
"""

from __future__ import annotations

import dataclasses
import heapq
import itertools
from collections.abc import Callable, Iterator

import numpy as np

from kvjax.cache.allocator import BLOCK_DTYPE
from kvjax.cache.block_keys import Namespace, chained_block_keys
from kvjax.cache.eviction import EvictionPolicy, EvictionQueue
from kvjax.cache.trie_node import LOWER_TIERS, Node, Tier

__all__ = ["DroppedNode", "Node", "PrefixTrie", "Tier"]


_NO_BLOCKS = np.zeros(0, BLOCK_DTYPE)


@dataclasses.dataclass(frozen=True, slots=True)
class DroppedNode:
    """Pages that left the trie while a host or disk copy of some of them existed."""

    namespace: Namespace
    keys: list[bytes]  # stable keys of the node's pages, in order
    tiers: np.ndarray  # uint8 [len(keys)]: the Tier bits each page had (HOST/DISK matter)


class PrefixTrie:
    """Radix trie of cached pages plus the evictable-leaf queue of one eviction policy."""

    def __init__(self, page_size: int, policy: EvictionPolicy, clock: Callable[[], float]):
        self.page_size = page_size
        self.page_bytes = 4 * page_size
        self.policy = policy  # bound by the owner (see EvictionPolicy.bind)
        self.queue = EvictionQueue(policy)
        self.clock = clock
        self.num_evictable = 0  # device pages in unlocked, unpinned nodes
        self.num_nodes = 0  # excluding roots
        self.evicted_pages = 0  # pages that lost their device copy
        self.offloaded_pages = 0  # ... of which a host/disk copy remains in the trie
        self.dropped_pages = 0  # pages removed from the trie entirely
        self.lossy_offload = False  # lower-tier copies are lossy: pages leaving the device become lossy
        self._lower: dict[bytes, Node] = {}  # key of a page with a HOST/DISK bit -> its node
        self._roots: dict[Namespace, Node] = {}
        self._soft: list[tuple[float, int, Node]] = []  # heap of soft-pin expiries
        self._order = itertools.count()

    # --- lookup ----------------------------------------------------------------------------

    def root(self, namespace: Namespace, *, create: bool) -> Node | None:
        root = self._roots.get(namespace)
        if root is None and create:
            root = Node(None, b"", memoryview(b""), _NO_BLOCKS, None, 0, True, 0.0)
            root.namespace = namespace
            self._roots[namespace] = root
        return root

    def walk(self, node: Node, buf: bytes, start: int, end: int) -> list[tuple[Node, int]]:
        """Nodes below ``node`` matching ``buf[start:end]``, each with its matched page count.

        Every node but the last is matched whole; the last may be matched partly.
        """
        page_bytes = self.page_bytes
        path = []
        while start < end:
            child = node.children.get(buf[start : start + page_bytes])
            if child is None:
                break
            label = child.label
            if buf.startswith(label, start, end):
                path.append((child, len(child.blocks)))
                start += len(label)
                node = child
                continue
            path.append((child, self._common_pages(label, buf, start, end)))
            break
        return path

    # --- structure -------------------------------------------------------------------------

    def split(self, node: Node, num_head_pages: int) -> Node:
        """Cut ``node`` after ``num_head_pages``; return the new head, ``node`` keeps the rest."""
        cut = num_head_pages * self.page_bytes
        parent = node.parent
        head = Node(parent, node.key, _compact(node.label[:cut]), node.blocks[:num_head_pages],
                    None, node.first_page, node.on_device, node.last_access)  # fmt: skip
        for field in ("lock", "hard_pins", "soft_until", "soft_pinned", "hits"):
            setattr(head, field, getattr(node, field))
        node.key = bytes(node.label[cut : cut + self.page_bytes])
        node.label = _compact(node.label[cut:])
        node.blocks = node.blocks[num_head_pages:]
        if node.tiers is not None:
            head.tiers, node.tiers = node.tiers[:num_head_pages], node.tiers[num_head_pages:]
        if node.lossy is not None:
            head.lossy, node.lossy = node.lossy[:num_head_pages], node.lossy[num_head_pages:]
        node.first_page += num_head_pages
        if node.keys is not None:
            head.keys, node.keys = node.keys[:num_head_pages], node.keys[num_head_pages:] or None
        head.children[node.key] = node
        head.num_device_children = int(node.on_device)
        parent.children[head.key] = head
        node.parent = head
        self.num_nodes += 1
        if head.soft_pinned:
            heapq.heappush(self._soft, (head.soft_until, next(self._order), head))
        if head.tiers is not None:
            for index in np.flatnonzero(head.tiers & LOWER_TIERS):
                self._lower[head.keys[index]] = head
        return head

    def insert(self, parent: Node, label: memoryview, blocks: np.ndarray, now: float, *,
               lossy: bool = False) -> Node:  # fmt: skip
        """Add a device node under ``parent``, locked once (by the sequence that holds ``parent``).

        ``label`` may be a view of the caller's token bytes: slicing it later costs nothing.
        ``lossy``: the blocks hold KV fetched from a lossy copy.
        """
        node = Node(parent, bytes(label[: self.page_bytes]), label, blocks, None,
                    parent.first_page + parent.num_pages, True, now)  # fmt: skip
        node.lossy = np.ones(len(blocks), bool) if lossy else None
        node.lock = 1
        parent.children[node.key] = node
        parent.num_device_children += 1
        self.num_nodes += 1
        return node

    def insert_offloaded(self, parent: Node, label: bytes, tiers: np.ndarray, now: float, *,
                         keys: list[bytes] | None = None) -> Node:  # fmt: skip
        """Add an unlocked off-device node under ``parent`` whose pages have only the copies in
        ``tiers`` (uint8 HOST/DISK bits, one per page): a prefix found in a lower tier by key
        (``keys``: its pages' keys, when the caller has them)."""
        node = Node(parent, bytes(label[: self.page_bytes]), memoryview(label),
                    np.full(len(tiers), -1, BLOCK_DTYPE), np.array(tiers, np.uint8),
                    parent.first_page + parent.num_pages, False, now)  # fmt: skip
        node.lossy = np.ones(len(tiers), bool) if self.lossy_offload else None
        parent.children[node.key] = node
        self.num_nodes += 1
        node.keys = keys
        for key in self.page_keys(node):
            self._lower[key] = node
        return node

    def can_extend(self, node: Node) -> bool:
        """Whether new pages may join ``node`` in place: a device leaf held by one sequence only
        (DeviceIndex also asks that the sequence inserted it: pages never join a node it hit)."""
        return (node.parent is not None and node.lock == 1 and not node.children
                and node.hard_pins == 0 and not node.soft_pinned)  # fmt: skip

    def extend(self, node: Node, label: memoryview, blocks: np.ndarray, now: float, *,
               lossy: bool = False) -> None:  # fmt: skip
        if node.lossy is not None or lossy:
            node.lossy = np.concatenate((node.page_lossy(), np.full(len(blocks), lossy)))
        node.label = memoryview(bytes(node.label) + label)
        node.blocks = np.concatenate((node.blocks, blocks))
        if node.tiers is not None:
            node.tiers = np.concatenate((node.tiers, np.full(len(blocks), Tier.DEVICE, np.uint8)))
        node.last_access = now

    def attach(self, node: Node, blocks: np.ndarray, now: float, *, lossy: bool = False) -> None:
        """Give an off-device node device blocks again, locked once by the attaching sequence;
        its pages are as lossy as the KV the blocks hold (``lossy``)."""
        node.blocks = np.array(blocks, BLOCK_DTYPE)
        node.lossy = np.ones(len(blocks), bool) if lossy else None
        node.tiers = node.tiers | np.uint8(Tier.DEVICE)
        node.on_device = True
        node.lock = 1
        node.last_access = now
        node.parent.num_device_children += 1

    def replace(self, node: Node, blocks: np.ndarray, now: float) -> np.ndarray:
        """Make ``blocks`` (exact KV) the device copy of the unlocked device node ``node``,
        locked once by the sequence that holds them (as ``attach``); return the blocks it had,
        which the trie no longer references. Host/disk copies and their bits stay as they are."""
        if not node.on_device or node.lock or len(blocks) != node.num_pages:
            raise RuntimeError(f"node at page {node.first_page} ({node.on_device=}, {node.lock=}, "
                               f"{node.num_pages} pages) cannot take {len(blocks)} new blocks")  # fmt: skip
        self.lock(node, whole_path=False)  # leaves the evictable count if it was in it
        old, node.blocks = node.blocks, np.array(blocks, BLOCK_DTYPE)
        node.lossy = None
        node.last_access = now
        return old

    def mark_descendants_lossy(self, node: Node) -> None:
        """Flag every page below ``node`` lossy: KV computed over its pages (or fetched as
        lossy copies) while they were lossy, which an exact copy of ``node`` does not make exact."""
        stack = list(node.children.values())
        while stack:
            below = stack.pop()
            below.lossy = np.ones(len(below.blocks), bool)
            stack.extend(below.children.values())

    # --- locks, heat and pins --------------------------------------------------------------

    def lock(self, node: Node, now: float | None = None, *, whole_path: bool = True) -> None:
        """Lock ``node`` (and its ancestors); with ``now``, also count a hit on each."""
        while node.parent is not None:
            if self.is_candidate(node):
                self.num_evictable -= len(node.blocks)
            node.lock += 1
            if now is not None:
                node.hits += 1
                node.last_access = now
            if not whole_path:
                return
            node = node.parent

    def unlock(self, node: Node, now: float) -> None:
        """Undo ``lock(node)``. ValueError (nothing changed) if a node on the path is unlocked."""
        self._require_path(node, "lock", "is not locked")
        self._decrement_path(node, "lock", now)

    def hard_pin(self, node: Node) -> None:
        while node.parent is not None:
            if self.is_candidate(node):
                self.num_evictable -= len(node.blocks)
            node.hard_pins += 1
            node = node.parent

    def hard_unpin(self, node: Node, now: float) -> None:
        self._require_path(node, "hard_pins", "is not pinned")
        self._decrement_path(node, "hard_pins", now)

    def soft_pin(self, node: Node, until: float) -> None:
        """Keep ``node``'s path on device until clock time ``until`` (seconds)."""
        while node.parent is not None:
            if self.is_candidate(node):
                self.num_evictable -= len(node.blocks)
            # a new pin always gets an expiry (an expired pin left its old, maybe later, time: after
            # the clock stepped back, or before time 0, a pin never expired)
            if until > node.soft_until or not node.soft_pinned:
                node.soft_until = max(node.soft_until, until) if node.soft_pinned else until
                heapq.heappush(self._soft, (node.soft_until, next(self._order), node))
            node.soft_pinned = True
            node = node.parent

    def expire_soft_pins(self, now: float) -> None:
        """Release the soft pins whose expiry time is ``<= now`` (lazy: the cache calls this
        before it allocates, evicts or pins)."""
        soft = self._soft
        while soft and soft[0][0] <= now:
            _, _, node = heapq.heappop(soft)
            if node.soft_pinned and node.soft_until <= now and node.parent is not None:
                node.soft_pinned = False
                if self.is_candidate(node):
                    self._became_candidate(node, now)

    # --- eviction --------------------------------------------------------------------------

    def is_evictable_leaf(self, node: Node) -> bool:
        return (node.num_device_children == 0 and node.parent is not None
                and self.is_candidate(node))  # fmt: skip

    def prepare_eviction(self, now: float) -> None:
        """Call before a run of ``pop_victim``: a policy whose order drifts with time
        (``time_invariant`` False) is re-ranked at ``now``."""
        if not self.policy.time_invariant:
            self.queue.rebuild([n for n in self.nodes() if self.is_evictable_leaf(n)], now)

    def pop_victim(self) -> Node | None:
        """The evictable leaf the policy ranks first, taken off the queue (None if none).
        Evict from it with ``evict_tail``; a leaf not evicted must be pushed back
        (``requeue``)."""
        return self.queue.pop(self.is_evictable_leaf)

    def requeue(self, node: Node, now: float) -> None:
        """Put back a leaf ``pop_victim`` returned and the caller did not evict."""
        if self.is_evictable_leaf(node):
            self.queue.push(node, now)

    def evict_tail(self, node: Node, num_pages: int, now: float, *, keep_without_copy: int = 0,
                   offloaded_keys: list[bytes] | None = None,
                   ) -> tuple[np.ndarray, list[tuple[bytes, int]], list[DroppedNode]]:  # fmt: skip
        """Take the last ``num_pages`` device pages of the evictable leaf ``node``.

        Pages with a HOST or DISK copy stay indexed, off device, up to the first one without
        a copy: that page and everything after it leave the trie. ``keep_without_copy``
        (write-back): up to that many leaving pages without a copy get a HOST bit now, a copy
        the caller promises to make, so they stay indexed too.

        Returns (block ids no longer the trie's, ``(key, block)`` of each page given a HOST
        bit, the nodes that left the trie with host/disk copies). The keys of every page that
        stayed indexed off device are appended to ``offloaded_keys`` when it is given.
        """
        if not 0 < num_pages <= len(node.blocks) or not self.is_evictable_leaf(node):
            raise RuntimeError(f"cannot evict {num_pages} pages of node at page {node.first_page} "
                               f"({len(node.blocks)} pages, evictable leaf: {self.is_evictable_leaf(node)})")  # fmt: skip
        kept = self._keep_leaving(node, num_pages, keep_without_copy) if keep_without_copy else []
        self.num_evictable -= num_pages
        self.evicted_pages += num_pages
        keep = len(node.blocks) - num_pages
        if node.tiers is None and keep:  # device only, partly evicted: cut in place, no split
            blocks = node.blocks[keep:]
            dropped = self._truncate(node, keep)
            self.queue.push(node, now)  # still an evictable leaf; its tail page changed
            return blocks, kept, dropped
        if keep:
            self.split(node, keep)
        blocks, parent = node.blocks, node.parent
        if node.tiers is None:
            copied = 0
        else:  # pages up to the first one without a host/disk copy stay, off device
            has_copy = (node.tiers & LOWER_TIERS) != 0
            copied = num_pages if has_copy.all() else int(np.argmin(has_copy))
        dropped, survivor = [], None
        if 0 < copied < num_pages:
            survivor = self.split(node, copied)
            dropped = self._drop(node)
        elif copied == num_pages:
            survivor = node
        else:
            dropped = self._drop(node)
        if survivor is not None:
            self._offload(survivor)
            if offloaded_keys is not None:
                offloaded_keys += self.page_keys(survivor)
        if parent.parent is not None and self.is_evictable_leaf(parent):
            self.queue.push(parent, now)
        return blocks, kept, dropped

    def _keep_leaving(self, node: Node, num_pages: int, budget: int) -> list[tuple[bytes, int]]:
        """HOST bits for the leading leaving pages of ``node`` that have no copy (at most
        ``budget``), stopping at the first one the budget cannot cover."""
        first = len(node.blocks) - num_pages
        tiers = node.page_tiers()
        missing = [i for i in range(first, len(node.blocks)) if not tiers[i] & LOWER_TIERS][:budget]
        if not missing:
            return []
        keys = self.page_keys(node)
        node.tiers = tiers
        kept = []
        for index in missing:
            tiers[index] |= np.uint8(Tier.HOST)
            self._lower[keys[index]] = node
            kept.append((keys[index], int(node.blocks[index])))
        return kept

    def set_tier(self, node: Node, page: int, tier: Tier) -> None:
        """Record a host or disk copy of page ``page`` of ``node``."""
        node.tiers = node.page_tiers()
        node.tiers[page] |= np.uint8(tier)
        self._lower[self.page_keys(node)[page]] = node
        if page == len(node.blocks) - 1 and self.is_evictable_leaf(node):
            self.queue.push(node, self.clock())  # the policy may rank it differently now

    def clear_tier(self, node: Node, page: int, tier: Tier) -> list[DroppedNode]:
        """Forget a host or disk copy; an off-device page left with no copy leaves the trie,
        and so do the pages after it (they are unreachable without it): returned as records."""
        if node.tiers is None:
            return []  # device only: no host/disk copy to forget
        node.tiers[page] &= np.uint8(~tier & 0xFF)
        if not node.tiers[page] & LOWER_TIERS and node.keys is not None and page < len(node.keys):
            if self._lower.get(node.keys[page]) is node:
                del self._lower[node.keys[page]]
        if not node.on_device and node.tiers[page] == 0:
            if page:
                self.split(node, page)
            return self._drop(node)
        if page == len(node.blocks) - 1 and self.is_evictable_leaf(node):
            self.queue.push(node, self.clock())  # ranked with the copy it had: rank it again (as set_tier)
        return []

    def locate(self, key: bytes) -> tuple[Node, int] | None:
        """(node, index in node) of the page with a host/disk copy whose key is ``key``, or None."""
        node = self._lower.get(key)
        if node is None:
            return None
        return node, node.keys.index(key)

    def page_depth(self, key: bytes) -> int | None:
        """Index in its sequence of the page ``locate(key)`` finds (None: not indexed)."""
        located = self.locate(key)
        return None if located is None else located[0].first_page + located[1]

    # --- stable keys and traversal ---------------------------------------------------------

    def page_keys(self, node: Node) -> list[bytes]:
        """Stable 16-byte chained keys of ``node``'s pages (see block_keys), computed once."""
        keys = node.keys or []
        if len(keys) < len(node.blocks):
            if keys:
                parent_key = keys[-1]
            elif node.parent.parent is None:
                parent_key = None
            else:
                parent_key = self.page_keys(node.parent)[-1]
            rest = np.frombuffer(node.label, "<i4")[len(keys) * self.page_size :]
            keys = keys + chained_block_keys(rest, self.page_size, self.namespace_of(node), parent_key)
            node.keys = keys
        return keys

    def parent_key(self, node: Node, index: int) -> bytes | None:
        """Key of the page before page ``index`` of ``node`` (None before a sequence's first page)."""
        if index:
            return self.page_keys(node)[index - 1]
        return None if node.parent.parent is None else self.page_keys(node.parent)[-1]

    def namespace_of(self, node: Node) -> Namespace:
        """The namespace of the root above ``node``."""
        while node.parent is not None:
            node = node.parent
        return node.namespace

    def nodes(self) -> Iterator[Node]:
        """Every live non-root node, parents before children."""
        stack = list(self._roots.values())
        while stack:
            node = stack.pop()
            stack.extend(node.children.values())
            if node.parent is not None:
                yield node

    def roots(self) -> dict[Namespace, Node]:
        return self._roots

    def check_invariants(self) -> np.ndarray:
        """Raise RuntimeError on any broken structural invariant; return all device block ids.

        Per node: linked under its first page, label length, page offsets, DEVICE bits vs
        block ids, no page without a copy, a lossy flag per page (every page off device
        lossy when the lower-tier copies are), device-children count, device pages only
        below device pages, locked/pinned nodes still on device, locks and pins never above
        the parent's, every page with a host/disk copy findable by key. Then: node count,
        ``num_evictable`` equal to the unlocked unpinned device pages, every evictable leaf
        findable in the eviction queue, no block backing two pages, no stale key entry.
        """
        blocks, evictable, count, lower = [], 0, 0, 0
        for node in self.nodes():
            count += 1
            self._check_node(node)
            evictable += len(node.blocks) if self.is_candidate(node) else 0
            if node.on_device:
                blocks.append(node.blocks)
            if self.is_evictable_leaf(node) and node.heap_version < 0:
                raise RuntimeError(f"evictable leaf at page {node.first_page} is not in the queue")
            lower += 0 if node.tiers is None else int(np.count_nonzero(node.tiers & LOWER_TIERS))
        if (count, evictable) != (self.num_nodes, self.num_evictable):
            raise RuntimeError(f"counted {count} nodes, {evictable} evictable pages; "
                               f"trie says {self.num_nodes}, {self.num_evictable}")  # fmt: skip
        if lower != len(self._lower):
            raise RuntimeError(f"{len(self._lower)} keys indexed for {lower} pages with host/disk copies")
        device_blocks = np.concatenate(blocks) if blocks else np.zeros(0, BLOCK_DTYPE)
        if len(np.unique(device_blocks)) != len(device_blocks):
            raise RuntimeError("a device block backs two trie pages")
        return device_blocks

    # --- helpers ---------------------------------------------------------------------------

    def _common_pages(self, label: memoryview, buf: bytes, start: int, end: int) -> int:
        size = min(len(label), end - start)
        ours = np.frombuffer(label, np.uint8, size)
        theirs = np.frombuffer(buf, np.uint8, size, start)
        differ = np.flatnonzero(ours != theirs)
        return int(differ[0] if differ.size else size) // self.page_bytes

    def _check_node(self, node: Node) -> None:
        parent = node.parent
        where = f"node at page {node.first_page}"
        if parent.children.get(node.key) is not node or node.key != bytes(node.label[: self.page_bytes]):
            raise RuntimeError(f"{where} is not linked under its first page")
        if len(node.blocks) == 0 or len(node.label) != len(node.blocks) * self.page_bytes:
            raise RuntimeError(f"{where} has {len(node.blocks)} blocks for {len(node.label)} label bytes")
        if node.first_page != parent.first_page + len(parent.blocks):
            raise RuntimeError(f"{where} follows a parent ending at page {parent.first_page + len(parent.blocks)}")
        tiers = node.page_tiers()
        on_device = (tiers & Tier.DEVICE) != 0
        if not (on_device == node.on_device).all() or not ((node.blocks >= 0) == node.on_device).all():
            raise RuntimeError(f"{where}: blocks and DEVICE bits disagree with {node.on_device=}")
        if not node.on_device and (tiers == 0).any():
            raise RuntimeError(f"{where} keeps a page with no copy in any tier")
        if node.lossy is not None and (node.lossy.dtype != bool or len(node.lossy) != len(node.blocks)):
            raise RuntimeError(f"{where} has {len(node.lossy)} lossy flags for {len(node.blocks)} pages")
        if self.lossy_offload and not node.on_device and not node.page_lossy().all():
            raise RuntimeError(f"{where} is off device, where every copy is lossy, but a page is marked exact")
        if node.num_device_children != sum(c.on_device for c in node.children.values()):
            raise RuntimeError(f"{where} miscounts its device children")
        if node.on_device and not parent.on_device:
            raise RuntimeError(f"{where} is on device below an off-device parent")
        if (node.lock or node.hard_pins or node.soft_pinned) and not node.on_device:
            raise RuntimeError(f"{where} is locked or pinned but was evicted from device")
        if parent.parent is not None and (
            node.lock > parent.lock or node.hard_pins > parent.hard_pins
            or node.soft_pinned > parent.soft_pinned
            or (node.soft_pinned and node.soft_until > parent.soft_until)  # an unpinned node's time means nothing
        ):  # fmt: skip
            raise RuntimeError(f"{where} is locked or pinned more than its parent")
        if node.tiers is not None:
            for index in np.flatnonzero(node.tiers & LOWER_TIERS):
                if self.locate(node.keys[index]) != (node, index):
                    raise RuntimeError(f"{where}: page {index} has a host/disk copy but its key does not lead to it")

    @staticmethod
    def is_candidate(node: Node) -> bool:
        """On device, unlocked and unpinned: its pages count in ``num_evictable``."""
        return node.on_device and node.lock == 0 and node.hard_pins == 0 and not node.soft_pinned

    def _became_candidate(self, node: Node, now: float) -> None:
        self.num_evictable += len(node.blocks)
        if node.num_device_children == 0:
            self.queue.push(node, now)
            self._maybe_compact(now)

    def _require_path(self, node: Node, field: str, problem: str) -> None:
        if node.parent is None:
            raise ValueError("node is a root or no longer in the trie")
        walker = node
        while walker.parent is not None:
            if getattr(walker, field) <= 0:
                raise ValueError(f"node at page {walker.first_page} {problem}")
            walker = walker.parent

    def _decrement_path(self, node: Node, field: str, now: float) -> None:
        while node.parent is not None:
            setattr(node, field, getattr(node, field) - 1)
            if self.is_candidate(node):
                self._became_candidate(node, now)
            node = node.parent

    def _truncate(self, node: Node, num_pages: int) -> list[DroppedNode]:
        """Keep the first ``num_pages`` pages of the device-only ``node``; what followed
        leaves the trie. Returns the dropped nodes with host/disk copies."""
        dropped = []
        for child in list(node.children.values()):
            dropped += self._drop(child)  # off device (node is a device leaf) and unreachable now
        self.dropped_pages += len(node.blocks) - num_pages
        node.label = _compact(node.label[: num_pages * self.page_bytes])
        node.blocks = node.blocks[:num_pages]
        if node.keys is not None:
            node.keys = node.keys[:num_pages]
        if node.lossy is not None:
            node.lossy = node.lossy[:num_pages]
        return dropped

    def _offload(self, node: Node) -> None:
        node.on_device = False
        node.blocks = np.full(len(node.blocks), -1, BLOCK_DTYPE)
        node.tiers = node.tiers & np.uint8(LOWER_TIERS)
        if self.lossy_offload:  # only lossy copies remain
            node.lossy = np.ones(len(node.blocks), bool)
        node.parent.num_device_children -= 1
        self.offloaded_pages += len(node.blocks)

    def _drop(self, node: Node) -> list[DroppedNode]:
        """Remove ``node`` and everything below it; return those that had host/disk copies."""
        parent = node.parent
        del parent.children[node.key]
        parent.num_device_children -= int(node.on_device)
        stack, gone_nodes = [node], []
        while stack:
            gone_nodes.append(stack.pop())
            stack.extend(gone_nodes[-1].children.values())
        dropped = []
        namespace = None
        for gone in gone_nodes:  # before unlinking, so page_keys() still works
            if gone.tiers is not None and (gone.tiers & LOWER_TIERS).any():
                namespace = namespace or self.namespace_of(gone)
                keys = self.page_keys(gone)
                for index in np.flatnonzero(gone.tiers & LOWER_TIERS):
                    del self._lower[keys[index]]
                dropped.append(DroppedNode(namespace, keys, gone.tiers))
        for gone in gone_nodes:
            self.dropped_pages += len(gone.blocks)
            self.num_nodes -= 1
            gone.parent = None
            gone.on_device = False
        return dropped

    def _maybe_compact(self, now: float) -> None:
        # Stale entries pile up as nodes are locked and unlocked; rebuild when they dominate.
        if len(self.queue) > 4 * self.num_nodes + 1024:
            self.queue.rebuild([n for n in self.nodes() if self.is_evictable_leaf(n)], now)


def _compact(label: memoryview) -> memoryview:
    """Copy a label out of its request's token buffer once it is a small part of it.

    Labels are zero-copy views of the buffer that inserted them, so splits and evictions
    never copy token bytes; a view under a quarter of its buffer gets its own copy so a
    small surviving node does not keep a large prompt alive (amortised O(1) per byte).
    """
    if 4 * len(label) < label.obj.__len__():
        return memoryview(bytes(label))
    return label
