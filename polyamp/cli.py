"""The ``polyamp`` command: ``polyamp info`` (backends and POLYAMP_BACKEND in effect)."""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence

from . import __version__
from ._registry import ENV_VAR, available_backends


def _info(args: argparse.Namespace) -> int:
    print(f"polyamp {__version__}")
    env = os.environ.get(ENV_VAR, "").strip()
    print(f"{ENV_VAR}: {env or '(unset: backend chosen from the arrays, numpy by default)'}")
    rows = [("backend", "available", "version", "reason")]
    for info in available_backends():
        rows.append((info.name, "yes" if info.available else "no", info.version or "-",
                     info.reason or ""))
    widths = [max(len(r[i]) for r in rows) for i in range(3)]
    for row in rows:
        print("  ".join(c.ljust(w) for c, w in zip(row[:3], widths)) + "  " + row[3])
    return 0


def build_parser() -> argparse.ArgumentParser:
    """The argument parser; subcommands register themselves here."""
    parser = argparse.ArgumentParser(prog="polyamp", description=__doc__)
    parser.add_argument("--version", action="version", version=f"polyamp {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("info", help="list backends, their availability and versions").set_defaults(
        func=_info
    )
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the console script and of ``python -m polyamp``."""
    args = build_parser().parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
