"""Block events: every block a tier stores or drops, and every tier cleared, as an ordered log.

An event is ``(seq, namespace, key, parent, tier, kind)``:

* ``seq``: position in the cache's log, from 0, consecutive (a subscriber sees a gap only
  if it fell behind and lost batches, which its ``lost_batches`` counts);
* ``namespace``: the 16-byte digest of the block's namespace (``Namespace.digest()``);
* ``key`` / ``parent``: the block's 16-byte chained key and its parent's (None for the first
  page of a sequence); both None for ``cleared``;
* ``tier``: "device", "host" or "disk";
* ``kind``: "stored" (the tier now holds the block), "removed" (it no longer does) or
  "cleared" (the tier dropped everything; later events build it up again).

Events of one step form one batch (``EventLog.flush``), delivered whole and in order to
every subscription. Reading is pull-based: a subscriber calls ``Subscription.poll()`` and
gets the batches flushed since its last call; nothing in the cache calls out to it. A
subscription that falls more than ``max_batches`` behind loses its oldest batches (counted),
so a stalled reader never grows the cache's memory; it rebuilds its view from a fresh
subscription's ``initial`` holdings.

Applying the events in order to an empty ``BlockIndex`` reproduces what the tiers hold.
"""

from __future__ import annotations

import collections
import dataclasses
import itertools
import threading
from collections.abc import Iterable, Iterator

__all__ = ["EVENT_KINDS", "TIER_NAMES", "BlockEvent", "BlockIndex", "EventLog", "Subscription"]

TIER_NAMES = ("device", "host", "disk")
EVENT_KINDS = ("stored", "removed", "cleared")


@dataclasses.dataclass(frozen=True, slots=True)
class BlockEvent:
    """One change of one tier; see the module docstring for the fields."""

    seq: int
    namespace: bytes | None  # 16-byte namespace digest; None for "cleared"
    key: bytes | None  # 16-byte chained block key; None for "cleared"
    parent: bytes | None  # the parent block's key; None at a sequence's first page
    tier: str  # "device" | "host" | "disk"
    kind: str  # "stored" | "removed" | "cleared"


class BlockIndex:
    """(namespace, key) -> set of tiers: what a log of events says the tiers hold.

    ``apply`` folds events in; equality compares the holdings, so a shadow index built from
    events can be checked against the cache's own (``KVCache.block_index()``).
    """

    def __init__(self, entries: Iterable[tuple[bytes, bytes, str]] = ()):
        self._tiers: dict[tuple[bytes, bytes], set[str]] = {}
        for namespace, key, tier in entries:
            self._tiers.setdefault((namespace, key), set()).add(tier)

    def apply(self, events: Iterable[BlockEvent]) -> None:
        """Fold ``events`` in, in order. ValueError for a "removed" of a block the tier does
        not hold or a "stored" of one it already holds (a log out of step with its cache)."""
        for event in events:
            if event.kind == "cleared":
                for where in self._tiers.values():
                    where.discard(event.tier)
                self._tiers = {block: where for block, where in self._tiers.items() if where}
                continue
            block = (event.namespace, event.key)
            where = self._tiers.get(block, set())
            if (event.kind == "stored") == (event.tier in where):  # refused before anything changes
                raise ValueError(f"event {event.seq}: {event.kind} {event.key.hex()[:8]} on {event.tier}, "
                                 f"which holds it: {event.tier in where}")  # fmt: skip
            (where.add if event.kind == "stored" else where.discard)(event.tier)
            if where:
                self._tiers[block] = where
            else:
                self._tiers.pop(block, None)

    def tiers(self, namespace: bytes, key: bytes) -> frozenset[str]:
        """Tiers holding the block (empty if none)."""
        return frozenset(self._tiers.get((namespace, key), ()))

    def entries(self) -> Iterator[tuple[bytes, bytes, str]]:
        """Every (namespace, key, tier) held, in no particular order."""
        for (namespace, key), where in self._tiers.items():
            for tier in where:
                yield namespace, key, tier

    def __len__(self) -> int:
        return sum(len(where) for where in self._tiers.values())

    def __eq__(self, other: object) -> bool:
        return isinstance(other, BlockIndex) and self._tiers == other._tiers

    def difference(self, other: BlockIndex, limit: int = 5) -> list[str]:
        """Up to ``limit`` (namespace, key, tier) held by one index and not the other, as text."""
        ours, theirs = set(self.entries()), set(other.entries())
        return [f"{'only here' if e in ours else 'only there'}: {e[1].hex()[:8]} on {e[2]}"
                for e in itertools.islice(sorted(ours ^ theirs), limit)]  # fmt: skip


class Subscription:
    """One reader's queue of event batches; see the module docstring."""

    def __init__(self, log: EventLog, max_batches: int):
        self._log = log
        self.initial: BlockIndex | None = None  # what the tiers held when it started (KVCache.subscribe)
        self._batches: collections.deque[tuple[BlockEvent, ...]] = collections.deque()
        self._max_batches = max_batches
        self.lost_batches = 0
        self.closed = False

    def poll(self) -> list[tuple[BlockEvent, ...]]:
        """The batches flushed since the last call, oldest first (empty list if none)."""
        with self._log._lock:
            batches = list(self._batches)
            self._batches.clear()
        return batches

    def close(self) -> None:
        """Stop receiving batches."""
        self._log._unsubscribe(self)

    def _deliver(self, batch: tuple[BlockEvent, ...]) -> None:
        self._batches.append(batch)
        while len(self._batches) > self._max_batches:
            self._batches.popleft()
            self.lost_batches += 1


class EventLog:
    """The cache's event log: numbered events, collected per step, fanned out to subscriptions.

    Recording costs nothing while nobody subscribes (``active`` is False): callers check it
    before computing block keys for an event.
    """

    def __init__(self):
        self._lock = threading.Lock()
        self._pending: list[BlockEvent] = []
        self._subscriptions: list[Subscription] = []
        self._seq = 0

    @property
    def active(self) -> bool:
        """Whether any subscription is open (events are recorded only then)."""
        return bool(self._subscriptions)

    @property
    def next_seq(self) -> int:
        return self._seq

    def record(self, namespace: bytes | None, key: bytes | None, parent: bytes | None, tier: str,
               kind: str) -> None:  # fmt: skip
        """Append one event to the current batch (no-op while nobody subscribes)."""
        if not self._subscriptions:
            return
        if tier not in TIER_NAMES or kind not in EVENT_KINDS:
            raise ValueError(f"event tier={tier!r} kind={kind!r}; expected one of {TIER_NAMES} / {EVENT_KINDS}")
        with self._lock:
            self._pending.append(BlockEvent(self._seq, namespace, key, parent, tier, kind))
            self._seq += 1

    def flush(self) -> int:
        """Close the current batch and deliver it to every subscription; returns its size."""
        with self._lock:
            if not self._pending:
                return 0
            batch, self._pending = tuple(self._pending), []
            for subscription in self._subscriptions:
                subscription._deliver(batch)
            return len(batch)

    def subscribe(self, max_batches: int = 4096) -> Subscription:
        """A new subscription; it receives the batches flushed from now on."""
        if not isinstance(max_batches, int) or max_batches < 1:
            raise ValueError(f"max_batches={max_batches!r} must be an int >= 1")
        subscription = Subscription(self, max_batches)
        with self._lock:
            self._subscriptions.append(subscription)
        return subscription

    def _unsubscribe(self, subscription: Subscription) -> None:
        with self._lock:
            if subscription in self._subscriptions:
                self._subscriptions.remove(subscription)
            subscription.closed = True
            if not self._subscriptions:
                self._pending.clear()
