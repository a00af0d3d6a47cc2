"""The modules one applied step enters, in order: polyamp's torch facade (``step`` + ``update``),
the paddle facade's ``minimize`` and an engine step with a StepGuard and a reducer (rank 0 of two
beside an aligned stand-in for rank 1: the calls of a real group). Prints, per path, the modules in
the order first entered, how many calls each took and how often the step came back to a module it
had left.

    python tools/trace_step.py

Measured with ``sys.setprofile`` on Python function calls under polyamp's own folders (the
array libraries' calls are not counted), on the third of three identical steps (warm caches).
"""

from __future__ import annotations

import os
import sys
from collections import Counter
from collections.abc import Callable

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
OURS = tuple(os.path.join(ROOT, d) + os.sep for d in ("polyamp", "compat", "backends"))


def _module(path: str) -> str | None:
    for base in OURS:
        if path.startswith(base):
            return os.path.relpath(path, ROOT)
    return None


def trace(step: Callable[[], None]) -> tuple[list[str], Counter, int]:
    """(modules in first-entered order, calls per module, returns to a module already left)."""
    order: list[str] = []
    calls: Counter = Counter()
    trail: list[str] = []

    def profile(frame, event, arg):  # noqa: ANN001
        if event != "call":
            return
        name = _module(frame.f_code.co_filename)
        if name is None:
            return
        calls[name] += 1
        if name not in order:
            order.append(name)
        if not trail or trail[-1] != name:
            trail.append(name)

    for _ in range(2):
        step()
    sys.setprofile(profile)
    try:
        step()
    finally:
        sys.setprofile(None)
    seen: set[str] = set()
    returns = 0
    for name in trail:
        returns += name in seen
        seen.add(name)
    return order, calls, returns


def torch_facade() -> Callable[[], None]:
    import torch

    import polyamp

    params = [torch.nn.Parameter(torch.zeros(1000)) for _ in range(10)]
    opt = torch.optim.SGD(params, lr=0.0)
    scaler = polyamp.GradScaler("cpu")
    scaler.scale(torch.ones(()))

    def step() -> None:
        for p in params:
            p.grad = torch.ones(1000)
        scaler.step(opt)
        scaler.update()
    return step


def paddle_minimize() -> Callable[[], None]:
    from polyamp.compat.paddle import GradScaler

    from polyamp import Parameter
    from polyamp.optim import SGD

    params = [Parameter(np.zeros(1000, np.float32)) for _ in range(10)]
    opt = SGD(params, lr=0.0)
    scaler = GradScaler(backend="numpy")

    def step() -> None:
        scaler.scale(np.ones((), np.float32))
        for p in params:
            p.grad = np.ones(1000, np.float32)
        scaler.minimize(opt)
    return step


def guarded_engine() -> Callable[[], None]:
    from polyamp import LossScaler, StepGuard
    from polyamp.distributed import Reducer

    class RankZeroOfTwo(Reducer):
        """Rank 0 of two beside an aligned rank 1 that sends what it sends (a group of one would skip
        the fingerprint): the MAX of a copy is itself, a SUM doubles it, its one-value part cancels."""

        def __init__(self) -> None:
            super().__init__("two", 0, 2, None)

        def _prepare(self, array):  # noqa: ANN001, ANN202
            return array

        def _allreduce(self, buffer, op):  # noqa: ANN001, ANN202
            from polyamp.distributed import _fingerprint, _wire

            if op == "sum" and buffer.dtype == np.int64 and buffer.shape == (1,):
                flag, v = divmod(int(buffer[0]), _wire.B)  # rank 1 sends the same flag and -v mod Q
                buffer[0] += flag * _wire.B + (-v) % _fingerprint.Q
            elif op == "sum":
                buffer *= 2
            elif buffer.shape[0] > _wire.HEAD:  # the MAX: rank 1's slots hold the same values as ours
                slots = buffer[_wire.HEAD:].reshape(2, -1)
                slots[1] = slots[0]

        def _barrier(self):  # noqa: ANN202
            pass

    guard = StepGuard(loss_zscore=6.0, max_grad_norm=1e9)
    scaler = LossScaler(backend="numpy", reducer=RankZeroOfTwo(), guard=guard)
    grads = [np.ones(1000, np.float32) for _ in range(10)]

    def step() -> None:
        scaler.step(grads, lambda: None, loss=1.0)
        scaler.update()
    return step


def main() -> None:
    for title, build in (("torch facade: step + update", torch_facade),
                         ("paddle facade: minimize", paddle_minimize),
                         ("LossScaler with a StepGuard and a reducer: step + update", guarded_engine)):
        try:
            order, calls, returns = trace(build())
        except ImportError as exc:
            print(f"## {title}\n\nskipped: {exc}\n")
            continue
        print(f"## {title}\n")
        total = sum(calls.values())
        print(f"{len(order)} modules, {total} calls, {returns} returns to a module already left\n")
        for name in order:
            print(f"1. `{name}` ({calls[name]} calls)")
        print()


if __name__ == "__main__":
    main()
