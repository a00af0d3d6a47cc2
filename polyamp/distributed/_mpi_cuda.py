"""Whether the MPI library under mpi4py takes CUDA device buffers (CUDA-aware MPI).

mpi4py passes CuPy buffers to MPI as they are but cannot say whether MPI can read them, so
polyamp asks MPI: ``POLYAMP_MPI_CUDA_AWARE=0/1`` overrides; else the MPI-4.1 info key
``mpi_memory_alloc_kinds`` naming cuda; else Open MPI's ``MPIX_Query_cuda_support()``.
"""

from __future__ import annotations

import ctypes
import os
from typing import Any

from .._errors import ConfigError

ENV_VAR = "POLYAMP_MPI_CUDA_AWARE"


def mpi_is_cuda_aware(mpi: Any) -> bool:
    """True when MPI (the ``mpi4py.MPI`` module ``mpi``) can all-reduce CUDA device memory."""
    env = os.environ.get(ENV_VAR, "").strip()
    if env:
        if env not in ("0", "1"):
            raise ConfigError(f"{ENV_VAR} must be 0 or 1 (or unset to ask MPI), got {ENV_VAR}={env!r}")
        return env == "1"
    try:
        kinds = mpi.INFO_ENV.Get("mpi_memory_alloc_kinds") or ""
    except Exception:  # an MPI older than 4.1 has no such key
        kinds = ""
    return "cuda" in kinds.lower() or _openmpi_query()


def _openmpi_query() -> bool:
    """Open MPI's ``MPIX_Query_cuda_support()`` from a libmpi mapped into this process (False elsewhere)."""
    try:
        with open("/proc/self/maps") as maps:  # Linux
            fields = [line.split() for line in maps]
    except OSError:
        return False
    paths = {f[-1] for f in fields if len(f) >= 6 and os.path.basename(f[-1]).startswith("libmpi.so")}
    for path in sorted(paths):
        try:
            library = ctypes.CDLL(path, mode=getattr(os, "RTLD_NOLOAD", 0))
            query = getattr(library, "MPIX_Query_cuda_support", None)
        except OSError:
            continue
        if query is not None:
            return bool(query())
    return False
