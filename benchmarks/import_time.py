"""Cost of ``import polyamp`` against ``import numpy`` (which it needs), in fresh processes.

Each side runs in its own new interpreter (``python -c "import x"``), alternating, so both see the
same machine load; the table shows the median wall time of the import measured inside each
process (``time.perf_counter`` around the import) and the difference. Run:

    python benchmarks/import_time.py [--runs 5]
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys

CODE = "import time; t = time.perf_counter(); import {0}; print(time.perf_counter() - t)"


def once(module: str) -> float:
    """Seconds one fresh interpreter spends on ``import module``."""
    out = subprocess.run([sys.executable, "-c", CODE.format(module)], capture_output=True,
                         text=True, check=True)
    return float(out.stdout)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=5, help="fresh processes per side (default: 5)")
    args = parser.parse_args()
    once("polyamp")  # warms the file cache for both
    times: dict[str, list[float]] = {"numpy": [], "polyamp": []}
    for _ in range(args.runs):
        for module in times:
            times[module].append(once(module))
    numpy_ms, polyamp_ms = (statistics.median(times[m]) * 1e3 for m in ("numpy", "polyamp"))
    print(f"median of {args.runs} fresh processes")
    print(f"import numpy    {numpy_ms:7.1f} ms")
    print(f"import polyamp  {polyamp_ms:7.1f} ms")
    print(f"difference      {polyamp_ms - numpy_ms:+7.1f} ms  (ratio {polyamp_ms / numpy_ms:.2f}x)")


if __name__ == "__main__":
    main()
