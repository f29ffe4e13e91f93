"""``dmuon-verify``: check measured events against the harness's prediction.

Subcommands (each module registers its own parser with ``register_cli``):

- ``check EVENTS... --against RUN``: compare events Parquet files (from ``dmuon-trace`` or a
  run's ``events_rank*.parquet``) with a predicted run (``verify.check``).

Exit status: 0 pass; 1 mismatch (each missing / unexpected collective named); 2 bad input or
arguments. Errors go to stderr. ``dmuon-verify-traffic`` (``verify.run.main``) runs the traffic
experiment itself under torchrun.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence

#: Subcommand -> module providing ``register_cli(subparsers)``.
SUBCOMMANDS: dict[str, str] = {"check": "verify.check"}


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``dmuon-verify``; returns the process exit code."""
    parser = argparse.ArgumentParser(
        prog="dmuon-verify", description=__doc__.split("\n\n")[0],
        epilog=__doc__.split("\n\n", 1)[1], formatter_class=argparse.RawDescriptionHelpFormatter)
    subparsers = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for module in SUBCOMMANDS.values():
        importlib.import_module(module).register_cli(subparsers)
    args = parser.parse_args(argv)
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
