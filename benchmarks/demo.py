"""Time ``polyamp demo`` as a new user runs it: a fresh process, the whole demo, its table's times.

Each run is a new ``python -m polyamp demo --no-plot --no-progress`` with an empty numba cache
(``NUMBA_CACHE_DIR`` in a new temporary folder, as on a fresh install: the NumPy kernels compile
in the run). Variants, alternating so both see the same machine load:

* ``default``: as shipped (the demo runs BLAS on one thread, polyamp/demo/threads.py);
* ``blas-all-cores``: ``OPENBLAS_NUM_THREADS`` (and MKL's, OMP's) set to the cpu count, which the
  demo keeps: OpenBLAS's own default, as before issue 34.

Prints per run the three rows' times (the table's time column), the process's wall time and its
CPU time (user + system; on a busy machine a spinning BLAS thread shows up here), and the load
average before each run. Nothing is asserted: compare the numbers with docs/benchmarks.md.

Run: ``python benchmarks/demo.py [--runs 3] [--steps 300] [--variants default,blas-all-cores]``
"""

from __future__ import annotations

import argparse
import os
import re
import resource
import statistics
import subprocess
import sys
import tempfile
import time

THREAD_VARS = ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS")
VARIANTS = {"default": {}, "blas-all-cores": {v: str(os.cpu_count() or 1) for v in THREAD_VARS}}
ROW = re.compile(r"^(float32|float16|bfloat16)\S*.*?\s(\d+\.\d+)s$")


def once(variant: str, steps: int) -> tuple[list[float], float, float, float]:
    """(row times, wall s, CPU s, load average) of one fresh ``polyamp demo``."""
    env = {k: v for k, v in os.environ.items() if k not in THREAD_VARS}
    env.update(VARIANTS[variant])
    load = os.getloadavg()[0]
    with tempfile.TemporaryDirectory(prefix="polyamp-numba-") as cache:
        env["NUMBA_CACHE_DIR"] = cache  # empty: the kernels compile, as on a fresh install
        before = resource.getrusage(resource.RUSAGE_CHILDREN)
        start = time.perf_counter()
        out = subprocess.run([sys.executable, "-m", "polyamp", "demo", "--no-plot", "--no-progress",
                              "--steps", str(steps)], capture_output=True, text=True, env=env, check=True)
        wall = time.perf_counter() - start
        after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    rows = [float(m.group(2)) for line in out.stdout.splitlines() if (m := ROW.match(line.strip()))]
    return rows, wall, cpu, load


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=3, help="fresh processes per variant (default: 3)")
    parser.add_argument("--steps", type=int, default=300, help="steps per training run (default: 300)")
    parser.add_argument("--variants", default=",".join(VARIANTS),
                        help=f"comma-separated, of {', '.join(VARIANTS)} (default: all)")
    args = parser.parse_args()
    names = args.variants.split(",")
    unknown = [n for n in names if n not in VARIANTS]
    if unknown:
        parser.error(f"--variants: unknown {unknown}; expected some of {list(VARIANTS)}")
    print(f"polyamp demo --steps {args.steps}, fresh process and numba cache per run, {os.cpu_count()} cpus")
    print(f"{'variant':<16} {'load':>5}  {'float32':>8} {'fp16':>8} {'polyamp':>8}  {'wall':>7} {'CPU':>7}")
    walls: dict[str, list[float]] = {n: [] for n in names}
    for _ in range(args.runs):
        for name in names:
            rows, wall, cpu, load = once(name, args.steps)
            walls[name].append(wall)
            cells = " ".join(f"{r:7.1f}s" for r in rows)
            print(f"{name:<16} {load:5.2f}  {cells}  {wall:6.1f}s {cpu:6.1f}s", flush=True)
    for name in names:
        print(f"median wall, {name}: {statistics.median(walls[name]):.1f} s")


if __name__ == "__main__":
    main()
