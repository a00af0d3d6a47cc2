"""What an extra of polyamp takes on disk: every package it pulls, transitively, as installed here.

Each package's size is the sum of the files its installer recorded (its ``RECORD``: what ``du``
shows for its folders, in bytes, 1 MB = 10**6 bytes). The README's "Install and test" figures
come from this (tests/test_readme.py compares them where the whole extra is installed).

Run: ``python tools/install_size.py [--extra test]``
"""

from __future__ import annotations

import argparse
import os
import re
from importlib import metadata

from packaging.requirements import Requirement


def _key(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _size(dist: metadata.Distribution) -> int:
    total = 0
    for file in dist.files or []:
        path = dist.locate_file(file)
        if os.path.isfile(path) and not os.path.islink(path):
            total += os.path.getsize(path)
    return total


def sizes(extra: str = "test") -> tuple[dict[str, int], list[str]]:
    """({package: bytes} for every installed package ``polyamp[extra]`` pulls, [the ones missing])."""
    wanted = [Requirement(r) for r in metadata.distribution("polyamp").requires or []]
    todo = [r for r in wanted if r.marker is not None and r.marker.evaluate({"extra": extra})]
    found: dict[str, int] = {}
    missing: list[str] = []
    while todo:
        req = todo.pop()
        key = _key(req.name)
        if key in found or key in missing:
            continue
        try:
            dist = metadata.distribution(req.name)
        except metadata.PackageNotFoundError:
            missing.append(key)
            continue
        found[key] = _size(dist)
        for line in dist.requires or []:
            sub = Requirement(line)
            if sub.marker is None or sub.marker.evaluate({"extra": ""}):
                todo.append(sub)
    return found, missing


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--extra", default="test", help="the extra of polyamp to measure (default: test)")
    args = parser.parse_args(argv)
    found, missing = sizes(args.extra)
    for name, size in sorted(found.items(), key=lambda item: -item[1]):
        print(f"{size / 1e6:8.1f} MB  {name}")
    total = sum(found.values())
    others = total - found.get("torch", 0)
    print(f"{total / 1e9:8.2f} GB  in all; {others / 1e9:.2f} GB without torch itself")
    if missing:
        print(f"not installed (not counted): {', '.join(sorted(missing))}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
