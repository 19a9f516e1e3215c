"""``python -m kvjax <command>``: the command-line entry.

Each command lives in its own module, which provides ``add_subcommand(subparsers)``
registering an argparse parser whose ``func`` default takes the parsed arguments and
returns an exit code.
"""

from __future__ import annotations

import argparse
import importlib
import sys

# Modules that contribute a subcommand, in the order `--help` lists them.
COMMAND_MODULES = ("kvjax.tools.demo", "kvjax.tools.replay_cli")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="kvjax", description=__doc__.splitlines()[0])
    subparsers = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name in COMMAND_MODULES:
        module = importlib.import_module(name)
        if hasattr(module, "add_subcommand"):
            module.add_subcommand(subparsers)
    args = parser.parse_args(argv)
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
