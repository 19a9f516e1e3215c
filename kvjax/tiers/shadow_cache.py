"""The flat cache whose evictions the host tier follows: device and host blocks as one device.

Device and host together hit on exactly the pages they hold between them, so the most they
can hit is what one device cache of their total size would hold. A device policy cannot
rank host pages that way on its own: it learns on the device's time scale (its horizon
follows the device's capacity), and a page fetched back from host is a miss to it, so it
judges pages that live long on host as if they had been evicted. Ranking host victims by the
device policy's order cost the shared Mooncake trace 2% of its hits against one LRU cache of
the same total size, where one cache under the same policy gains 4% (``bench_policies.py
--tiered``).

``ShadowCache`` is that one cache, without the KV: a ``DeviceIndex`` of the device's plus the
host's blocks under a fresh instance of the cache's policy, fed every admitted prompt
(admitted, committed and released at once: block ids only, no pool). The pages it evicts
are the ones the flat cache would no longer hold; ``TierIndex`` evicts host copies of those
first (see ``TierIndex.make_host_room``). Its policy learns on the tiers' combined time scale
and sees a host hit as the hit it is. Costs: one more trie of the tiers' total pages and, per
admission, one walk, one insert and the eviction it makes, plus one chained key per page it
stores or evicts.

It only orders host victims: what a request hits is always what the real tiers hold.
"""

from __future__ import annotations

import collections
from collections.abc import Callable

import numpy as np

from kvjax.cache.block_events import EventLog
from kvjax.cache.block_keys import Namespace
from kvjax.cache.cost_model import CostModel
from kvjax.cache.device_index import DeviceIndex
from kvjax.text.tokens import TOKEN_DTYPE

__all__ = ["ShadowCache"]


class _Changes(EventLog):
    """The shadow's device events, applied at once to its set of evicted keys (no batches)."""

    active = True  # the index computes block keys for events only while someone listens

    def __init__(self, shadow: ShadowCache):
        super().__init__()
        self._shadow = shadow

    def record(self, namespace: bytes | None, key: bytes | None, parent: bytes | None, tier: str,
               kind: str) -> None:  # fmt: skip
        self._shadow._changed(key, kind == "stored")


class ShadowCache:
    """One device cache of ``num_blocks`` blocks (the device's plus the host's) that holds no
    KV, under a fresh instance of ``policy``; see the module docstring.

    ``evicted(key)``: whether it evicted the page of ``key`` and has not stored it again
    since (the latest ``num_blocks`` such keys are remembered); ``take_evicted()``: the keys
    it evicted since the last call, in eviction order.
    """

    def __init__(self, num_blocks: int, page_size: int, policy: str, clock: Callable[[], float], *,
                 vocab_size: int | None = None, cost_model: CostModel | None = None,
                 block_nbytes: int = 0):  # fmt: skip
        self.index = DeviceIndex(num_blocks, page_size, policy=policy, vocab_size=vocab_size, clock=clock,
                                 cost_model=cost_model, block_nbytes=block_nbytes, events=_Changes(self))  # fmt: skip
        self.num_blocks = num_blocks
        self._out: collections.OrderedDict[bytes, None] = collections.OrderedDict()  # oldest first
        self._evicted: collections.deque[bytes] = collections.deque(maxlen=num_blocks)  # not taken yet

    def observe(self, namespace: Namespace, buf: bytes) -> int:
        """Admit one prompt (its token bytes), commit the pages a later prompt can hit (up to
        the page of its last token, as ``DeviceIndex.admit`` matches) and release it; return
        the pages it hit."""
        tokens = np.frombuffer(buf, TOKEN_DTYPE)
        index = self.index
        handle = index.admit(tokens, namespace)
        if handle is None:  # nothing is held between calls, so only a prompt over the pool
            return 0
        index.commit(handle, tokens[: index.admit_limit(len(buf)) // 4])  # the pages a later prompt can hit
        index.release(handle)
        return handle.num_hit_tokens // index.page_size

    def evicted(self, key: bytes) -> bool:
        return key in self._out

    def take_evicted(self) -> list[bytes]:
        evicted = list(self._evicted)
        self._evicted.clear()
        return evicted

    def _changed(self, key: bytes, stored: bool) -> None:
        out = self._out
        if stored:
            out.pop(key, None)
            return
        out[key] = None
        out.move_to_end(key)
        self._evicted.append(key)  # beyond num_blocks untaken, the oldest go
        if len(out) > self.num_blocks:
            out.popitem(last=False)
