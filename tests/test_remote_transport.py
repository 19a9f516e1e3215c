"""Remote transport: offers and pulls over jax.experimental.transfer within this process (a
connection to its own server), the watchdog on pulls that never complete, the reaper of
offers nobody pulled, and the block checksums.

A pull left blocked when the interpreter exits aborts it, so every test that abandons a pull
offers the id it waits for before it ends: the blocked thread then completes.
"""

import time

import numpy as np
import pytest

from kvjax.tiers.remote_transport import PullError, RemoteTransport, block_checksums, verified_blocks

NS, OTHER_NS = b"n" * 16, b"o" * 16


@pytest.fixture(scope="module")
def transport():
    transport = RemoteTransport(reap=False)
    yield transport
    transport.close()


def payload(num_blocks, block_nbytes=256, seed=0):
    return np.random.default_rng(seed).integers(0, 256, (num_blocks, block_nbytes), np.uint8)


def keys(n, start=0):
    return [i.to_bytes(16, "little") for i in range(start, start + n)]


def test_an_offer_pulled_once_arrives_bit_exact(transport):
    sent = payload(5)
    offer_id = transport.offer(sent)
    got = transport.pull(transport.address, offer_id, 5, 256, time.monotonic() + 20)
    assert got.dtype == np.uint8 and np.array_equal(got, sent)
    assert transport.acknowledge(offer_id) and not transport.acknowledge(offer_id)


def test_a_pull_of_an_id_never_offered_is_abandoned_at_its_deadline_and_the_connection_replaced(transport):
    before = transport.stats()
    never = 12345
    start = time.monotonic()
    with pytest.raises(PullError, match="deadline") as caught:
        transport.pull(transport.address, never, 2, 256, start + 0.3)
    assert caught.value.reason == "timeout"
    assert time.monotonic() - start < 0.3 + 0.5  # the watchdog, not the library's ~30 s
    stats = transport.stats()
    assert stats["pull_timeouts"] == before["pull_timeouts"] + 1
    assert stats["abandoned_pulls"] == before["abandoned_pulls"] + 1
    # a later pull from the same server works on a fresh connection
    sent = payload(2, seed=1)
    offer_id = transport.offer(sent)
    assert np.array_equal(transport.pull(transport.address, offer_id, 2, 256, time.monotonic() + 20), sent)
    transport.offer(payload(2), offer_id=never)  # lets the abandoned wait finish before exit
    transport.acknowledge(never)


def test_a_pull_of_the_wrong_size_fails_at_once(transport):
    offer_id = transport.offer(payload(3))
    with pytest.raises(PullError) as caught:
        transport.pull(transport.address, offer_id, 2, 256, time.monotonic() + 20)
    assert caught.value.reason == "failed"


def test_a_failed_pull_replaces_its_connection_and_a_bad_address_fails_as_a_pull(transport):
    # a connection that failed (its peer restarted at the same address) was reused forever
    class Broken:
        def pull(self, offer_id, specs):
            raise RuntimeError("Connection closed recv() == 0")
    address, failures = "127.0.0.1:1", transport.stats()["pull_failures"]
    transport._connections[address] = Broken()
    with pytest.raises(PullError) as caught:
        transport.pull(address, 5, 2, 256, time.monotonic() + 20)
    assert caught.value.reason == "failed" and address not in transport._connections
    for bad in ("", "127.0.0.1:99999", "127.0.0.1:abc"):  # the library's own errors, as failed pulls
        with pytest.raises(PullError, match=rf"cannot connect to {bad!r}") as caught:
            transport.pull(bad, 5, 2, 256, time.monotonic() + 20)
        assert caught.value.reason == "failed"
    assert transport.stats()["pull_failures"] == failures + 4


@pytest.mark.parametrize("address", ["0.0.0.0:0", "[::]:0", ":0"])
def test_a_transfer_server_on_every_interface_is_refused(address):
    # its peers were told a wildcard address, and a puller on another host aborted connecting
    with pytest.raises(ValueError, match=r"listens on every interface, and peers cannot connect to a wildcard"):
        RemoteTransport(address, reap=False)


def test_expired_offers_nobody_acknowledged_are_pulled_back_and_dropped():
    now = [0.0]
    transport = RemoteTransport(offer_ttl_s=5.0, clock=lambda: now[0], reap=False)
    try:
        kept, pulled, dropped = (transport.offer(payload(1, seed=i)) for i in range(3))
        transport.pull(transport.address, pulled, 1, 256, time.monotonic() + 20)
        assert transport.acknowledge(pulled)
        assert transport.reap_expired() == 0 and transport.outstanding_offers == 2  # not expired yet
        now[0] = 6.0
        assert transport.reap_expired() == 2 and transport.outstanding_offers == 0
        assert transport.stats()["reclaimed"] == 2 and transport.stats()["reclaim_timeouts"] == 0
        assert not transport.acknowledge(kept) and not transport.acknowledge(dropped)
    finally:
        transport.close()


def test_offer_rejects_anything_but_a_byte_matrix(transport):
    with pytest.raises(ValueError, match="u8\\[num_blocks, block_nbytes\\]"):
        transport.offer(np.zeros((2, 4), np.float32))


def test_offer_rejects_a_ttl_that_is_not_a_positive_number_of_seconds(transport):
    # a ttl_s of 0 meant the transport's default, a negative one an offer the reaper took at once
    for bad in (0, 0.0, -1.0, float("nan")):
        with pytest.raises(ValueError, match=rf"ttl_s={bad!r} must be > 0 seconds"):
            transport.offer(payload(1), ttl_s=bad)


def test_checksums_bind_namespace_key_and_bytes():
    blocks = payload(4, seed=3)
    sums = block_checksums(NS, keys(4), blocks)
    assert len({*sums}) == 4 and all(len(s) == 16 for s in sums)
    assert verified_blocks(NS, keys(4), blocks, sums) == 4
    flipped = blocks.copy()
    flipped[2, 100] ^= 1
    assert verified_blocks(NS, keys(4), flipped, sums) == 2  # the leading run before the bad block
    assert verified_blocks(NS, keys(4), blocks[::-1], sums) == 0  # blocks in the wrong order
    assert verified_blocks(NS, keys(4, start=1), blocks, sums) == 0  # another prompt's keys
    assert verified_blocks(OTHER_NS, keys(4), blocks, sums) == 0  # another tenant
    with pytest.raises(ValueError, match="3 keys for 4 payload rows"):
        block_checksums(NS, keys(3), blocks)
