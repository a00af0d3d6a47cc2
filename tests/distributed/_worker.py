"""One rank of a test job: load a function from a test file, run it, pickle what happened.

Launched by the fixtures in conftest.py, never collected by pytest. Usage::

    python _worker.py gloo FILE::NAME ARGS.pkl OUTDIR RANK SIZE PORT PG_TIMEOUT
    mpirun ... python _worker.py mpi FILE::NAME ARGS.pkl OUTDIR

The function is called as ``fn(rank, size, *args)``; for gloo the default process group is
initialised first (TCP store on 127.0.0.1:PORT, timeout PG_TIMEOUT seconds). The outcome goes
to OUTDIR/rankR.pkl, written atomically, so a rank that dies leaves no (half) record.
"""

from __future__ import annotations

import importlib.util
import os
import pickle
import sys
import time
import traceback
from pathlib import Path


def _load(target: str):
    path, name = target.rsplit("::", 1)
    module_name = "polyamp_dist_case_" + Path(path).stem
    spec = importlib.util.spec_from_file_location(module_name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[module_name] = module
    spec.loader.exec_module(module)
    return getattr(module, name)


_loaded: dict[str, object] = {}


def run_cases(rank: int, size: int, cases: list[tuple[str, str, tuple]]) -> dict[str, dict]:
    """Each ``(name, FILE::NAME, args)`` of ``cases`` in turn on this rank's one process group (or
    MPI job): name -> the record a job of its own would leave (a raising case does not stop the
    next). conftest.run_shared launches it, for cases that need no fresh group."""
    records = {}
    for name, target, args in cases:
        if target not in _loaded:
            _loaded[target] = _load(target)
        records[name] = _call(_loaded[target], rank, size, args)
    return records


def _call(fn, rank: int, size: int, args: tuple) -> dict:
    """``fn(rank, size, *args)``: its value, or the exception it raised, and the seconds it ran."""
    record = {"value": None, "error": None, "error_type": "", "error_message": "", "traceback": ""}
    start = time.monotonic()
    try:
        record["value"] = fn(rank, size, *args)
    except BaseException as exc:  # the host reports it
        record.update(
            error=exc,
            error_type=f"{type(exc).__module__}.{type(exc).__qualname__}",
            error_message=str(exc),
            traceback=traceback.format_exc(),
        )
    record["elapsed"] = time.monotonic() - start
    return record


def _init_gloo(rank: int, size: int, port: int, pg_timeout: float) -> None:
    from datetime import timedelta

    import torch.distributed as dist

    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=size,
        timeout=timedelta(seconds=pg_timeout),
    )


def _write(out: Path, rank: int, record: dict) -> None:
    try:
        data = pickle.dumps(record)
    except Exception:  # an unpicklable value or exception: keep its text
        record["value"], record["error"] = repr(record["value"]), None
        data = pickle.dumps(record)
    tmp = out / f".rank{rank}.tmp"
    tmp.write_bytes(data)
    os.replace(tmp, out / f"rank{rank}.pkl")


def main() -> None:
    mode, target, args_path, out = sys.argv[1:5]
    out = Path(out)
    if mode == "gloo":
        rank, size, port = (int(v) for v in sys.argv[5:8])
        (out / f"rank{rank}.pid").write_text(str(os.getpid()))
        _init_gloo(rank, size, port, float(sys.argv[8]))
    else:
        from mpi4py import MPI

        rank, size = MPI.COMM_WORLD.Get_rank(), MPI.COMM_WORLD.Get_size()
        (out / f"rank{rank}.pid").write_text(str(os.getpid()))
    fn = _load(target)
    args = pickle.loads(Path(args_path).read_bytes())
    _write(out, rank, _call(fn, rank, size, args))
    sys.stdout.flush()
    sys.stderr.flush()
    if mode == "gloo":
        os._exit(0)  # skip the process group's teardown, which may block on a failed peer


if __name__ == "__main__":
    main()
