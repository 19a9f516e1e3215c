"""Device kernels over the kvjax page pool (paged attention, KV write, block copy)."""

from pallas_kernels.backend import IMPLS, resolve_impl
from pallas_kernels.block_copy import gather_blocks, scatter_blocks
from pallas_kernels.kv_format import FORMATS, KVFormat, QuantizedPages
from pallas_kernels.kv_write import write_kv
from pallas_kernels.paged_attention import paged_attention
from pallas_kernels.reference import (
    gather_blocks_reference,
    paged_attention_reference,
    scatter_blocks_reference,
    write_kv_reference,
)
from pallas_kernels.validation import (
    check_block_ids,
    check_paged_attention_metadata,
    check_slot_mapping,
)

__all__ = [
    "FORMATS",
    "KVFormat",
    "QuantizedPages",
    "IMPLS",
    "resolve_impl",
    "paged_attention",
    "paged_attention_reference",
    "write_kv_reference",
    "gather_blocks_reference",
    "scatter_blocks_reference",
    "check_paged_attention_metadata",
    "check_slot_mapping",
    "write_kv",
    "gather_blocks",
    "scatter_blocks",
    "check_block_ids",
]
