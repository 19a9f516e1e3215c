"""What the demo shows: a progress line while it runs, a few generated replies, a headline
comparing the two runs, and the time-to-first-token plot (matplotlib, optional)."""

from __future__ import annotations

import math
import os
import time
from pathlib import Path

import numpy as np

from kvjax.serving.engine_events import Event, FinishEvent

__all__ = ["UNCACHED_CAPTION", "ProgressLine", "check_plot_path", "headline", "plot_ttft", "sample_replies",
           "ttft_by_request", "ttft_figure"]

UNCACHED_CAPTION = ("uncached: the same requests on the same engine, each in a namespace of its own, "
                    "so nothing hits the cache")


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


def sample_replies(demo, per_kind: int = 1, prompt_chars: int = 40) -> list[str]:
    """Lines showing the end of the prompt and the generated text of the first finished
    request of each session kind (``per_kind`` each), from the cached run."""
    tokenizer = demo.engines["cached"].tokenizer
    kinds = {session.session_id: session.kind for session in demo.sessions}
    shown: dict[str, int] = {}
    lines = []
    for request_id, finish in demo.results["cached"].finishes.items():
        kind = kinds.get(request_id.split("/")[0], "?")
        if finish.status != "finished" or finish.text is None or shown.get(kind, 0) >= per_kind:
            continue
        try:
            prompt = tokenizer.decode(finish.prompt_token_ids[-prompt_chars:])
        except (TypeError, ValueError):  # a tokenizer without decode, or a cut mid-character
            continue
        shown[kind] = shown.get(kind, 0) + 1
        lines.append(f"  {request_id:<16} ...{prompt!r} -> {finish.text!r}")
    return lines


def headline(demo) -> str:
    """The verdict in a few lines: rejections, identical outputs, prefill work saved, TTFT and
    throughput compared."""
    snapshots = {name: engine.metrics.to_json() for name, engine in demo.engines.items()}
    ttft = {name: s["latencies"]["ttft_seconds"] for name, s in snapshots.items()}
    rate = {name: s["gauges"]["generated_tokens_per_second"] for name, s in snapshots.items()}
    lines = []
    for name in ("cached", "uncached"):
        rejected, submitted = demo.rejected[name], len(demo.results[name].finishes)
        if rejected:
            rid, reason = next(iter(rejected.items()))
            lines.append(f"{name} run: {len(rejected)} of {submitted} requests rejected (first, {rid}: {reason})")
    if demo.identical is None:
        lines.append("same generated tokens with and without the cache: not checked, "
                     "no request finished in both runs")
    else:
        same = "yes" if demo.identical else "NO (a bug: the cache must never change outputs)"
        lines.append(f"same generated tokens with and without the cache: {same} ({len(demo.compared)} requests)")
    cached, uncached = demo.prefill_tokens["cached"], demo.prefill_tokens["uncached"]
    saved = f" ({uncached / cached:.1f}x fewer)" if cached and uncached else ""
    lines += [
        f"prefill tokens computed: {cached:,} cached vs {uncached:,} uncached{saved}",
        f"time to first token p50 {_ms(ttft['cached']['p50'])} vs {_ms(ttft['uncached']['p50'])}, "
        f"p99 {_ms(ttft['cached']['p99'])} vs {_ms(ttft['uncached']['p99'])}; "
        f"throughput {rate['cached']:.0f} vs {rate['uncached']:.0f} generated tokens/s",
    ]
    return "\n".join(lines)


def check_plot_path(path) -> None:
    """ValueError unless a plot can be written at ``path``: not a folder, in a folder that
    exists and, when matplotlib is installed (else the plot is skipped), with an extension it
    writes and a file that can be opened for writing (tried; a new one is removed again)."""
    target = Path(path)
    if target.is_dir():
        raise ValueError(f"plot path {str(path)!r} is a folder; expected a file name such as ttft.png")
    folder = target.parent
    if not folder.is_dir():
        raise ValueError(f"plot path {str(path)!r}: folder {str(folder)!r} does not exist; "
                         "expected a file in an existing folder")
    formats = _plot_formats()
    if formats is not None and target.suffix.lower().lstrip(".") not in formats:
        raise ValueError(f"plot path {str(path)!r} ends in {target.suffix or 'no extension'!r}; "
                         f"expected one of {', '.join('.' + f for f in sorted(formats))}")
    if formats is None:  # no matplotlib: the plot is skipped, nothing is written
        return
    existed = target.exists()
    try:  # opened for append, not written: a file there is left as it is (non-blocking: a FIFO fails, not hangs)
        os.close(os.open(target, os.O_WRONLY | os.O_CREAT | os.O_APPEND | getattr(os, "O_NONBLOCK", 0), 0o666))
    except OSError as error:  # found only at savefig, after both runs of the workload
        raise ValueError(f"plot path {str(path)!r} cannot be written ({error.strerror or error}); "
                         "expected a file in a folder you can write") from None
    if not existed:
        target.unlink(missing_ok=True)


def plot_ttft(demo, path: str) -> str:
    """Writes the TTFT plot of ``demo``'s two runs to ``path``; returns a line saying where
    (or why it was skipped)."""
    try:
        import matplotlib

        matplotlib.use("Agg")  # files only: no display needed
        import matplotlib.pyplot as plt
    except ImportError:
        return "plot skipped: matplotlib is not installed (pip install 'kvjax[demo]')"
    ttft = {name: ttft_by_request(result) for name, result in demo.results.items()}
    order = list(demo.results["uncached"].finishes)  # finish order of the uncached run: comparable per request
    fig = ttft_figure(ttft, order)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return f"plot: {path}"


def ttft_figure(ttft: dict[str, dict[str, float]], order: list[str]):
    """The TTFT figure: per request (in ``order``) and as a distribution, of
    ``ttft[run][request_id]`` (seconds) for the runs "cached" and "uncached"; p50/p99 in the
    title, one legend for both panels (none over the data), what "uncached" means in a caption."""
    import matplotlib.pyplot as plt

    fig, (per_request, cdf) = plt.subplots(1, 2, figsize=(11, 4.8))
    headline_parts = []
    for name, style in (("cached", "s"), ("uncached", "o")):
        ms = {rid: 1e3 * seconds for rid, seconds in ttft[name].items()}
        if not ms:
            continue
        p50, p99 = np.percentile(list(ms.values()), [50, 99])
        headline_parts.append(f"{name} p50 {_ms_text(p50)}, p99 {_ms_text(p99)}")
        color = "tab:orange" if name == "cached" else "tab:blue"
        ids = [rid for rid in order if rid in ms]
        per_request.plot(range(len(ids)), [ms[rid] for rid in ids], style, ms=3, color=color, label=name)
        values = sorted(ms.values())
        cdf.step(values, [(i + 1) / len(values) for i in range(len(values))], where="post", color=color)
    all_ms = [1e3 * v for run in ttft.values() for v in run.values()]
    _readable_ms_axis(per_request.yaxis, per_request.set_yscale, all_ms)
    _readable_ms_axis(cdf.xaxis, cdf.set_xscale, all_ms)
    per_request.set(xlabel="request (in the uncached run's finish order)", ylabel="time to first token (ms)",
                    title="TTFT per request")  # fmt: skip
    cdf.set(xlabel="time to first token (ms)", ylabel="fraction of requests", title="TTFT distribution",
            ylim=(0, 1.04))  # fmt: skip
    for fraction, label in ((0.5, "p50"), (0.99, "p99")):
        cdf.axhline(fraction, color="gray", lw=0.6, ls=":")
        cdf.annotate(label, (0, fraction), xycoords=("axes fraction", "data"), xytext=(3, 2),
                     textcoords="offset points", fontsize=8, color="gray")  # fmt: skip
    for axes in (per_request, cdf):
        axes.grid(True, alpha=0.3)
    fig.suptitle("Time to first token: " + " vs ".join(headline_parts), fontsize=11, y=0.98)
    fig.legend(*per_request.get_legend_handles_labels(), loc="upper center", ncol=2, frameon=False,
               bbox_to_anchor=(0.5, 0.94), markerscale=2)  # fmt: skip
    fig.text(0.5, 0.01, UNCACHED_CAPTION, ha="center", va="bottom", fontsize=9, color="dimgray")
    fig.tight_layout(rect=(0, 0.04, 1, 0.9))
    return fig


# --- helpers ---------------------------------------------------------------------------------


def _readable_ms_axis(axis, set_scale, values_ms: list[float]) -> None:
    """Log scale with ticks at 1-2-5 (or powers of ten over many decades), labelled in plain
    milliseconds, no minor labels; linear with a few ticks when the values span under 10x
    (a log axis there gets only minor labels, which overlap)."""
    from matplotlib.ticker import FuncFormatter, LogLocator, MaxNLocator, NullFormatter, ScalarFormatter

    positive = [v for v in values_ms if v > 0]
    low, high = (min(positive), max(positive)) if positive else (1.0, 1.0)
    if high / low < 10:
        set_scale("linear")
        axis.set_major_locator(MaxNLocator(nbins=6))
        axis.set_major_formatter(ScalarFormatter(useOffset=False))  # decimals as the ticks need
        return
    set_scale("log")
    decades = math.log10(high / low)
    axis.set_major_locator(LogLocator(base=10, subs=(1.0, 2.0, 5.0) if decades <= 2.5 else (1.0,)))
    axis.set_minor_formatter(NullFormatter())
    axis.set_major_formatter(FuncFormatter(lambda value, _: _ms_number(value)))


def _ms_number(value: float) -> str:
    return f"{value:,.0f}" if value >= 1 else f"{value:.2g}"


def _ms_text(milliseconds: float) -> str:
    return f"{_ms_number(milliseconds)} ms"


def _plot_formats() -> set[str] | None:
    try:
        from matplotlib.backend_bases import FigureCanvasBase
    except ImportError:
        return None
    return set(FigureCanvasBase.get_supported_filetypes())


def _ms(seconds) -> str:
    return "-" if seconds is None else _ms_text(1e3 * seconds)
