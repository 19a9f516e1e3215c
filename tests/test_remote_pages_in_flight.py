"""import_pages while the cache's own transfers of the same pages are in flight, on the real
transfer engine with its links held back on purpose (a gate per direction): a host copy still
on its way, or a host slot given to a fetch, must never be served or exported as the page's
bytes, and the trie must stay consistent."""

import threading

import numpy as np
import pytest
from kv_cache_cases import page_content
from test_kv_cache import POOL, TIMEOUT, compute, make, prompt
from tier_cases import random_blocks, same_bits

from kvjax.tiers.transfer import TransferEngine


class GatedTransfer(TransferEngine):
    """The real engine; device->host copies wait for ``offloads`` and fetches for ``fetches``
    (set: open); ``fail_offloads`` makes copies raise. Nothing runs inline or helped, so a
    held link really holds."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **{**kwargs, "direct_cpu_reads": False, "inline_fetch_bytes": 0})
        self.offloads, self.fetches = threading.Event(), threading.Event()
        self.offloads.set()
        self.fetches.set()
        self.fail_offloads = False

    def _run_offload(self, jobs):
        self.offloads.wait(TIMEOUT)
        if self.fail_offloads:
            raise OSError("a copy failed on purpose")
        return super()._run_offload(jobs)

    def _run_fetch(self, jobs):
        self.fetches.wait(TIMEOUT)
        return super()._run_fetch(jobs)

    def _help(self, job):
        return False


def hit_kv(cache, tokens):
    handle = cache.admit(tokens)
    assert cache.wait_ready(handle, TIMEOUT)
    num_hit = handle.num_hit_tokens // cache.page_size
    kv = np.asarray(cache.pool.gather(handle.block_ids[:num_hit]))
    cache.release(handle)
    return kv


@pytest.mark.parametrize("copy_fails", [False, True])
def test_an_imported_page_whose_own_copy_is_in_flight_gets_the_imported_bytes(copy_fails):
    # the page's write-through copy is still on its way when the page leaves the trie and
    # another node's copy arrives: the import adopted the pending entry, marked it ready without
    # writing its slot, and export / a fetch read whatever the slot held before
    tokens, kv = prompt(9), random_blocks(3, POOL.block_shape, seed=1)
    with make(write_policy="write_through", transfer_factory=GatedTransfer) as cache:
        compute(cache, tokens[:5], blocks=kv)
        assert cache.flush(TIMEOUT)
        cache.poll()
        cache.transfer.offloads.clear()  # the device->host link is slow from here on
        compute(cache, tokens, blocks=kv)  # page 1's copy is in flight
        cache.evict(8)
        cache.evict_host(1)  # page 0 leaves; page 1's pending copy stays (a transfer uses it)
        assert cache.import_pages(tokens, None, 0, kv[:2]) == 2
        export = cache.export_pages(tokens, None, 0, 2)
        assert same_bits(export.payload().view(np.float32).reshape(2, *POOL.block_shape), kv[:2])
        cache.transfer.fail_offloads = copy_fails
        cache.transfer.offloads.set()
        cache.flush(TIMEOUT)
        cache.poll()
        assert same_bits(hit_kv(cache, tokens), kv[:2])  # with the copy failed too
        cache.check_invariants()


def test_an_import_stops_before_a_page_whose_host_slot_a_fetch_holds():
    # a request's fetch took the host slots of pages whose new copies it handed them to; the
    # request left, its pages too: importing them again used to insert the trie nodes, then fail
    # in add_host, leaving a HOST bit without a host entry for good
    page = 4
    p, q = prompt(13), prompt(21, start=300)
    kv_p = np.stack([page_content("n", p[: (i + 1) * page], POOL.block_shape) for i in range(4)])
    kv_q = np.stack([page_content("n", q[: (i + 1) * page], POOL.block_shape) for i in range(6)])
    with make(host_blocks=3, transfer_factory=GatedTransfer) as cache:
        compute(cache, p, blocks=kv_p)
        cache.evict(8)
        cache.flush(TIMEOUT)
        cache.poll()  # pages 0-2 of p on host, which is full
        compute(cache, p[:5], blocks=kv_p)
        compute(cache, q, blocks=kv_q)
        cache.transfer.fetches.clear()  # the host->device link is slow from here on
        handle = cache.admit(p)  # fetches pages 1-2; evicting q's pages hands their slots over
        assert cache.tiers.num_handed and not cache.is_ready(handle)
        cache.release(handle)  # the request leaves, its fetch still in flight
        cache.evict(8)
        cache.evict_host(1)
        compute(cache, p[:5], blocks=kv_p)
        for _ in range(2):  # stops before the handed pages (the second one raised)
            cache.import_pages(p, None, 0, kv_p[:3])
        cache.transfer.fetches.set()
        cache.flush(TIMEOUT)
        cache.poll()
        cache.check_invariants()
        kv = hit_kv(cache, p)
        assert same_bits(kv, kv_p[: len(kv)])
