"""Fetch or recompute: what bringing a cached prefix back from host or disk costs, against
computing its KV again.

A request whose prefix continues past its device pages onto pages held only on host or disk
can either fetch those pages (copy them up, then scatter them into the pool) or recompute
them in its prefill. Recomputing ``n`` tokens starting at position ``s`` costs

    n * seconds_per_token + seconds_per_token_position * (s*n + n*(n-1)/2)

(dense work per token, plus attention over every earlier position); fetching ``b`` blocks,
``d`` of which must first be read from disk, costs

    fetch_latency + b * block_bytes / host_bytes_per_second
    + (d > 0) * disk_latency + d * block_bytes / disk_bytes_per_second.

The prefill of the prompt's tail runs either way, so only the marginal recompute cost
counts. :meth:`FetchCostModel.pages_to_fetch` picks the number of leading lower-tier pages
whose fetch saves the most time (0: recompute them all).

The defaults were measured on CPU with the tiny model (``configs/tiny.toml``, 16 KiB pages)
by ``benchmarks/bench_fetch_vs_recompute.py --repeats 5`` on a shared 2-core machine (fits
of two runs, rounded): fetching from host pays off from one page (a 32-token prompt, where
the two are within 15% of each other; 2.2-2.9x at 128 tokens, 16-19x at 2048), from disk
from about three pages. A deployment measures its own model and links and passes its own
``FetchCostModel`` (``KVCacheConfig.cost_model``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

import numpy as np

__all__ = ["FetchCostModel"]


@dataclasses.dataclass(frozen=True, slots=True)
class FetchCostModel:
    """Seconds to recompute tokens or fetch blocks; see the module docstring for the formulas."""

    seconds_per_token: float = 2.5e-4
    seconds_per_token_position: float = 1.0e-8
    fetch_latency: float = 2.5e-3  # one host->device fetch: thread hand-offs, copy-in, scatter
    host_bytes_per_second: float = 9.0e7  # one small device_put per block on CPU
    disk_latency: float = 6.0e-3  # one restore (segment read and checksum), before any byte
    disk_bytes_per_second: float = 5.5e7

    def __post_init__(self):
        for field in dataclasses.fields(self):
            value = getattr(self, field.name)
            if not isinstance(value, (int, float)) or value < 0 or value != value:
                raise ValueError(f"{field.name}={value!r} must be a number >= 0")
        for name in ("host_bytes_per_second", "disk_bytes_per_second"):
            if getattr(self, name) == 0:
                raise ValueError(f"{name}=0 must be > 0 bytes per second")

    @classmethod
    def from_dict(cls, values: Mapping) -> FetchCostModel:
        known = [f.name for f in dataclasses.fields(cls)]
        unknown = sorted(set(values) - set(known))
        if unknown:
            raise ValueError(f"unknown cost model keys {unknown}; expected some of {known}")
        return cls(**values)

    def recompute_seconds(self, first_token: int, num_tokens: int) -> float:
        """Seconds to recompute tokens ``first_token .. first_token + num_tokens - 1``."""
        positions = first_token * num_tokens + num_tokens * (num_tokens - 1) / 2
        return num_tokens * self.seconds_per_token + positions * self.seconds_per_token_position

    def fetch_seconds(self, num_blocks: int, num_disk_blocks: int, block_bytes: int) -> float:
        """Seconds to bring ``num_blocks`` blocks to the device, ``num_disk_blocks`` of them
        read from disk first (0 seconds for no blocks)."""
        if num_blocks == 0:
            return 0.0
        seconds = self.fetch_latency + num_blocks * block_bytes / self.host_bytes_per_second
        if num_disk_blocks:
            seconds += self.disk_latency + num_disk_blocks * block_bytes / self.disk_bytes_per_second
        return seconds

    def pages_to_fetch(self, first_page: int, page_size: int, on_disk: np.ndarray,
                       block_bytes: int) -> int:  # fmt: skip
        """How many of the lower-tier pages ``first_page, first_page + 1, ...`` to fetch.

        ``on_disk[i]``: page ``first_page + i`` must be read from disk (no host copy). Returns
        the ``k`` that saves the most seconds (recompute of the k pages minus their fetch),
        0 when no ``k`` saves anything.
        """
        if len(on_disk) == 0:
            return 0
        saved = self.seconds_saved(first_page, page_size, on_disk, block_bytes)
        best = int(np.argmax(saved))
        return best + 1 if saved[best] > 0 else 0

    def seconds_saved(self, first_page: int, page_size: int, on_disk: np.ndarray,
                      block_bytes: int) -> np.ndarray:  # fmt: skip
        """``saved[k - 1]``: seconds saved by fetching the first ``k`` pages instead of
        recomputing them (negative: fetching is slower), float64 ``[len(on_disk)]``."""
        k = np.arange(1, len(on_disk) + 1, dtype=np.float64)
        tokens = k * page_size
        start = first_page * page_size
        recompute = tokens * self.seconds_per_token + (
            start * tokens + tokens * (tokens - 1) / 2) * self.seconds_per_token_position
        disk = np.cumsum(np.asarray(on_disk, bool))
        fetch = self.fetch_latency + k * block_bytes / self.host_bytes_per_second
        fetch = fetch + (disk > 0) * self.disk_latency + disk * block_bytes / self.disk_bytes_per_second
        return recompute - fetch

    def break_even_tokens(self, page_size: int, block_bytes: int, *, from_disk: bool = False,
                          max_pages: int = 1 << 14) -> int | None:  # fmt: skip
        """Shortest prefix (tokens, whole pages from position 0) that is cheaper to fetch than
        to recompute, or None if none up to ``max_pages`` pages is."""
        saved = self.seconds_saved(0, page_size, np.full(max_pages, from_disk), block_bytes)
        wins = np.flatnonzero(saved > 0)
        return None if wins.size == 0 else int(wins[0] + 1) * page_size
