"""A prefix-trie node: a run of whole pages of one sequence prefix, and the tiers of a page.

Per node: ``label`` (the pages' token ids as little-endian int32 bytes), ``blocks`` (device
block id of each page, -1 where the page is not on device), ``tiers`` (Tier bits of each
page; None while the node is on device only, the common case, so the hot path keeps no
array for it), ``lossy`` (per page: the KV a hit on it gets is not the KV that was computed,
because it came through a lossy offload codec; None while no page is, the common case),
``lock`` (running sequences holding the node), ``hits`` (admissions that used it),
``last_access`` (clock seconds), ``hard_pins`` and a soft pin that expires at
``soft_until``.
"""

from __future__ import annotations

import enum

import numpy as np

from kvjax.cache.block_keys import Namespace

__all__ = ["LOWER_TIERS", "Node", "Tier"]


class Tier(enum.IntFlag):
    """Where a page has a copy. A page may be in several tiers at once."""

    DEVICE = 1
    HOST = 2
    DISK = 4


LOWER_TIERS = int(Tier.HOST | Tier.DISK)
"""Tiers below the device: a page with one of these bits survives device eviction."""


class Node:
    """A run of whole pages; see the module docstring for the meaning of each field."""

    __slots__ = (
        "parent", "key", "label", "blocks", "tiers", "first_page", "children", "lock",
        "hard_pins", "soft_until", "soft_pinned", "hits", "last_access", "on_device",
        "num_device_children", "heap_version", "namespace", "keys", "lossy",
    )  # fmt: skip

    def __init__(self, parent, key, label, blocks, tiers, first_page, on_device, now):
        self.parent: Node | None = parent  # None for a root and for a removed node
        self.key: bytes = key  # bytes of the first page: the key in parent.children
        self.label: memoryview = label  # int32 token bytes of all pages (a view, see prefix_trie._compact)
        self.blocks: np.ndarray = blocks  # BLOCK_DTYPE [num_pages]
        self.tiers: np.ndarray | None = tiers  # uint8 [num_pages]; None: DEVICE only
        self.first_page = first_page  # pages before this node on its path
        self.children: dict[bytes, Node] = {}
        self.lock = 0
        self.hard_pins = 0
        self.soft_until = 0.0
        self.soft_pinned = False
        self.hits = 0
        self.last_access = now
        self.on_device = on_device
        self.num_device_children = 0
        self.heap_version = -1  # version of this node's live eviction-queue entry, -1: none
        self.namespace: Namespace | None = None  # set on roots only
        self.keys: list[bytes] | None = None  # lazily computed stable keys of a prefix of pages
        self.lossy: np.ndarray | None = None  # bool [num_pages]; None: every page exact

    @property
    def num_pages(self) -> int:
        return len(self.blocks)

    @property
    def tail_tiers(self) -> int:
        return int(Tier.DEVICE) if self.tiers is None else int(self.tiers[-1])

    def page_lossy(self) -> np.ndarray:
        """Lossy flag of every page, bool ``[num_pages]`` (a fresh array when lossy is None)."""
        if self.lossy is None:
            return np.zeros(len(self.blocks), bool)
        return self.lossy

    def page_tiers(self) -> np.ndarray:
        """Tier bits of every page, uint8 ``[num_pages]`` (a fresh array when tiers is None)."""
        if self.tiers is None:
            return np.full(len(self.blocks), Tier.DEVICE, np.uint8)
        return self.tiers
