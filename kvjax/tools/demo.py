"""``python -m kvjax demo``: the tiny model serving a built-in workload, with the cache and
without, side by side.

The workload (``kvjax.tools.workload``: shared system prompts, multi-turn conversations, few-shot
templates, two tenants) runs twice on the ``tiny`` preset: once with the KV cache, once with
every request in a namespace of its own (the same engine, a cache that never hits). The demo
prints the metrics of both runs side by side, checks that both produced the same tokens,
and writes a plot of time to first token per request (needs matplotlib: ``pip install
'kvjax[demo]'``). Exits non-zero if the outputs differ or the cache saved no prefill work.

Compilations are cached on disk (``~/.cache/kvjax/jax``, or ``$JAX_COMPILATION_CACHE_DIR``)
so a second run starts in seconds; ``--no-compile-cache`` turns that off.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import jax
import numpy as np

from kvjax.serving.engine import Engine
from kvjax.tools.demo_kernels import kernel_checks
from kvjax.tools.demo_report import ProgressLine, headline, plot_ttft
from kvjax.tools.workload import (
    Session,
    WorkloadResult,
    WorkloadSpec,
    build_workload,
    drive,
)
from pallas_kernels.kv_format import FORMATS, GRANULARITIES

__all__ = ["DemoResult", "add_subcommand", "run_demo"]

DEFAULT_PLOT = "kvjax_demo_ttft.png"


class DemoResult:
    """Both runs: ``engines`` and ``results`` keyed "cached" / "uncached", and the verdict."""

    def __init__(self, engines: dict[str, Engine], results: dict[str, WorkloadResult], sessions: list[Session]):
        self.engines, self.results, self.sessions = engines, results, sessions
        cached, uncached = results["cached"].outputs, results["uncached"].outputs
        self.identical = cached.keys() == uncached.keys() and all(
            np.array_equal(cached[k], uncached[k]) for k in cached)
        counters = {name: engine.metrics.to_json()["counters"] for name, engine in engines.items()}
        self.prefill_tokens = {name: c["prefill_tokens"] for name, c in counters.items()}

    @property
    def ok(self) -> bool:
        return self.identical and self.prefill_tokens["cached"] < self.prefill_tokens["uncached"]


def run_demo(out=sys.stdout, *, preset: str = "tiny", spec: WorkloadSpec | None = None,
             plot_path: str | None = DEFAULT_PLOT, progress=sys.stderr, with_kernel_checks: bool = False,
             tiers: bool = False, **engine_overrides) -> DemoResult:  # fmt: skip
    """Runs the demo (see the module docstring), prints to ``out``, returns both runs.

    ``spec`` sizes the workload; ``plot_path`` None skips the plot; ``progress`` None hides
    the progress line; ``tiers`` keeps the preset's host/disk tiers (off by default: today
    every new number of blocks moved between tiers costs an XLA compilation, seconds on
    CPU, which would swamp the comparison); ``engine_overrides`` go to ``Engine.from_preset``.
    """
    print(f"kvjax demo on {jax.default_backend()}: preset {preset!r}", file=out)
    if with_kernel_checks:
        failed = kernel_checks(out)
        if failed:
            print(f"{failed} kernel check(s) failed", file=out)
    sessions = build_workload(spec)
    engines = {name: Engine.from_preset(preset, tiers=tiers, **engine_overrides) for name in ("cached", "uncached")}
    start = time.perf_counter()
    compiled = sum(engine.runner.warmup() for engine in engines.values())
    pool_cfg = engines["cached"].pool.config
    print(f"page pool: {pool_cfg.num_blocks} blocks of {pool_cfg.page_size} tokens, pages stored as "
          f"{pool_cfg.kv_format.name() if pool_cfg.kv_quant else pool_cfg.dtype}, "
          f"{pool_cfg.bytes_per_block} bytes per block", file=out)  # fmt: skip
    print(f"warm-up: {compiled} compilations of the model step (token buckets "
          f"{engines['cached'].runner.token_buckets}) in {time.perf_counter() - start:.1f}s", file=out)
    num_requests = sum(len(s.turns) for s in sessions)
    print(f"workload: {len(sessions)} sessions, {num_requests} requests "
          f"(system prompts, multi-turn, few-shot; tenants {sorted({s.namespace for s in sessions})})", file=out)
    results = {}
    for name, engine in engines.items():
        with ProgressLine(progress, name, num_requests) as bar:
            start = time.perf_counter()
            results[name] = drive(engine, sessions, isolate=name == "uncached", on_event=bar.update)
            engine.summary(time.perf_counter() - start, engine.num_generated_tokens)
        engine.close()
    result = DemoResult(engines, results, sessions)
    metrics = {name: engine.metrics for name, engine in engines.items()}
    print("\n" + metrics["cached"].summary_table(metrics["uncached"], labels=("cached", "uncached")), file=out)
    print("\n" + headline(result), file=out)
    if plot_path is not None:
        print(plot_ttft(results, plot_path), file=out)
    return result


def add_subcommand(subparsers) -> None:
    """Registers ``python -m kvjax demo``."""
    parser = subparsers.add_parser("demo", help="serve a built-in workload with and without the KV cache")
    parser.add_argument("--preset", default="tiny", help="configs/<preset>.toml (default: %(default)s)")
    parser.add_argument("--plot", default=DEFAULT_PLOT, metavar="PNG",
                        help="where to write the TTFT plot (default: %(default)s)")  # fmt: skip
    parser.add_argument("--no-plot", action="store_true", help="skip the plot")
    parser.add_argument("--kernel-checks", action="store_true",
                        help="first check the kernels against their references (adds ~10-20s on CPU)")
    parser.add_argument("--tiers", action="store_true",
                        help="keep the preset's host/disk tiers below the device pool")
    parser.add_argument("--kv-quant", default=None, choices=["none", *FORMATS],
                        help="store pages quantized in both runs (default: the preset's [cache] kv_quant)")
    parser.add_argument("--kv-scale", default=None, choices=list(GRANULARITIES),
                        help="quantization scales per token or per page (default: the preset's)")
    parser.add_argument("--no-compile-cache", action="store_true",
                        help="do not keep compiled steps in ~/.cache/kvjax/jax between runs")  # fmt: skip
    parser.set_defaults(func=_main)


def _main(args: argparse.Namespace) -> int:
    if not args.no_compile_cache:
        enable_compile_cache()
    cache_options = {key: value for key, value in (("kv_quant", args.kv_quant), ("kv_scale", args.kv_scale))
                     if value is not None}  # fmt: skip
    result = run_demo(preset=args.preset, plot_path=None if args.no_plot else args.plot,
                      with_kernel_checks=args.kernel_checks, tiers=args.tiers,
                      cache_options=cache_options or None)  # fmt: skip
    return 0 if result.ok else 1


def enable_compile_cache() -> None:
    """Persist XLA compilations (seconds each on CPU) across runs, in ``~/.cache/kvjax/jax``
    (or ``$JAX_COMPILATION_CACHE_DIR``); the demo and the benchmarks that run the engine share it."""
    directory = os.environ.get("JAX_COMPILATION_CACHE_DIR") or str(Path.home() / ".cache" / "kvjax" / "jax")
    jax.config.update("jax_compilation_cache_dir", directory)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.1)
