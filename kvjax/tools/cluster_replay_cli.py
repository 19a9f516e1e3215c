"""The cluster options of ``python -m kvjax replay``: ``--nodes N`` replays the trace through N
simulated nodes behind the router (``kvjax.tools.cluster_replay``) instead of one cache.

``--device-blocks``, ``--host-blocks``, ``--disk-blocks``, ``--write-through`` and ``--policy``
then describe each node. Without ``--nodes`` the replay is the single-node one, and the
cluster-only options are refused.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Sequence

from kvjax.cluster.router import STRATEGIES, RouterConfig
from kvjax.cluster.router_options import ROUTER_OPTIONS, add_router_options, router_config
from kvjax.tools.cluster_replay import (
    DEFAULT_POLICY_SHARE_S,
    ClusterSpec,
    FetchModel,
    ServiceModel,
    cluster_replay,
    format_cluster_report,
)
from kvjax.tools.trace import TraceRequest

__all__ = ["add_cluster_arguments", "cluster_options_without_nodes", "run_cluster_replay"]

_DEFAULTS, _SERVICE, _FETCH = RouterConfig(), ServiceModel(), FetchModel()
_SERVICE_OPTIONS = ("prefill_tokens_per_s", "decode_tokens_per_s")
_FETCH_OPTIONS = ("kv_bytes_per_token", "link_bytes_per_s")
_CLUSTER_ONLY = ("router", *ROUTER_OPTIONS, *_SERVICE_OPTIONS, *_FETCH_OPTIONS, "no_remote_fetch",
                 "policy_share_s", "no_policy_sharing", "pooled")


def add_cluster_arguments(parser: argparse.ArgumentParser) -> None:
    """Adds the cluster options to the ``replay`` parser (every one defaults to None: unset)."""
    group = parser.add_argument_group("cluster (with --nodes; the capacities above are per node)")
    group.add_argument("--nodes", type=int, metavar="N", help="simulate N nodes behind the router")
    group.add_argument("--router", choices=STRATEGIES, help=f"routing strategy (default: {_DEFAULTS.strategy})")
    add_router_options(group, remote_fetch_cost_default="the remote fetch model's ratio")
    group.add_argument("--prefill-tokens-per-s", type=float, metavar="R",
                       help=f"service model: a node's prefill rate (default: {_SERVICE.prefill_tokens_per_s:g})")
    group.add_argument("--decode-tokens-per-s", type=float, metavar="R",
                       help=f"service model: one request's decode rate (default: {_SERVICE.decode_tokens_per_s:g})")
    group.add_argument("--no-remote-fetch", action="store_const", const=True,
                       help="nodes never fetch blocks another node holds (they recompute them)")
    group.add_argument("--policy-share-s", type=float, metavar="S",
                       help="seconds of trace time between the nodes' exchanges of learned reuse statistics "
                            f"(reuse policy; default: {DEFAULT_POLICY_SHARE_S:g})")  # fmt: skip
    group.add_argument("--no-policy-sharing", action="store_const", const=True,
                       help="each node's eviction policy learns from its own traffic only")
    group.add_argument("--pooled", action="store_const", const=True,
                       help="one cache of the cluster's capacity, a namespace per node: the ceiling of cooperative "
                            "caching (a yardstick, see kvjax.tools.cluster_replay)")  # fmt: skip
    group.add_argument("--kv-bytes-per-token", type=int, metavar="B",
                       help=f"remote fetch: bytes of KV a token (default: {_FETCH.kv_bytes_per_token:,}, an 8B model)")
    group.add_argument("--link-bytes-per-s", type=float, metavar="R",
                       help=f"remote fetch: the link's rate (default: {_FETCH.link_bytes_per_s:g})")


def cluster_options_without_nodes(args: argparse.Namespace) -> list[str]:
    """The cluster-only options given without ``--nodes`` (as flags), for the error."""
    if args.nodes is not None:
        return []
    return [f"--{name.replace('_', '-')}" for name in _CLUSTER_ONLY if getattr(args, name) is not None]


def run_cluster_replay(args: argparse.Namespace, requests: Sequence[TraceRequest], out) -> int:
    """Replays ``requests`` through ``args.nodes`` nodes and prints the report (and with
    ``--json`` one JSON line); returns 0. ValueError naming the value for a setting out of
    range."""
    router = router_config(args, args.router or _DEFAULTS.strategy)
    service = ServiceModel(**_given(args, _SERVICE_OPTIONS))
    if args.no_policy_sharing and args.policy_share_s is not None:
        raise ValueError(f"--policy-share-s {args.policy_share_s:g} and --no-policy-sharing contradict each other")
    if args.no_remote_fetch and args.remote_fetch_cost is not None:  # the router would credit fetches never made
        raise ValueError(f"--remote-fetch-cost {args.remote_fetch_cost:g} and --no-remote-fetch contradict each other")
    share = args.policy_share_s if args.policy_share_s is not None else DEFAULT_POLICY_SHARE_S
    spec = ClusterSpec(args.nodes, args.device_blocks, args.host_blocks, args.disk_blocks, args.write_through,
                       args.policy, args.block_tokens, None if args.no_policy_sharing else share,
                       pooled=bool(args.pooled))  # fmt: skip
    fetch = None if args.no_remote_fetch else FetchModel(**_given(args, _FETCH_OPTIONS))
    report = cluster_replay(requests, spec, router=router, service=service, fetch=fetch)
    print(format_cluster_report(args.trace, report), file=out)
    if args.json:
        print(json.dumps(report.as_dict()), file=out)
    return 0


def _given(args: argparse.Namespace, names: Sequence[str]) -> dict:
    return {name: getattr(args, name) for name in names if getattr(args, name) is not None}
