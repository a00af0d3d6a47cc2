"""Benchmark one overflow report against one unscale pass on the same gradients (issue 16, item 7).

Both run on the same ``--count`` float16 gradients of ``--size`` elements (default 1000 x 100K),
one of which holds an inf (so the report also counts one tensor in detail):

* ``unscale``: the backend's ``unscale_and_check`` (what every step does), with the scale 0.5
  and 2.0 alternately so every value returns to where it started (exact, no drift);
* ``report``:  ``polyamp.explain_overflow(grads)`` (what a skipped step with diagnose=True adds).

One untimed warm-up of each, then interleaved within each repetition (order alternated);
prints each median and the ratio report / unscale (the target is <= 2).

Run: ``python benchmarks/overflow_report.py [--backend numpy|torch] [--count 1000] [--size 100K] [--reps 3]``
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np

import polyamp


def parse_size(text: str) -> int:
    """An element count such as ``100000``, ``100K`` (thousands) or ``1M`` (millions)."""
    text = text.strip().upper()
    mult = {"K": 1000, "M": 1000_000}.get(text[-1:], 1)
    return int(float(text[:-1] if mult > 1 else text) * mult)


def make_grads(backend: str, count: int, size: int) -> list:
    rng = np.random.default_rng(0)
    base = rng.standard_normal(size).astype(np.float16)
    grads = [base.copy() for _ in range(count)]
    grads[count // 2][size // 3] = np.inf
    if backend == "torch":
        import torch

        grads = [torch.from_numpy(g) for g in grads]
    return grads


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backend", choices=("numpy", "torch"), default="numpy")
    parser.add_argument("--count", type=int, default=1000)
    parser.add_argument("--size", type=parse_size, default=parse_size("100K"))
    parser.add_argument("--reps", type=int, default=3)
    args = parser.parse_args()
    grads = make_grads(args.backend, args.count, args.size)
    backend = polyamp.get_backend(args.backend)
    like = grads[0]
    found = backend.full(0.0, "float32", like)
    scales = [backend.full(v, "float32", like) for v in (0.5, 2.0)]
    times: dict[str, list[float]] = {"unscale": [], "report": []}
    backend.unscale_and_check(grads, scales[0], found)  # warm-up, untimed: first calls pay
    backend.unscale_and_check(grads, scales[1], found)  # for thread pools and page faults
    report = polyamp.explain_overflow(grads)
    for rep in range(args.reps):
        order = ("unscale", "report") if rep % 2 == 0 else ("report", "unscale")
        for name in order:
            start = time.perf_counter()
            if name == "unscale":
                backend.unscale_and_check(grads, scales[rep % 2], found)
            else:
                report = polyamp.explain_overflow(grads)
            times[name].append(time.perf_counter() - start)
    assert report is not None and len(report.tensors) == 1, report
    unscale, rep_time = statistics.median(times["unscale"]), statistics.median(times["report"])
    gib = args.count * args.size * 2 / 2**30
    print(f"{args.backend}: {args.count} x {args.size} float16 gradients ({gib:.2f} GiB), "
          f"median of {args.reps}")
    print(f"  unscale pass: {unscale * 1e3:8.1f} ms")
    print(f"  report:       {rep_time * 1e3:8.1f} ms")
    print(f"  ratio report / unscale: {rep_time / unscale:.2f} (target <= 2)")


if __name__ == "__main__":
    main()
