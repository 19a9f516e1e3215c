"""What an admission (or a prefetch) takes from a trie match, decided before anything changes.

A match is a trie walk: ``[(node, pages matched in it)]``. The plan cuts it before the first
lossy page when the caller refuses lossy hits, splits it into the device pages at its start
(mapped at once) and the lower-tier pages after them, and asks the fetch cost model how many
of those are worth fetching rather than recomputing.

Lossy flags of the device pages are read here, before ``PrefixCache.admit_matched`` locks the
path: locking may split the last node, after which ``matched`` names the deeper half.

``HitSources`` remembers, per admitted sequence, where its hit pages came from (device, host,
disk) and which of them are lossy, for ``KVCache.hit_tokens_by_tier`` / ``lossy_hit_pages``.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from kvjax.cache.cost_model import CostModel
from kvjax.cache.trie_node import Node, Tier

__all__ = ["FetchPlan", "HitSources", "plan_fetch"]

_HOST = int(Tier.HOST)


@dataclasses.dataclass(slots=True)
class FetchPlan:
    """See the module docstring. Page counts are pages of ``page_size`` tokens."""

    matched: list[tuple[Node, int]]  # the match, cut before a refused lossy page
    refused: int  # lossy pages the cut left out (recomputed)
    first: int  # device pages at the start of ``matched``
    lower: list[tuple[Node, int]]  # (node, index) of the lower-tier pages after them
    on_disk: np.ndarray  # bool [len(lower)]: page only on disk
    num_fetch: int  # leading pages of ``lower`` the cost model says to fetch
    device_lossy: np.ndarray | None  # bool [first], None unless the offload codec is lossy


def plan_fetch(matched: list[tuple[Node, int]], *, cost_model: CostModel, page_size: int,
               block_nbytes: int, lossy_codec: bool, accept_lossy: bool) -> FetchPlan:  # fmt: skip
    """The plan of ``matched``; ``block_nbytes`` is what one page moves between tiers
    (the codec's bytes), ``lossy_codec`` whether lower-tier copies are lossy."""
    refused = 0
    if lossy_codec and not accept_lossy:
        matched, refused = _cut_at_lossy(matched)
    first, lower = 0, []
    for node, k in matched:
        if node.on_device and not lower:
            first += k
        else:
            lower.extend((node, i) for i in range(k))
    on_disk = np.array([not int(node.tiers[i]) & _HOST for node, i in lower], bool)
    num_fetch = cost_model.pages_to_fetch(first, page_size, on_disk, block_nbytes)
    device_lossy = None
    if lossy_codec:
        flags = [node.page_lossy()[:k] for node, k in matched]
        device_lossy = np.concatenate(flags)[:first] if flags else np.zeros(0, bool)
    return FetchPlan(matched, refused, first, lower, on_disk, num_fetch, device_lossy)


class HitSources:
    """Per live sequence: (device pages mapped, from_disk of its fetched pages, lossy flags of
    the device pages or None, lossy pages refused). Sequences that fetched nothing, mapped no
    lossy page and refused none are not recorded: all their hits are exact device hits."""

    def __init__(self, page_size: int):
        self.page_size = page_size
        self._sources: dict[int, tuple[int, np.ndarray, np.ndarray | None, int]] = {}

    def record(self, seq_id: int, first: int, from_disk: np.ndarray, device_lossy: np.ndarray | None,
               refused: int = 0) -> None:  # fmt: skip
        if len(from_disk) or device_lossy is not None or refused:
            self._sources[seq_id] = (first, from_disk, device_lossy, refused)

    def refused(self, seq_id: int) -> int:
        """Pages right after the hits that were lossy (or followed one) and were refused."""
        return self._sources.get(seq_id, (0, (), None, 0))[3]

    def forget(self, seq_id: int) -> None:
        self._sources.pop(seq_id, None)

    def by_tier(self, seq_id: int, num_hit_tokens: int) -> dict[str, int]:
        """``num_hit_tokens`` split by the tier each hit page came from (tokens)."""
        num_hit = num_hit_tokens // self.page_size
        first, from_disk, _, _ = self._sources.get(seq_id, (num_hit, (), None, 0))
        device = min(first, num_hit)
        disk = int(np.count_nonzero(from_disk[: num_hit - device]))
        return {"device": device * self.page_size, "host": (num_hit - device - disk) * self.page_size,
                "disk": disk * self.page_size}  # fmt: skip

    def lossy_pages(self, seq_id: int, num_hit_tokens: int, lossy_codec: bool) -> np.ndarray:
        """bool ``[hit pages]``: device pages as the trie marked them, fetched ones as the codec made them."""
        num_hit = num_hit_tokens // self.page_size
        first, _, device_lossy, _ = self._sources.get(seq_id, (num_hit, (), None, 0))
        lossy = np.zeros(num_hit, bool)
        if device_lossy is not None:
            lossy[:first] = device_lossy
        lossy[first:] = lossy_codec
        return lossy


def _cut_at_lossy(matched: list[tuple[Node, int]]) -> tuple[list[tuple[Node, int]], int]:
    """(``matched`` up to its first lossy page, how many pages that leaves out)."""
    for j, (node, k) in enumerate(matched):
        flags = node.page_lossy()[:k]
        if flags.any():
            cut = int(np.argmax(flags))
            refused = k - cut + sum(k for _, k in matched[j + 1 :])
            return matched[:j] + ([(node, cut)] if cut else []), refused
    return matched, 0
