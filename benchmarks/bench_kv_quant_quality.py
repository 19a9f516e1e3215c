"""What quantized KV pages cost in quality, end to end on the tiny model.

For the float pool and every format x scale granularity, with random weights and with the
tiny model's shipped trained weights:

* greedy agreement: the demo workload (``kvjax.tools.workload``, as ``python -m kvjax demo`` runs
  it) served by ``Engine.from_preset("tiny", tiers=False, cache_options={"kv_quant": ...,
  "kv_scale": ...})``, compared request by request with the float pool's run: the share of
  generated tokens identical at the same position, the mean number of tokens before the first
  difference, and the share of requests identical throughout. After a multi-turn request
  differs, the session's later prompts differ too (they hold the reply), so later turns
  compare answers to different prompts: the prefix count is the cleaner of the two numbers;
* log-likelihood: mean log-probability (nats per token) of a fixed held-out text,
  teacher-forced through the paged model on a pool of that format, in chunks of ``--chunks``
  tokens per sequence (so later chunks attend to KV that earlier ones wrote, quantized; a
  chunk of 1 writes token by token, as decoding does), and its change against the float pool.
  The dense forward (no pool) is printed as a check of the float row.

A random-weight model's greedy output is near-degenerate (a repeated byte), which flatters
agreement, and its likelihood is ~uniform. So the trained weights the ``tiny`` preset ships
(``configs/tiny.npz``, made by ``python -m kvjax.tools.train_tiny`` from the checkout's
README and docstrings) are measured too; the held-out text is the docstrings of
``pallas_kernels/``, which that training leaves out.

    .venv/bin/python benchmarks/bench_kv_quant_quality.py [--quick] [--chunks 24,1]

XLA compilations are cached on disk as the demo does (``--no-compile-cache`` turns it off).
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from kv_quant_common import ALL_FORMATS, command_line, format_table

from kvjax.config.presets import load_preset
from kvjax.serving.engine import Engine
from kvjax.serving.model import BatchInputs, ModelConfig, Transformer, load_weights
from kvjax.tiers.page_pool import Buckets, bucket, build_batch
from kvjax.tools.demo import enable_compile_cache
from kvjax.tools.train_tiny import corpus, heldout_sequences, mean_log_likelihood_dense
from kvjax.tools.workload import WorkloadSpec, build_workload, drive
from pallas_kernels.kv_format import KVFormat, empty_pool

REPO = Path(__file__).resolve().parents[1]
QUICK_SPEC = WorkloadSpec(system_prompts=1, questions_per_system_prompt=4, conversations=2,
                          turns_per_conversation=2, few_shot_templates=1, queries_per_template=3)


@dataclasses.dataclass(frozen=True)
class Agreement:
    """Greedy outputs of a run against the reference run's (fractions in [0, 1])."""

    identical_tokens: float  # reference tokens matched at the same position
    mean_prefix: float  # tokens before the first difference, mean over requests
    identical_requests: float  # requests whose whole output matches
    mean_length: float  # reference tokens per request, mean


def main() -> None:
    args = parse_args()
    if args.compile_cache:
        enable_compile_cache()
    preset, spec = "tiny", QUICK_SPEC if args.quick else WorkloadSpec()
    sections = load_preset(preset)
    cfg = ModelConfig.from_dict(sections["model"])
    _, heldout = corpus(REPO)
    seed = sections.get("engine", {}).get("seed", 0)
    models = {"random": _committed(Transformer(cfg, seed=seed)),
              "trained": _committed(load_weights(cfg, sections["weights"]))}
    sequences = heldout_sequences(heldout, args.ll_seqs, args.ll_len)
    print(f"tiny model {cfg}\nworkload: {len(build_workload(spec))} sessions; held-out text: "
          f"{sequences.shape[0]} sequences x {sequences.shape[1]} bytes\n")
    for name, model in models.items():
        rows, dense, sample = quality_rows(preset, model, spec, sequences, args.chunks)
        print(f"{name} weights: dense forward (no pool) {dense:.4f} nats/token; "
              f"most varied reply on the float pool: {sample!r}")
        headers = ["format", "identical greedy tokens", "tokens before 1st diff (mean)",
                   "identical requests"]
        for chunk in args.chunks:
            headers += [f"LL chunk {chunk} (nats/token)", "delta vs float"]
        print(format_table(headers, rows) + "\n")
    print(f"command: {command_line()}")


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true",
                        help="a smaller workload, one short chunking")
    parser.add_argument("--chunks", type=lambda s: [int(c) for c in s.split(",")], default=None,
                        help="prefill chunk sizes of the likelihood columns (default: 24,1; --quick: 24)")
    parser.add_argument("--ll-seqs", type=int, default=8, help="held-out sequences")
    parser.add_argument("--ll-len", type=int, default=256, help="bytes per held-out sequence")
    parser.add_argument("--no-compile-cache", dest="compile_cache", action="store_false")
    args = parser.parse_args()
    if args.chunks is None:  # --quick keeps chunks given by hand (it used to replace them)
        args.chunks = [24] if args.quick else [24, 1]
    if args.quick:
        args.ll_seqs, args.ll_len = min(args.ll_seqs, 4), min(args.ll_len, 128)
    return args


def quality_rows(preset: str, model: Transformer, spec: WorkloadSpec, sequences: np.ndarray,
                 chunks: list[int]):
    """Table rows (one per format), the dense forward's log-likelihood and, to show how
    degenerate the model's greedy output is, the float pool run's most varied reply as text."""
    outputs, likelihoods = {}, {}
    for fmt in ALL_FORMATS:
        start = time.perf_counter()
        engine = Engine.from_preset(preset, tiers=False, model=model,
                                    cache_options={"kv_quant": fmt.quant or "none",
                                                   "kv_scale": fmt.granularity})
        outputs[fmt] = drive(engine, build_workload(spec)).outputs
        engine.close()
        likelihoods[fmt] = [mean_log_likelihood(model, sequences, fmt, chunk, max(chunks))
                            for chunk in chunks]
        print(f"  {fmt.name()}: {time.perf_counter() - start:.1f}s", flush=True)
    base = KVFormat()
    rows = []
    for fmt in ALL_FORMATS:
        agree = greedy_agreement(outputs[base], outputs[fmt])
        row = [fmt.name(), f"{agree.identical_tokens:.1%}",
               f"{agree.mean_prefix:.2f} of {agree.mean_length:.2f}",
               f"{agree.identical_requests:.1%}"]
        for ll, ll_float in zip(likelihoods[fmt], likelihoods[base]):
            row += [f"{ll:.4f}", f"{ll - ll_float:+.4f}"]
        rows.append(row)
    sample = max(outputs[base].values(), key=lambda tokens: len(set(tokens.tolist())))
    text = bytes(int(t) for t in sample if t < 256).decode(errors="replace")
    return rows, mean_log_likelihood_dense(model, sequences), text


# --- greedy agreement --------------------------------------------------------------------------


def greedy_agreement(reference: dict[str, np.ndarray], other: dict[str, np.ndarray]) -> Agreement:
    """Compares ``other``'s generated tokens with ``reference``'s, request id by request id.

    A request missing from ``other`` matches nothing; tokens past the shorter output differ.
    """
    if not reference:
        raise ValueError("reference has no requests; expected the outputs of a run")
    matched = prefix_total = identical = total = 0
    for request_id, ref in reference.items():
        ref = np.asarray(ref)
        out = np.asarray(other.get(request_id, np.zeros(0, ref.dtype)))
        n = min(len(ref), len(out))
        same = ref[:n] == out[:n]
        matched += int(same.sum())
        prefix_total += n if same.all() else int(np.argmin(same))
        identical += int(len(ref) == len(out) and bool(same.all()))
        total += len(ref)
    count = len(reference)
    return Agreement(matched / total if total else 1.0, prefix_total / count, identical / count,
                     total / count)


# --- log-likelihood ----------------------------------------------------------------------------


def mean_log_likelihood(model: Transformer, sequences: np.ndarray, fmt: KVFormat, chunk: int,
                        pad_chunk: int | None = None, page_size: int = 16) -> float:
    """Mean log-probability (nats/token) of ``sequences  # i32[num_seqs, seq_len]``, each token
    predicted from the ones before it in its row, prefilled ``chunk`` tokens per row per step
    through the paged forward on a fresh pool in ``fmt`` (every row in every step).

    Steps are padded to ``pad_chunk`` (>= ``chunk``) tokens per row, so calls with different
    chunks but one ``pad_chunk`` share a compilation."""
    num_seqs, seq_len = sequences.shape
    pages_per_seq = -(-seq_len // page_size)
    cfg = model.cfg
    shape = (num_seqs * pages_per_seq, cfg.num_layers, 2, cfg.num_kv_heads, page_size, cfg.head_dim)
    kv_pages = empty_pool(shape, fmt, cfg.jnp_dtype)
    tables = [list(range(s * pages_per_seq, (s + 1) * pages_per_seq)) for s in range(num_seqs)]
    # One padded token count for every step: one compilation per format and pad_chunk.
    buckets = Buckets(num_seqs, pages_per_seq, bucket(num_seqs * max(chunk, pad_chunk or 0), 1))
    graphdef, state = nnx.split(model)
    total = 0.0
    for begin in range(0, seq_len, chunk):
        q = min(chunk, seq_len - begin)
        meta = build_batch(tables, [begin + q] * num_seqs, [q] * num_seqs, page_size=page_size,
                           num_blocks=shape[0], buckets=buckets)
        tokens = np.zeros(meta.slot_mapping.shape, np.int32)
        tokens[: num_seqs * q] = sequences[:, begin:begin + q].reshape(-1)
        # Token at position p predicts p + 1; the last position of a row predicts nothing.
        targets = np.zeros_like(tokens)
        has_target = np.zeros(tokens.shape, bool)
        nxt = np.arange(begin + 1, begin + q + 1)
        targets[: num_seqs * q] = sequences[:, np.minimum(nxt, seq_len - 1)].reshape(-1)
        has_target[: num_seqs * q] = np.tile(nxt < seq_len, num_seqs)
        inputs = BatchInputs(tokens, meta.positions, meta.slot_mapping, meta.block_tables,
                             meta.seq_lens, meta.cu_q_lens, meta.num_seqs)
        log_probs, kv_pages = _target_log_probs(graphdef, state, inputs, kv_pages, targets)
        total += float(np.asarray(log_probs)[has_target].sum())
    return total / (num_seqs * (seq_len - 1))


@functools.partial(jax.jit, static_argnums=0, donate_argnums=3)
def _target_log_probs(graphdef, state, inputs: BatchInputs, kv_pages, targets):
    model = nnx.merge(graphdef, state)
    logits, kv_pages = model(inputs, kv_pages)  # [num_tokens, vocab]
    log_probs = jax.nn.log_softmax(logits, axis=-1)
    return jnp.take_along_axis(log_probs, targets[:, None], -1)[:, 0], kv_pages


def _committed(model: Transformer) -> Transformer:
    """``model`` with its arrays committed to the default device, as restored checkpoints
    are: jit keys compilations on that too, so otherwise random and trained weights would
    compile every step twice."""
    nnx.update(model, jax.device_put(nnx.state(model), jax.devices()[0]))
    return model


if __name__ == "__main__":
    main()
