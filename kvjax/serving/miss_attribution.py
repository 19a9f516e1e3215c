"""Why a request's prompt tokens missed the cache: never seen, evicted, other namespace, or
a different rendering of a template seen before.

The cache only says how much of a prompt hit; the cause of the rest comes from memory of
what earlier requests brought. This module keeps that memory cheaply, independent of the
cache's structure: the chained key of every full page the engine has admitted or finished
(bounded, least recently seen forgotten first), once with the request's namespace and once
under one fixed namespace shared by all (so a page cached for another tenant is recognised),
plus the template fingerprints seen per namespace. A missed page is then:

* ``evicted``: its key (with namespace) was seen before: the KV existed and was dropped;
* ``other_namespace``: only the namespace-free key was seen: another tenant, model, adapter
  or salt holds the same tokens, which isolation forbids sharing;
* ``different_template``: never seen anywhere, but the prompt's template fingerprint
  (``kvjax.text.canonicalize.template_fingerprint``) was: the template's variable parts (dates,
  ids, whitespace) broke the prefix;
* ``never_seen``: none of these;
* ``recomputed``: the cache held the page on host or disk and it was computed anyway: the
  cost model found recomputing it cheaper than fetching it, or its fetch failed; the cache
  reports how many (they follow the hits);
* ``lossy_refused``: the cache held the page only as lossy (compressed on offload) KV and the
  request refused lossy hits (``accept_lossy=False``); the cache reports how many (they
  follow the recomputed pages: the match stops at the first lossy one).

The page holding the prompt's last token is never mapped (its logits are needed, so the cache
always computes it): its tokens carry the cause of the first missed page before it, or
``never_seen`` when every earlier page hit. Counts are in tokens
and in pages (a partial page counts as one).
"""

from __future__ import annotations

import collections
from collections.abc import Callable

import numpy as np

from kvjax.cache.block_keys import Namespace, as_namespace, chained_block_keys

__all__ = ["MissAttributor"]

_ANY_NAMESPACE = Namespace(tenant="\x00kvjax-any-namespace")  # no real tenant name starts with NUL


class MissAttributor:
    """Remembers up to ``max_pages`` page keys (each kept twice) and explains misses."""

    def __init__(self, page_size: int, *, max_pages: int = 1 << 20):
        if page_size < 1 or max_pages < 1:
            raise ValueError(f"{page_size=} and {max_pages=} must be >= 1")
        self.page_size = page_size
        self.max_pages = max_pages
        self._seen: collections.OrderedDict[bytes, None] = collections.OrderedDict()
        self._seen_anywhere: collections.OrderedDict[bytes, None] = collections.OrderedDict()
        self._fingerprints: set[tuple[Namespace, str]] = set()

    def attribute(self, tokens: np.ndarray, namespace: Namespace | str | None, num_hit_tokens: int,
                  fingerprint: str | None = None, refused_pages: int = 0,
                  elsewhere: Callable[[int], np.ndarray] | None = None,
                  recomputed_pages: int = 0) -> dict[str, tuple[int, int]]:  # fmt: skip
        """``{cause: (tokens, pages)}`` for the prompt ``tokens`` past ``num_hit_tokens`` (a
        multiple of ``page_size``); read-only. ``fingerprint`` is the prompt's template
        fingerprint (None: not a text prompt, never ``different_template``);
        ``recomputed_pages``: how many pages right after the hits were held on host or disk
        and computed anyway; ``refused_pages``: how many pages after those were lossy and
        refused;
        ``elsewhere(n)``: which of the first n pages a tier holds under another namespace
        (``KVCache.pages_in_other_namespaces``: blocks this process never saw), asked only when
        a page would otherwise count as never seen."""
        ns = as_namespace(namespace)
        page = self.page_size
        # Pages before the one holding the last token are mappable; the rest is the tail.
        num_hit_pages, num_mappable = num_hit_tokens // page, (len(tokens) - 1) // page
        keys = chained_block_keys(tokens[: num_mappable * page], page, ns)
        keys_anywhere = chained_block_keys(tokens[: num_mappable * page], page, _ANY_NAMESPACE)
        template_seen = fingerprint is not None and (ns, fingerprint) in self._fingerprints
        causes, held_elsewhere = {}, None
        for index in range(num_hit_pages, num_mappable):
            if index < num_hit_pages + recomputed_pages:
                cause = "recomputed"
            elif index < num_hit_pages + recomputed_pages + refused_pages:
                cause = "lossy_refused"
            elif keys[index] in self._seen:
                cause = "evicted"
            elif keys_anywhere[index] in self._seen_anywhere:
                cause = "other_namespace"
            elif elsewhere is not None and (held_elsewhere := _once(held_elsewhere, elsewhere, num_mappable))[index]:
                cause = "other_namespace"
            else:
                cause = "different_template" if template_seen else "never_seen"
            causes.setdefault(cause, [0, 0])
            causes[cause][0] += page
            causes[cause][1] += 1
        tail = len(tokens) - max(num_mappable, num_hit_pages) * page
        if tail > 0:
            first_cause = next(iter(causes), "never_seen")
            causes.setdefault(first_cause, [0, 0])
            causes[first_cause][0] += tail
            causes[first_cause][1] += 1
        return {cause: (counts[0], counts[1]) for cause, counts in causes.items()}

    def remember(self, tokens: np.ndarray, namespace: Namespace | str | None,
                 fingerprint: str | None = None) -> None:  # fmt: skip
        """Record the full pages of ``tokens`` (and the template) as seen in ``namespace``."""
        ns = as_namespace(namespace)
        usable = len(tokens) - len(tokens) % self.page_size
        _remember(self._seen, chained_block_keys(tokens[:usable], self.page_size, ns), self.max_pages)
        _remember(self._seen_anywhere, chained_block_keys(tokens[:usable], self.page_size, _ANY_NAMESPACE),
                  self.max_pages)  # fmt: skip
        if fingerprint is not None:
            self._fingerprints.add((ns, fingerprint))


def _once(held: np.ndarray | None, elsewhere: Callable[[int], np.ndarray], num_pages: int) -> np.ndarray:
    return elsewhere(num_pages) if held is None else held


def _remember(seen: collections.OrderedDict, keys: list[bytes], limit: int) -> None:
    for key in keys:
        seen[key] = None
        seen.move_to_end(key)
    while len(seen) > limit:
        seen.popitem(last=False)

