"""Time to first token: fetch a cached prefix from host (or disk) or recompute it.

A prompt of ``P`` tokens (whole pages) runs on the tiny model (``configs/tiny.toml``) over a
``KVCache``, three ways, each timed from ``admit`` to the first token's logits on the host:

* recompute: nothing cached; one prefill step over all ``P`` tokens;
* host: the first ``P - page_size`` tokens' pages sit on host only (written back on
  eviction); admit fetches them, ``wait_ready`` scatters them into the pool, then one step
  prefills the last page (a prompt's last page is always computed);
* disk: the same pages on disk only (host copies dropped): restore, fetch, then the step.

Every configuration runs once untimed first (compilations), then ``--repeats`` times
interleaved; the table shows the fastest run (a shared machine only ever adds time).

The fit turns the rows into a ``CostModel`` (recompute: ``a + b*P + c*P**2/2`` seconds;
fetch: fixed latency plus bytes over bandwidth, beyond the last page's step) and reports
the break-even prompt length: measured (first ``P`` where fetching wins) and modelled.

    .venv/bin/python benchmarks/bench_fetch_vs_recompute.py [--lengths 32,64,...] [--repeats 5]
        [--no-disk]

Measured here (CPU, 2 cores shared with other jobs, load ~3; ``--repeats 7``), ms:

| prompt tokens | cached pages | recompute | disk | host | host vs recompute |
|---:|---:|---:|---:|---:|---:|
| 32 | 1 | 11.82 | 17.88 | 10.42 | 1.13x |
| 64 | 3 | 14.47 | 16.64 | 12.70 | 1.14x |
| 128 | 7 | 43.27 | 32.59 | 15.07 | 2.87x |
| 256 | 15 | 130.37 | 41.76 | 27.15 | 4.80x |
| 512 | 31 | 225.10 | 40.16 | 29.64 | 7.60x |
| 1024 | 63 | 331.13 | 67.75 | 30.02 | 11.03x |
| 2048 | 127 | 701.26 | 80.44 | 37.47 | 18.72x |

Break-even: host from the first size (32 tokens: one cached page, within the noise), disk
from 128 tokens measured (64 modelled). The fitted models of this and one more run are the
defaults of ``kvjax.cache.cost_model.CostModel``.
"""

from __future__ import annotations

import argparse
import functools
import sys
import tempfile
import time
from pathlib import Path

import jax
import numpy as np
from flax import nnx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kvjax.cache.cost_model import CostModel  # noqa: E402
from kvjax.config.presets import load_preset  # noqa: E402
from kvjax.serving.model import BatchInputs, ModelConfig, Transformer  # noqa: E402
from kvjax.tiers.kv_cache import KVCache, KVCacheConfig  # noqa: E402
from kvjax.tiers.page_pool import Buckets, PoolConfig  # noqa: E402

ALWAYS_FETCH = CostModel(recompute_seconds_per_token=1.0)  # the benchmark decides, not the cache


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--lengths", default="32,64,128,256,512,1024,2048",
                        help="prompt lengths in tokens, whole pages (default: %(default)s)")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--no-disk", action="store_true", help="skip the disk column")
    args = parser.parse_args()
    preset = load_preset("tiny")
    model_cfg = ModelConfig.from_dict(preset["model"])
    page_size = preset["cache"]["page_size"]
    lengths = [int(n) for n in args.lengths.split(",")]
    bad = [n for n in lengths if n % page_size or n < 2 * page_size]
    if bad:
        raise SystemExit(f"lengths {bad} must be multiples of page_size={page_size}, at least two pages")
    bench = Bench(model_cfg, page_size, max(lengths), disk=not args.no_disk)
    modes = ["recompute"] + ([] if args.no_disk else ["disk"]) + ["host"]  # disk's restore refills host
    times = {(mode, n): [] for mode in modes for n in lengths}
    for repeat in range(args.repeats + 1):  # pass 0 compiles
        for n in lengths:
            for mode in modes:
                seconds = bench.ttft(mode, n)
                if repeat:
                    times[(mode, n)].append(seconds)
    best = {key: min(values) for key, values in times.items()}
    bench.close()
    print_table(best, lengths, modes, page_size, bench.block_bytes)
    print_fit(best, lengths, modes, page_size, bench.block_bytes)
    print(f"\ncommand: benchmarks/bench_fetch_vs_recompute.py {' '.join(sys.argv[1:])}".rstrip())


class Bench:
    """One KVCache with host (and disk) tiers, the tiny model and a jitted paged step."""

    def __init__(self, model_cfg: ModelConfig, page_size: int, max_len: int, disk: bool):
        pages = max_len // page_size
        pool = PoolConfig(num_blocks=2 * pages + 2, num_layers=model_cfg.num_layers,
                          num_kv_heads=model_cfg.num_kv_heads, page_size=page_size,
                          head_dim=model_cfg.head_dim, dtype=model_cfg.dtype)  # fmt: skip
        self.block_bytes = pool.bytes_per_block
        self._tmp = tempfile.TemporaryDirectory() if disk else None
        config = KVCacheConfig(pool=pool, host_bytes=2 * pages * pool.bytes_per_block,
                               disk_dir=self._tmp.name if disk else None,
                               disk_bytes=(1 << 30) if disk else 0, cost_model=ALWAYS_FETCH,
                               vocab_size=model_cfg.vocab_size)  # fmt: skip
        self.cache = KVCache(config)
        self.page_size = page_size
        self.pages_per_seq = pages
        graphdef, self.state = nnx.split(Transformer(model_cfg))
        self.step = jax.jit(functools.partial(_step, graphdef), donate_argnums=(2,))
        self.prompts: dict[int, np.ndarray] = {}

    def ttft(self, mode: str, num_tokens: int) -> float:
        """Seconds from admit to the first token's logits for ``mode`` (see module docstring)."""
        cache = self.cache
        tokens = self._prompt(num_tokens, cached=mode != "recompute")
        if mode == "disk":  # every host copy goes (they all have disk copies)
            cache.evict_host(cache.stats.host_blocks)
        start = time.perf_counter()
        handle = cache.admit(tokens)
        if not cache.wait_ready(handle, timeout=60):
            raise RuntimeError("fetch did not finish in 60 s")
        hit = handle.num_hit_tokens
        expected = 0 if mode == "recompute" else num_tokens - self.page_size
        source = "device" if mode == "recompute" else mode
        by_tier = cache.admission_report(handle).hit_tokens
        if hit != expected or by_tier.get(source, 0) != expected:
            raise RuntimeError(f"{mode}: {by_tier} hit tokens, expected {expected}")
        logits = self._prefill(handle, tokens, hit)
        np.asarray(logits[num_tokens - hit - 1])  # the first token's logits, on the host
        seconds = time.perf_counter() - start
        if mode != "recompute":  # a recomputed prompt is never cached: it would crowd the host
            cache.commit(handle, tokens)
        cache.release(handle)
        cache.evict(cache.num_reclaimable)  # the fetched pages go back down for the next run
        cache.poll()
        return seconds

    def close(self) -> None:
        self.cache.close()
        if self._tmp is not None:
            self._tmp.cleanup()

    def _prompt(self, num_tokens: int, cached: bool) -> np.ndarray:
        """A fresh prompt each time (recompute), or one whose prefix was cached and spilled."""
        if not cached:
            return np.random.default_rng().integers(0, 256, num_tokens).astype(np.int32)
        if num_tokens not in self.prompts:
            tokens = np.random.default_rng(num_tokens).integers(0, 256, num_tokens).astype(np.int32)
            handle = self.cache.admit(tokens)
            self._prefill(handle, tokens, 0)
            self.cache.commit(handle, tokens)
            self.cache.release(handle)
            self.cache.evict(self.cache.num_reclaimable)  # write-back: the pages go to host
            if not self.cache.flush(timeout=60):  # ... and to disk, for the disk column
                raise RuntimeError("flush did not finish in 60 s")
            self.prompts[num_tokens] = tokens
        return self.prompts[num_tokens]

    def _prefill(self, handle, tokens: np.ndarray, start: int):
        pool = self.cache.pool
        count = len(tokens) - start
        meta = pool.build_batch([handle.block_table], [len(tokens)], [count],
                                buckets=Buckets(min_num_seqs=1, min_pages_per_seq=self.pages_per_seq))  # fmt: skip
        padded = np.zeros(len(meta.slot_mapping), np.int32)
        padded[:count] = tokens[start:]
        batch = BatchInputs(padded, meta.positions, meta.slot_mapping, meta.block_tables, meta.seq_lens,
                            meta.cu_q_lens, meta.num_seqs)  # fmt: skip
        logits, pool.kv_pages = self.step(self.state, batch, pool.kv_pages)
        return logits


def _step(graphdef, state, batch, kv_pages):
    return nnx.merge(graphdef, state)(batch, kv_pages)


def print_table(best, lengths, modes, page_size, block_bytes) -> None:
    print(f"Time to first token on {jax.default_backend()}, tiny model, page_size={page_size}, "
          f"{block_bytes} bytes per page (best of the repeats, ms):\n")
    header = "| prompt tokens | cached pages | " + " | ".join(f"{m} ms" for m in modes)
    header += " | host vs recompute | winner |" if "host" in modes else " |"
    print(header)
    print("|" + "---:|" * (len(modes) + 2) + ("---:|---|" if "host" in modes else ""))
    for n in lengths:
        row = [f"{best[(m, n)] * 1e3:.2f}" for m in modes]
        speed = best[("recompute", n)] / best[("host", n)]
        winner = min(modes, key=lambda m: best[(m, n)])
        print(f"| {n} | {n // page_size - 1} | " + " | ".join(row) + f" | {speed:.2f}x | {winner} |")


def print_fit(best, lengths, modes, page_size, block_bytes) -> None:
    """Least-squares CostModel from the rows, and the break-even prompt lengths."""
    n = np.array(lengths, np.float64)
    recompute = np.array([best[("recompute", int(k))] for k in lengths])
    a, b, c = np.linalg.lstsq(np.stack([np.ones_like(n), n, n * n / 2], 1), recompute, rcond=None)[0]
    last_page = a + b * page_size + c * page_size**2 / 2  # the step every mode runs
    blocks = n / page_size - 1
    host = np.array([best[("host", int(k))] for k in lengths]) - last_page
    latency, per_block = np.linalg.lstsq(np.stack([np.ones_like(blocks), blocks], 1), host, rcond=None)[0]
    fields = dict(recompute_seconds_per_token=max(b, 1e-9), recompute_seconds_per_token_position=max(c, 0.0),
                  fetch_latency_seconds=max(latency, 0.0), host_bytes_per_second=block_bytes / max(per_block, 1e-12))
    if "disk" in modes:
        disk = np.array([best[("disk", int(k))] - best[("host", int(k))] for k in lengths])
        d_latency, d_per_block = np.linalg.lstsq(np.stack([np.ones_like(blocks), blocks], 1), disk, rcond=None)[0]
        fields.update(disk_latency_seconds=max(d_latency, 0.0), disk_bytes_per_second=block_bytes / max(d_per_block, 1e-12))
    model = CostModel(**{k: float(f"{v:.3g}") for k, v in fields.items()})
    print(f"\nfitted: {model}")
    for mode in [m for m in modes if m != "recompute"]:
        wins = [k for k in lengths if best[(mode, k)] < best[("recompute", k)]]
        measured = f"{wins[0]} tokens" if wins else f"none up to {lengths[-1]}"
        modelled = model.break_even_tokens(page_size, block_bytes, from_disk=mode == "disk")
        modelled = "never" if modelled is None else f"{modelled + page_size} tokens"  # + the last page
        print(f"break-even ({mode}): measured at the first prompt of {measured}; modelled {modelled}")


if __name__ == "__main__":
    main()
