"""Where a ``ShardedGradScaler`` step's time goes beside torch's: each side in a gloo group of ONE with
``torch.distributed.all_reduce`` replaced by a no-op (a sum over one rank is the identity; gloo's own
latency, some 60-80 us here, would otherwise swamp the Python). Rows:

- ``group of one``: polyamp's path for one rank (its flag alone: nobody to differ from);
- ``as rank 0 of 2``: the path two or more ranks pay (the fingerprint digested into the message):
  the group reports two ranks and the all-reduce adds what an aligned rank 1 would (its share
  cancels this rank's, as ``tests/distributed/test_fingerprint.py``'s ``Recorder`` does);
- the same without the digest, and without the agreement: each row's difference to the one above
  is that part's cost in place (cold caches included, which is why it exceeds the part timed alone).

    python tools/step_breakdown.py [--steps 4000] [--reps 3]

The rows that cut parts out send wrong messages (stubbed to pass the check): this is an analysis,
not a benchmark (``benchmarks/distributed_step.py``).
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import time
import warnings
from typing import Any

ROWS = {"one": "polyamp, group of one", "two": "polyamp as rank 0 of 2",
        "digest": "rank 0 of 2 without the digest", "agreement": "polyamp without the agreement"}


def _patch(row: str, dist: Any) -> None:
    """The all-reduce for ``row`` (a no-op, or rank 0 of 2 beside an aligned rank 1), and its cut."""
    import numpy as np

    from polyamp import _agreement, _iteration
    from polyamp.distributed import _fingerprint, _wire

    class Done:
        def wait(self, *args: Any, **kwargs: Any) -> bool:
            return True

    def peer(tensor: Any, *args: Any, **kwargs: Any) -> Any:
        if row in ("two", "digest") and tensor.dtype == torch_int64 and tensor.numel() == 1:
            message = tensor.numpy()  # the agreement's host buffer
            v = int(message[0]) % _wire.B  # an aligned, clean rank 1 sends -v mod Q: the v parts cancel
            message[0] += (-v) % _fingerprint.Q
        return Done() if kwargs.get("async_op") else None

    import torch

    torch_int64 = torch.int64
    dist.all_reduce = peer
    if row in ("two", "digest"):
        world = dist.get_world_size
        dist.get_world_size = lambda group=None: 2 if group is not None else world()
    buffer = np.zeros(1, np.int64)
    if row == "digest":  # the fingerprint's fields and the message built from them
        _agreement.Agreement._fields = lambda self, place, host, state: None
        _wire.OneValue.send = lambda self, fields, found, values: buffer
    elif row == "agreement":  # the whole agreement: the flag stands as agreed
        _iteration.Iteration.agree_flag = lambda self, found, whose=0: found


def _side(cls: Any, torch: Any, steps: int) -> float:
    params = [torch.nn.Parameter(torch.randn(1000)) for _ in range(10)]
    optimizer = torch.optim.SGD(params, lr=1e-9)
    scaler = cls("cpu", init_scale=2.0**16)
    scaler.scale(torch.ones(()))
    grads = [torch.randn(1000) for _ in params]
    total = 0
    for i in range(steps + 300):
        if i == 300:
            total = 0
        for p, g in zip(params, grads):
            p.grad = g.clone()
        start = time.perf_counter_ns()
        scaler.step(optimizer)
        scaler.update()
        total += time.perf_counter_ns() - start
    return total / steps / 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=4000)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--row", default="", help=argparse.SUPPRESS)  # one row per process
    args = parser.parse_args()
    if not args.row:
        import subprocess
        import sys

        print("us per step (step + update, 10 x 1K float32, SGD, 1 thread, all-reduce a no-op), "
              f"median of {args.reps}")
        for row in ROWS:
            subprocess.run([sys.executable, __file__, "--steps", str(args.steps), "--reps", str(args.reps),
                            "--row", row], check=True)
        return
    warnings.simplefilter("ignore")
    import torch
    import torch.distributed as dist
    from polyamp.compat.torch import ShardedGradScaler
    from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler as TorchSharded

    torch.set_num_threads(1)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=0, world_size=1)
    _patch(args.row, dist)
    ours, theirs = [], []
    for _ in range(args.reps):
        theirs.append(_side(TorchSharded, torch, args.steps))
        ours.append(_side(ShardedGradScaler, torch, args.steps))
    t, p = statistics.median(theirs), statistics.median(ours)
    print(f"  {ROWS[args.row]:<32} {p:6.1f}   torch {t:6.1f}   difference {p - t:+5.1f}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
