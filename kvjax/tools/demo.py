"""``python -m kvjax demo``: the tiny model serving a built-in workload, with the cache and
without, side by side.

The workload (``kvjax.tools.workload``: shared system prompts, multi-turn conversations, few-shot
templates, two tenants) runs twice on the ``tiny`` preset: once with the KV cache, once with
every request in a namespace of its own (the same engine, a cache that never hits). The demo
prints a few of the generated replies and the metrics of both runs side by side, checks that
both produced the same tokens, and writes a plot of time to first token per request (needs
matplotlib: ``pip install 'kvjax[demo]'``). The ``tiny`` preset's model has small trained
weights (``kvjax.tools.train_tiny``; ``--random-weights`` for random ones).

Exit status 1, with one line on stderr saying why, when no request finished in both runs (a
pool too small for the workload rejects them all), the outputs differ, or the cache saved no
prefill work; 2 for bad arguments (see ``kvjax.tools.cli``).

Compilations are cached on disk (``~/.cache/kvjax/jax``, or ``$JAX_COMPILATION_CACHE_DIR``)
so a second run starts in seconds; ``--no-compile-cache`` turns that off.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

import jax
import numpy as np

from kvjax.config.presets import load_preset
from kvjax.metrics.compilations import CompileCount
from kvjax.serving.engine import Engine
from kvjax.serving.preset import RANDOM_WEIGHTS
from kvjax.tools.cli import CommandError
from kvjax.tools.demo_kernels import kernel_checks
from kvjax.tools.demo_report import (
    UNCACHED_CAPTION,
    ProgressLine,
    check_plot_path,
    headline,
    plot_ttft,
    sample_replies,
)
from kvjax.tools.workload import Session, WorkloadResult, WorkloadSpec, build_workload, drive
from pallas_kernels.kv_format import FORMATS, GRANULARITIES

__all__ = ["DEMO_SPEC", "DemoResult", "add_subcommand", "run_demo"]

DEFAULT_PLOT = "kvjax_demo_ttft.png"
# The built-in workload with replies long enough to read (32 bytes; few-shot labels 16), and
# more system prompts than the device pool holds, each visited in turn: later questions find
# their prompt's KV on host or disk. Ten prompts, so that each revisit comes after more than
# device and host hold together: with eight, whether a revisit found its prompt on host or on
# disk hung on transfer timing (disk hit tokens 0-912 from run to run), with ten 960 each run.
DEMO_SPEC = WorkloadSpec(max_new_tokens=32, system_prompts=10, questions_per_system_prompt=4,
                         system_prompt_chars=1200, rotate_prompts=True)
DEMO_DISK_BYTES = 64 << 20
_DISK_PREFIX = "kvjax-demo-disk-"  # the cached run's disk tier: a temporary directory of this name


class DemoResult:
    """Both runs: ``engines`` and ``results`` keyed "cached" / "uncached", and the verdict.

    ``finished`` holds the ids of the requests that finished in each run, ``compared`` those
    that finished in both, ``identical`` whether both runs finished the same requests with the
    same tokens (None when no request finished in both: nothing to compare), ``rejected``
    the rejected requests' finish reasons by id, per run.
    """

    def __init__(self, engines: dict[str, Engine], results: dict[str, WorkloadResult], sessions: list[Session]):
        self.engines, self.results, self.sessions = engines, results, sessions
        self.finished = {name: {rid for rid, f in result.finishes.items() if f.status == "finished"}
                         for name, result in results.items()}
        self.rejected = {name: {rid: f.reason for rid, f in result.finishes.items() if f.status == "rejected"}
                         for name, result in results.items()}
        self.compared = sorted(self.finished["cached"] & self.finished["uncached"])
        cached, uncached = results["cached"].outputs, results["uncached"].outputs
        self.identical = None if not self.compared else (
            self.finished["cached"] == self.finished["uncached"]
            and all(np.array_equal(cached[rid], uncached[rid]) for rid in self.compared))
        counters = {name: engine.metrics.to_json()["counters"] for name, engine in engines.items()}
        self.prefill_tokens = {name: c["prefill_tokens"] for name, c in counters.items()}

    @property
    def ok(self) -> bool:
        return self.failure is None

    @property
    def failure(self) -> str | None:
        """Why the demo failed, in one line; None when it did not."""
        if self.identical is None:
            rejected = self.rejected["cached"]
            if rejected:
                rid, reason = next(iter(rejected.items()))
                return (f"no request finished: all {len(rejected)} submitted requests were rejected "
                        f"(first, {rid}: {reason}); expected a preset whose pool holds the workload's prompts")
            return "no request finished in both runs; nothing to compare"
        if not self.identical:
            return ("the cached run's outputs differ from the uncached run's (a bug: the cache must "
                    "never change outputs)")
        if self.prefill_tokens["cached"] >= self.prefill_tokens["uncached"]:
            return (f"the cache saved no prefill work: {self.prefill_tokens['cached']} prefill tokens "
                    f"cached vs {self.prefill_tokens['uncached']} uncached")
        return None


def run_demo(out=None, *, preset: str = "tiny", spec: WorkloadSpec | None = None,
             plot_path: str | None = DEFAULT_PLOT, progress=None, with_kernel_checks: bool = False,
             tiers: bool = True, **engine_overrides) -> DemoResult:  # fmt: skip
    """Runs the demo (see the module docstring), prints to ``out``, returns both runs.

    ``out`` defaults to ``sys.stdout``; ``spec`` sizes the workload; ``plot_path`` None skips
    the plot; ``progress``: a stream for a progress line (None: none); ``tiers``: the cached
    run keeps the preset's host tier and adds a disk tier in a temporary directory (when the
    preset has a host tier); ``engine_overrides`` go to ``Engine.from_preset`` (e.g.
    ``weights="random"``). A bad preset or plot path raises ValueError before anything runs.
    """
    out = out or sys.stdout  # looked up now: tests swap it
    if plot_path is not None:
        check_plot_path(plot_path)
    with tempfile.TemporaryDirectory(prefix=_DISK_PREFIX) as disk_dir:
        cached = (_tier_options(preset, engine_overrides, disk_dir) if tiers else None) or {
            **engine_overrides, "tiers": False}
        engines = {"cached": Engine.from_preset(preset, **cached),
                   "uncached": Engine.from_preset(preset, **{**engine_overrides, "tiers": False})}  # fmt: skip
        try:
            return _run(out, preset, engines, spec or DEMO_SPEC, plot_path, progress, with_kernel_checks,
                        engine_overrides.get("weights"))  # fmt: skip
        finally:
            for engine in engines.values():
                engine.close()


def _tier_options(preset: str, engine_overrides: dict, disk_dir: str) -> dict | None:
    """``from_preset`` options of a cached run with the preset's host tier and a disk tier in
    ``disk_dir``; None when the preset (or ``cache_options``) has no host tier."""
    options = dict(engine_overrides.get("cache_options") or {})
    host_bytes = options.get("host_bytes", load_preset(preset).get("tiers", {}).get("host_bytes", 0))
    if not host_bytes:
        return None
    options = {"disk_dir": disk_dir, "disk_bytes": DEMO_DISK_BYTES, **options}
    return {**engine_overrides, "cache_options": options}


def _run(out, preset, engines, spec, plot_path, progress, with_kernel_checks, weights) -> DemoResult:
    print(f"kvjax demo on {jax.default_backend()}: preset {preset!r}, {_weights_label(preset, weights)}", file=out)
    if with_kernel_checks:
        failed = kernel_checks(out)
        if failed:
            print(f"{failed} kernel check(s) failed", file=out)
    sessions = build_workload(spec)
    start = time.perf_counter()
    compiled = sum(engine.warmup() for engine in engines.values())
    cached = engines["cached"]
    pool_cfg = cached.pool.config
    print(f"page pool: {pool_cfg.num_blocks} blocks of {pool_cfg.page_size} tokens, pages stored as "
          f"{pool_cfg.kv_format.name() if pool_cfg.kv_quant else pool_cfg.dtype}, "
          f"{pool_cfg.bytes_per_block} bytes per block", file=out)  # fmt: skip
    print(f"tiers of the cached run: {_tiers_line(cached.cache, preset)}", file=out)
    print(f"warm-up: {compiled} compilations (model step for token buckets {cached.runner.token_buckets}, "
          f"tier moves and swaps for transfer buckets {cached.cache.config.transfer_buckets}) "
          f"in {time.perf_counter() - start:.1f}s", file=out)  # fmt: skip
    num_requests = sum(len(s.turns) for s in sessions)
    print(f"workload: {len(sessions)} sessions, {num_requests} requests "
          f"(system prompts, multi-turn, few-shot; tenants {sorted({s.namespace for s in sessions})})", file=out)
    results, after_warmup = {}, {}
    for name, engine in engines.items():
        with ProgressLine(progress, name, num_requests) as bar:
            count, start = CompileCount(), time.perf_counter()
            results[name] = drive(engine, sessions, isolate=name == "uncached", on_event=bar.update)
            engine.summary(time.perf_counter() - start, engine.num_generated_tokens)
            after_warmup[name] = count.value
    result = DemoResult(engines, results, sessions)
    replies = sample_replies(result)
    if replies:
        print("\nsome replies (end of the prompt -> generated text):", file=out)
        print("\n".join(replies), file=out)
    metrics = {name: engine.metrics for name, engine in engines.items()}
    print("\n" + metrics["cached"].summary_table(metrics["uncached"], labels=("cached", "uncached")), file=out)
    print(f"({UNCACHED_CAPTION}: its misses of prompts seen before count as other_namespace)", file=out)
    print("\n" + headline(result), file=out)
    print(f"compilations after warm-up: {after_warmup['cached']} cached, {after_warmup['uncached']} uncached",
          file=out)  # fmt: skip
    if plot_path is not None and result.compared:
        print(plot_ttft(result, plot_path), file=out)
    return result


def _tiers_line(cache, preset: str) -> str:
    config = cache.config
    if not config.tiered:
        return "device only"
    block = config.pool.bytes_per_block
    disk = ""
    if config.disk_dir:
        preset_dir = load_preset(preset).get("tiers", {}).get("disk_dir", "")
        instead = f" (not the preset's disk_dir {preset_dir!r})" if preset_dir and preset_dir != config.disk_dir else ""
        temporary = Path(config.disk_dir).name.startswith(_DISK_PREFIX)
        disk = f", disk {config.disk_bytes >> 20} MiB in " + (f"a temporary directory{instead}" if temporary
                                                              else repr(config.disk_dir))  # fmt: skip
    return f"device {config.pool.num_blocks} blocks, host {config.host_bytes // block} blocks{disk}"


def add_subcommand(subparsers) -> None:
    """Registers ``python -m kvjax demo``."""
    parser = subparsers.add_parser("demo", help="serve a built-in workload with and without the KV cache")
    parser.add_argument("--preset", default="tiny",
                        help="a shipped preset's name or the path of a .toml file (default: %(default)s)")
    parser.add_argument("--random-weights", action="store_true",
                        help="random model weights instead of the preset's trained ones")
    parser.add_argument("--plot", default=DEFAULT_PLOT, metavar="PNG",
                        help="where to write the TTFT plot (default: %(default)s)")  # fmt: skip
    parser.add_argument("--no-plot", action="store_true", help="skip the plot")
    parser.add_argument("--kernel-checks", action="store_true",
                        help="first check the kernels against their references (adds ~10-20s on CPU)")
    parser.add_argument("--no-tiers", action="store_true",
                        help="the cached run without host and disk tiers (default: the preset's host "
                             "tier and a disk tier in a temporary directory)")
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
    # The progress line redraws with \r: only on a terminal, so logs and pipes get none.
    result = run_demo(preset=args.preset, plot_path=None if args.no_plot else args.plot,
                      with_kernel_checks=args.kernel_checks, tiers=not args.no_tiers,
                      cache_options=cache_options or None,
                      weights=RANDOM_WEIGHTS if args.random_weights else None,
                      progress=sys.stderr if sys.stderr.isatty() else None)  # fmt: skip
    if result.failure is not None:
        raise CommandError(result.failure)
    return 0


def enable_compile_cache() -> None:
    """Persist XLA compilations (seconds each on CPU) across runs, in ``~/.cache/kvjax/jax``
    (or ``$JAX_COMPILATION_CACHE_DIR``); the demo and the benchmarks that run the engine share it."""
    directory = os.environ.get("JAX_COMPILATION_CACHE_DIR") or str(Path.home() / ".cache" / "kvjax" / "jax")
    jax.config.update("jax_compilation_cache_dir", directory)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.1)


def _weights_label(preset: str, weights) -> str:
    """Which weights ``Engine.from_preset(preset, weights=weights)`` loads, for the header."""
    if weights is None:
        weights = load_preset(preset).get("weights", RANDOM_WEIGHTS)
    return "random weights" if weights == RANDOM_WEIGHTS else f"weights {Path(weights).name}"
