"""cProfile of one ``ShardedGradScaler`` step (``step`` + ``update``, 10 x 1K float32, SGD) in a gloo
group of ONE, against torch's own: the per-call table of the functions each side runs (polyamp's own
modules, and torch's scaler's), and the Python calls per step.

    python tools/profile_step.py [--steps 2000] [--top 25]

Figures under cProfile are inflated by the profiler; they rank where the time goes, they are not the
benchmark (``benchmarks/distributed_step.py``).
"""

from __future__ import annotations

import argparse
import cProfile
import os
import pstats
import re
import socket
import sys
import warnings
from datetime import timedelta


def _side(cls, torch):  # noqa: ANN001, ANN202
    params = [torch.nn.Parameter(torch.randn(1000)) for _ in range(10)]
    opt = torch.optim.SGD(params, lr=1e-3)
    scaler = cls("cpu", init_scale=2.0**16)
    scaler.scale(torch.ones(()))
    grads = [torch.randn(1000) for _ in params]

    def fill() -> None:
        for p, g in zip(params, grads):
            p.grad = g.clone()

    def step() -> None:
        scaler.step(opt)
        scaler.update()
    return fill, step


def _calls(fill, step) -> int:  # noqa: ANN001
    """The Python calls one step makes (``sys.setprofile``)."""
    calls = [0]

    def count(frame, event, arg):  # noqa: ANN001, ANN202
        calls[0] += event == "call"
    fill()
    sys.setprofile(count)
    step()
    sys.setprofile(None)
    return calls[0]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=2000)
    parser.add_argument("--top", type=int, default=25)
    args = parser.parse_args()
    warnings.simplefilter("ignore")
    import torch
    import torch.distributed as dist
    from polyamp.compat.torch import ShardedGradScaler
    from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler as TorchSharded

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=0, world_size=1, timeout=timedelta(seconds=60))
    try:
        for name, cls, pattern in (("polyamp", ShardedGradScaler, r"polyamp|compat/|backends/"),
                                   ("torch", TorchSharded, r"grad_scaler|distributed_c10d")):
            fill, step = _side(cls, torch)
            for _ in range(20):
                fill()
                step()
            calls = _calls(fill, step)
            profile = cProfile.Profile()
            for _ in range(args.steps):
                fill()
                profile.enable()
                step()
                profile.disable()
            print(f"## {name}: {calls} Python calls per step (optimizer.step's own included)\n")
            stats = pstats.Stats(profile)
            rows = []
            for (path, line, func), (_, ncalls, tottime, cumtime, _) in stats.stats.items():
                if re.search(pattern, path):
                    short = path.split("site-packages/")[-1].split("/work/main/")[-1]
                    rows.append((cumtime, ncalls, tottime, f"{short}:{line}({func})"))
            print("| function | calls/step | tottime us/step | cumtime us/step |\n|---|---|---|---|")
            for cumtime, ncalls, tottime, where in sorted(rows, reverse=True)[:args.top]:
                n = args.steps
                print(f"| `{where}` | {ncalls / n:g} | {tottime / n * 1e6:.1f} | {cumtime / n * 1e6:.1f} |")
            print()
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
