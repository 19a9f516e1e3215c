"""Paged attention against dense attention and JAX's shipped GPU paged attention.

Decode: achieved K/V bandwidth (K/V bytes of the live tokens / time) against a copy
bandwidth measured in the same run (``x + 1`` over a large array: bytes read + written / time).
Chunked prefill: query tokens per second. Every timed implementation is also checked against
dense attention on the same inputs (the ``max|diff|`` columns), so a fast wrong kernel shows.

    python benchmarks/bench_paged_attention.py --out gpu_results/bench.json      # on a GPU
    python benchmarks/bench_paged_attention.py --quick --out /tmp/bench.json     # CPU smoke

Timing: compile and two warm-up calls, then ``--rounds`` rounds of ``n`` back-to-back calls
(``n`` sized to ~20 ms), each round ended by ``block_until_ready``; the median per-call time is
reported. Back-to-back dispatch hides Python overhead only when a call takes longer than its
dispatch, so the smallest cases overstate kernel time.

Quantized decode (``--quant`` adds it first, ``--quant-only`` runs only it): at the same shapes,
the paged kernel on the ``--dtype`` pool against int8 / fp8_e4m3 pools (per-token and per-page
scales, made from that pool): time, bytes read per second (quantized pages plus their scales),
decode tokens per second (one layer), the speed-up over ``--dtype`` and the relative error
norm of the output against the ``--dtype`` kernel's (the quantization error; a broken kernel
shows as ~100%). The issue's goal: >= 1.6x the bfloat16 decode throughput at ctx >= 4k.

    python benchmarks/bench_paged_attention.py --quant-only --out gpu_results/bench_quant.json
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import pathlib
import statistics
import sys
import time
import warnings

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))
from paged_attention_report import render_markdown  # noqa: E402  (benchmarks/, beside this file)

from pallas_kernels import paged_attention  # noqa: E402
from pallas_kernels.dispatch import tuning_keys  # noqa: E402
from pallas_kernels.kv_format import KVFormat, quantize_pool, relative_error  # noqa: E402

DECODE_BATCHES = (8, 32, 64, 128, 256)
DECODE_CONTEXTS = (512, 2048, 4096, 8192, 32768)
QUICK_BATCHES, QUICK_CONTEXTS = (2, 8), (256, 1024)
# --sweep: tuning variants of the GPU kernel, one knob at a time around the defaults, on a
# many-sequence decode, a few-long-sequences decode (split-K) and a chunked prefill:
# (batch, context, query tokens per sequence) -> variants.
_DECODE_VARIANTS = ({}, dict(pages_per_compute_block=4), dict(pages_per_compute_block=16),
                    dict(num_stages=2), dict(num_stages=4), dict(num_warps=8),
                    dict(num_splits=1), dict(num_splits=16), dict(num_splits=64))
_PREFILL_VARIANTS = ({}, dict(block_q=32), dict(block_q=32, num_warps=8), dict(num_warps=8),
                     dict(pages_per_compute_block=4), dict(num_stages=2))
SWEEPS = {(64, 8192, 1): _DECODE_VARIANTS, (8, 32768, 1): _DECODE_VARIANTS,
          (4, 2048, 512): _PREFILL_VARIANTS}
QUICK_SWEEPS = {(8, 1024, 1): _DECODE_VARIANTS[:3], (2, 256, 64): _PREFILL_VARIANTS[:2]}
# Quantized decode: (batch, context) in order of importance (all in the goal's region), and
# the pool formats set against the --dtype pool.
QUANT_CASES = ((64, 4096), (32, 8192), (128, 8192), (32, 32768), (256, 4096))
QUICK_QUANT_CASES = ((8, 1024), (2, 256))
QUANT_FORMATS = "int8/token,int8/page,fp8_e4m3/token,fp8_e4m3/page"
# Tuning probe, first quantized case only, GPU kernel only: the default step holds as many
# tokens as for bfloat16 (the converted tiles live in registers), i.e. half the bytes in
# flight; twice the pages with two stages keeps the staged shared memory about the same.
QUANT_PROBE = dict(pages_per_compute_block=16, num_stages=2)


def main() -> None:
    args = _parse_args()
    on_gpu = jax.default_backend() == "gpu"
    if args.quick:
        args.batches, args.contexts = QUICK_BATCHES, QUICK_CONTEXTS
        args.head_dim, args.prefill = 64, [(2, 64, 256)]
        args.max_kv_gib = min(args.max_kv_gib, 0.0625)
        args.dtype = "float32"  # XLA:CPU has no bfloat16 x bfloat16 -> float32 dot
        args.sweeps = QUICK_SWEEPS
        args.quant_cases = QUICK_QUANT_CASES
    impl = args.impl = args.impl or ("pallas_gpu" if on_gpu else "xla")
    started = time.perf_counter()
    copy_bw = copy_bandwidth(args.copy_mib * 2**20)
    report = dict(command=" ".join([pathlib.Path(sys.executable).name] + sys.argv),
                  backend=jax.default_backend(), device=str(jax.devices()[0].device_kind),
                  jax=jax.__version__, impl=impl, dtype=args.dtype, copy_gb_s=copy_bw / 1e9,
                  decode=[], prefill=[], sweep=[], quant=[], notes=[])
    skipped = []
    for kind, case in _jobs(args):
        if time.perf_counter() - started > args.budget_s:
            skipped.append(f"{kind} {case}")
            continue
        try:
            if kind == "quant":
                report["quant"] += bench_quant_decode(*case, args, impl, copy_bw)
            elif kind == "decode":
                report["decode"].append(bench_decode(*case, args, impl, on_gpu, copy_bw,
                                                     report["notes"]))
            elif kind == "sweep":
                report["sweep"].append(bench_variant(*case, args, impl, copy_bw))
            else:
                report["prefill"].append(bench_prefill(*case, args, impl))
        except Exception as error:  # one failing case (compile, OOM) must not end the run
            text = " ".join(str(error).split())[:300]
            report["notes"].append(f"{kind} {case} failed: {type(error).__name__}: {text}")
            print(f"{kind} {case} failed: {type(error).__name__}: {text}", file=sys.stderr, flush=True)
        _write(report, args.out)  # after every job: a step killed by its time limit keeps these
    if skipped:
        report["notes"].append(f"{len(skipped)} jobs not started, past --budget-s="
                               f"{args.budget_s:g}: " + "; ".join(skipped))
    print(_write(report, args.out))


def _write(report, out) -> str:
    """Writes the JSON report to ``out`` and its markdown beside it; returns the markdown."""
    text = render_markdown(report)
    if out:
        out = pathlib.Path(out)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(report, indent=2))
        out.with_suffix(".md").write_text(text)
    return text


def _parse_args():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help="small shapes for a CPU smoke run")
    p.add_argument("--impl", default=None, help="paged implementation (default: best here)")
    p.add_argument("--out", default=None, help="write JSON here and markdown beside it (.md)")
    p.add_argument("--batches", type=_ints, default=DECODE_BATCHES)
    p.add_argument("--contexts", type=_ints, default=DECODE_CONTEXTS)
    p.add_argument("--num-q-heads", type=int, default=8)
    p.add_argument("--num-kv-heads", type=int, default=2)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--page-size", type=int, default=16)
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    p.add_argument("--max-kv-gib", type=float, default=4.0, help="skip larger decode cases")
    p.add_argument("--copy-mib", type=int, default=None, help="copy-bandwidth array size")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--budget-s", type=float, default=600.0, help="stop starting new cases")
    p.add_argument("--sweep", action="store_true", help="also time GPU tuning variants")
    p.add_argument("--quant", action="store_true", help="quantized decode comparison first")
    p.add_argument("--quant-only", action="store_true", help="only the quantized comparison")
    p.add_argument("--quant-formats", type=_formats, default=QUANT_FORMATS,
                   help="pool formats QUANT/GRANULARITY, comma-separated")
    p.add_argument("--quant-cases", type=_cases, default=QUANT_CASES,
                   help="decode shapes BATCHxCTX, comma-separated")
    args = p.parse_args()
    args.prefill = [(4, 512, 2048), (1, 2048, 2048)]  # (chunks, tokens per chunk, context)
    args.sweeps = SWEEPS
    if args.copy_mib is None:
        args.copy_mib = 64 if args.quick else 2048
    return args


def _ints(text: str):
    return tuple(int(x) for x in text.split(","))


def _formats(text: str):
    try:
        return tuple(KVFormat(*name.split("/")) for name in text.split(","))
    except (TypeError, ValueError) as err:
        raise argparse.ArgumentTypeError(f"{text!r}: {err}") from None


def _cases(text: str):
    return tuple(tuple(int(n) for n in case.split("x")) for case in text.split(","))


def _jobs(args):
    """In order of importance, so a --budget-s cut drops the least useful: the quantized
    comparison when asked for, decode cases in the target region (batch >= 32, context >= 4k),
    prefill, the tuning sweep, other decode cases."""
    cases = [(b, c) for b in args.batches for c in args.contexts]
    target = [bc for bc in cases if bc[0] >= 32 and bc[1] >= 4096]
    # The variants are the GPU kernel's knobs; other implementations would ignore them.
    sweep = [("sweep", (*case, v)) for case, variants in args.sweeps.items() for v in variants
             if args.sweep and args.impl == "pallas_gpu"]
    probe = [QUANT_PROBE] if args.impl == "pallas_gpu" else []
    quant = [("quant", (*bc, [{}] + probe * (i == 0))) for i, bc in enumerate(args.quant_cases)]
    if args.quant_only:
        return quant
    return ((quant if args.quant else []) + [("decode", bc) for bc in target]
            + [("prefill", p) for p in args.prefill] + sweep
            + [("decode", bc) for bc in cases if bc not in target])


def time_call(fn, *args, rounds: int = 5) -> float:
    """Median seconds per call of ``fn(*args)`` (see the module docstring for the method)."""
    return _median_seconds(lambda: fn(*args), rounds)


def copy_bandwidth(nbytes: int, rounds: int = 5) -> float:
    """Bytes read + written per second by a jitted ``x + 1`` over ``nbytes`` of float32.

    The input is donated and the output fed back, so every call reuses one buffer: a fresh
    output per call would time page faults on a CPU. float32 because XLA:CPU widens bfloat16
    arithmetic, which would time conversions.
    """
    step = jax.jit(lambda a: a + 1, donate_argnums=0)
    state = [jnp.zeros((nbytes // 4,), jnp.float32)]

    def call():
        state[0] = step(state[0])
        return state[0]

    return 2 * nbytes / _median_seconds(call, rounds)


def _median_seconds(call, rounds: int, round_s: float = 0.02) -> float:
    """Warm up ``call`` (compile + 2 calls), then ``rounds`` rounds of ``n`` back-to-back calls
    sized to ~``round_s``, each ended by ``block_until_ready``; median seconds per call."""
    for _ in range(2):
        jax.block_until_ready(call())
    t0 = time.perf_counter()
    jax.block_until_ready(call())
    n = max(1, min(200, int(round_s / max(time.perf_counter() - t0, 1e-6))))
    per_call = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        for _ in range(n):
            out = call()
        jax.block_until_ready(out)
        per_call.append((time.perf_counter() - t0) / n)
    return statistics.median(per_call)


def make_paged_batch(rng, *, batch, ctx, q_len, args):
    """A pool with shuffled pages; every sequence holds ``ctx`` tokens, ``q_len`` of them new."""
    ps, kvh, d = args.page_size, args.num_kv_heads, args.head_dim
    dtype = jnp.dtype(args.dtype)
    pages = -(-ctx // ps)
    num_blocks = batch * pages + 1
    key = jax.random.PRNGKey(int(rng.integers(1 << 30)))
    kq, kp = jax.random.split(key)
    kv_pages = jax.random.normal(kp, (num_blocks, 1, 2, kvh, ps, d), dtype)
    tables = rng.permutation(num_blocks)[: batch * pages].reshape(batch, pages).astype(np.int32)
    q = jax.random.normal(kq, (batch * q_len, args.num_q_heads, d), dtype)
    return dict(q=q, kv_pages=kv_pages, block_tables=jnp.asarray(tables),
                seq_lens=jnp.full((batch,), ctx, jnp.int32),
                cu_q_lens=jnp.arange(batch + 1, dtype=jnp.int32) * q_len,
                num_seqs=jnp.array([batch], jnp.int32))


def contiguous_kv(inputs):
    """``[batch, kv heads, ctx, d]`` K and V gathered out of the pool (outside the timing)."""
    pages = inputs["kv_pages"][inputs["block_tables"], 0]  # [b, pages, 2, kvh, ps, d]
    b, n, _, kvh, ps, d = pages.shape
    kv = pages.transpose(2, 0, 3, 1, 4, 5).reshape(2, b, kvh, n * ps, d)
    return kv[0], kv[1]


@functools.partial(jax.jit, static_argnames=("q_len",))
def dense_attention(q, k, v, seq_lens, *, q_len):
    """Causal GQA attention over contiguous K/V: ``q [b * q_len, H, d]``, ``k/v [b, kvh, L, d]``."""
    b, kvh, ctx, d = k.shape
    qg = q.reshape(b, q_len, kvh, -1, d)
    logits = jnp.einsum("bqkgd,bkld->bkgql", qg, k, preferred_element_type=jnp.float32)
    q_pos = seq_lens[:, None] - q_len + jnp.arange(q_len)[None]  # [b, q_len]
    mask = jnp.arange(ctx)[None, None, :] <= q_pos[:, :, None]
    logits = jnp.where(mask[:, None, None], logits / math.sqrt(d), -jnp.inf)
    probs = jax.nn.softmax(logits, axis=-1).astype(v.dtype)
    out = jnp.einsum("bkgql,bkld->bqkgd", probs, v, preferred_element_type=jnp.float32)
    return out.reshape(q.shape).astype(q.dtype)


def shipped_paged_attention(inputs):
    """JAX's own GPU paged attention on equivalent inputs, or ``(None, reason)``."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            from jax.experimental.pallas.ops.gpu import paged_attention as shipped
    except ImportError as err:  # deprecated in 0.12; may be gone later
        return None, f"jax.experimental.pallas.ops.gpu.paged_attention unavailable: {err}"
    pool = inputs["kv_pages"][:, 0]  # [blocks, 2, kvh, ps, d]
    k_pages = pool[:, 0].transpose(1, 0, 2, 3)  # [kvh, blocks, ps, d]
    v_pages = pool[:, 1].transpose(1, 0, 2, 3)
    pages_per_seq = inputs["block_tables"].shape[1]
    k_splits = next(k for k in (16, 8, 4, 2, 1) if pages_per_seq % k == 0)
    per_split = pages_per_seq // k_splits
    ppcb = next(p for p in (8, 4, 2, 1) if per_split % p == 0)
    fn = jax.jit(functools.partial(shipped.paged_attention, k_splits=k_splits,
                                   pages_per_compute_block=ppcb))
    # It does not scale q; fold 1/sqrt(d) in outside the timing.
    q = inputs["q"] * (1.0 / math.sqrt(inputs["q"].shape[-1]))
    args = (q, k_pages, v_pages, inputs["block_tables"], inputs["seq_lens"])
    return (fn, args), f"k_splits={k_splits}, pages_per_compute_block={ppcb}"


def bench_decode(batch, ctx, args, impl, on_gpu, copy_bw, notes):
    kv_bytes = batch * ctx * args.num_kv_heads * args.head_dim * 2 * jnp.dtype(args.dtype).itemsize
    row = dict(batch=batch, ctx=ctx, kv_mib=kv_bytes / 2**20)
    if kv_bytes > args.max_kv_gib * 2**30:
        notes.append(f"decode batch={batch} ctx={ctx}: {kv_bytes / 2**30:.1f} GiB of K/V "
                     f"exceeds --max-kv-gib={args.max_kv_gib}")
        return row | dict(skipped="kv bytes over cap")
    inputs = make_paged_batch(np.random.default_rng(batch * 7 + ctx), batch=batch, ctx=ctx,
                              q_len=1, args=args)
    k, v = contiguous_kv(inputs)
    dense = functools.partial(dense_attention, q_len=1)
    expect = dense(inputs["q"], k, v, inputs["seq_lens"])
    timed = {"paged": (_paged_fn(impl, max_q_len=1), tuple(inputs.values())),
             "dense": (dense, (inputs["q"], k, v, inputs["seq_lens"]))}
    if on_gpu:
        shipped, note = shipped_paged_attention(inputs)
        if shipped is None:
            notes.append(note)
        else:
            timed["jax_shipped"] = shipped
            row["jax_shipped_config"] = note
    if impl == "pallas_gpu":
        timed["kernel_only"] = _kernel_only(inputs, interpret=not on_gpu, max_q_len=1)
    for name, (fn, fn_args) in timed.items():
        seconds = time_call(fn, *fn_args, rounds=args.rounds)
        row[name] = dict(us=seconds * 1e6, gb_s=kv_bytes / seconds / 1e9,
                         copy_frac=kv_bytes / seconds / copy_bw)
        if name != "kernel_only":  # its output is in the kernel's own row layout
            row[name]["max_diff"] = _max_diff(fn(*fn_args), expect)
    del inputs, k, v
    return row


def bench_prefill(chunks, q_len, ctx, args, impl):
    inputs = make_paged_batch(np.random.default_rng(ctx + q_len), batch=chunks, ctx=ctx,
                              q_len=q_len, args=args)
    k, v = contiguous_kv(inputs)
    dense = functools.partial(dense_attention, q_len=q_len)
    expect = dense(inputs["q"], k, v, inputs["seq_lens"])
    row = dict(chunks=chunks, q_len=q_len, ctx=ctx)
    visible = sum(ctx - q_len + i + 1 for i in range(q_len)) * chunks
    flops = 4 * visible * args.num_q_heads * args.head_dim
    timed = {"paged": (_paged_fn(impl, max_q_len=q_len), tuple(inputs.values())),
             "dense": (dense, (inputs["q"], k, v, inputs["seq_lens"]))}
    for name, (fn, fn_args) in timed.items():
        seconds = time_call(fn, *fn_args, rounds=args.rounds)
        row[name] = dict(us=seconds * 1e6, tokens_s=chunks * q_len / seconds,
                         tflop_s=flops / seconds / 1e12, max_diff=_max_diff(fn(*fn_args), expect))
    return row


def bench_variant(batch, ctx, q_len, variant, args, impl, copy_bw):
    """The paged implementation with tuning ``variant`` on one case; ``vs_default`` compares
    it with the first (default) variant of the same case."""
    row = dict(batch=batch, ctx=ctx, q_len=q_len, variant=variant)
    inputs = make_paged_batch(np.random.default_rng(batch * 7 + ctx), batch=batch, ctx=ctx,
                              q_len=q_len, args=args)
    try:
        seconds = time_call(_paged_fn(impl, max_q_len=q_len, **variant), *inputs.values(),
                            rounds=args.rounds)
    except Exception as err:  # a variant Triton cannot compile is a result, not a crash
        return row | dict(error=f"{type(err).__name__}: {str(err)[:200]}")
    kv_bytes = batch * ctx * args.num_kv_heads * args.head_dim * 2 * jnp.dtype(args.dtype).itemsize
    return row | dict(us=seconds * 1e6, copy_frac=kv_bytes / seconds / copy_bw)


def bench_quant_decode(batch, ctx, variants, args, impl, copy_bw):
    """Rows for one decode shape: the ``--dtype`` pool, then each quantized format made from
    it (with each tuning ``variant``); speed-up and error are against the ``--dtype`` row."""
    inputs = make_paged_batch(np.random.default_rng(batch * 7 + ctx), batch=batch, ctx=ctx,
                              q_len=1, args=args)
    meta = tuple(inputs.values())[2:]
    base_fn = _paged_fn(impl, max_q_len=1)
    base_s = time_call(base_fn, *inputs.values(), rounds=args.rounds)
    base_out = base_fn(*inputs.values())
    elements = batch * ctx * 2 * args.num_kv_heads * args.head_dim
    base_bytes = elements * jnp.dtype(args.dtype).itemsize
    head = dict(batch=batch, ctx=ctx)
    rows = [head | dict(format=args.dtype, variant={}, **_rates(base_s, base_bytes, batch, copy_bw),
                        speedup=1.0, rel_err=0.0)]
    for fmt in args.quant_formats:
        name = fmt.name()
        pool = quantize_pool(inputs["kv_pages"], fmt)
        nbytes = elements * fmt.bytes_per_element(args.head_dim, args.page_size)
        for variant in variants:
            row = head | dict(format=name, variant=variant)
            try:
                fn = _paged_fn(impl, max_q_len=1, **variant)
                seconds = time_call(fn, inputs["q"], pool, *meta, rounds=args.rounds)
                err = relative_error(fn(inputs["q"], pool, *meta), base_out)
            except Exception as error:  # a format or variant Triton cannot compile is a result
                text = " ".join(str(error).split()).replace("|", "/")  # one table cell
                rows.append(row | dict(error=f"{type(error).__name__}: {text[:200]}"))
                continue
            rows.append(row | _rates(seconds, nbytes, batch, copy_bw)
                        | dict(speedup=base_s / seconds, rel_err=err))
        del pool
    return rows


def _rates(seconds, nbytes, batch, copy_bw):
    return dict(us=seconds * 1e6, gb_s=nbytes / seconds / 1e9, copy_frac=nbytes / seconds / copy_bw,
                tokens_s=batch / seconds)


def _kernel_only(inputs, *, interpret, **tuning):
    """The GPU kernel's ``pallas_call`` alone on prepared inputs (default tuning, no split
    combine): the gap to the full call is what the jnp steps around it cost."""
    from pallas_kernels import paged_attention_gpu as gpu
    from pallas_kernels import paged_attention_gpu_plan as gpu_plan

    q, kv_pages, tables, seq_lens, cu_q_lens, num_seqs = inputs.values()
    plan = gpu_plan.make_plan(q, kv_pages, tables, interpret=interpret, block_q=None,
                              pages_per_compute_block=None, num_splits=None, **tuning)
    work = gpu_plan.work_items(cu_q_lens, seq_lens, num_seqs, plan)
    fn = jax.jit(lambda *a: gpu._call_kernel(
        *a, plan, layer=0, sm_scale=1 / math.sqrt(q.shape[-1]), sliding_window=None,
        soft_cap=None, interpret=interpret, num_warps=gpu._NUM_WARPS,
        num_stages=gpu._NUM_STAGES))
    return fn, (work, tables, gpu_plan.group_rows(q, plan), kv_pages)


def _max_diff(out, expect) -> float:
    return float(jnp.max(jnp.abs(out.astype(jnp.float32) - expect.astype(jnp.float32))))


def _paged_fn(impl, **tuning):
    # max_q_len is the GPU kernel's: an impl gets only the tuning it takes
    tuning = {k: v for k, v in tuning.items() if k in tuning_keys("paged_attention", impl)}
    return jax.jit(functools.partial(paged_attention, layer=0, impl=impl, **tuning))


if __name__ == "__main__":
    main()
