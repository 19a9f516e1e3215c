"""A node's side of remote fetch as the owner: peers ask for pages of a prompt, it offers them.

The side channel is the node's HTTP API (``kvjax.cluster.node_server``):

``POST /kv/offer`` with ``OfferRequest`` (JSON): the request's tenant (``namespace``; null
is the default) and its ``cache_salt`` (``salt``; "" or absent, as a node from before salts
sends it: none), the prompt's tokens up to the last page wanted (little-endian int32,
base64), the pages wanted (``first_page``, ``num_pages``), the requester's page identity
(codec name, stored dtype and shape, model: ``KVCache.page_identity``) and block bytes, and
the seconds it will wait (``wait_s``). The answer is an ``OfferReply``: how many leading
pages are offered (possibly 0), the one-time offer id, the transfer server's address, each
page's key and checksum (``kvjax.tiers.remote_transport.block_checksums``) and the tier it
came from. The requester pulls the payload (``u8[num_pages, block_nbytes]``) and then
``POST /kv/ack {"offer_id": ...}`` so the offer is not reclaimed.

Isolation: the pages are found by walking the prompt's tokens in the request's namespace
(tenant and salt), so a node offers a block only to a request of the tenant and salt that
computed it; the requester checks keys and checksums (which cover the namespace's digest)
against its own namespace's keys as well.

Threads: the walk and the reads run on the engine thread (``EngineWorker.export``, between
steps); the checksums and the offer on the HTTP handler's worker thread.

Faults for tests (``fault``; a node started with ``--remote-fault MODE`` also takes
``POST /kv/fault {"mode": ..., "slow_s": ...}`` to change it): "hang" answers with an id it
never offers; "corrupt" flips a byte after the checksums; "wrong" offers the pages in reverse
order under the right checksums; "slow" offers only after ``slow_s`` seconds; "refuse"
answers 503. Off ("none") by default; nothing else looks at it.
"""

from __future__ import annotations

import base64
import dataclasses
import secrets
import threading
import time
from collections.abc import Callable, Mapping

import numpy as np

from kvjax.cache.block_keys import Namespace, as_namespace
from kvjax.tiers.kv_cache_remote import ExportedPages
from kvjax.tiers.remote_transport import RemoteTransport, block_checksums

__all__ = ["FAULTS", "OfferReply", "OfferRequest", "OfferService", "decode_tokens", "encode_tokens"]

FAULTS = ("none", "hang", "corrupt", "wrong", "slow", "refuse")
_MAX_PAGES = 1024  # per offer: bounds the memory one ask can pin until it is pulled or reclaimed
_MAX_WAIT_S = 600.0  # per offer: a fetch worth waiting longer for is not worth fetching


def encode_tokens(tokens) -> str:
    return base64.b64encode(np.asarray(tokens, "<i4").tobytes()).decode()


def decode_tokens(text: str) -> np.ndarray:
    raw = base64.b64decode(text, validate=True)
    if len(raw) % 4:
        raise ValueError(f"tokens of {len(raw)} bytes are not int32s")
    return np.frombuffer(raw, "<i4")


@dataclasses.dataclass(frozen=True, slots=True)
class OfferRequest:
    """What a node asks a peer for (see the module docstring).

    ``namespace``: the request's, a ``Namespace`` of a tenant and a salt (a tenant name or
    None, the default, is taken as one without a salt); only those two travel, so a model or
    adapter in it is refused.
    """

    namespace: Namespace
    tokens: np.ndarray  # int32, the prompt up to the last page wanted
    first_page: int
    num_pages: int
    codec: str
    block_nbytes: int
    wait_s: float  # seconds the requester waits for the whole fetch from now

    def __post_init__(self) -> None:
        namespace = as_namespace(self.namespace)
        if namespace.model or namespace.adapter:
            raise ValueError(f"namespace={namespace!r}: an offer request carries a tenant and a salt only")
        object.__setattr__(self, "namespace", namespace)  # frozen

    def to_json(self) -> dict:
        return {"namespace": self.namespace.tenant, "salt": self.namespace.salt, "tokens": encode_tokens(self.tokens),
                "first_page": self.first_page, "num_pages": self.num_pages, "codec": self.codec,
                "block_nbytes": self.block_nbytes, "wait_s": self.wait_s}  # fmt: skip

    @classmethod
    def from_json(cls, body: Mapping) -> OfferRequest:
        """ValueError naming the field for a malformed request."""
        try:
            tenant, salt = body["namespace"], body.get("salt")
            fields = (decode_tokens(body["tokens"]), int(body["first_page"]), int(body["num_pages"]),
                      str(body["codec"]), int(body["block_nbytes"]), float(body["wait_s"]))  # fmt: skip
        except (KeyError, TypeError, ValueError) as error:
            raise ValueError(f"bad offer request: {type(error).__name__}: {error}") from None
        if tenant is not None and (not isinstance(tenant, str) or not tenant):
            raise ValueError(f"namespace={tenant!r} must be a tenant name or null")
        salt = "" if salt is None else salt  # absent: a node from before salts, whose requests have none
        if not isinstance(salt, str):
            raise ValueError(f"salt={salt!r} must be a string (the request's cache_salt; \"\": none)")
        request = cls(dataclasses.replace(as_namespace(tenant), salt=salt), *fields)
        if not 0.0 <= request.wait_s <= _MAX_WAIT_S:  # also NaN; a deadline past any clock's range
            raise ValueError(f"wait_s={request.wait_s!r} must be a number of seconds in [0, {_MAX_WAIT_S:g}]")
        if request.first_page < 0 or not 0 < request.num_pages <= _MAX_PAGES:
            raise ValueError(f"first_page={request.first_page} must be >= 0 and num_pages={request.num_pages} "
                             f"in [1, {_MAX_PAGES}]")  # fmt: skip
        return request


@dataclasses.dataclass(frozen=True, slots=True)
class OfferReply:
    """What the owner offers: ``num_pages`` leading pages of those asked for (0: none)."""

    num_pages: int
    offer_id: int = 0
    address: str = ""  # the owner's transfer server
    block_nbytes: int = 0
    keys: tuple[bytes, ...] = ()
    checksums: tuple[bytes, ...] = ()
    tiers: tuple[str, ...] = ()
    reason: str = ""  # why fewer pages than asked for

    def to_json(self) -> dict:
        return {"num_pages": self.num_pages, "offer_id": self.offer_id, "address": self.address,
                "block_nbytes": self.block_nbytes, "keys": [key.hex() for key in self.keys],
                "checksums": [checksum.hex() for checksum in self.checksums], "tiers": list(self.tiers),
                "reason": self.reason}  # fmt: skip

    @classmethod
    def from_json(cls, body: Mapping) -> OfferReply:
        try:
            reply = cls(int(body["num_pages"]), int(body["offer_id"]), str(body["address"]),
                        int(body["block_nbytes"]), tuple(bytes.fromhex(k) for k in body["keys"]),
                        tuple(bytes.fromhex(c) for c in body["checksums"]), tuple(body["tiers"]),
                        str(body.get("reason", "")))  # fmt: skip
        except (KeyError, TypeError, ValueError) as error:
            raise ValueError(f"bad offer reply: {type(error).__name__}: {error}") from None
        if not len(reply.keys) == len(reply.checksums) == reply.num_pages >= 0:
            raise ValueError(f"offer reply of {reply.num_pages} pages with {len(reply.keys)} keys and "
                             f"{len(reply.checksums)} checksums")  # fmt: skip
        host, _, port = reply.address.rpartition(":")
        if reply.num_pages and not (host and port.isdigit() and 0 < int(port) < 65536):
            raise ValueError(f"offer reply address={reply.address!r}: expected the transfer server's host:port")
        return reply


class OfferService:
    """Answers ``/kv/offer`` and ``/kv/ack`` for one node (see the module docstring).

    ``export(request) -> ExportedPages``: runs the export on the engine thread and waits for
    it (``EngineWorker.export``); ``codec`` / ``block_nbytes``: this node cache's
    ``page_identity`` (codec name, stored dtype and shape, model) and block bytes, which a
    request must match.
    """

    def __init__(self, transport: RemoteTransport, export: Callable[[OfferRequest, float], ExportedPages],
                 codec: str, block_nbytes: int, *, fault: str = "none", slow_s: float = 5.0):  # fmt: skip
        if fault not in FAULTS:
            raise ValueError(f"fault={fault!r}; expected one of {FAULTS}")
        self.transport, self.export, self.codec, self.block_nbytes = transport, export, codec, block_nbytes
        self.fault, self.slow_s = fault, slow_s
        self.counters = {"asks": 0, "offered_pages": 0, "empty": 0, "late": 0}
        self._lock = threading.Lock()

    def offer(self, body: Mapping) -> OfferReply:
        """Blocking; ValueError for a malformed request, ``PermissionError`` when refusing."""
        start = time.monotonic()
        request = OfferRequest.from_json(body)
        if self.fault == "refuse":
            raise PermissionError("this node refuses to offer blocks (fault injection)")
        self._count("asks")
        if (request.codec, request.block_nbytes) != (self.codec, self.block_nbytes):
            return self._empty(f"codec {request.codec} / {request.block_nbytes} B; this node stores "
                               f"{self.codec} / {self.block_nbytes} B")  # fmt: skip
        deadline = start + request.wait_s
        export = self.export(request, deadline)
        if export.num_pages == 0:
            return self._empty("none of the pages is cached here")
        payload = export.payload()
        checksums = block_checksums(export.namespace, export.keys, payload)
        if time.monotonic() >= deadline:  # nobody will pull it
            self._count("late")
            return self._empty("the requester's wait ended before the offer")
        # the requester may pull until its wait ends: an offer reclaimed before that (the
        # transport's TTL alone) made a good peer's slow pull hang, and the peer suspect
        offer_id = self._offer(payload, max(self.transport.offer_ttl_s, deadline - time.monotonic()))
        self._count("offered_pages", export.num_pages)
        return OfferReply(export.num_pages, offer_id, self.transport.address, self.block_nbytes, tuple(export.keys),
                          tuple(checksums), tuple(export.tiers))  # fmt: skip

    def set_fault(self, body: Mapping) -> str:
        """Change the fault mode (tests); ValueError naming a bad mode."""
        mode = body.get("mode")
        if mode not in FAULTS:
            raise ValueError(f"mode={mode!r}; expected one of {FAULTS}")
        self.fault, self.slow_s = mode, float(body.get("slow_s", self.slow_s))
        return mode

    def ack(self, body: Mapping) -> bool:
        try:
            return self.transport.acknowledge(int(body["offer_id"]))
        except (KeyError, TypeError, ValueError) as error:
            raise ValueError(f"bad ack: {type(error).__name__}: {error}") from None

    def _offer(self, payload: np.ndarray, ttl_s: float) -> int:
        if self.fault == "hang":
            return secrets.randbits(62) + 1  # an id nobody offers: the pull never completes
        if self.fault == "corrupt":
            payload = payload.copy()
            payload[-1, -1] ^= 0x40
        elif self.fault == "wrong" and len(payload) > 1:
            payload = payload[::-1].copy()
        if self.fault == "slow":
            offer_id = secrets.randbits(62) + 1
            timer = threading.Timer(self.slow_s, self._offer_as, (offer_id, payload))
            timer.daemon = True
            timer.start()
            return offer_id
        return self.transport.offer(payload, ttl_s)

    def _offer_as(self, offer_id: int, payload: np.ndarray) -> None:
        """The "slow" fault: the offer appears late, under the id already answered."""
        self.transport.offer(payload, offer_id=offer_id)

    def _empty(self, reason: str) -> OfferReply:
        self._count("empty")
        return OfferReply(0, reason=reason)

    def _count(self, name: str, amount: int = 1) -> None:
        with self._lock:
            self.counters[name] += amount
