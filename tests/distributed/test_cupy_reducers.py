"""CuPy arrays across ranks: the NCCL reducer (one rank, one device) and CuPy over MPI.

Every test carries the ``gpu`` mark and skips, saying why, where CuPy has no CUDA device.
"""

from __future__ import annotations

import numpy as np
import pytest
from polyamp.backends import cupy as cupy_backend

from polyamp import ForeignArrayError
from polyamp.distributed import reducer

pytestmark = pytest.mark.gpu
_INFO = cupy_backend.backend_info()
if not _INFO["available"]:
    pytest.skip(f"cupy backend unavailable: {_INFO['reason']}", allow_module_level=True)

import cupy  # noqa: E402


@pytest.fixture(scope="module")
def nccl():
    from cupy.cuda import nccl

    if not nccl.available:
        pytest.skip("cupy cannot load the NCCL library (pip install nvidia-nccl-cu12)")
    return nccl


def test_nccl_reducer_on_one_rank(nccl):
    comm = nccl.NcclCommunicator(1, nccl.get_unique_id(), 0)
    red = reducer(comm, timeout=30)
    assert (red.name, red.rank, red.size, red.timeout) == ("cupy:nccl", 0, 1, 30.0)
    x = cupy.arange(5, dtype=cupy.float32) - 2
    assert red.allreduce_sum_(x) is x
    np.testing.assert_array_equal(x.get(), np.arange(5, dtype=np.float32) - 2)
    red.allreduce_max_(x)
    red.barrier()
    for bad in (np.ones(3, np.float32), cupy.ones(3, cupy.int8), cupy.ones(6, cupy.float32)[::2]):
        with pytest.raises(ForeignArrayError, match="'cupy:nccl'"):
            red.allreduce_sum_(bad)
    assert red.collectives == 3


def cupy_over_mpi(rank: int, size: int) -> tuple:
    import cupy

    from polyamp.distributed import reducer

    red = reducer("mpi")
    x = cupy.full(4, rank + 1.0, dtype=cupy.float32)
    red.allreduce_sum_(x)
    return x.get(), red._cuda_aware, red.collectives


def test_cupy_arrays_over_mpi(run_mpi):
    job = run_mpi(cupy_over_mpi, 3)
    for values, cuda_aware, count in job.results():
        np.testing.assert_array_equal(values, np.full(4, 6.0, np.float32))
        assert cuda_aware in (True, False) and count == 1
