"""Benchmark polyamp's cupy unscale-and-check kernels against torch's fused CUDA kernel.

Both work in place on the same CUDA buffers (torch tensors, seen by cupy through zero-copy
DLPack views). Candidates, interleaved within each repetition:

* ``polyamp``:      the cupy backend's ``unscale_and_check`` on the cupy views;
* ``polyamp+dlpack``: the same given the torch tensors (a DLPack view per tensor per call);
* ``torch``:        ``torch._amp_foreach_non_finite_check_and_unscale_``;
* ``copy``:         a device-to-device copy of the same bytes (the bandwidth yardstick).

Scales alternate 2.0 / 0.5 so the data stays finite and exact. Times are CUDA-event medians
after warm-up; GB/s counts each byte read and written once (2 x the gradient bytes).
Targets (on a GPU): polyamp no slower than torch; >= 80% of copy bandwidth on large buffers.

Run: ``python benchmarks/cupy_unscale.py [--reps 20] [--inner 10] [--check]``
"""

from __future__ import annotations

import argparse
import statistics
import sys
from collections.abc import Callable
from typing import Any

CASES = [("1000 x 4K", 1000, 4096), ("10 x 16M", 10, 16 << 20)]
DTYPES = ("float32", "float16")
TARGET_COPY_FRACTION = 0.8


def require_gpu() -> tuple[Any, Any, Any]:
    """(cupy, torch, the bound cupy backend), or exit saying why this machine cannot run it."""
    from polyamp.backends import cupy as cupy_backend

    import polyamp

    info = cupy_backend.backend_info()
    if not info["available"]:
        sys.exit(f"cupy_unscale: needs a CUDA GPU; cupy backend unavailable: {info['reason']}")
    try:
        import torch
    except ImportError as exc:
        sys.exit(f"cupy_unscale: needs torch with CUDA to compare against ({exc})")
    if not torch.cuda.is_available():
        sys.exit("cupy_unscale: needs torch with CUDA to compare against (torch sees no GPU)")
    import cupy

    return cupy, torch, polyamp.get_backend("cupy")


def time_ms(torch: Any, fn: Callable[[], None], inner: int) -> float:
    """Milliseconds per call of ``fn``: ``inner`` calls between two CUDA events."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(inner):
        fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / inner


def candidates(cupy: Any, torch: Any, backend: Any, tensors: list) -> dict[str, Callable]:
    """The timed functions, each unscaling (or copying) the same bytes once per call."""
    views = [cupy.from_dlpack(t) for t in tensors]
    like = views[0]
    scales = [backend.full(s, "float32", like) for s in (2.0, 0.5)]
    torch_inv = [torch.full((), 1 / s, device=tensors[0].device) for s in (2.0, 0.5)]
    found, torch_found = backend.full(0.0, "float32", like), torch.zeros((), device="cuda")
    nbytes = sum(t.numel() * t.element_size() for t in tensors)
    src, dst = cupy.empty(nbytes, cupy.uint8), cupy.empty(nbytes, cupy.uint8)
    turn = [0]

    def flip() -> int:
        turn[0] ^= 1
        return turn[0]

    return {
        "polyamp": lambda: backend.unscale_and_check(views, scales[flip()], found),
        "polyamp+dlpack": lambda: backend.unscale_and_check(tensors, scales[flip()], found),
        "torch": lambda: torch._amp_foreach_non_finite_check_and_unscale_(
            tensors, torch_found, torch_inv[flip()]),
        "copy": lambda: dst.data.copy_from_device_async(src.data, nbytes),
    }


def measure(cupy: Any, torch: Any, backend: Any, count: int, size: int, dtype: str,
            args: argparse.Namespace) -> dict[str, float]:
    """Median ms per call of every candidate on ``count`` tensors of ``size`` elements."""
    gen = torch.Generator(device="cuda").manual_seed(0)
    tensors = [torch.randint(-1000, 1000, (size,), device="cuda", generator=gen)
               .to(getattr(torch, dtype)) for _ in range(count)]
    fns = candidates(cupy, torch, backend, tensors)
    times: dict[str, list[float]] = {name: [] for name in fns}
    for fn in fns.values():
        time_ms(torch, fn, args.warmup)
    for rep in range(args.reps):
        names = list(fns)
        for name in names[rep % len(names):] + names[: rep % len(names)]:
            times[name].append(time_ms(torch, fns[name], args.inner))
    return {name: statistics.median(ts) for name, ts in times.items()}


def report(label: str, dtype: str, nbytes: int, ms: dict[str, float]) -> list[str]:
    """One table row; returns the targets this row misses."""
    gbps = {name: 2 * nbytes / (t * 1e-3) / 1e9 for name, t in ms.items()}
    ratio = ms["polyamp"] / ms["torch"]
    of_copy = gbps["polyamp"] / gbps["copy"]
    print(f"{label:<10} {dtype:<8} {nbytes / 1e6:9.1f} MB  "
          + "  ".join(f"{ms[n]:8.4f}" for n in ("polyamp", "polyamp+dlpack", "torch", "copy"))
          + f"  {ratio:6.2f}  {gbps['polyamp']:8.0f} {gbps['torch']:8.0f} {gbps['copy']:8.0f}"
          + f"  {of_copy:6.0%}")
    missed = []
    if ratio > 1.0:
        missed.append(f"{label} {dtype}: polyamp/torch = {ratio:.2f} > 1")
    if nbytes >= 100e6 and of_copy < TARGET_COPY_FRACTION:
        missed.append(f"{label} {dtype}: {of_copy:.0%} of copy bandwidth < 80%")
    return missed


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=20, help="timed repetitions (median taken)")
    parser.add_argument("--inner", type=int, default=10, help="calls between two events")
    parser.add_argument("--warmup", type=int, default=5, help="untimed calls first")
    parser.add_argument("--check", action="store_true", help="exit 1 when a target is missed")
    args = parser.parse_args(argv)
    cupy, torch, backend = require_gpu()
    props = cupy.cuda.runtime.getDeviceProperties(cupy.cuda.Device().id)
    name = props["name"].decode() if isinstance(props["name"], bytes) else props["name"]
    print(f"device: {name} ({props['multiProcessorCount']} SMs), "
          f"cupy {cupy.__version__}, torch {torch.__version__}")
    print(f"{'case':<10} {'dtype':<8} {'bytes':>12}  {'polyamp':>8}  {'+dlpack':>8}  "
          f"{'torch':>8}  {'copy':>8}  {'ratio':>6}  {'GB/s':>8} {'torch':>8} {'copy':>8}"
          f"  {'%copy':>6}   (times in ms per call; ratio = polyamp / torch)")
    missed = []
    for label, count, size in CASES:
        for dtype in DTYPES:
            ms = measure(cupy, torch, backend, count, size, dtype, args)
            nbytes = count * size * (4 if dtype == "float32" else 2)
            missed += report(label, dtype, nbytes, ms)
            torch.cuda.empty_cache()
            cupy.get_default_memory_pool().free_all_blocks()
    print("targets: " + ("all met" if not missed else "MISSED: " + "; ".join(missed)))
    return 1 if missed and args.check else 0


if __name__ == "__main__":
    sys.exit(main())
