"""What an admission (or a prefetch) takes from a trie match, decided before anything changes.

A match is a trie walk: ``[(node, pages matched in it)]``. The plan cuts it before the first
lossy page when the caller refuses lossy hits, splits it into the device pages at its start
(mapped at once) and the lower-tier pages after them, and asks the fetch cost model how many
of those are worth fetching rather than recomputing.

Lossy flags of the device pages are read here, before ``DeviceIndex.begin_admission`` locks the
path: locking may split the last node, after which ``matched`` names the deeper half.

``HitSources`` remembers, per admitted sequence, where its hit pages came from (device, host,
disk) and which of them are lossy, for the sequence's ``AdmissionReport``.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from kvjax.cache.cost_model import CostModel
from kvjax.cache.trie_node import Node, Tier

__all__ = ["AdmissionReport", "FetchPlan", "HitSources", "plan_fetch"]

_HOST = int(Tier.HOST)
_NOTHING_ON_DISK = np.zeros(0, bool)
_NOTHING_ON_DISK.flags.writeable = False


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
    if lower:
        on_disk = np.array([not int(node.tiers[i]) & _HOST for node, i in lower], bool)
        num_fetch = cost_model.pages_to_fetch(first, page_size, on_disk, block_nbytes)
    else:  # the common case: nothing below the device to weigh
        on_disk, num_fetch = _NOTHING_ON_DISK, 0
    device_lossy = None
    if lossy_codec:
        flags = [node.page_lossy()[:k] for node, k in matched]
        device_lossy = np.concatenate(flags)[:first] if flags else np.zeros(0, bool)
    return FetchPlan(matched, refused, first, lower, on_disk, num_fetch, device_lossy)


@dataclasses.dataclass(frozen=True, slots=True)
class AdmissionReport:
    """Where a sequence's prompt pages came from, final once the sequence is ready.

    ``hit_tokens``: tokens served from cached KV, by the tier each page came from ("device",
    "host", "disk"); ``recomputed_pages``: pages matched on host or disk and recomputed
    anyway (the cost model chose it, or their fetch failed); ``refused_lossy_pages``: pages
    right after the hits that were cached only lossily and refused (``accept_lossy=False``);
    ``lossy_pages`` bool ``[hit pages]``: which hit pages hold KV that went through a lossy
    offload codec; ``sources`` uint8 ``[hit pages]``: the Tier each hit page came from.
    """

    hit_tokens: dict[str, int]
    recomputed_pages: int
    refused_lossy_pages: int
    lossy_pages: np.ndarray
    sources: np.ndarray

    @property
    def num_hit_tokens(self) -> int:
        return sum(self.hit_tokens.values())


class HitSources:
    """Per live sequence: (device pages mapped, from_disk of its lower-tier pages, lossy flags
    of the device pages or None, lossy pages refused, lower-tier pages matched). Sequences that
    matched nothing below the device, mapped no lossy page and refused none are not recorded:
    all their hits are exact device hits."""

    def __init__(self, page_size: int, lossy_codec: bool):
        self.page_size = page_size
        self.lossy_codec = lossy_codec
        self._sources: dict[int, tuple[int, np.ndarray, np.ndarray | None, int, int]] = {}

    def record(self, seq_id: int, first: int, from_disk: np.ndarray, device_lossy: np.ndarray | None,
               refused: int, num_lower: int) -> None:  # fmt: skip
        if num_lower or device_lossy is not None or refused:
            self._sources[seq_id] = (first, from_disk, device_lossy, refused, num_lower)

    def forget(self, seq_id: int) -> None:
        self._sources.pop(seq_id, None)

    def report(self, seq_id: int, num_hit_tokens: int) -> AdmissionReport:
        """The report of a sequence whose hits are now ``num_hit_tokens`` tokens."""
        num_hit = num_hit_tokens // self.page_size
        first, from_disk, device_lossy, refused, num_lower = self._sources.get(seq_id, (num_hit, (), None, 0, 0))
        device = min(first, num_hit)
        disk = int(np.count_nonzero(from_disk[: num_hit - device]))
        page = self.page_size
        hit_tokens = {"device": device * page, "host": (num_hit - device - disk) * page, "disk": disk * page}
        lossy = np.zeros(num_hit, bool)
        if device_lossy is not None:
            lossy[:first] = device_lossy
        lossy[first:] = self.lossy_codec
        sources = np.full(num_hit, _HOST, np.uint8)
        sources[:device] = Tier.DEVICE
        sources[device:][np.asarray(from_disk[: num_hit - device], bool)] = Tier.DISK
        return AdmissionReport(hit_tokens, num_lower - (num_hit - device), refused, lossy, sources)


def _cut_at_lossy(matched: list[tuple[Node, int]]) -> tuple[list[tuple[Node, int]], int]:
    """(``matched`` up to its first lossy page, how many pages that leaves out)."""
    for j, (node, k) in enumerate(matched):
        flags = node.page_lossy()[:k]
        if flags.any():
            cut = int(np.argmax(flags))
            refused = k - cut + sum(k for _, k in matched[j + 1 :])
            return matched[:j] + ([(node, cut)] if cut else []), refused
    return matched, 0
