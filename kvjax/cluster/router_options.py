"""The router's knobs (``RouterConfig``) as command-line options, written once for every
command that routes: ``python -m kvjax.cluster router`` and the cluster replay.

Every option defaults to None (unset), so ``RouterConfig`` supplies the default and a
caller can tell which ones were given; the help shows the default."""

from __future__ import annotations

import argparse

from kvjax.cluster.router import RECENT_PER_NODE, RouterConfig

__all__ = ["ROUTER_OPTIONS", "add_router_options", "router_config"]

ROUTER_OPTIONS = ("share_slack_abs", "share_slack_rel", "long_prefix_slack", "long_prefix_units", "imbalance_abs",
                  "imbalance_rel", "tokens_per_load_unit", "fair_window", "remote_fetch_cost", "follow_dropped")
_DEFAULTS = RouterConfig()


def add_router_options(group, *, remote_fetch_cost_default: str = "no credit") -> None:
    """Add the ``ROUTER_OPTIONS`` to ``group`` (a parser or an argument group)."""
    group.add_argument("--share-slack-abs", type=float, metavar="N",
                       help=f"requests a node may take over its share of the recent ones (default: "
                            f"{_DEFAULTS.share_slack_abs:g})")
    group.add_argument("--share-slack-rel", type=float, metavar="F",
                       help=f"the same as a fraction of the share; the larger of the two applies (default: "
                            f"{_DEFAULTS.share_slack_rel:g})")
    group.add_argument("--long-prefix-slack", type=float, metavar="M",
                       help=f"the slack, as a multiple, for a request whose longest holders would save more "
                            f"than --long-prefix-units typical prompts of prefill (default: "
                            f"{_DEFAULTS.long_prefix_slack:g})")
    group.add_argument("--long-prefix-units", type=float, metavar="U",
                       help=f"typical prompts of prefill (load units) a request's longest holders must save, against "
                            f"the best node within the plain slack, for --long-prefix-slack to apply (default: "
                            f"{_DEFAULTS.long_prefix_units:g})")
    group.add_argument("--imbalance-abs", type=float, metavar="N",
                       help=f"load units a node may be above the mean load before the safety valve skips it "
                            f"(default: {_DEFAULTS.imbalance_abs:g})")
    group.add_argument("--imbalance-rel", type=float, metavar="F",
                       help=f"the same as a fraction of the mean load; the larger of the two applies (default: "
                            f"{_DEFAULTS.imbalance_rel:g})")
    group.add_argument("--tokens-per-load-unit", type=int, metavar="TOKENS",
                       help="uncached prefill tokens counted as one request of load (default: learned, the mean "
                            "uncached prompt routed)")
    group.add_argument("--fair-window", type=int, metavar="K",
                       help=f"recent decisions that fair turns and the share bound count (default: "
                            f"{RECENT_PER_NODE} per live node)")
    group.add_argument("--remote-fetch-cost", type=float, metavar="F",
                       help=f"seconds to fetch a block from another node over seconds to recompute it: when a "
                            f"request's longest holders are skipped, the others are ranked by loads crediting what "
                            f"they can fetch (default: {remote_fetch_cost_default})")
    group.add_argument("--no-follow-dropped", dest="follow_dropped", action="store_const", const=False,
                       help="send a request whose first block no node holds by fair turns, not to the node "
                            "that dropped that block last (default: follow it)")


def router_config(args: argparse.Namespace, strategy: str, **overrides) -> RouterConfig:
    """The ``RouterConfig`` of ``strategy`` with the options given in ``args`` (then
    ``overrides``); ValueError names a bad value."""
    given = {name: getattr(args, name) for name in ROUTER_OPTIONS if getattr(args, name, None) is not None}
    return RouterConfig(strategy, **{**given, **overrides})
