"""Pages leaving for another node and pages arriving from one: ``KVCache.export_pages`` and
``KVCache.import_pages``.

Export (the owner): the pages ``first_page ..`` of a prompt's cached prefix, from whichever
tier holds each (device blocks gathered now, host slots copied now, disk blocks read now),
in the cache's stored format (its codec's: a quantized pool's blocks packed bit-exact). The
walk is the prompt's own, in its own namespace: a node hands out only pages a request of
that namespace would hit. The export stops at the first page it cannot read (a copy still
in flight, a disk block that fails its checksum) and before the first lossy page; a lossy
codec exports nothing (its copies would arrive as exact).

``payload()`` turns the export into ``u8[num_pages, block_nbytes]``, waiting for the device
gather; call it off the serving thread. The gather was issued before anything else touched
the pool, so the pool may be updated (donated) meanwhile.

Import (the puller): pulled pages, verified by the caller, join the trie as host pages
right after the prompt's cached prefix, exactly like pages a previous eviction left on host;
the next admission of the prompt finds them there and fetches them like any host hit. Pages
the cache meanwhile holds itself are skipped; pages that no longer follow the cached prefix
(it shrank below ``first_page``) are dropped.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from kvjax.cache.block_keys import as_namespace, chained_block_keys
from kvjax.cache.trie_node import Tier
from kvjax.text.tokens import token_bytes
from kvjax.tiers.transfer import bucket_rows, move_batches

__all__ = ["ExportedPages", "export_pages", "import_pages"]

_HOST, _DISK = int(Tier.HOST), int(Tier.DISK)


@dataclasses.dataclass(slots=True)
class ExportedPages:
    """Pages of one namespace on their way out (see the module docstring).

    ``keys``: the pages' chained keys, in order; ``tiers``: where each was read ("device",
    "host", "disk"); ``block_shape`` / ``dtype``: one stored block (the codec's).
    """

    namespace: bytes  # digest
    keys: list[bytes]
    tiers: list[str]
    block_shape: tuple[int, ...]
    dtype: np.dtype
    device_rows: list[int] = dataclasses.field(default_factory=list)
    device_blocks: list[tuple[jax.Array, int]] = dataclasses.field(default_factory=list)  # (padded batch, rows used)
    lower_rows: list[int] = dataclasses.field(default_factory=list)
    lower_blocks: np.ndarray | None = None  # [len(lower_rows), *block_shape] of dtype

    @property
    def num_pages(self) -> int:
        return len(self.keys)

    @property
    def block_nbytes(self) -> int:
        return int(np.prod(self.block_shape)) * np.dtype(self.dtype).itemsize

    def payload(self) -> np.ndarray:
        """``u8[num_pages, block_nbytes]``: every page's stored bytes, waiting for the gather."""
        blocks = np.zeros((self.num_pages, *self.block_shape), self.dtype)
        if self.device_rows:
            blocks[self.device_rows] = np.concatenate([np.asarray(batch)[:used] for batch, used in self.device_blocks])
        if self.lower_rows:
            blocks[self.lower_rows] = self.lower_blocks
        return blocks.view(np.uint8).reshape(self.num_pages, self.block_nbytes)  # -1 is no size for 0 pages


def export_pages(cache, tokens, namespace, first_page: int, num_pages: int) -> ExportedPages:
    """The leading run of pages ``first_page .. first_page + num_pages - 1`` of ``tokens``'
    cached prefix that ``cache`` can hand out now; see the module docstring."""
    ns = as_namespace(namespace)
    digest, codec = ns.digest(), cache.codec
    export = ExportedPages(digest, [], [], codec.block_shape, codec.dtype)
    if first_page < 0 or num_pages < 0:
        raise ValueError(f"first_page={first_page} and num_pages={num_pages} must be >= 0")
    if codec.lossy or num_pages == 0:
        return export
    trie, tiers = cache.trie, cache.tiers
    pages = [(node, i) for node, k in cache.lookup(tokens, ns).matched for i in range(k)]
    device_ids, host_slots, disk_keys = [], [], []
    for node, i in pages[first_page : first_page + num_pages]:
        if node.lossy is not None and node.lossy[i]:
            break
        key, row = trie.page_keys(node)[i], len(export.keys)
        if node.on_device:
            device_ids.append(int(node.blocks[i]))
            export.device_rows.append(row)
            tier = "device"
        else:
            bits, entry = int(node.tiers[i]), tiers.host_state(key)
            if bits & _HOST and entry is not None and entry.ready:
                host_slots.append(entry.slot)
                tier = "host"
            elif bits & _DISK and cache.disk_tier is not None:
                disk_keys.append(key)
                tier = "disk"
            else:  # its only copy is still on its way
                break
            export.lower_rows.append(row)
        export.keys.append(key)
        export.tiers.append(tier)
    lower = _read_lower(cache, export, host_slots, disk_keys, digest)
    if device_ids:
        export.device_blocks = _gather(cache, device_ids)
    export.lower_blocks = lower
    return export


def import_pages(cache, tokens, namespace, first_page: int, blocks: np.ndarray) -> int:
    """Insert ``blocks`` (``[n, *block_shape]`` of the codec's dtype, verified) as host pages
    ``first_page .. first_page + n - 1`` of ``tokens``; returns how many pages joined the
    trie (0 without a host tier or with a lossy codec; see the module docstring)."""
    if not cache.config.tiered or cache.codec.lossy or not len(blocks):
        return 0
    codec, trie, tiers = cache.codec, cache.trie, cache.tiers
    if tuple(blocks.shape[1:]) != codec.block_shape or blocks.dtype != codec.dtype:
        raise ValueError(f"blocks {tuple(blocks.shape)} {blocks.dtype} must be [n, *{codec.block_shape}] "
                         f"{codec.dtype}")  # fmt: skip
    ns = as_namespace(namespace)
    buf, page_bytes = token_bytes(tokens, cache.vocab_size), trie.page_bytes
    end = (first_page + len(blocks)) * page_bytes
    if len(buf) < end:
        raise ValueError(f"{len(blocks)} pages from page {first_page} need {end // 4} tokens; got {len(buf) // 4}")
    cache._version += 1  # noqa: SLF001 - this module is KVCache's, split off for length
    fit = cache._mover.make_host_room(len(blocks))  # noqa: SLF001 - may split or drop trie nodes: walk after it
    matched = cache._walk(ns, buf, end)  # noqa: SLF001
    have = sum(k for _, k in matched)
    count = min(fit, first_page + len(blocks) - have)
    if have < first_page or count <= 0:
        return 0
    if matched and matched[-1][1] < matched[-1][0].num_pages:
        node, k = matched[-1]
        matched[-1] = (trie.split(node, k), k)
    parent = matched[-1][0] if matched else trie.root(ns, create=True)
    digest = ns.digest()
    parent_key = trie.page_keys(parent)[-1] if matched else None
    keys = chained_block_keys(np.frombuffer(buf[have * page_bytes : (have + count) * page_bytes], "<i4"),
                              cache.page_size, digest, parent=parent_key)  # fmt: skip
    # a page whose old host entry gave its slot to a fetch in flight, or took a slot a fetch
    # has not read yet, takes no new copy until that settles (writing now would overwrite
    # what the fetch is about to read: another page's KV, maybe another tenant's): stop
    # before it, the trie not yet touched
    count = next((index for index, key in enumerate(keys) if tiers.is_handed(key) or tiers.awaits_slot(key)), count)
    if count <= 0:
        return 0
    keys = keys[:count]
    node = trie.insert_offloaded(parent, buf[have * page_bytes : (have + count) * page_bytes],
                                 np.full(count, _HOST, np.uint8), cache.clock(), keys=keys)  # fmt: skip
    pending = []  # pages whose slot does not hold their bytes yet: new ones, and adopted copies in flight
    for index, key in enumerate(keys):
        entry = tiers.host_entries.get(key)
        if entry is None or not entry.ready:
            pending.append(index)
        tiers.add_host(key, digest, node, index, ready=False)
    rows = np.asarray(pending, np.intp)
    cache.host_pool.write(np.asarray([tiers.slot_of(keys[i]) for i in pending], np.intp),
                          blocks[have - first_page + rows])  # fmt: skip
    for index in pending:  # an adopted copy already ready keeps its state (and its bytes)
        tiers.host_done(keys[index], True)
    return count


def _read_lower(cache, export: ExportedPages, host_slots: list[int], disk_keys: list[bytes],
                digest: bytes) -> np.ndarray | None:  # fmt: skip
    """The host and disk pages' bytes, in export order; the export is cut before the first
    disk page that fails to read."""
    if not export.lower_rows:
        return None
    lower = np.zeros((len(export.lower_rows), *export.block_shape), export.dtype)
    is_host = np.array([export.tiers[row] == "host" for row in export.lower_rows], bool)
    if host_slots:
        lower[is_host] = cache.host_pool.read(np.asarray(host_slots, np.intp))
    if disk_keys:
        read = cache.disk_tier.get(disk_keys, digest)
        lower[~is_host] = read.blocks
        for key, hit in zip(disk_keys, read.hits):  # a corrupt or unreadable block left the disk tier:
            if not hit and not cache.disk_tier.contains(key, digest):  # its page loses the DISK bit
                cache.tiers.forget_disk(key, digest)
        cache._mover._count_disk_errors()  # noqa: SLF001 - KVCache's own module, split off for length
        if not read.hits.all():
            bad_key = disk_keys[int(np.argmin(read.hits))]
            _truncate(export, export.keys.index(bad_key))
            lower = lower[: len(export.lower_rows)]
    return lower


def _truncate(export: ExportedPages, num_pages: int) -> None:
    del export.keys[num_pages:], export.tiers[num_pages:]
    export.device_rows = [row for row in export.device_rows if row < num_pages]
    export.lower_rows = [row for row in export.lower_rows if row < num_pages]


def _gather(cache, block_ids: list[int]) -> list[tuple[jax.Array, int]]:
    """Gather (and encode) the device blocks now, in bucket-padded batches (the shapes
    ``KVCache.warmup`` compiled): ``(batch, rows used)``."""
    buckets = cache.config.transfer_buckets
    batches = []
    for start, size in move_batches(len(block_ids), buckets):
        rows = np.full(bucket_rows(size, buckets), -1, np.int32)
        rows[:size] = block_ids[start : start + size]
        batches.append((cache._gather(cache.pool.kv_pages, jnp.asarray(rows)), size))  # noqa: SLF001
    return batches
