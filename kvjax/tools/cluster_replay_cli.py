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

from kvjax.cluster.router import RECENT_PER_NODE, STRATEGIES, RouterConfig
from kvjax.tools.cluster_replay import ClusterSpec, FetchModel, ServiceModel, cluster_replay, format_cluster_report
from kvjax.tools.trace import TraceRequest

__all__ = ["add_cluster_arguments", "cluster_options_without_nodes", "run_cluster_replay"]

_DEFAULTS, _SERVICE, _FETCH = RouterConfig(), ServiceModel(), FetchModel()
_ROUTER_OPTIONS = ("share_slack_abs", "share_slack_rel", "long_prefix_slack", "long_prefix_units", "imbalance_abs",
                   "imbalance_rel", "tokens_per_load_unit", "fair_window", "remote_fetch_cost")
_SERVICE_OPTIONS = ("prefill_tokens_per_s", "decode_tokens_per_s")
_FETCH_OPTIONS = ("kv_bytes_per_token", "link_bytes_per_s")
_CLUSTER_ONLY = ("router", *_ROUTER_OPTIONS, *_SERVICE_OPTIONS, *_FETCH_OPTIONS, "no_remote_fetch")


def add_cluster_arguments(parser: argparse.ArgumentParser) -> None:
    """Adds the cluster options to the ``replay`` parser (every one defaults to None: unset)."""
    group = parser.add_argument_group("cluster (with --nodes; the capacities above are per node)")
    group.add_argument("--nodes", type=int, metavar="N", help="simulate N nodes behind the router")
    group.add_argument("--router", choices=STRATEGIES, help=f"routing strategy (default: {_DEFAULTS.strategy})")
    group.add_argument("--share-slack-abs", type=float, metavar="X",
                       help=f"requests a node may take over its share of the recent ones (default: "
                            f"{_DEFAULTS.share_slack_abs:g})")
    group.add_argument("--share-slack-rel", type=float, metavar="F",
                       help=f"the same as a fraction of the share (default: {_DEFAULTS.share_slack_rel:g})")
    group.add_argument("--long-prefix-slack", type=float, metavar="M",
                       help=f"the slack for a request whose holders would save a long prefix, as a multiple "
                            f"(default: {_DEFAULTS.long_prefix_slack:g})")
    group.add_argument("--long-prefix-units", type=float, metavar="U",
                       help=f"how long: more than U typical prompts of prefill (default: "
                            f"{_DEFAULTS.long_prefix_units:g})")
    group.add_argument("--imbalance-abs", type=float, metavar="X",
                       help=f"load units a holder may exceed the mean load by (default: {_DEFAULTS.imbalance_abs:g})")
    group.add_argument("--imbalance-rel", type=float, metavar="F",
                       help=f"the same as a fraction of the mean load (default: {_DEFAULTS.imbalance_rel:g})")
    group.add_argument("--tokens-per-load-unit", type=int, metavar="T",
                       help="uncached prefill tokens counted as one request of load (default: learned, the "
                            "mean uncached prompt routed)")
    group.add_argument("--fair-window", type=int, metavar="K",
                       help=f"recent decisions fair turns and the share count (default: {RECENT_PER_NODE} per node)")
    group.add_argument("--prefill-tokens-per-s", type=float, metavar="R",
                       help=f"service model: a node's prefill rate (default: {_SERVICE.prefill_tokens_per_s:g})")
    group.add_argument("--decode-tokens-per-s", type=float, metavar="R",
                       help=f"service model: one request's decode rate (default: {_SERVICE.decode_tokens_per_s:g})")
    group.add_argument("--no-remote-fetch", action="store_const", const=True,
                       help="nodes never fetch blocks another node holds (they recompute them)")
    group.add_argument("--kv-bytes-per-token", type=int, metavar="B",
                       help=f"remote fetch: bytes of KV a token (default: {_FETCH.kv_bytes_per_token:,}, an 8B model)")
    group.add_argument("--link-bytes-per-s", type=float, metavar="R",
                       help=f"remote fetch: the link's rate (default: {_FETCH.link_bytes_per_s:g})")
    group.add_argument("--remote-fetch-cost", type=float, metavar="F",
                       help="router: seconds to fetch a block over seconds to recompute it (default: the remote "
                            "fetch model's ratio)")


def cluster_options_without_nodes(args: argparse.Namespace) -> list[str]:
    """The cluster-only options given without ``--nodes`` (as flags), for the error."""
    if args.nodes is not None:
        return []
    return [f"--{name.replace('_', '-')}" for name in _CLUSTER_ONLY if getattr(args, name) is not None]


def run_cluster_replay(args: argparse.Namespace, requests: Sequence[TraceRequest], out) -> int:
    """Replays ``requests`` through ``args.nodes`` nodes and prints the report (and with
    ``--json`` one JSON line); returns 0. ValueError naming the value for a setting out of
    range."""
    router = RouterConfig(args.router or _DEFAULTS.strategy, **_given(args, _ROUTER_OPTIONS))
    service = ServiceModel(**_given(args, _SERVICE_OPTIONS))
    spec = ClusterSpec(args.nodes, args.device_blocks, args.host_blocks, args.disk_blocks, args.write_through,
                       args.policy, args.block_tokens)  # fmt: skip
    fetch = None if args.no_remote_fetch else FetchModel(**_given(args, _FETCH_OPTIONS))
    report = cluster_replay(requests, spec, router=router, service=service, fetch=fetch)
    print(format_cluster_report(args.trace, report), file=out)
    if args.json:
        print(json.dumps(report.as_dict()), file=out)
    return 0


def _given(args: argparse.Namespace, names: Sequence[str]) -> dict:
    return {name: getattr(args, name) for name in names if getattr(args, name) is not None}
