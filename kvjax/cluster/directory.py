"""The cluster's prefix directory on Redis: which live node holds which block, in which tier.

Key schema (``prefix`` is "kvjax" by default; hex is lowercase; ``{ns}`` is the 16-byte
``Namespace.digest()`` and ``{key}`` the 16-byte chained block key, both in hex):

=============================  ======  ==============  ============================================
key                            type    TTL             holds (written by)
=============================  ======  ==============  ============================================
``{prefix}:cluster``           hash    none            model, page_size, tokenizer, canonicalize:
                                                       what every node and the router key prompts
                                                       with (the first node; the others must agree)
``{prefix}:nodes``             set     none            node ids that may be live (register; a
                                                       heartbeat prunes ids whose record expired)
``{prefix}:node:{id}:epoch``   string  none            the node's last epoch, INCR on every start,
                                                       never reused (register)
``{prefix}:node:{id}``         hash    ``node_ttl_s``  epoch, address, inflight, prefill_tokens,
                                                       started (register, heartbeat, the node's
                                                       step writes; routers HINCRBY the load)
``{prefix}:b:{ns}:{key}``      hash    ``block_ttl_s`` node id -> "{epoch}:{tier mask}" (each node
                                                       from its block events; mask: device 1,
                                                       host 2, disk 4)
=============================  ======  ==============  ============================================

Reading rules: a node is live while its record exists (its heartbeat keeps the TTL); an entry
counts only if its epoch equals the live record's epoch, so a restarted node's (or a dead
node's) old entries are never used. A lookup of a request's block keys is one round trip: one
server-side script reads the live records and walks the keys in order, stopping at the first
block no live node still extends its run with, and returns per live node the length of its
leading run and how many of those blocks are fastest on each tier. (A client-side pipeline of
one HGETALL per block took 0.45 ms p50 for 64 keys here; the script 0.2 ms.)

Memory: each node writes one field per block it holds, and deletes it when its events say
the block left its last tier (an empty hash disappears), so a live node leaves nothing behind.
What a dead node, or a node's previous epoch, wrote is never read and is bounded: one field
per node id and block (a restart overwrites its own field), and it expires with the block
key's TTL, which only a live holder's writes and periodic refreshes extend (see
``kvjax.cluster.publisher``). ``{prefix}:node:{id}:epoch`` stays, one small key per node id
ever used, so epochs never repeat. Blocks are ~100 bytes of Redis memory per holder.

Not for Redis Cluster: the scripts read node records they do not declare as keys.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Iterable, Mapping, Sequence

import redis

from kvjax.cluster.node_view import NodeLoad, NodeView

__all__ = [
    "TIER_BITS",
    "ClusterInfo",
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

    ``tokenizer`` names the tokenizer ("byte": ``kvjax.text.tokenizer.ByteTokenizer()``);
    ``canonicalize``: nodes canonicalize text prompts (the default ``CanonicalizeConfig``).
    """

    model: str
    page_size: int  # tokens per block
    tokenizer: str = "byte"
    canonicalize: bool = False

    def to_fields(self) -> dict[str, str]:
        return {"model": self.model, "page_size": str(self.page_size), "tokenizer": self.tokenizer,
                "canonicalize": "1" if self.canonicalize else "0"}  # fmt: skip

    @classmethod
    def from_fields(cls, fields: Mapping[bytes | str, bytes | str]) -> ClusterInfo:
        text = {_text(k): _text(v) for k, v in fields.items()}
        missing = [name for name in _ENTRY_FIELDS if name not in text]
        if missing:
            raise ValueError(f"cluster record lacks {missing}; has {sorted(text)}")
        return cls(text["model"], int(text["page_size"]), text["tokenizer"], text["canonicalize"] == "1")


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
    """

    def __init__(self, client: redis.Redis, *, prefix: str = "kvjax", node_ttl_s: float = 6.0,
                 block_ttl_s: float = 1800.0):  # fmt: skip
        if not prefix or ":" in prefix:
            raise ValueError(f"prefix={prefix!r} must be a non-empty name without ':'")
        for name, value in (("node_ttl_s", node_ttl_s), ("block_ttl_s", block_ttl_s)):
            if not value > 0:
                raise ValueError(f"{name}={value!r} must be > 0 seconds")
        self.client, self.prefix = client, prefix
        self.node_ttl_s, self.block_ttl_s = float(node_ttl_s), float(block_ttl_s)
        self._register = client.register_script(_REGISTER)
        self._heartbeat = client.register_script(_HEARTBEAT)
        self._deregister = client.register_script(_DEREGISTER)
        self._add_load = client.register_script(_ADD_LOAD)
        self._lookup = client.register_script(_LOOKUP)

    @classmethod
    def connect(cls, url: str, *, timeout_s: float = 2.0, **options) -> Directory:
        """A directory on the Redis at ``url`` (``redis://host:port/db``)."""
        client = redis.Redis.from_url(url, socket_timeout=timeout_s, socket_connect_timeout=timeout_s)
        return cls(client, **options)

    # --- keys ------------------------------------------------------------------------------

    def node_key(self, node_id: str) -> str:
        return f"{self.prefix}:node:{node_id}"

    def block_key(self, namespace: bytes, key: bytes) -> str:
        return block_key(self.prefix, namespace, key)

    # --- a node's writes -------------------------------------------------------------------

    def register(self, node_id: str, address: str, cluster: ClusterInfo) -> int:
        """Start a new epoch of ``node_id`` at ``address``; returns the epoch.

        ValueError if the cluster record disagrees with ``cluster`` (another model or page
        size on the same prefix), naming both values.
        """
        _check_node_id(node_id)
        fields = [item for pair in cluster.to_fields().items() for item in pair]
        keys = [f"{self.prefix}:cluster", f"{self.prefix}:nodes", f"{self.node_key(node_id)}:epoch",
                self.node_key(node_id)]  # fmt: skip
        try:
            epoch = self._register(keys, [node_id, address, self._ms(self.node_ttl_s), int(time.time()), *fields])
        except redis.ResponseError as error:
            if "cluster " in str(error):
                raise ValueError(f"node {node_id!r} cannot join prefix {self.prefix!r}: {error}") from None
            raise
        return int(epoch)

    def heartbeat(self, node_id: str, epoch: int, load: NodeLoad) -> str:
        """Refresh the node's record and load. Returns "ok", "gone" (the record expired or
        Redis lost it: register again and re-publish) or "superseded" (a newer epoch of the
        same id registered: stop writing)."""
        status = self._heartbeat([self.node_key(node_id), f"{self.prefix}:nodes"],
                                 [epoch, self._ms(self.node_ttl_s), load.inflight, load.prefill_tokens,
                                  self.prefix])  # fmt: skip
        return {1: "ok", 0: "gone", -1: "superseded"}[int(status)]

    def write_blocks(self, node_id: str, epoch: int, masks: Mapping[tuple[bytes, bytes], int],
                     load: NodeLoad | None = None) -> None:  # fmt: skip
        """One transaction: each ``(namespace, key) -> tier mask`` becomes the node's entry
        (mask 0 deletes it), and ``load`` (if given) its record's load.

        Routers see all of it or none of it. ``load`` also refreshes the record's TTL: a
        node that steps is alive (a record that already expired gets no epoch back, so it
        stays invisible until the node registers again).
        """
        ttl_ms = self._ms(self.block_ttl_s)
        with self.client.pipeline(transaction=True) as pipe:
            for (namespace, key), mask in masks.items():
                name = self.block_key(namespace, key)
                if mask:
                    pipe.hset(name, node_id, f"{epoch}:{mask}")
                    pipe.pexpire(name, ttl_ms)
                else:
                    pipe.hdel(name, node_id)
            if load is not None:
                node = self.node_key(node_id)
                pipe.hset(node, mapping={"inflight": load.inflight, "prefill_tokens": load.prefill_tokens})
                pipe.pexpire(node, self._ms(self.node_ttl_s))
            pipe.execute()

    def refresh_blocks(self, blocks: Iterable[tuple[bytes, bytes]]) -> None:
        """Extend the TTL of these block entries (one pipeline): a holder keeps them alive."""
        ttl_ms = self._ms(self.block_ttl_s)
        with self.client.pipeline(transaction=False) as pipe:
            for namespace, key in blocks:
                pipe.pexpire(self.block_key(namespace, key), ttl_ms)
            pipe.execute()

    def deregister(self, node_id: str, epoch: int) -> None:
        """Drop the node's record now (a clean shutdown), if ``epoch`` is still the live one."""
        self._deregister([self.node_key(node_id)], [epoch])

    # --- a router's reads and writes -------------------------------------------------------

    def cluster_info(self) -> ClusterInfo | None:
        """What the nodes registered (None before the first node)."""
        fields = self.client.hgetall(f"{self.prefix}:cluster")
        return ClusterInfo.from_fields(fields) if fields else None

    def lookup(self, namespace: bytes, keys: Sequence[bytes]) -> list[NodeView]:
        """Every live node with the leading run of ``keys`` (a request's chained block keys,
        in order, of ``namespace``) it holds; one round trip. Sorted by node id."""
        head = f"{self.prefix}:b:{namespace.hex()}:"  # once: per-key formatting was 0.15 ms of 256 keys
        names = [head + key.hex() for key in keys]
        reply = self._lookup(names, [self.prefix])
        views = []
        for row in reply:
            node_id, epoch, address, inflight, prefill, run, device, host, disk = row
            views.append(NodeView(_text(node_id), int(epoch), _text(address),
                                  NodeLoad(int(inflight or 0), int(prefill or 0)), int(run),
                                  {"device": int(device), "host": int(host), "disk": int(disk)}))  # fmt: skip
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


def _check_node_id(node_id: str) -> None:
    if not isinstance(node_id, str) or not node_id or any(c in node_id for c in ": \t\n"):
        raise ValueError(f"node_id={node_id!r} must be a non-empty str without ':' or whitespace")


def _text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value


# KEYS: cluster hash, nodes set, epoch counter, node record.
# ARGV: node id, address, ttl ms, started (unix s), then cluster field, value pairs.
_REGISTER = """
for i = 5, #ARGV, 2 do
  local current = redis.call('HGET', KEYS[1], ARGV[i])
  if current and current ~= ARGV[i + 1] then
    return redis.error_reply('cluster ' .. ARGV[i] .. '=' .. current .. ' but this node has ' .. ARGV[i + 1])
  end
end
for i = 5, #ARGV, 2 do redis.call('HSETNX', KEYS[1], ARGV[i], ARGV[i + 1]) end
local epoch = redis.call('INCR', KEYS[3])
redis.call('DEL', KEYS[4])
redis.call('HSET', KEYS[4], 'epoch', epoch, 'address', ARGV[2], 'inflight', 0, 'prefill_tokens', 0,
           'started', ARGV[4])
redis.call('PEXPIRE', KEYS[4], ARGV[3])
redis.call('SADD', KEYS[2], ARGV[1])
return epoch
"""

# KEYS: node record, nodes set. ARGV: epoch, ttl ms, inflight, prefill tokens, prefix.
_HEARTBEAT = """
local current = redis.call('HGET', KEYS[1], 'epoch')
if not current then return 0 end
if current ~= ARGV[1] then return -1 end
redis.call('HSET', KEYS[1], 'inflight', ARGV[3], 'prefill_tokens', ARGV[4])
redis.call('PEXPIRE', KEYS[1], ARGV[2])
for _, id in ipairs(redis.call('SMEMBERS', KEYS[2])) do
  if redis.call('EXISTS', ARGV[5] .. ':node:' .. id) == 0 then redis.call('SREM', KEYS[2], id) end
end
return 1
"""

# KEYS: node record. ARGV: epoch.
_DEREGISTER = """
if redis.call('HGET', KEYS[1], 'epoch') == ARGV[1] then redis.call('DEL', KEYS[1]) end
"""

# KEYS: node record. ARGV: inflight delta, prefill tokens delta.
_ADD_LOAD = """
if redis.call('HEXISTS', KEYS[1], 'epoch') == 0 then return 0 end
redis.call('HINCRBY', KEYS[1], 'inflight', ARGV[1])
redis.call('HINCRBY', KEYS[1], 'prefill_tokens', ARGV[2])
return 1
"""

# KEYS: the request's block keys in order. ARGV: prefix.
# Returns per live node {id, epoch, address, inflight, prefill_tokens, run, device, host, disk}.
# Per key it asks only for the fields of nodes whose run is still unbroken, and matches an
# entry against that node's "{epoch}:{mask}" strings (a table lookup, no parsing).
_LOOKUP = """
local prefix = ARGV[1]
local live, valid, run, tiers, extending = {}, {}, {}, {}, {}
for _, id in ipairs(redis.call('SMEMBERS', prefix .. ':nodes')) do
  local rec = redis.call('HMGET', prefix .. ':node:' .. id, 'epoch', 'address', 'inflight', 'prefill_tokens')
  if rec[1] then
    live[#live + 1] = {id, rec}
    extending[#extending + 1] = id
    local e = rec[1] .. ':'
    -- entry -> its fastest tier: 1 device, 2 host, 3 disk
    valid[id] = {[e .. '1'] = 1, [e .. '2'] = 2, [e .. '3'] = 1, [e .. '4'] = 3, [e .. '5'] = 1, [e .. '6'] = 2,
                 [e .. '7'] = 1}
    run[id] = 0
    tiers[id] = {0, 0, 0}
  end
end
for i, key in ipairs(KEYS) do
  if #extending == 0 then break end
  local entries = redis.call('HMGET', key, unpack(extending))
  local broken = false
  for j, id in ipairs(extending) do
    local fastest = entries[j] and valid[id][entries[j]]
    if fastest then
      run[id] = i
      local counts = tiers[id]
      counts[fastest] = counts[fastest] + 1
    else
      broken = true
    end
  end
  if broken then
    local still = {}
    for _, id in ipairs(extending) do
      if run[id] == i then still[#still + 1] = id end
    end
    extending = still
  end
end
local out = {}
for _, node in ipairs(live) do
  local id, rec = node[1], node[2]
  local t = tiers[id]
  out[#out + 1] = {id, rec[1], rec[2], rec[3], rec[4], run[id], t[1], t[2], t[3]}
end
return out
"""
