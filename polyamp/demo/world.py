"""The ranks of ``polyamp demo --distributed mpi|torch``: a reducer, and this rank's share
(``mpirun``'s COMM_WORLD, or a gloo group from torchrun's environment); imported only when asked.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

from polyamp._errors import ConfigError, install_hint

CHOICES = ("mpi", "torch")
#: Seconds a collective may wait for a lagging rank before the demo gives up with an error.
TIMEOUT = 120.0
_TORCHRUN_ENV = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


@dataclass(frozen=True)
class World:
    """This process's place among the demo's ranks (one process: rank 0 of 1, no reducer)."""

    rank: int = 0
    size: int = 1
    reducer: Any = None
    engine: str | None = None
    owns_group: bool = False  # the demo built torch's process group, so it tears it down

    def close(self) -> None:
        """Tear down what the demo started: a gloo group left alive at exit can abort the process."""
        if self.owns_group:
            import torch.distributed as dist

            dist.barrier()  # no rank destroys the group while another still uses it
            dist.destroy_process_group()

    @property
    def prints(self) -> bool:
        """Whether this rank prints (rank 0 does; the others stay silent)."""
        return self.rank == 0

    def share(self, n: int, what: str) -> slice:
        """This rank's rows of ``n``: equal contiguous shards, so the average is the global mean."""
        if n % self.size:
            raise ConfigError(
                f"{what}={n} cannot be split into {self.size} equal shards (one per rank). Fix: "
                f"pass a {what} divisible by {self.size}, e.g. {what}={n - n % self.size or self.size}."
            )
        per = n // self.size
        return slice(self.rank * per, (self.rank + 1) * per)


def join(engine: str | None) -> World:
    """The world for ``--distributed engine`` (None: one process); a clear error if it cannot run."""
    if engine is None:
        return World()
    if engine not in CHOICES:
        raise ConfigError(f"--distributed {engine!r}: expected one of {list(CHOICES)}")
    from polyamp.distributed import reducer

    group, owned = ("mpi", False) if engine == "mpi" else _torch_group()
    red = reducer(group, timeout=TIMEOUT)
    return World(red.rank, red.size, red, engine, owned)


def _torch_group() -> tuple[Any, bool]:
    """torch.distributed's default group (the caller's, or one from torchrun's), and whether built here."""
    try:
        import torch.distributed as dist
    except ImportError as exc:
        raise ConfigError(
            f"--distributed torch needs torch.distributed ({exc}). Fix: {install_hint('torch')}"
        ) from exc
    if dist.is_initialized():
        return dist.group.WORLD, False
    missing = [k for k in _TORCHRUN_ENV if not os.environ.get(k)]
    if missing:
        raise ConfigError(
            f"--distributed torch needs torchrun's environment, but {', '.join(missing)} "
            f"{'is' if len(missing) == 1 else 'are'} not set. Fix: start it as `torchrun "
            "--nproc-per-node 2 -m polyamp demo --distributed torch` (or use `mpirun -n 2 polyamp "
            "demo --distributed mpi`, adding --allow-run-as-root after mpirun when you are root)."
        )
    dist.init_process_group("gloo", timeout=timedelta(seconds=TIMEOUT))
    return dist.group.WORLD, True
