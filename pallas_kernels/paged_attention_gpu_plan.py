"""How the GPU paged-attention kernel cuts a ragged batch into programs (static decisions and
the jnp steps around the kernel): tile sizes, the work list, query-head grouping, split-K.

See :mod:`pallas_kernels.paged_attention_gpu` for the kernel and the reasons behind the
cut; everything here runs in plain jnp before or after the ``pallas_call``.
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp

__all__ = ["Plan", "make_plan", "num_work_items", "work_items", "group_rows", "ungroup_rows",
           "combine_splits"]

# A tensor-core dot (Triton's tt.dot) needs M, N and K of at least 16.
_MIN_DOT_DIM = 16
# Query rows per program for batches that may hold prefill chunks: enough reuse of each K/V
# tile to make prefill compute-bound, few enough registers for the float32 accumulator.
_PREFILL_ROWS = 64
# K bytes per inner step: 32 KiB (128 tokens of bfloat16 at head_dim 128), plus as much V.
# Larger tiles spilled registers or filled shared memory in sm_90 builds (float32 or
# head_dim 256 at 128 tokens); smaller ones leave fewer bytes in flight per program.
_BLOCK_K_BYTES = 32 * 1024
# H200/H100 have 132 SMs. Below two programs per SM split-K is used, aiming at four per SM.
_MIN_PROGRAMS = 2 * 132
_TARGET_PROGRAMS = 4 * 132


@dataclasses.dataclass(frozen=True)
class Plan:
    """Static shape decisions for one call (all sizes in tokens, pages or rows)."""
    num_kv_heads: int
    group: int  # query heads per KV head
    group_pad: int  # group rounded up to a power of two
    block_q: int  # query tokens per work item
    page_size: int
    pages_per_block: int  # pages per inner step
    num_work: int  # static length of the work list
    num_splits: int

    @property
    def rows(self) -> int:
        return self.block_q * self.group_pad


def make_plan(q, kv_pages, block_tables, *, interpret, max_q_len, block_q, pages_per_compute_block,
          num_splits) -> Plan:
    """Validates the Triton constraints and picks defaults; raises ``ValueError``."""
    num_tokens, num_q_heads, head_dim = q.shape
    num_kv_heads, page_size = kv_pages.shape[3], kv_pages.shape[4]
    max_num_seqs, pages_per_seq = block_tables.shape
    if not _is_pow2(head_dim) or head_dim < _MIN_DOT_DIM:
        raise ValueError(f"{head_dim=} must be a power of two >= {_MIN_DOT_DIM} for the GPU kernel")
    if not _is_pow2(page_size):
        raise ValueError(f"{page_size=} must be a power of two for the GPU kernel")
    if max_q_len is None:
        max_q_len = num_tokens
    if not isinstance(max_q_len, int) or max_q_len < 1:
        raise ValueError(f"max_q_len={max_q_len!r} must be a positive int")
    group = num_q_heads // num_kv_heads
    group_pad = _next_pow2(group)
    if block_q is None:
        # No more tokens than sequence slots is the shape of a decode batch: one token each.
        decode_like = max_q_len == 1 or num_tokens <= max_num_seqs
        target_rows = _MIN_DOT_DIM if decode_like else _PREFILL_ROWS
        block_q = min(max(1, target_rows // group_pad), _next_pow2(max_q_len))
        block_q = max(block_q, _MIN_DOT_DIM // group_pad, 1)
    if not isinstance(block_q, int) or not _is_pow2(block_q) or block_q * group_pad < _MIN_DOT_DIM:
        raise ValueError(
            f"block_q={block_q!r} must be a power of two with block_q * {group_pad=} >= "
            f"{_MIN_DOT_DIM} (query rows per program)")
    pps = pages_per_compute_block
    if pps is None:
        # At most 256 tokens: the [rows, block_k] float32 logits tile lives in registers.
        block_k = min(256, _BLOCK_K_BYTES // (head_dim * jnp.dtype(q.dtype).itemsize))
        pps = max(1, block_k // page_size, -(-_MIN_DOT_DIM // page_size))
    if not isinstance(pps, int) or not _is_pow2(pps) or pps * page_size < _MIN_DOT_DIM:
        raise ValueError(
            f"pages_per_compute_block={pps!r} must be a power of two with "
            f"pages_per_compute_block * {page_size=} >= {_MIN_DOT_DIM}")
    num_work = num_work_items(num_tokens, max_num_seqs, block_q, max_q_len)
    if num_splits is None:
        num_splits = 1 if interpret else _default_splits(num_work * num_kv_heads,
                                                         -(-pages_per_seq // pps))
    if not isinstance(num_splits, int) or num_splits < 1:
        raise ValueError(f"num_splits={num_splits!r} must be a positive int")
    return Plan(num_kv_heads=num_kv_heads, group=group, group_pad=group_pad, block_q=block_q,
                 page_size=page_size, pages_per_block=pps, num_work=num_work,
                 num_splits=num_splits)


def _default_splits(programs: int, steps_per_seq: int) -> int:
    """Split-K factor: none when ``programs`` already fill the GPU, else enough to reach
    ``_TARGET_PROGRAMS``, keeping at least two page steps per split of a full-width table."""
    if programs >= _MIN_PROGRAMS:
        return 1
    return max(1, min(-(-_TARGET_PROGRAMS // programs), steps_per_seq // 2))


def num_work_items(num_tokens: int, max_num_seqs: int, block_q: int, max_q_len: int) -> int:
    """Static bound on ``sum_s cdiv(q_len_s, block_q)`` over any ragged layout.

    At most ``n = min(max_num_seqs, num_tokens)`` sequences have tokens, and
    ``cdiv(q, b) <= (q + b - 1) / b``, so the sum is at most ``(num_tokens + n * (b - 1)) / b``;
    it is also at most ``n * cdiv(max_q_len, b)``. A decode batch (``block_q`` = 1 token used
    per item) gets exactly ``num_tokens`` items.
    """
    n = min(max_num_seqs, num_tokens)
    bound = (num_tokens + n * (block_q - 1)) // block_q
    bound = min(bound, n * -(-min(max_q_len, num_tokens) // block_q))
    return max(1, bound)


def work_items(cu_q_lens, seq_lens, num_seqs, plan: Plan):
    """Lists the work items: ``i32[num_work, 5]`` = (seq, first row, rows, first pos, kv len).

    ``first row`` is the item's first token in ``q``; ``rows`` its live tokens (0 for a spare
    item); ``first pos`` the position of its first token in the sequence.
    """
    max_num_seqs = seq_lens.shape[0]
    live = jnp.arange(max_num_seqs) < num_seqs[0]
    q_lens = jnp.where(live, cu_q_lens[1:] - cu_q_lens[:-1], 0)
    blocks = (q_lens + plan.block_q - 1) // plan.block_q
    ends = jnp.cumsum(blocks)
    w = jnp.arange(plan.num_work, dtype=jnp.int32)
    # The item's sequence: how many sequences end at or before it. A compare-all count fuses
    # into one small kernel, where a binary search would be a loop of launches on a GPU.
    seq = jnp.sum(ends[None, :] <= w[:, None], axis=1, dtype=jnp.int32)
    seq = jnp.minimum(seq, max_num_seqs - 1)
    q_block = w - (ends[seq] - blocks[seq])
    first = q_block * plan.block_q
    rows = jnp.where(w < ends[-1], jnp.clip(q_lens[seq] - first, 0, plan.block_q), 0)
    kv_len = seq_lens[seq]
    first_pos = kv_len - q_lens[seq] + first
    return jnp.stack([seq, cu_q_lens[seq] + first, rows, first_pos, kv_len], axis=1).astype(
        jnp.int32)


def group_rows(q, plan: Plan):
    """``[num_tokens, num_q_heads, d]`` -> ``[num_kv_heads, num_tokens * group_pad, d]``.

    Row ``t * group_pad + g`` holds token ``t``'s query head ``g`` of the KV head, so a work
    item's rows are one contiguous 2-D tile and the kernel needs no reshape of ``q``.
    """
    num_tokens, _, head_dim = q.shape
    qg = q.reshape(num_tokens, plan.num_kv_heads, plan.group, head_dim)
    if plan.group_pad != plan.group:
        qg = jnp.pad(qg, ((0, 0), (0, 0), (0, plan.group_pad - plan.group), (0, 0)))
    return qg.transpose(1, 0, 2, 3).reshape(plan.num_kv_heads, num_tokens * plan.group_pad,
                                            head_dim)


def ungroup_rows(out_rows, plan: Plan, live_tokens, num_q_heads: int):
    """Inverse of :func:`group_rows`; rows of padding tokens (never written) become 0."""
    num_tokens = out_rows.shape[1] // plan.group_pad
    head_dim = out_rows.shape[2]
    out = out_rows.reshape(plan.num_kv_heads, num_tokens, plan.group_pad, head_dim)
    out = out.transpose(1, 0, 2, 3)[:, :, : plan.group].reshape(num_tokens, num_q_heads, head_dim)
    live = jnp.arange(num_tokens) < live_tokens
    return jnp.where(live[:, None, None], out, 0)


def combine_splits(acc, m, l):
    """Merges split-K partials ``acc [splits, kvh, rows, d]``, ``m``/``l [splits, kvh, rows]``."""
    m_max = m.max(axis=0)
    shift = jnp.where(m_max == -jnp.inf, 0.0, m_max)
    scale = jnp.exp(m - shift)  # 0 for a split that saw no visible key
    denom = (l * scale).sum(axis=0)
    acc = (acc * scale[..., None]).sum(axis=0)
    return acc / jnp.where(denom > 0, denom, 1.0)[..., None]


def _is_pow2(n: int) -> bool:
    return n >= 1 and n & (n - 1) == 0


def _next_pow2(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()
