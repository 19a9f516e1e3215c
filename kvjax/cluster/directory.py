"""The cluster's prefix directory on Redis: which live node holds which block, in which tier.

Key schema (``prefix`` is "kvjax" by default; hex is lowercase; ``{ns}`` is the 16-byte
``Namespace.digest()`` and ``{key}`` the 16-byte chained block key, both in hex):

=============================  ======  ==============  ============================================
key                            type    TTL             holds (written by)
=============================  ======  ==============  ============================================
``{prefix}:cluster``           hash    none            model, page_size, tokenizer, canonicalize:
                                                       what every node and the router key prompts
                                                       with (the first node; the others must agree)
``{prefix}:nodes``             set     none            node ids that may be live (register,
                                                       deregister; a heartbeat prunes ids whose
                                                       record expired)
``{prefix}:node:{id}:epoch``   string  none            the node's last epoch, INCR on every start,
                                                       never reused (register)
``{prefix}:node:{id}``         hash    ``node_ttl_s``  epoch, incarnation, address, inflight,
                                                       prefill_tokens, started (register,
                                                       heartbeat, the node's step writes; routers
                                                       HINCRBY the load)
``{prefix}:node:{id}:learned`` string  ``node_ttl_s``  JSON {"epoch": e, "incarnation": i,
                                                       "statistics": {...}}: what the node's
                                                       eviction policy learned, for its peers
                                                       (``ReuseStatistics.as_dict``; the node's
                                                       heartbeat)
``{prefix}:b:{ns}:{key}``      hash    ``block_ttl_s`` node id -> "{epoch}/{incarnation}:{tier
                                                       mask}" (each node from its block events;
                                                       mask: device 1, host 2, disk 4), or
                                                       "{epoch}/{incarnation}:0:{ms}" for a first
                                                       block the node dropped at ``ms`` (unix ms
                                                       of the node's clock)
=============================  ======  ==============  ============================================

Reading rules: a node is live while its record exists (its heartbeat keeps the TTL); an entry
counts only if its epoch and incarnation equal the live record's, so a restarted node's (or a
dead node's) old entries are never used. A lookup of a request's block keys is one round trip:
one server-side script reads the live records and returns per live node the length of its
leading run of the keys and how many of those blocks are fastest on each tier, and when it
dropped the first key if it did (a first block, one with no parent, that leaves a node's last
tier stays as a dropped entry, "{epoch}/{incarnation}:0:{ms}", as long as the block's key
lives: the router sends a request nobody holds back to the node that saw its prefix last,
``kvjax.cluster.router``). A node that registers a new epoch writes its marks again (its
publisher keeps those of the last ``block_ttl_s``); marks of a previous epoch are not read,
like its other entries.

The script does not read every key: it relies on what a node's cache guarantees and its
publisher mirrors transaction by transaction, that a block is held only with its parent (the
trie drops the pages after a page it drops), and a block on device only with its parent on
device. So a node's run ends at the last block it holds, and its device blocks are the run's
first ones: after block 1 (one HMGET for every node, which ends a cold lookup), binary
searches find each holder's run and device boundary, and only the blocks of the run past
that boundary (host or disk, not prefix-closed between them) are read one by one, which
also finds any gap there. 256 keys held on device by 4 nodes: 0.49 -> 0.03 ms of Redis time
against walking every key (``benchmarks/bench_router.py``). A gap among device entries, which
no publisher writes, can make a run look longer than it is: a routing hint, never KV.

Epochs after Redis lost its data: the counters restart, so an epoch number alone could be
handed out twice, to a process that registered before the loss (and has not heard of it yet)
and one that registered after; the old one's writes would count as the new one's. Two rules
keep every (epoch, incarnation) of a node id unique: each ``Directory`` client draws a random
``incarnation`` that all its records and entries carry (32 random bits: two clients match with
odds of 1 in 4 billion), and a client registering again takes the larger of INCR and one past
its own last epoch, in the same script (its own writes from before it heard of the loss never
match its new epoch). Heartbeats, load writes, deregistration and learned statistics check
both, like lookups.

Memory: each node writes one field per block it holds, and deletes it when its events say
the block left its last tier (an empty hash disappears), so a live node leaves nothing behind
but its dropped first blocks, one field each while the key lives (its TTL, which any
holder's writes and refreshes extend).
What a dead node, or a node's previous epoch, wrote is never read and is bounded: one field
per node id and block (a restart overwrites its own field), and it expires with the block
key's TTL, which only a live holder's writes and periodic refreshes extend (see
``kvjax.cluster.publisher``). ``{prefix}:node:{id}:epoch`` stays, one small key per node id
ever used, so epochs never repeat while Redis keeps its data. Blocks are ~100 bytes of Redis
memory per holder; the incarnation in each entry adds ~16 (20,000 blocks of one holder: 211 ->
226 bytes each, key included).

Not for Redis Cluster: the scripts read keys they do not declare (node records, block keys).
"""

from __future__ import annotations

import dataclasses
import functools
import json
import secrets
import time
from collections.abc import Iterable, Mapping, Sequence

import redis

from kvjax.cluster.node_view import DEFAULT_BLOCK_TTL_S, NodeLoad, NodeView
from kvjax.text.canonicalize import CanonicalizeConfig
from kvjax.text.tokenizer import ByteTokenizer, TokenizerAdapter

__all__ = [
    "TIER_BITS",
    "ClusterInfo",
    "check_node_id",
    "Directory",
    "NodeLoad",
    "NodeView",
    "block_key",
    "tier_mask",
]

TIER_BITS = {"device": 1, "host": 2, "disk": 4}
"""Bit of each tier in a block entry's mask."""

_ENTRY_FIELDS = ("model", "page_size", "tokenizer", "canonicalize")


@dataclasses.dataclass(frozen=True, slots=True)
class ClusterInfo:
    """What every node of a cluster shares: the router keys prompts with it.

    ``tokenizer`` names the tokenizer: "byte" is ``kvjax.text.tokenizer.ByteTokenizer()``,
    "byte:<json>" a ``ByteTokenizer`` of those settings, anything else one the router does
    not know (it routes token-id prompts only). ``canonicalize``: nodes canonicalize text
    prompts: False, True (the default ``CanonicalizeConfig``) or the JSON of another config.
    A node whose record differs in any of these cannot join (``Directory.register``).
    """

    model: str
    page_size: int  # tokens per block
    tokenizer: str = "byte"
    canonicalize: bool | str = False

    def to_fields(self) -> dict[str, str]:
        canonicalize = self.canonicalize if isinstance(self.canonicalize, str) else "1" if self.canonicalize else "0"
        return {"model": self.model, "page_size": str(self.page_size), "tokenizer": self.tokenizer,
                "canonicalize": canonicalize}  # fmt: skip

    @classmethod
    def from_fields(cls, fields: Mapping[bytes | str, bytes | str]) -> ClusterInfo:
        text = {_text(k): _text(v) for k, v in fields.items()}
        missing = [name for name in _ENTRY_FIELDS if name not in text]
        if missing:
            raise ValueError(f"cluster record lacks {missing}; has {sorted(text)}")
        canonicalize = {"1": True, "0": False}.get(text["canonicalize"], text["canonicalize"])
        return cls(text["model"], int(text["page_size"]), text["tokenizer"], canonicalize)

    @classmethod
    def of(cls, model: str, page_size: int, tokenizer: object, canonicalize: CanonicalizeConfig | None) -> ClusterInfo:
        """The record of nodes serving ``model`` with ``tokenizer`` and ``canonicalize`` (None or
        disabled: off), each named exactly, so that a router keys prompts as those nodes do."""
        if isinstance(tokenizer, TokenizerAdapter) and isinstance(tokenizer.wrapped, ByteTokenizer):
            tokenizer = tokenizer.wrapped  # checked against the model's vocabulary: the same ids
        if isinstance(tokenizer, ByteTokenizer):
            name = "byte" if tokenizer == ByteTokenizer() else \
                "byte:" + json.dumps(dataclasses.asdict(tokenizer), sort_keys=True)  # fmt: skip
        else:
            name = getattr(tokenizer, "name", type(tokenizer).__name__)
        if canonicalize is None or not canonicalize.enabled:
            canon: bool | str = False
        elif canonicalize == CanonicalizeConfig():
            canon = True
        else:
            canon = json.dumps(dataclasses.asdict(canonicalize), sort_keys=True)
        return cls(model, page_size, name, canon)

    def text_keying(self) -> tuple[ByteTokenizer, CanonicalizeConfig | None] | None:
        """The tokenizer and canonicalization the nodes apply to a text prompt, or None when
        the router cannot (a tokenizer other than the byte one)."""
        return _text_keying(self.tokenizer, self.canonicalize)


@functools.lru_cache(maxsize=16)  # per request on the router: parsed once per cluster record
def _text_keying(tokenizer_name: str, canonicalize: bool | str) -> tuple[ByteTokenizer, CanonicalizeConfig | None] | None:
    if tokenizer_name == "byte":
        tokenizer = ByteTokenizer()
    elif tokenizer_name.startswith("byte:"):
        tokenizer = ByteTokenizer(**json.loads(tokenizer_name[len("byte:"):]))
    else:
        return None
    if canonicalize is True:
        return tokenizer, CanonicalizeConfig()
    if isinstance(canonicalize, str):
        return tokenizer, CanonicalizeConfig.from_dict(json.loads(canonicalize))
    return tokenizer, None


def block_key(prefix: str, namespace: bytes, key: bytes) -> str:
    """The Redis key of one block of one namespace."""
    return f"{prefix}:b:{namespace.hex()}:{key.hex()}"


def tier_mask(tiers: Iterable[str]) -> int:
    """The mask of a set of tier names; ValueError naming an unknown one."""
    mask = 0
    for tier in tiers:
        if tier not in TIER_BITS:
            raise ValueError(f"tier={tier!r}; expected one of {tuple(TIER_BITS)}")
        mask |= TIER_BITS[tier]
    return mask


class Directory:
    """The directory's client: nodes write their records and blocks, routers look them up.

    ``node_ttl_s``: a node's record expires this long after its last heartbeat (a dead node
    leaves the routing set within it); ``block_ttl_s``: a block entry expires this long after
    a holder last wrote or refreshed it. Methods raise ``redis.RedisError`` when Redis is
    unreachable; callers decide what that means.

    ``incarnation``: random hex drawn per client, written with each epoch it registers (see
    the module docstring: epochs stay unique when Redis loses its data). One process, one
    client per node id.
    """

    def __init__(self, client: redis.Redis, *, prefix: str = "kvjax", node_ttl_s: float = 6.0,
                 block_ttl_s: float = DEFAULT_BLOCK_TTL_S):  # fmt: skip
        if not prefix or ":" in prefix:
            raise ValueError(f"prefix={prefix!r} must be a non-empty name without ':'")
        for name, value in (("node_ttl_s", node_ttl_s), ("block_ttl_s", block_ttl_s)):
            if not value > 0:
                raise ValueError(f"{name}={value!r} must be > 0 seconds")
        self.client, self.prefix = client, prefix
        self.node_ttl_s, self.block_ttl_s = float(node_ttl_s), float(block_ttl_s)
        self.incarnation = secrets.token_hex(4)
        self._last_epochs: dict[str, int] = {}  # node id -> the last epoch this client registered
        self._register = client.register_script(_REGISTER)
        self._heartbeat = client.register_script(_HEARTBEAT)
        self._deregister = client.register_script(_DEREGISTER)
        self._add_load = client.register_script(_ADD_LOAD)
        self._write_load = client.register_script(_WRITE_LOAD)
        self._lookup = client.register_script(_LOOKUP)

    @classmethod
    def connect(cls, url: str, *, timeout_s: float = 2.0, **options) -> Directory:
        """A directory on the Redis at ``url`` (``redis://host:port/db``)."""
        client = redis.Redis.from_url(url, socket_timeout=timeout_s, socket_connect_timeout=timeout_s)
        return cls(client, **options)

    @property
    def address(self) -> str:
        """The Redis this directory is on, for messages: ``redis://host:port/db`` (or
        ``rediss://``, ``unix://path[?db=N]``), never the password."""
        pool = self.client.connection_pool
        kwargs = pool.connection_kwargs
        if "path" in kwargs:
            db = kwargs.get("db", 0)
            return f"unix://{kwargs['path']}" + (f"?db={db}" if db else "")
        scheme = "rediss" if issubclass(pool.connection_class, redis.SSLConnection) else "redis"
        return f"{scheme}://{kwargs.get('host', 'localhost')}:{kwargs.get('port', 6379)}/{kwargs.get('db', 0)}"

    # --- keys ------------------------------------------------------------------------------

    def node_key(self, node_id: str) -> str:
        return f"{self.prefix}:node:{node_id}"

    def learned_key(self, node_id: str) -> str:
        return f"{self.node_key(node_id)}:learned"

    def block_key(self, namespace: bytes, key: bytes) -> str:
        return block_key(self.prefix, namespace, key)

    # --- a node's writes -------------------------------------------------------------------

    def register(self, node_id: str, address: str, cluster: ClusterInfo) -> int:
        """Start a new epoch of ``node_id`` at ``address``; returns the epoch.

        ValueError if the cluster record disagrees with ``cluster`` (another model or page
        size on the same prefix), naming both values.
        """
        check_node_id(node_id)
        fields = [item for pair in cluster.to_fields().items() for item in pair]
        keys = [f"{self.prefix}:cluster", f"{self.prefix}:nodes", f"{self.node_key(node_id)}:epoch",
                self.node_key(node_id)]  # fmt: skip
        try:
            least = self._last_epochs.get(node_id, 0) + 1  # Redis may have lost the counter since
            epoch = self._register(keys, [node_id, address, self._ms(self.node_ttl_s), int(time.time()),
                                          self.incarnation, least, *fields])  # fmt: skip
        except redis.ResponseError as error:
            # _REGISTER's own refusal, not any error naming a cluster ("CLUSTERDOWN The cluster is down")
            if str(error).startswith("cluster "):
                raise ValueError(f"node {node_id!r} cannot join prefix {self.prefix!r}: {error}") from None
            raise
        self._last_epochs[node_id] = int(epoch)
        return int(epoch)

    def heartbeat(self, node_id: str, epoch: int, load: NodeLoad) -> str:
        """Refresh the node's record and load. Returns "ok", "gone" (the record expired, Redis
        lost it, or holds another epoch of this client's: Redis went back to older data;
        register again and re-publish) or "superseded" (a newer epoch of the same id
        registered, or the same epoch number by another client after Redis lost its data:
        stop writing)."""
        status = self._heartbeat([self.node_key(node_id), f"{self.prefix}:nodes"],
                                 [epoch, self._ms(self.node_ttl_s), load.inflight, load.prefill_tokens,
                                  self.prefix, self.incarnation])  # fmt: skip
        return {1: "ok", 0: "gone", -1: "superseded"}[int(status)]

    def write_blocks(self, node_id: str, epoch: int, masks: Mapping[tuple[bytes, bytes], int],
                     load: NodeLoad | None = None, *,
                     dropped: Mapping[tuple[bytes, bytes], int] | None = None) -> None:  # fmt: skip
        """One transaction: each ``(namespace, key) -> tier mask`` becomes the node's entry
        (mask 0 deletes it, or marks it dropped at ``dropped[block]`` (unix ms >= 1) if the
        block is in ``dropped``: a sequence's first block), and ``load`` (if given) its
        record's load.

        Routers see all of it or none of it. ``load`` also refreshes the record's TTL: a
        node that steps is alive. Only while ``epoch`` is the record's: an expired record is
        not written (it stays invisible until the node registers again), nor a newer epoch's
        (an old process that has not yet heard it was superseded).
        """
        ttl_ms = self._ms(self.block_ttl_s)
        dropped = dropped or {}
        tag = f"{epoch}/{self.incarnation}"
        with self.client.pipeline(transaction=True) as pipe:
            for block, mask in masks.items():
                name = self.block_key(*block)
                if mask or block in dropped:
                    pipe.hset(name, node_id, f"{tag}:{mask}" if mask else f"{tag}:0:{max(1, dropped[block])}")
                    pipe.pexpire(name, ttl_ms)
                else:
                    pipe.hdel(name, node_id)
            if load is not None:
                self._write_load([self.node_key(node_id)], [epoch, load.inflight, load.prefill_tokens,
                                                            self._ms(self.node_ttl_s), self.incarnation],
                                 client=pipe)  # fmt: skip
            pipe.execute()

    def refresh_blocks(self, blocks: Iterable[tuple[bytes, bytes]]) -> None:
        """Extend the TTL of these block entries (one pipeline): a holder keeps them alive."""
        ttl_ms = self._ms(self.block_ttl_s)
        with self.client.pipeline(transaction=False) as pipe:
            for namespace, key in blocks:
                pipe.pexpire(self.block_key(namespace, key), ttl_ms)
            pipe.execute()

    def server_id(self) -> str | None:
        """The Redis server's run id: another one after the server restarted (even from its
        persisted data) or a replica took over, which may hold less than was written. None
        where the server refuses INFO."""
        try:
            run_id = self.client.info("server").get("run_id")
        except redis.ResponseError:
            return None
        return None if run_id is None else str(run_id)

    def write_learned(self, node_id: str, epoch: int, statistics: Mapping) -> None:
        """Publish what the node's eviction policy learned (a JSON-safe mapping) under its
        epoch; it expires with the node's record unless written again."""
        check_node_id(node_id)
        record = {"epoch": int(epoch), "incarnation": self.incarnation, "statistics": statistics}
        self.client.set(self.learned_key(node_id), json.dumps(record), px=self._ms(self.node_ttl_s))

    def peers_learned(self, node_id: str) -> dict[str, dict]:
        """What every other live node published with ``write_learned``, by node id: only a
        record written under the node's live epoch and incarnation (a dead node's, or a
        previous epoch's, is left out); malformed records are left out too."""
        others = sorted(_text(other) for other in self.client.smembers(f"{self.prefix}:nodes"))
        others = [other for other in others if other != node_id]
        with self.client.pipeline(transaction=False) as pipe:
            for other in others:
                pipe.hmget(self.node_key(other), "epoch", "incarnation")
                pipe.get(self.learned_key(other))
            replies = pipe.execute()
        learned = {}
        for other, (epoch, incarnation), record in zip(others, replies[::2], replies[1::2]):
            if epoch is None or record is None:
                continue
            try:
                record = json.loads(record)
                if (int(record["epoch"]) == int(epoch) and record.get("incarnation") == _text(incarnation or b"")
                        and isinstance(record["statistics"], dict)):  # fmt: skip
                    learned[other] = record["statistics"]
            except (ValueError, KeyError, TypeError, RecursionError):  # RecursionError: nested too deep
                continue
        return learned

    def deregister(self, node_id: str, epoch: int) -> None:
        """Drop the node's record, its id in the node set and its learned statistics now (a
        clean shutdown), if ``epoch`` of this client is still the live one: routers stop
        choosing it, and its block entries are never read again (no later record has this
        epoch and incarnation); they expire with their keys."""
        self._deregister([self.node_key(node_id), f"{self.prefix}:nodes", self.learned_key(node_id)],
                         [epoch, self.incarnation, node_id])  # fmt: skip

    # --- a router's reads and writes -------------------------------------------------------

    def cluster_info(self) -> ClusterInfo | None:
        """What the nodes registered (None before the first node)."""
        fields = self.client.hgetall(f"{self.prefix}:cluster")
        return ClusterInfo.from_fields(fields) if fields else None

    def lookup(self, namespace: bytes, keys: Sequence[bytes]) -> list[NodeView]:
        """Every live node with the leading run of ``keys`` (a request's chained block keys,
        in order, of ``namespace``) it holds, and when it dropped the first key (0: it did not,
        in this epoch); one round trip. Sorted by node id."""
        reply = self._lookup([], [self.prefix, f"{self.prefix}:b:{namespace.hex()}:", b"".join(keys).hex()])
        views = []
        for row in reply:
            node_id, epoch, address, inflight, prefill, run, device, host, disk, dropped = row
            views.append(NodeView(_text(node_id), int(epoch), _text(address),
                                  NodeLoad(int(inflight or 0), int(prefill or 0)), int(run),
                                  {"device": int(device), "host": int(host), "disk": int(disk)},
                                  int(dropped)))  # fmt: skip
        views.sort(key=lambda view: view.node_id)
        return views

    def live_nodes(self) -> list[NodeView]:
        """Every live node (a lookup of no blocks)."""
        return self.lookup(b"", [])

    def add_load(self, node_id: str, inflight: int, prefill_tokens: int) -> bool:
        """Count a routed request on the node at once (the node's own writes correct it
        later). False if the node's record is gone."""
        return bool(self._add_load([self.node_key(node_id)], [inflight, prefill_tokens]))

    # --- helpers ---------------------------------------------------------------------------

    @staticmethod
    def _ms(seconds: float) -> int:
        return max(1, round(seconds * 1000))


def check_node_id(node_id: str) -> None:
    """ValueError naming ``node_id`` unless it can name a node (no ':' or whitespace)."""
    if not isinstance(node_id, str) or not node_id or any(c in node_id for c in ": \t\n"):
        raise ValueError(f"node_id={node_id!r} must be a non-empty str without ':' or whitespace")


def _text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value


# KEYS: cluster hash, nodes set, epoch counter, node record.
# ARGV: node id, address, ttl ms, started (unix s), incarnation, the least epoch to take (one
# past the client's last: the counter may have restarted), then cluster field, value pairs.
_REGISTER = """
for i = 7, #ARGV, 2 do
  local current = redis.call('HGET', KEYS[1], ARGV[i])
  if current and current ~= ARGV[i + 1] then
    return redis.error_reply('cluster ' .. ARGV[i] .. '=' .. current .. ' but this node has ' .. ARGV[i + 1])
  end
end
for i = 7, #ARGV, 2 do redis.call('HSETNX', KEYS[1], ARGV[i], ARGV[i + 1]) end
local epoch = redis.call('INCR', KEYS[3])
if epoch < tonumber(ARGV[6]) then
  epoch = tonumber(ARGV[6])
  redis.call('SET', KEYS[3], epoch)
end
redis.call('DEL', KEYS[4])
redis.call('HSET', KEYS[4], 'epoch', epoch, 'incarnation', ARGV[5], 'address', ARGV[2], 'inflight', 0,
           'prefill_tokens', 0, 'started', ARGV[4])
redis.call('PEXPIRE', KEYS[4], ARGV[3])
redis.call('SADD', KEYS[2], ARGV[1])
return epoch
"""

# KEYS: node record, nodes set. ARGV: epoch, ttl ms, inflight, prefill tokens, prefix, incarnation.
_HEARTBEAT = """
local current = redis.call('HMGET', KEYS[1], 'epoch', 'incarnation')
if not current[1] then return 0 end
if current[1] ~= ARGV[1] then
  -- another epoch of this very client: Redis went back to a snapshot (or a lagging replica),
  -- not another process: its record is as good as gone
  if current[2] == ARGV[6] then return 0 end
  return -1
end
if current[2] ~= ARGV[6] then return -1 end
redis.call('HSET', KEYS[1], 'inflight', ARGV[3], 'prefill_tokens', ARGV[4])
redis.call('PEXPIRE', KEYS[1], ARGV[2])
for _, id in ipairs(redis.call('SMEMBERS', KEYS[2])) do
  if redis.call('EXISTS', ARGV[5] .. ':node:' .. id) == 0 then redis.call('SREM', KEYS[2], id) end
end
return 1
"""

# KEYS: node record, nodes set, learned statistics. ARGV: epoch, incarnation, node id.
_DEREGISTER = """
local current = redis.call('HMGET', KEYS[1], 'epoch', 'incarnation')
if current[1] == ARGV[1] and current[2] == ARGV[2] then
  redis.call('DEL', KEYS[1], KEYS[3])
  redis.call('SREM', KEYS[2], ARGV[3])
end
"""

# KEYS: node record. ARGV: inflight delta, prefill tokens delta.
_ADD_LOAD = """
if redis.call('HEXISTS', KEYS[1], 'epoch') == 0 then return 0 end
redis.call('HINCRBY', KEYS[1], 'inflight', ARGV[1])
redis.call('HINCRBY', KEYS[1], 'prefill_tokens', ARGV[2])
return 1
"""

# KEYS: node record. ARGV: epoch, inflight, prefill tokens, ttl ms, incarnation.
_WRITE_LOAD = """
local current = redis.call('HMGET', KEYS[1], 'epoch', 'incarnation')
if current[1] ~= ARGV[1] or current[2] ~= ARGV[5] then return 0 end
redis.call('HSET', KEYS[1], 'inflight', ARGV[2], 'prefill_tokens', ARGV[3])
redis.call('PEXPIRE', KEYS[1], ARGV[4])
return 1
"""

# ARGV: prefix, the block keys' name head ("{prefix}:b:{ns hex}:"), the request's block keys in
# order as one hex string (32 digits each: one argument, not one per key, is 0.1 ms less
# packing at 256 keys). Returns per live node {id, epoch, address, inflight, prefill_tokens,
# run, device, host, disk, the ms it dropped block 1 in this epoch or 0}. Relies on each
# node's entries being prefix-closed, and its device entries too (see the module docstring):
# block 1 for every node in one HMGET, then per node that holds it the last block, a binary
# search for its run, one for its device boundary, and one HGET per block of the run past it
# (host or disk, which are not prefix-closed).
_LOOKUP = """
local prefix, head, packed = ARGV[1], ARGV[2], ARGV[3]
local count = #packed / 32
local names = {}
local function name(i)
  local n = names[i]
  if not n then
    n = head .. string.sub(packed, i * 32 - 31, i * 32)
    names[i] = n
  end
  return n
end
local live, ids = {}, {}
for _, id in ipairs(redis.call('SMEMBERS', prefix .. ':nodes')) do
  local rec = redis.call('HMGET', prefix .. ':node:' .. id, 'epoch', 'address', 'inflight', 'prefill_tokens',
                         'incarnation')
  if rec[1] then
    live[#live + 1] = {id, rec}
    ids[#ids + 1] = id
  end
end
local first = {}
if count > 0 and #ids > 0 then first = redis.call('HMGET', name(1), unpack(ids)) end
local out = {}
for j, node in ipairs(live) do
  local id, rec = node[1], node[2]
  local e = rec[1] .. '/' .. (rec[5] or '') .. ':'
  -- entry of this epoch and incarnation -> its fastest tier: 1 device, 2 host, 3 disk
  local valid = {[e .. '1'] = 1, [e .. '2'] = 2, [e .. '3'] = 1, [e .. '4'] = 3, [e .. '5'] = 1, [e .. '6'] = 2,
                 [e .. '7'] = 1}
  local seen = {}
  local function tier(i)
    local t = seen[i]
    if t == nil then
      t = valid[redis.call('HGET', name(i), id)] or false
      seen[i] = t
    end
    return t
  end
  local function last(lo, hi, holds)  -- holds(lo) and not holds(hi): the last i with holds(i)
    while hi - lo > 1 do
      local mid = math.floor((lo + hi) / 2)
      if holds(mid) then lo = mid else hi = mid end
    end
    return lo
  end
  local run, counts, dropped = 0, {0, 0, 0}, 0
  if count > 0 then seen[1] = valid[first[j]] or false end
  if count > 0 and first[j] and not seen[1] and string.sub(first[j], 1, #e + 2) == e .. '0:' then
    dropped = tonumber(string.match(string.sub(first[j], #e + 3), '^%d+$')) or 0
  end
  if count > 0 and seen[1] then
    run = count
    if not tier(count) then run = last(1, count, tier) end
    local device = 0
    if tier(run) == 1 then
      device = run
    elseif tier(1) == 1 then
      device = last(1, run, function(i) return tier(i) == 1 end)
    end
    counts[1] = device
    for i = device + 1, run do
      local t = tier(i)
      if not t then
        run = i - 1
        break
      end
      counts[t] = counts[t] + 1
    end
  end
  out[#out + 1] = {id, rec[1], rec[2], rec[3], rec[4], run, counts[1], counts[2], counts[3], dropped}
end
return out
"""
