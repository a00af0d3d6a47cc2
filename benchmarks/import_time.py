"""Cost of ``import polyamp`` against ``import numpy`` (which it needs), in fresh processes.

Each side runs in its own new interpreter (``python -c "import x"``), alternating, so both see the
same machine load; the table shows the median wall time of the import measured inside each
process (``time.perf_counter`` around the import) and the difference, and the same for the CPU
time the process spent on it (``time.process_time``: on a busy machine it leaves out the waits
for a core, which the wall time counts). Modules load from their bytecode caches, as in an
installed polyamp: the children run without PYTHONDONTWRITEBYTECODE, and a first, untimed
import writes the caches (numpy's were written when pip installed it). Run:

    python benchmarks/import_time.py [--runs 5]
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys

CODE = ("import time; t, c = time.perf_counter(), time.process_time(); import {0}; "
        "print(time.perf_counter() - t, time.process_time() - c)")


ENV = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}


def once(module: str) -> tuple[float, float]:
    """(wall, CPU) seconds one fresh interpreter spends on ``import module``."""
    out = subprocess.run([sys.executable, "-c", CODE.format(module)], capture_output=True,
                         text=True, check=True, env=ENV)
    wall, cpu = out.stdout.split()
    return float(wall), float(cpu)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=5, help="fresh processes per side (default: 5)")
    args = parser.parse_args()
    once("polyamp")  # writes polyamp's bytecode caches, and warms the file cache for both
    times: dict[str, list[tuple[float, float]]] = {"numpy": [], "polyamp": []}
    for _ in range(args.runs):
        for module in times:
            times[module].append(once(module))
    print(f"median of {args.runs} fresh processes      wall ms    CPU ms")
    medians = {m: [statistics.median(t[i] for t in times[m]) * 1e3 for i in (0, 1)] for m in times}
    for module, (wall, cpu) in medians.items():
        print(f"import {module:<8}                  {wall:7.1f}   {cpu:7.1f}")
    (n_wall, n_cpu), (p_wall, p_cpu) = medians["numpy"], medians["polyamp"]
    print(f"difference (polyamp - numpy)       {p_wall - n_wall:+7.1f}   {p_cpu - n_cpu:+7.1f}")
    print(f"ratio (polyamp / numpy)            {p_wall / n_wall:7.2f}x  {p_cpu / n_cpu:6.2f}x")


if __name__ == "__main__":
    main()
