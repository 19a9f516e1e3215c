"""Markdown rendering of ``bench_paged_attention.py``'s JSON report: one section per kind of
job that ran (quantized decode, decode, prefill, tuning sweep) and the goal lines."""

from __future__ import annotations

__all__ = ["render_markdown"]


def render_markdown(report) -> str:
    """The report as markdown: one section per kind of job that ran."""
    lines = [f"# Paged attention benchmark ({report['device']}, jax {report['jax']})", "",
             f"Command: `{report['command']}`", "",
             f"Paged implementation: `{report['impl']}`. Copy bandwidth (x + 1, read + write): "
             f"**{report['copy_gb_s']:.0f} GB/s**."]
    lines += _render_quant(report)
    lines += _render_decode(report) + _render_prefill(report) + _render_sweep(report)
    if report["notes"]:
        lines += ["", "Notes:"] + [f"- {n}" for n in report["notes"]]
    return "\n".join(lines) + "\n"


def _render_decode(report) -> list[str]:
    rows = [r for r in report["decode"] if "skipped" not in r]
    if not rows:
        return []
    lines = ["", f"## Decode (one query token per sequence), {report['dtype']}", "",
             "| batch | ctx | K/V MiB | paged us | kernel-only us | paged GB/s | % copy "
             "| dense us | dense GB/s | shipped us | shipped GB/s | paged vs shipped "
             "| max diff (paged, shipped) |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in sorted(rows, key=lambda r: (r["batch"], r["ctx"])):
        p, d, s = r["paged"], r["dense"], r.get("jax_shipped")
        kernel = f"{r['kernel_only']['us']:.1f}" if "kernel_only" in r else "n/a"
        shipped = "n/a | n/a | n/a"
        if s:
            shipped = f"{s['us']:.1f} | {s['gb_s']:.3g} | {s['us'] / p['us']:.2f}x"
        diffs = f"{p['max_diff']:.1e}, " + (f"{s['max_diff']:.1e}" if s else "n/a")
        lines.append(
            f"| {r['batch']} | {r['ctx']} | {r['kv_mib']:.1f} | {p['us']:.1f} | {kernel} | "
            f"{p['gb_s']:.3g} | {100 * p['copy_frac']:.0f}% | {d['us']:.1f} | {d['gb_s']:.3g} | "
            f"{shipped} | {diffs} |")
    return lines + _headline(rows)


def _render_prefill(report) -> list[str]:
    if not report["prefill"]:
        return []
    lines = ["", f"## Chunked prefill, {report['dtype']}", "",
             "| chunks x tokens | ctx | paged us | paged tokens/s | paged TFLOP/s | dense us "
             "| dense tokens/s | max diff |", "|---|---|---|---|---|---|---|---|"]
    for r in report["prefill"]:
        p, d = r["paged"], r["dense"]
        lines.append(f"| {r['chunks']} x {r['q_len']} | {r['ctx']} | {p['us']:.1f} | "
                     f"{p['tokens_s']:.3g} | {p['tflop_s']:.3g} | {d['us']:.1f} | "
                     f"{d['tokens_s']:.3g} | {p['max_diff']:.1e} |")
    return lines


def _render_sweep(report) -> list[str]:
    if not report["sweep"]:
        return []
    lines = ["", "## Tuning sweep", "", "| batch x q tokens | ctx | variant | us | vs default "
             "| K/V bytes / time, % copy |", "|---|---|---|---|---|---|"]
    default_us = {}
    for r in report["sweep"]:
        case = (r["batch"], r["ctx"], r["q_len"])
        if "us" not in r:
            lines.append(f"| {case[0]} x {case[2]} | {case[1]} | {r['variant']} | "
                         f"{r['error']} | | |")
            continue
        default_us.setdefault(case, r["us"])
        lines.append(f"| {case[0]} x {case[2]} | {case[1]} | {r['variant'] or 'default'} | "
                     f"{r['us']:.1f} | {default_us[case] / r['us']:.2f}x | "
                     f"{100 * r['copy_frac']:.0f}% |")
    return lines


def _render_quant(report) -> list[str]:
    """The quantized decode table and, per format, the speed-up range in the goal's region."""
    rows = report.get("quant") or []
    if not rows:
        return []
    lines = ["", f"## Quantized decode against the {report['dtype']} pool (same shapes)", "",
             "Bytes read: quantized pages plus their scales; tokens/s: one decode token per "
             "sequence per call (one layer's attention).", "",
             "| batch | ctx | pool | variant | us | GB/s read | % copy | tokens/s | speed-up "
             f"vs {report['dtype']} | rel. error vs {report['dtype']} |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        case = f"| {r['batch']} | {r['ctx']} | {r['format']} | {r['variant'] or 'default'} |"
        if "error" in r:
            lines.append(f"{case} {r['error']} | | | | | |")
            continue
        lines.append(f"{case} {r['us']:.1f} | {r['gb_s']:.3g} | {100 * r['copy_frac']:.0f}% | "
                     f"{r['tokens_s']:.3g} | {r['speedup']:.2f}x | {100 * r['rel_err']:.2f}% |")
    goal = [r for r in rows if "us" in r and not r["variant"] and r["batch"] >= 32
            and r["ctx"] >= 4096 and r["format"] != report["dtype"]]
    lines.append("")
    for name in dict.fromkeys(r["format"] for r in goal):
        ups = [r["speedup"] for r in goal if r["format"] == name]
        met = sum(u >= 1.6 for u in ups)
        lines.append(f"- {name} (default tuning): {min(ups):.2f}-{max(ups):.2f}x the "
                     f"{report['dtype']} decode throughput at batch >= 32, ctx >= 4k; goal "
                     f">= 1.6x met in {met} of {len(ups)} shapes.")
    return lines


def _headline(decode_rows) -> list[str]:
    """One line on the target region: batch >= 32 and context >= 4k."""
    rows = [r for r in decode_rows if "paged" in r and r["batch"] >= 32 and r["ctx"] >= 4096]
    if not rows:
        return []
    fracs = [100 * r["paged"]["copy_frac"] for r in rows]
    line = (f"Batch >= 32, ctx >= 4k ({len(rows)} cases): paged reaches {min(fracs):.0f}-"
            f"{max(fracs):.0f}% of copy bandwidth")
    ratios = [r["jax_shipped"]["us"] / r["paged"]["us"] for r in rows if "jax_shipped" in r]
    if ratios:
        line += f"; {min(ratios):.2f}-{max(ratios):.2f}x the speed of JAX's shipped kernel"
    return ["", line + "."]
