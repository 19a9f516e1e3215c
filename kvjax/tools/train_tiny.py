"""``python -m kvjax.tools.train_tiny``: trains the ``tiny`` preset's model, writes the weights
the package ships (``configs/tiny.npz``) and reports their held-out loss.

Text: the project's own documentation, under the project's licence (Apache-2.0), read from
the source checkout, nothing downloaded. The model trains on ``README.md``, the docstrings of
``kvjax/``, ``benchmarks/`` and ``tests/``, and the same docstrings again as chat turns
(``User: What does Engine.step do?`` / ``Assistant: <its docstring>``), so that the demo's
prompts, which end in ``Assistant:``, get a sentence back. The docstrings of
``pallas_kernels/`` are held out (the model never trains on them) and its loss on them is
reported in bits per byte (8 is a uniform guess over bytes). The model is byte-level, so
what it learns is the project's English: enough for readable demo output, not for correct
answers. Code markup (backticks, reST roles) is stripped from all text.

Training: ``steps`` AdamW steps of ``batch`` random ``seq_len``-byte windows, warm-up then
cosine decay, with a fixed seed: the same checkout and library versions give the same weights.
A few minutes on two CPU cores. The weights are stored as float16 (the model computes in
float32; the held-out figure is measured after the rounding).

    python -m kvjax.tools.train_tiny [--steps 1000] [--out configs/tiny.npz] [--force]
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import hashlib
import math
import re
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from kvjax.config.presets import load_preset
from kvjax.serving.model import ModelConfig, Transformer, load_weights, save_weights

__all__ = ["TrainSettings", "bits_per_byte", "corpus", "heldout_sequences", "main",
           "mean_log_likelihood_dense", "train"]

CHECKOUT = Path(__file__).resolve().parents[2]
TRAIN_SOURCES = ("kvjax", "benchmarks", "tests")  # docstrings, after README.md
HELDOUT_SOURCES = ("pallas_kernels",)
_ROLE = re.compile(r":[a-z]+:`~?([^`]*)`")  # :func:`name` -> name
_BACKTICKS = re.compile(r"`+")
_DOCUMENTED = (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)


@dataclasses.dataclass(frozen=True)
class TrainSettings:
    steps: int = 1000
    batch: int = 2
    # Bytes per training window: as long as the demo's prompts (up to ~700 bytes). Trained on
    # 128-byte windows, the model babbled past ~150 bytes of context.
    seq_len: int = 1024
    peak_lr: float = 3e-3
    weight_decay: float = 0.1  # AdamW's: held-out loss 3.05 vs 3.12 bits/byte with 1e-4 and 6e-3
    warmup: int = 50  # steps
    seed: int = 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m kvjax.tools.train_tiny",
                                     description=__doc__.splitlines()[0].replace("``", ""))
    parser.add_argument("--steps", type=int, default=TrainSettings.steps, help="(default: %(default)s)")
    parser.add_argument("--out", type=Path, default=CHECKOUT / "configs" / "tiny.npz",
                        help="weights file to write (default: the shipped configs/tiny.npz)")
    parser.add_argument("--force", action="store_true", help="replace --out if it exists")
    args = parser.parse_args(argv)
    if args.steps < 1:
        parser.error(f"--steps {args.steps} must be >= 1")
    if args.out.exists() and not args.force:
        parser.error(f"--out {str(args.out)!r} exists; pass --force to replace it")
    train_text, heldout_text = corpus(CHECKOUT)
    cfg = ModelConfig.from_dict(load_preset("tiny")["model"])
    settings = TrainSettings(steps=args.steps)
    digest = hashlib.sha256(train_text.encode()).hexdigest()[:12]  # which checkout text made the weights
    print(f"training text: {len(train_text.encode()):,} bytes (sha256 {digest}); "
          f"held out: {len(heldout_text.encode()):,} bytes")
    start = time.perf_counter()
    model, losses = train(cfg, train_text, settings, progress=sys.stdout)
    print(f"trained {settings.steps} steps in {time.perf_counter() - start:.0f}s; training loss "
          f"{losses[0] / math.log(2):.2f} -> {np.mean(losses[-50:]) / math.log(2):.2f} bits/byte "
          "(mean of the last 50 steps)")
    tmp = args.out.with_name(f".{args.out.name}.tmp.npz")
    tmp.unlink(missing_ok=True)
    save_weights(model, tmp, dtype="float16")
    tmp.replace(args.out)  # a crash mid-save leaves no half file under the real name
    shipped = load_weights(cfg, args.out)
    heldout = heldout_sequences(heldout_text, seq_len=256)
    print(f"held-out loss ({heldout.shape[0]} windows of {heldout.shape[1]} bytes): "
          f"{bits_per_byte(shipped, heldout):.3f} bits/byte; weights: {args.out} "
          f"({args.out.stat().st_size:,} bytes)")
    return 0


def corpus(checkout: Path = CHECKOUT) -> tuple[str, str]:
    """``(train, held_out)`` text of the checkout (see the module docstring)."""
    readme = checkout / "README.md"
    if not readme.is_file():
        raise ValueError(f"{str(readme)!r} not found; expected a kvjax source checkout")
    documented = [pair for folder in TRAIN_SOURCES for pair in _docstrings(checkout / folder)]
    turns = [f"User: {question}\nAssistant: {doc.split(chr(10) + chr(10))[0]}" for question, doc in documented]
    train_parts = [readme.read_text(encoding="utf-8")] + [doc for _, doc in documented] + turns
    heldout_parts = [doc for folder in HELDOUT_SOURCES for _, doc in _docstrings(checkout / folder)]
    return _plain("\n\n".join(train_parts)), _plain("\n\n".join(heldout_parts))


def train(cfg: ModelConfig, text: str, settings: TrainSettings, *,
          progress=None) -> tuple[Transformer, list[float]]:  # fmt: skip
    """Next-byte training of a fresh ``Transformer(cfg)`` on random windows of ``text``;
    returns the model and the loss of every step (nats per byte). ``progress``: a stream that
    gets a line every 10% of the steps."""
    import optax  # training only: serving never needs it

    data = np.frombuffer(text.encode(), np.uint8).astype(np.int32)
    if len(data) <= settings.seq_len + 1:
        raise ValueError(f"text has {len(data)} bytes; expected more than seq_len={settings.seq_len} + 1")
    model = Transformer(cfg, seed=settings.seed)
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    warmup = min(settings.warmup, settings.steps // 2)  # the decay needs >= 1 step
    schedule = optax.warmup_cosine_decay_schedule(0.0, settings.peak_lr, warmup,
                                                  settings.steps, settings.peak_lr / 10)
    optimizer = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(schedule, weight_decay=settings.weight_decay))

    def loss_fn(params, windows):  # windows: i32[batch, seq_len + 1]
        logits = jax.vmap(nnx.merge(graphdef, params, rest).forward_dense)(windows[:, :-1])
        picked = jnp.take_along_axis(jax.nn.log_softmax(logits), windows[:, 1:, None], -1)
        return -picked.mean()

    @jax.jit
    def step(params, opt_state, windows):
        loss, grads = jax.value_and_grad(loss_fn)(params, windows)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    rng = np.random.default_rng(settings.seed)
    opt_state, losses = optimizer.init(params), []
    for index in range(settings.steps):
        starts = rng.integers(0, len(data) - settings.seq_len - 1, settings.batch)
        windows = np.stack([data[s:s + settings.seq_len + 1] for s in starts])
        params, opt_state, loss = step(params, opt_state, jnp.asarray(windows))
        losses.append(float(loss))
        if progress is not None and (index + 1) % max(1, settings.steps // 10) == 0:
            print(f"  step {index + 1}/{settings.steps}: loss {losses[-1] / math.log(2):.2f} bits/byte",
                  file=progress, flush=True)
    nnx.update(model, params)
    return model, losses


def heldout_sequences(text: str, num_seqs: int | None = None, seq_len: int = 256) -> np.ndarray:
    """``text``'s bytes as ``i32[num_seqs, seq_len]`` rows (all whole rows when ``num_seqs`` is
    None)."""
    data = np.frombuffer(text.encode(), np.uint8).astype(np.int32)
    available = len(data) // seq_len
    num_seqs = available if num_seqs is None else num_seqs
    if num_seqs < 1 or num_seqs > available:
        raise ValueError(f"text has {len(data)} bytes: {available} rows of {seq_len=}, "
                         f"fewer than {num_seqs=} (expected >= 1)")
    return data[: num_seqs * seq_len].reshape(num_seqs, seq_len)


def mean_log_likelihood_dense(model: Transformer, sequences: np.ndarray) -> float:
    """Mean log-probability (nats per token) of ``sequences  # i32[num_seqs, seq_len]``, each
    token predicted from those before it in its row, by the dense forward (no pool)."""
    logits = jax.vmap(model.forward_dense)(jnp.asarray(sequences))
    log_probs = jax.nn.log_softmax(logits[:, :-1])
    picked = jnp.take_along_axis(log_probs, jnp.asarray(sequences)[:, 1:, None], -1)
    return float(picked.mean())


def bits_per_byte(model: Transformer, sequences: np.ndarray) -> float:
    """The model's loss on ``sequences`` in bits per byte (the byte tokenizer: a token is a byte)."""
    return -mean_log_likelihood_dense(model, sequences) / math.log(2)


def _plain(text: str) -> str:
    """``text`` without reST/Markdown code markup (``:func:`x```, double and single backticks):
    a byte model otherwise spends its capacity, and its greedy replies, on backticks."""
    return _BACKTICKS.sub("", _ROLE.sub(r"\1", text))


def _docstrings(folder: Path) -> list[tuple[str, str]]:
    """``(question, docstring)`` for every module, class and function docstring under
    ``folder`` (recursively, in path order); the question asks what the documented thing is."""
    found = []
    for path in sorted(folder.rglob("*.py")):
        module = ".".join(path.relative_to(folder.parent).with_suffix("").parts)
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            doc = ast.get_docstring(node) if isinstance(node, _DOCUMENTED) else None
            if not doc:
                continue
            if isinstance(node, ast.Module):
                question = f"What is in {module}?"
            elif isinstance(node, ast.ClassDef):
                question = f"What is {node.name}?"
            else:
                question = f"What does {node.name} do?"
            found.append((question, doc))
    return found


if __name__ == "__main__":
    sys.exit(main())
