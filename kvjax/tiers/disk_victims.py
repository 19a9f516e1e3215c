"""The order in which a disk tier evicts its segments: blocks nothing depends on first.

A page is found only through its prefix (its key chains its parent's, and a lookup walks
the trie from the root, probing the disk page by page), so a disk block's copy may be all
that keeps pages after it reachable: other disk blocks naming it as their parent, and
copies elsewhere (the host tier's) of pages whose parent it is. Dropping it drops those
too, copied for nothing. Least recently used alone would drop it as readily as a leaf:
spills go down a prefix before the pages after it, so its segment is often the oldest.

``VictimOrder`` ranks segments (a disk tier's unit of eviction; one block each for a tier
that evicts blocks) by what evicting one costs beyond its own blocks, then by least recent
use:

0. no block of it has a dependent outside it: its loss costs nothing else;
1. a block of it has dependents held elsewhere only (``hold``): the deepest disk copy of
   a prefix whose next pages are on host;
2. a block of it has a child block in another segment: that child's segment goes first.

A dependent in the same segment leaves with it, so a segment holding a whole chain is a
leaf. Ranks follow every change at once (evicting a child's segment can make its parent's
a leaf), so along a chain spread over segments eviction goes deepest first; only blocks
whose chains cross between segments both ways (a-c in one segment, b in another) leave no
order without a loss, and go least recently used first. Every change costs O(log n)
(a heap of ``(rank, last use, segment)`` with stale entries skipped and compacted away);
nothing walks the trie or every segment.

Not thread-safe: the disk tier calls it under its index lock.
"""

from __future__ import annotations

import collections
import heapq
import itertools
from collections.abc import Callable, Hashable

__all__ = ["VictimOrder"]

Block = Hashable  # (namespace, key) of a block; a parent is named the same way


class _Segment:
    __slots__ = ("outer", "held", "stamp")

    def __init__(self, stamp: int):
        self.outer = 0  # its blocks with a child block in another segment
        self.held = 0  # its blocks with dependents held elsewhere
        self.stamp = stamp  # last use (larger: more recent)

    @property
    def rank(self) -> int:
        return 2 if self.outer else 1 if self.held else 0


class VictimOrder:
    """Segments in eviction order (see the module docstring)."""

    def __init__(self):
        self._segments: dict[str, _Segment] = {}
        self._where: dict[Block, str] = {}  # held block -> its segment
        self._parent: dict[Block, Block] = {}  # held block -> its parent (when known)
        self._children: dict[Block, collections.Counter[str]] = {}  # parent -> segments of its held children
        self._num_children: collections.Counter[Block] = collections.Counter()
        self._holds: collections.Counter[Block] = collections.Counter()  # dependents held elsewhere
        self._heap: list[tuple[int, int, str]] = []
        self._clock = itertools.count()

    # --- segments and blocks ---------------------------------------------------------------

    def add_segment(self, name: str) -> None:
        """A new segment, used now (its blocks follow with ``add_block``)."""
        self._segments[name] = segment = _Segment(next(self._clock))
        self._push(name, segment)

    def touch(self, name: str) -> None:
        """Segment ``name`` was used now (read)."""
        segment = self._segments[name]
        segment.stamp = next(self._clock)
        self._push(name, segment)

    def remove_segment(self, name: str) -> None:
        """Segment ``name`` left (its blocks left first, ``remove_block``)."""
        del self._segments[name]

    def add_block(self, block: Block, name: str, parent: Block | None) -> None:
        """``block`` is held in segment ``name``; ``parent``: the block before it (None: the
        first of its sequence, or unknown)."""
        segment = self._segments[name]
        before = segment.rank
        self._where[block] = name
        outer, held = self._state(block)
        segment.outer += outer
        segment.held += held
        if parent is not None:
            self._parent[block] = parent
            self._change(parent, lambda: self._count_child(parent, name, 1))
        self._reranked(name, segment, before)

    def remove_block(self, block: Block) -> None:
        """``block`` is no longer held (evicted, discarded, corrupt, or replaced by a copy in
        another segment, which ``add_block`` then adds)."""
        name = self._where.get(block)
        if name is None:
            return
        segment = self._segments[name]
        before = segment.rank
        outer, held = self._state(block)
        segment.outer -= outer
        segment.held -= held
        del self._where[block]
        parent = self._parent.pop(block, None)
        if parent is not None:
            self._change(parent, lambda: self._count_child(parent, name, -1))
        self._reranked(name, segment, before)

    # --- dependents held elsewhere ---------------------------------------------------------

    def hold(self, block: Block, count: int = 1) -> None:
        """``count`` more dependents of ``block`` are held elsewhere (``block`` need not be
        held here, now or ever)."""
        self._change(block, lambda: self._holds.update({block: count}))

    def release(self, block: Block, count: int = 1) -> None:
        """Undo ``hold(block, count)``."""
        if self._holds[block] < count:
            raise ValueError(f"{count} dependents released of a block holding {self._holds[block]}")

        def drop():
            self._holds[block] -= count
            if not self._holds[block]:
                del self._holds[block]

        self._change(block, drop)

    def holds(self) -> dict[Block, int]:
        """Dependents held elsewhere, per block (a copy)."""
        return dict(self._holds)

    # --- eviction --------------------------------------------------------------------------

    def victim(self, evictable: Callable[[str], bool]) -> str | None:
        """The segment to evict next among those ``evictable`` says may go (pinned ones may
        not), or None. The caller evicts it (``remove_block`` each, then ``remove_segment``)."""
        segments, heap, aside, chosen = self._segments, self._heap, [], None
        while heap:
            item = heapq.heappop(heap)
            rank, stamp, name = item
            segment = segments.get(name)
            if segment is None or segment.stamp != stamp or segment.rank != rank:
                continue  # stale: gone, used or re-ranked since (a newer item stands for it)
            if not evictable(name):
                aside.append(item)
                continue
            chosen = name
            break
        for item in aside:
            heapq.heappush(heap, item)
        return chosen

    def rank(self, name: str) -> int:
        """Segment ``name``'s rank (0, 1 or 2, see the module docstring)."""
        return self._segments[name].rank

    def check(self, where: dict[Block, str]) -> None:
        """Raise RuntimeError unless the blocks held are ``where`` (block -> segment), every
        count equals one made from scratch, and every segment has a live heap item."""
        if where != self._where:
            raise RuntimeError(f"the eviction order holds {len(self._where)} blocks, the tier {len(where)}")
        children: dict[Block, collections.Counter[str]] = {}
        for block, parent in self._parent.items():
            children.setdefault(parent, collections.Counter())[self._where[block]] += 1
        if children != self._children or self._num_children != collections.Counter(
                {parent: sum(c.values()) for parent, c in children.items()}):  # fmt: skip
            raise RuntimeError("children counted per parent disagree with the blocks held")
        outer, held = collections.Counter(), collections.Counter()
        for block, name in self._where.items():
            block_outer, block_held = self._state(block)
            outer[name] += block_outer
            held[name] += block_held
        live = {(s.rank, s.stamp, name) for name, s in self._segments.items()}
        for name, segment in self._segments.items():
            if (segment.outer, segment.held) != (outer[name], held[name]):
                raise RuntimeError(f"segment {name} counts {segment.outer=} {segment.held=}, "
                                   f"its blocks {outer[name]}, {held[name]}")  # fmt: skip
        if not live <= set(self._heap) or set(self._where.values()) - set(self._segments):
            raise RuntimeError("a segment is missing from the eviction order, or a block from its segment")

    # --- helpers ---------------------------------------------------------------------------

    def _state(self, block: Block) -> tuple[bool, bool]:
        """(a child block in another segment, dependents held elsewhere) of a held block."""
        children = self._children.get(block)
        outer = children is not None and self._num_children[block] > children[self._where[block]]
        return outer, self._holds[block] > 0

    def _count_child(self, parent: Block, name: str, count: int) -> None:
        children = self._children.setdefault(parent, collections.Counter())
        children[name] += count
        self._num_children[parent] += count
        if not children[name]:
            del children[name]
        if not self._num_children[parent]:
            del self._children[parent], self._num_children[parent]

    def _change(self, block: Block, mutate: Callable[[], None]) -> None:
        """Apply ``mutate`` (a change of ``block``'s children or holds), re-ranking its segment."""
        name = self._where.get(block)
        if name is None:
            mutate()
            return
        segment = self._segments[name]
        before, (outer, held) = segment.rank, self._state(block)
        mutate()
        now_outer, now_held = self._state(block)
        segment.outer += now_outer - outer
        segment.held += now_held - held
        self._reranked(name, segment, before)

    def _reranked(self, name: str, segment: _Segment, before: int) -> None:
        if segment.rank != before:
            self._push(name, segment)

    def _push(self, name: str, segment: _Segment) -> None:
        heapq.heappush(self._heap, (segment.rank, segment.stamp, name))
        if len(self._heap) > 4 * len(self._segments) + 64:  # drop stale items: memory stays O(segments)
            self._heap = [(s.rank, s.stamp, n) for n, s in self._segments.items()]
            heapq.heapify(self._heap)
