"""What the demo shows: a progress line while it runs, a headline comparing the two runs, and
the time-to-first-token plot (matplotlib, optional)."""

from __future__ import annotations

import time

from kvjax.serving.engine_events import Event, FinishEvent

__all__ = ["ProgressLine", "headline", "plot_ttft", "ttft_by_request"]


class ProgressLine:
    """A one-line progress bar on ``stream`` (None: silent), redrawn at most 10 times a second.

    >>> import io
    >>> with ProgressLine(io.StringIO(), "cached", 2) as bar:
    ...     pass
    """

    def __init__(self, stream, label: str, total: int, width: int = 30):
        self.stream, self.label, self.total, self.width = stream, label, max(total, 1), width
        self.done = 0
        self._start = time.perf_counter()
        self._drawn = 0.0

    def update(self, event: Event) -> None:
        if isinstance(event, FinishEvent):
            self.done += 1
            now = time.perf_counter()
            if now - self._drawn >= 0.1 or self.done == self.total:
                self._draw(now)

    def __enter__(self) -> ProgressLine:
        self._draw(self._start)
        return self

    def __exit__(self, *exc_info) -> None:
        if self.stream is not None:
            self._draw(time.perf_counter())
            self.stream.write("\n")
            self.stream.flush()

    def _draw(self, now: float) -> None:
        self._drawn = now
        if self.stream is None:
            return
        filled = self.width * self.done // self.total
        bar = "#" * filled + "." * (self.width - filled)
        self.stream.write(f"\r{self.label:>9} [{bar}] {self.done}/{self.total} requests "
                          f"{now - self._start:5.1f}s")  # fmt: skip
        self.stream.flush()


def ttft_by_request(result) -> dict[str, float]:
    """Seconds to first token of every request that produced one, by request id."""
    return {rid: f.ttft_seconds for rid, f in result.finishes.items() if f.ttft_seconds is not None}


def headline(demo) -> str:
    """Three lines: identical outputs, prefill work saved, TTFT and throughput compared."""
    snapshots = {name: engine.metrics.to_json() for name, engine in demo.engines.items()}
    ttft = {name: s["latencies"]["ttft_seconds"] for name, s in snapshots.items()}
    rate = {name: s["gauges"]["generated_tokens_per_second"] for name, s in snapshots.items()}
    cached, uncached = demo.prefill_tokens["cached"], demo.prefill_tokens["uncached"]
    ratio = uncached / cached if cached else float("inf")
    num = len(demo.results["cached"].outputs)
    same = "yes" if demo.identical else "NO (a bug: the cache must never change outputs)"
    return "\n".join([
        f"same generated tokens with and without the cache: {same} ({num} requests)",
        f"prefill tokens computed: {cached:,} cached vs {uncached:,} uncached ({ratio:.1f}x fewer)",
        f"time to first token p50 {_ms(ttft['cached']['p50'])} vs {_ms(ttft['uncached']['p50'])}, "
        f"p99 {_ms(ttft['cached']['p99'])} vs {_ms(ttft['uncached']['p99'])}; "
        f"throughput {rate['cached']:.0f} vs {rate['uncached']:.0f} generated tokens/s",
    ])


def plot_ttft(results: dict, path: str) -> str:
    """Writes the TTFT plot to ``path``; returns a line saying where (or why it was skipped)."""
    try:
        import matplotlib

        matplotlib.use("Agg")  # files only: no display needed
        import matplotlib.pyplot as plt
    except ImportError:
        return "plot skipped: matplotlib is not installed (pip install 'kvjax[demo]')"
    ttft = {name: ttft_by_request(result) for name, result in results.items()}
    order = list(results["uncached"].finishes)  # finish order of the uncached run: comparable per request
    fig, (per_request, cdf) = plt.subplots(1, 2, figsize=(11, 4))
    for name, style in (("uncached", "o"), ("cached", "s")):
        ids = [rid for rid in order if rid in ttft[name]]
        per_request.plot(range(len(ids)), [1e3 * ttft[name][rid] for rid in ids], style, ms=3, label=name)
        values = sorted(1e3 * v for v in ttft[name].values())
        cdf.step(values, [(i + 1) / len(values) for i in range(len(values))], where="post", label=name)
    per_request.set(yscale="log", xlabel="request", ylabel="time to first token (ms)",
                    title="TTFT per request")  # fmt: skip
    cdf.set(xscale="log", xlabel="time to first token (ms)", ylabel="fraction of requests",
            title="TTFT distribution")  # fmt: skip
    for axes in (per_request, cdf):
        axes.grid(True, alpha=0.3)
        axes.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return f"plot: {path}"


def _ms(seconds) -> str:
    return "-" if seconds is None else f"{1e3 * seconds:,.0f} ms"
