"""TTFT saving from prefix hits against the ideal saving, at several hit ratios.

A request of ``L`` prompt tokens whose first ``h * L`` tokens are cached on the device runs
alone on an idle engine (``max_new_tokens=1``: its time to first token is its prefill). The
uncached TTFT is the same request in a fresh namespace. Saving = ``1 - TTFT(h) / TTFT(0)``.

FLOP model (forward pass, multiply-adds counted as 2 FLOPs), for a token at position ``p``:

    dense(p) = 2 * (d * (Hq + 2 * Hkv) * hd      # q, k, v projections
                    + Hq * hd * d                # output projection
                    + 3 * d * mlp                # SwiGLU MLP
                    + d * vocab)                 # logits (the model computes them per token)
    attn(p)  = 2 * 2 * Hq * hd * (p + 1)         # q.k over p+1 keys, then p.v
    per layer for every term but the logits.

Prefilling positions ``[s, L)`` costs ``F(s) = sum_{p=s}^{L-1} dense(p) + attn(p)``; the ideal
TTFT at hit ratio h is ``TTFT(0) * F(hL) / F(0)`` (ideal saving ``1 - F(hL)/F(0)``). The
engine pads a step's tokens to its bucket ladder, so a second yardstick counts FLOPs of the
padded token count ("bucket ideal"): what the engine can reach with its compiled shapes.
Goal: measured saving >= 90% of the ideal saving at h >= 0.5.

    .venv/bin/python benchmarks/bench_ttft.py [--prompt-len 1024] [--repeats 5]
        [--ratios 0.25,0.5,0.6,0.75,0.875] [--preset tiny]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kvjax.serving.engine import Engine  # noqa: E402
from kvjax.serving.engine_config import EngineConfig  # noqa: E402
from kvjax.serving.engine_events import FinishEvent  # noqa: E402
from kvjax.serving.model import ModelConfig  # noqa: E402
from kvjax.serving.model_runner import ModelRunner  # noqa: E402
from kvjax.serving.scheduler_config import SchedulerConfig  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", default="tiny")
    parser.add_argument("--prompt-len", type=int, default=1024)
    parser.add_argument("--ratios", default="0.25,0.5,0.6,0.75,0.875", help="hit ratios besides 0")
    parser.add_argument("--repeats", type=int, default=5, help="measurements per ratio; the minimum is kept")
    args = parser.parse_args()
    length = args.prompt_len
    ratios = [float(r) for r in args.ratios.split(",")]
    engine = _engine(args.preset, length)
    page = engine.pool.config.page_size
    start = time.perf_counter()
    print(f"warm-up: {engine.warmup()} compilations in {time.perf_counter() - start:.1f}s "
          f"(token buckets {engine.runner.token_buckets})")  # fmt: skip
    rng = np.random.default_rng(0)
    rows = []
    for h in [0.0] + [r for r in ratios if r > 0]:
        cached = int(h * length) // page * page
        rows.append((h, cached, min(_ttft(engine, rng, length, cached, f"h{h}-{r}") for r in range(args.repeats))))
    _print_table(engine, rows, rows[0][2], length)


def _engine(preset: str, length: int) -> Engine:
    """Device-only engine whose whole prompt fits one step, with a power-of-two ladder."""
    scheduler = SchedulerConfig(max_num_seqs=8, token_budget=length, max_prefill_chunk=length)
    ladder = tuple(1 << k for k in range(5, (length - 1).bit_length() + 1))  # 32 ... >= length
    config = EngineConfig(max_model_len=2 * length, token_buckets=ladder)
    return Engine.from_preset(preset, tiers=False, scheduler_config=scheduler, config=config)


def _ttft(engine: Engine, rng, length: int, cached: int, namespace: str) -> float:
    """Prime ``cached`` tokens of a fresh prompt in ``namespace``, then time the full prompt."""
    prompt = rng.integers(0, 256, length).astype(np.int32)
    if cached:
        engine.add_request(f"{namespace}/prime", tokens=prompt[: cached + 1], max_new_tokens=1, namespace=namespace)
        list(engine.run(summary=False))
    engine.add_request(f"{namespace}/measure", tokens=prompt, max_new_tokens=1, namespace=namespace)
    finish = next(e for e in engine.run(summary=False) if isinstance(e, FinishEvent))
    if finish.num_hit_tokens != cached:
        raise RuntimeError(f"expected {cached} hit tokens, got {finish.num_hit_tokens}")
    return finish.ttft_seconds


def prefill_flops(cfg: ModelConfig, start: int, end: int) -> float:
    """FLOPs to prefill positions ``[start, end)`` (see the module docstring)."""
    per_layer = cfg.d_model * (cfg.num_q_heads + 2 * cfg.num_kv_heads) * cfg.head_dim
    per_layer += cfg.num_q_heads * cfg.head_dim * cfg.d_model + 3 * cfg.d_model * cfg.mlp_dim
    dense = 2 * (cfg.num_layers * per_layer + cfg.d_model * cfg.vocab_size)
    positions = np.arange(start, end, dtype=np.float64)
    attention = 2 * 2 * cfg.num_q_heads * cfg.head_dim * cfg.num_layers * (positions + 1)
    return float(dense * (end - start) + attention.sum())


def _print_table(engine: Engine, rows, baseline: float, length: int) -> None:
    cfg, runner = engine.model.cfg, engine.runner
    total = prefill_flops(cfg, 0, length)
    print(f"\nprompt {length} tokens, model {cfg.num_layers} layers x d_model {cfg.d_model}, "
          f"page {engine.pool.config.page_size}; TTFT = min over repeats")
    header = (f"{'h':>6} {'cached':>7} {'computed':>9} {'bucket':>7} {'TTFT ms':>9} {'saving':>8} "
              f"{'ideal':>7} {'meas/ideal':>10} {'bucket ideal':>12} {'meas/bucket':>11}")
    print(header + "\n" + "-" * len(header))
    for h, cached, ttft in rows:
        computed = length - cached
        padded = _bucket(runner, computed)
        saving = 1 - ttft / baseline
        ideal = 1 - prefill_flops(cfg, cached, length) / total
        # The padded tokens cost dense FLOPs (attention skips them: their queries are masked).
        bucket_ideal = 1 - (prefill_flops(cfg, cached, length)
                            + (padded - computed) * (prefill_flops(cfg, 0, 1) - _attn(cfg, 0))) / total
        print(f"{h:>6.3f} {cached:>7} {computed:>9} {padded:>7} {1e3 * ttft:>9.2f} {saving:>8.1%} "
              f"{ideal:>7.1%} {_ratio(saving, ideal):>10} {bucket_ideal:>12.1%} {_ratio(saving, bucket_ideal):>11}")
    print("\ncommand: .venv/bin/python benchmarks/bench_ttft.py " + " ".join(sys.argv[1:]))


def _attn(cfg: ModelConfig, position: int) -> float:
    return 2 * 2 * cfg.num_q_heads * cfg.head_dim * cfg.num_layers * (position + 1)


def _bucket(runner: ModelRunner, num_tokens: int) -> int:
    return next(b for b in runner.token_buckets if b >= num_tokens)


def _ratio(measured: float, ideal: float) -> str:
    return "-" if ideal <= 0 else f"{measured / ideal:.0%}"


if __name__ == "__main__":
    main()
