"""The engine's model step: a scheduled batch -> bucketed device inputs -> one jitted call.

One jitted function serves every step (prefill chunks and decodes mixed): it runs the model
over the page pool (donated, so the pool is updated in place), takes the logits of each
sequence's last computed token and picks the greedy token per sequence on the device; a step
with a sampling (temperature > 0) request also runs a second jitted function, the sampler, on
those logits (kept apart so that greedy steps skip its work; ``warmup`` builds it all the
same, since a sampled request may come at any step). Only the tokens (``i32[max_num_seqs]``)
come back to the host each step.

Shapes are bucketed so the step compiles a handful of times, not once per batch:

* ``max_num_seqs`` rows and ``pages_per_seq`` table columns are fixed per runner (the
  scheduler's ``max_num_seqs`` and the engine's ``max_model_len``, rounded up to powers of
  two). Padding rows cost nothing: the kernels stop at ``num_seqs`` and at each ``seq_len``.
* the token count rounds up to the next value of a short ladder (``token_buckets``, powers
  of two; by default 16, 64, 256, 1024, ... up to the token budget): at most 4x padding on
  the tokens, in exchange for about half as many compilations as a power-of-two ladder (each
  costs seconds on CPU).

Compilations are counted by a Python counter that the step increments while it is traced
(tracing happens exactly when a new shape compiles); :attr:`ModelRunner.compilations` is the
number of traces this runner's calls caused. The jitted function is shared by every runner in
the process, so a second engine on the same model reuses the first one's compilations.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from kvjax.serving.model import BatchInputs
from kvjax.serving.sampling import SamplingBatch, SamplingParams, sample, sampling_batch
from kvjax.serving.step_plan import ScheduledSeq
from kvjax.tiers.page_pool import Buckets, PagePool, bucket, build_batch

__all__ = ["ModelRunner", "default_token_buckets"]

_TRACES = [0]  # incremented inside the jitted step: counts traces (= compilations) process-wide


def default_token_buckets(token_budget: int, minimum: int = 16) -> tuple[int, ...]:
    """``minimum, 4 * minimum, 16 * minimum, ...`` below the budget, then the budget's bucket."""
    top = bucket(token_budget, minimum)
    ladder = []
    size = minimum
    while size < top:
        ladder.append(size)
        size *= 4
    return tuple(ladder) + (top,)


class ModelRunner:
    """Runs scheduled sequences through ``model`` on ``pool``; see the module docstring.

    ``max_num_seqs`` sequences and ``token_budget`` tokens per step at most (the scheduler's
    limits); sequences up to ``max_model_len`` tokens. ``token_buckets`` (powers of two,
    ascending, the last one >= ``token_budget``) overrides the default ladder. ``impl``
    picks the kernels (``pallas_kernels.backend``).
    """

    def __init__(self, model: nnx.Module, pool: PagePool, *, max_num_seqs: int, token_budget: int,
                 max_model_len: int, token_buckets: Sequence[int] | None = None,
                 impl: str | None = None):  # fmt: skip
        self.graphdef, self.state = nnx.split(model)
        self.pool = pool
        self.impl = impl
        self.vocab_size = model.cfg.vocab_size
        page_size = pool.config.page_size
        self.max_num_seqs = bucket(max_num_seqs, 1)
        self.pages_per_seq = bucket(-(-max_model_len // page_size), 1)
        ladder = tuple(token_buckets) if token_buckets is not None else default_token_buckets(token_budget)
        _check_ladder(ladder, token_budget)
        self.token_buckets = ladder
        self.compilations = 0

    def run(self, seqs: Sequence[ScheduledSeq], sampling: Sequence[tuple[SamplingParams, int, int]],
            *, return_logits: bool = False):  # fmt: skip
        """Compute ``seqs`` (decodes and prefill chunks), sample one token per sequence.

        ``sampling[i]`` is ``(params, seed, index)`` for ``seqs[i]``. Returns ``(tokens, logits)``:
        ``tokens  # i32[len(seqs)]`` on the host, ``logits  # f32[len(seqs), vocab]`` of each
        sequence's last computed token when ``return_logits`` (else None). Tokens of sequences
        that do not sample (a prefill chunk short of the prompt's end) are meaningless.
        """
        if len(seqs) > self.max_num_seqs:
            raise ValueError(f"a step of {len(seqs)} sequences exceeds the runner's {self.max_num_seqs}")
        num_tokens = sum(seq.num_tokens for seq in seqs)
        # Past the ladder only when a failed fetch left a sequence more to recompute than
        # the scheduler budgeted: one more compilation rather than an error.
        token_bucket = next((b for b in self.token_buckets if b >= num_tokens), None) or bucket(num_tokens, 1)
        inputs = self._inputs(seqs, token_bucket)
        greedy = all(params.is_greedy for params, _, _ in sampling)
        params = None if greedy else sampling_batch(list(sampling), self.max_num_seqs)
        tokens, logits = self._call(inputs, params)
        host_tokens = np.asarray(tokens)[: len(seqs)]
        return host_tokens, (np.asarray(logits)[: len(seqs)] if return_logits else None)

    def warmup(self) -> int:
        """Compile every token bucket now (an empty batch each), and the sampler (its shapes
        are the same for every bucket); returns the compilations caused."""
        before = self.compilations
        params = sampling_batch([], self.max_num_seqs)  # a sampled request's first step built it otherwise
        for token_bucket in self.token_buckets:
            tokens, _ = self._call(self._inputs([], token_bucket), params)
            tokens.block_until_ready()
            params = None
        return self.compilations - before

    # --- helpers ---------------------------------------------------------------------------

    def _inputs(self, seqs: Sequence[ScheduledSeq], token_bucket: int) -> BatchInputs:
        buckets = Buckets(self.max_num_seqs, self.pages_per_seq, token_bucket)
        meta = build_batch([seq.block_table for seq in seqs], [seq.seq_len for seq in seqs],
                           [seq.num_tokens for seq in seqs], page_size=self.pool.config.page_size,
                           num_blocks=self.pool.config.num_blocks, buckets=buckets)  # fmt: skip
        tokens = np.zeros(token_bucket, np.int32)
        if seqs:
            live = np.concatenate([seq.token_ids for seq in seqs])
            tokens[: len(live)] = live
        return BatchInputs(tokens, meta.positions, meta.slot_mapping, meta.block_tables,
                           meta.seq_lens, meta.cu_q_lens, meta.num_seqs)

    def _call(self, inputs: BatchInputs, params: SamplingBatch | None):
        """``params`` None: every row greedy (the sampler, a compilation of its own, is skipped)."""
        before = _TRACES[0]
        tokens, logits, kv_pages = _model_step(self.graphdef, self.state, inputs, self.pool.kv_pages,
                                               impl=self.impl)  # fmt: skip
        self.pool.kv_pages = kv_pages
        if params is not None:
            tokens = _sample_step(logits, params)
        self.compilations += _TRACES[0] - before
        return tokens, logits


@functools.partial(jax.jit, static_argnums=0, static_argnames=("impl",), donate_argnums=3)
def _model_step(graphdef, state, inputs: BatchInputs, kv_pages, *, impl):
    """Greedy tokens and last-token logits of every sequence, and the updated pool."""
    _TRACES[0] += 1  # runs only while tracing: one per compilation
    model = nnx.merge(graphdef, state)
    logits, kv_pages = model(inputs, kv_pages, impl=impl)  # [num_tokens, vocab]
    last_rows = jnp.maximum(inputs.cu_q_lens[1:] - 1, 0)  # [max_num_seqs]: each seq's last token
    last_logits = logits[last_rows]  # [max_num_seqs, vocab]
    return jnp.argmax(last_logits, axis=-1).astype(jnp.int32), last_logits, kv_pages


@jax.jit
def _sample_step(last_logits, params: SamplingBatch):
    _TRACES[0] += 1
    return sample(last_logits, params)


def _check_ladder(ladder: tuple[int, ...], token_budget: int) -> None:
    powers = all(isinstance(b, int) and b > 0 and b & (b - 1) == 0 for b in ladder)
    if not ladder or not powers or list(ladder) != sorted(set(ladder)) or ladder[-1] < token_budget:
        raise ValueError(f"token_buckets={ladder} must be ascending powers of two, the last >= "
                         f"token_budget={token_budget}")
