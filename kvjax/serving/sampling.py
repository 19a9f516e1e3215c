"""Sampling settings and the on-device sampler of the engine's jitted step.

Greedy by default. ``temperature > 0`` samples from ``softmax(logits / temperature)``,
restricted to the ``top_k`` largest logits when ``top_k > 0``. Every draw uses the key
``fold_in(key(seed), index)`` where ``index`` is the number of tokens the request has
generated so far, so a request's tokens depend only on its seed and its own logits: not on
which other requests share its batch, nor on a preemption and recompute in between.

Settings travel to the device as per-row arrays (:class:`SamplingBatch`), so mixing greedy and
sampled requests in one step never changes a shape and never recompiles.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np

__all__ = ["SamplingParams", "SamplingBatch", "GREEDY", "sample", "sampling_batch"]


@dataclasses.dataclass(frozen=True, slots=True)
class SamplingParams:
    """How one request picks its tokens.

    ``temperature`` 0 means greedy (argmax); ``top_k`` 0 means the whole vocabulary;
    ``seed`` (an int in [0, 2**32)) makes sampled tokens reproducible; None lets the engine
    derive one from its own seed and the request's arrival order.
    """

    temperature: float = 0.0
    top_k: int = 0
    seed: int | None = None

    def __post_init__(self):
        if not isinstance(self.temperature, (int, float)) or isinstance(self.temperature, bool) \
                or not math.isfinite(self.temperature) or self.temperature < 0:
            raise ValueError(f"temperature={self.temperature!r} must be a finite number >= 0")
        if not isinstance(self.top_k, int) or isinstance(self.top_k, bool) or self.top_k < 0:
            raise ValueError(f"top_k={self.top_k!r} must be an int >= 0 (0: no limit)")
        if self.seed is not None and (not isinstance(self.seed, int) or not 0 <= self.seed < 2**32):
            raise ValueError(f"seed={self.seed!r} must be None or an int in [0, 2**32)")

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0


GREEDY = SamplingParams()
_INT32_MAX = 2**31 - 1


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class SamplingBatch:
    """Per-row sampling settings of one step, padded to the step's ``max_num_seqs`` rows."""

    temperature: jax.Array  # f32[max_num_seqs], 0 = greedy
    top_k: jax.Array  # i32[max_num_seqs], 0 = no limit
    seed: jax.Array  # u32[max_num_seqs]
    index: jax.Array  # i32[max_num_seqs], tokens the request generated before this draw


def sampling_batch(rows: list[tuple[SamplingParams, int, int]], max_num_seqs: int) -> SamplingBatch:
    """Host arrays for ``rows`` of ``(params, seed, index)``, padded with greedy rows."""
    temperature = np.zeros(max_num_seqs, np.float32)
    top_k = np.zeros(max_num_seqs, np.int32)
    seed = np.zeros(max_num_seqs, np.uint32)
    index = np.zeros(max_num_seqs, np.int32)
    for row, (params, row_seed, row_index) in enumerate(rows):
        if not params.is_greedy:  # greedy rows keep the zero defaults
            # a top_k past the vocabulary means all of it; int32 holds any vocabulary size
            temperature[row], top_k[row] = params.temperature, min(params.top_k, _INT32_MAX)
            seed[row], index[row] = row_seed, row_index
    return SamplingBatch(temperature, top_k, seed, index)


def sample(logits, params: SamplingBatch):
    """One token per row: ``logits  # f32[rows, vocab]`` -> ``i32[rows]``. Traceable."""
    greedy = jnp.argmax(logits, axis=-1).astype(jnp.int32)
    vocab = logits.shape[-1]
    # k-th largest logit per row; rows without a limit keep everything.
    k = jnp.where(params.top_k > 0, jnp.minimum(params.top_k, vocab), vocab)
    descending = -jnp.sort(-logits, axis=-1)
    threshold = jnp.take_along_axis(descending, (k - 1)[:, None], axis=-1)  # [rows, 1]
    # exactly k tokens: those above the k-th largest logit, then the ties at it in index order
    # (every tie at the threshold drew: top_k=1 was not greedy when the top logits tied)
    above = logits > threshold
    ties = logits == threshold
    room = k[:, None] - jnp.sum(above, axis=-1, keepdims=True)
    keep = above | (ties & (jnp.cumsum(ties, axis=-1) <= room))
    safe_temperature = jnp.where(params.temperature > 0, params.temperature, 1.0)
    scaled = jnp.where(keep, logits / safe_temperature[:, None], -jnp.inf)

    def draw(row_logits, seed, index):
        key = jax.random.fold_in(jax.random.PRNGKey(seed), index)
        return jax.random.categorical(key, row_logits).astype(jnp.int32)

    drawn = jax.vmap(draw)(scaled, params.seed, params.index)
    return jnp.where(params.temperature > 0, drawn, greedy)
