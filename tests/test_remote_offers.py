"""The owner's side of remote fetch in one process: ``OfferService`` over a real cache and
a real transfer server (its reaper driven by hand on a fake clock), the requester's pull and
checks done by hand. (The HTTP round trip between node processes: test_cluster_remote.)"""

import dataclasses
import time

import pytest
from test_kv_cache import POOL, compute, make, prompt
from tier_cases import random_blocks

from kvjax.cache.block_keys import Namespace, as_namespace, chained_block_keys
from kvjax.cluster.remote_offers import OfferReply, OfferRequest, OfferService
from kvjax.tiers.block_codec import make_codec
from kvjax.tiers.remote_transport import RemoteTransport, verified_blocks

TTL_S = 5.0
WAIT_S = 20  # generous: a loaded 2-core CI box


@pytest.fixture
def owner():
    with make() as cache:
        yield cache


@pytest.fixture
def clock():
    return [0.0]


@pytest.fixture
def transport(clock):
    transport = RemoteTransport(offer_ttl_s=TTL_S, clock=lambda: clock[0], reap=False)
    yield transport
    transport.close()


def service(owner, transport):
    def export(request, deadline):
        return owner.export_pages(request.tokens, request.namespace, request.first_page, request.num_pages)

    return OfferService(transport, export, owner.page_identity, owner.codec.block_nbytes)


def ask(owner, tokens, namespace, num_pages, wait_s, identity=None):
    identity = identity or owner.page_identity
    return OfferRequest(namespace, tokens, 0, num_pages, identity, owner.codec.block_nbytes, wait_s).to_json()


def pull_and_check(owner, transport, reply, tokens, namespace):
    """The requester's pull and checks: how many leading pages verified."""
    payload = transport.pull(reply.address, reply.offer_id, reply.num_pages, reply.block_nbytes,
                             time.monotonic() + WAIT_S)  # fmt: skip
    ns = as_namespace(namespace)
    keys = chained_block_keys(tokens, POOL.page_size, ns)[: reply.num_pages]
    assert list(reply.keys) == keys
    return verified_blocks(ns.digest(), keys, payload, reply.checksums)


def test_an_offer_lasts_as_long_as_its_requester_waits(owner, transport, clock):
    # the offer expired after the transport's TTL whatever the requester's wait (up to 600 s):
    # the reaper pulled it back while the requester could still pull, whose pull then hung to
    # its deadline and made a good peer suspect
    tokens = prompt(13)
    compute(owner, tokens, "t", random_blocks(4, POOL.block_shape))
    offers = service(owner, transport)
    reply = OfferReply.from_json(offers.offer(ask(owner, tokens, "t", 3, wait_s=6 * TTL_S)).to_json())
    short = OfferReply.from_json(offers.offer(ask(owner, tokens, "t", 3, wait_s=TTL_S / 5)).to_json())
    assert reply.num_pages == short.num_pages == 3
    clock[0] = 2 * TTL_S  # past the TTL, within the first requester's wait
    assert transport.reap_expired() == 1 and transport.outstanding_offers == 1  # a short wait keeps the TTL
    assert pull_and_check(owner, transport, reply, tokens, "t") == 3
    assert offers.ack({"offer_id": reply.offer_id}) and transport.outstanding_offers == 0


def test_a_peer_whose_blocks_have_the_same_bytes_but_another_dtype_layout_or_model_gets_none(transport):
    # the handshake compared the codec's name and block bytes: a float pool's "raw" names no
    # dtype or layout, so a bfloat16 pool with twice the heads (the same bytes a block) took
    # this float32 pool's blocks and read them as its own: wrong KV; so did a node of the
    # same shapes with other weights
    with make(model_id="weights-a") as owner:
        tokens = prompt(13)
        compute(owner, tokens, "t", random_blocks(4, POOL.block_shape))
        offers = service(owner, transport)
        layout = dataclasses.replace(POOL, dtype="bfloat16", num_kv_heads=2 * POOL.num_kv_heads)
        others = [make_codec(other).identity + "/model=weights-a"
                  for other in (dataclasses.replace(POOL, dtype="int32"), layout)]  # fmt: skip
        for identity in others + [owner.codec.identity + "/model=weights-b", owner.codec.identity]:
            assert identity != owner.page_identity
            reply = offers.offer(ask(owner, tokens, "t", 3, WAIT_S, identity))
            assert reply.num_pages == 0 and f"codec {identity} / " in reply.reason
            assert owner.page_identity in reply.reason
        assert offers.offer(ask(owner, tokens, "t", 3, WAIT_S)).num_pages == 3


def test_a_salted_block_is_offered_only_to_a_request_of_the_same_tenant_and_salt(owner, transport):
    """A request's cache_salt travels in the ask (the ``salt`` field): the owner walks the
    prompt in the tenant and salt asked for, so pages cached under a salt go to no unsalted
    or differently salted request, and pages cached unsalted to no salted one."""
    tokens, salted = prompt(13), Namespace("t", salt="user-7")
    compute(owner, tokens, salted, random_blocks(4, POOL.block_shape))
    offers = service(owner, transport)
    for namespace in ("t", None, Namespace("t", salt="user-8"), Namespace("u", salt="user-7")):
        reply = offers.offer(ask(owner, tokens, namespace, 3, WAIT_S))
        assert (reply.num_pages, reply.reason) == (0, "none of the pages is cached here"), namespace
    reply = OfferReply.from_json(offers.offer(ask(owner, tokens, salted, 3, WAIT_S)).to_json())
    assert reply.num_pages == 3
    assert pull_and_check(owner, transport, reply, tokens, salted) == 3  # keys and checksums of the salted digest
    assert offers.ack({"offer_id": reply.offer_id})
    other = prompt(13, start=100)
    compute(owner, other, "t", random_blocks(4, POOL.block_shape))
    assert offers.offer(ask(owner, other, salted, 3, WAIT_S)).num_pages == 0
    assert offers.offer(ask(owner, other, "t", 3, WAIT_S)).num_pages == 3


def test_an_ask_carries_its_salt_and_an_ask_without_one_has_none():
    asked = OfferRequest(Namespace("t", salt="user-7"), prompt(32), 0, 2, "raw", 64, 1.0)
    body = asked.to_json()
    assert (body["namespace"], body["salt"]) == ("t", "user-7")
    assert OfferRequest.from_json(body).namespace == Namespace("t", salt="user-7")
    del body["salt"]  # a node from before salts
    assert OfferRequest.from_json(body).namespace == Namespace("t")
    assert OfferRequest.from_json({**body, "namespace": None, "salt": ""}).namespace == Namespace()
    for salt, message in ((7, r"salt=7 must be a string \(the request's cache_salt"),
                          ("\ud800", r"salt='\\ud800' must be valid Unicode text")):  # fmt: skip
        with pytest.raises(ValueError, match=message):
            OfferRequest.from_json({**body, "salt": salt})
    with pytest.raises(ValueError, match="an offer request carries a tenant and a salt only"):
        OfferRequest(Namespace("t", model="m"), prompt(32), 0, 2, "raw", 64, 1.0)
