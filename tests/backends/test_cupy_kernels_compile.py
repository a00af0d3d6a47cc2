"""The CI check that compiles the cupy backend's CUDA kernels with nvcc (no GPU needed)."""

from __future__ import annotations

import subprocess
import sys
from types import SimpleNamespace


def test_every_kernel_compiles_with_nvcc(check_tool, nvcc):
    proc = subprocess.run([sys.executable, str(check_tool.__file__)], capture_output=True,
                          text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    kern = check_tool.load_kernels()
    for names in kern.MODULE_KERNELS.values():
        for name in names:
            assert name in proc.stdout
    assert "passed" in proc.stdout


def _fake_module(name: str, source: str) -> SimpleNamespace:
    return SimpleNamespace(
        MODULE_SOURCES={name: source},
        MODULE_KERNELS={name: ("polyamp_unscale_float32",)},
        UNSCALE_KERNELS={"float32": "polyamp_unscale_float32"},
    )


def test_a_kernel_that_does_not_compile_fails_the_check(check_tool, nvcc, tmp_path):
    broken = _fake_module(
        "broken",
        'extern "C" __global__ void polyamp_unscale_float32(float* x) { x[0] = no_such_name; }',
    )
    _, errors = check_tool.run_checks(broken, nvcc, ["sm_80"], tmp_path)
    assert any("no_such_name" in e for e in errors)


def test_an_unscale_kernel_without_vector_loads_fails_the_check(check_tool, nvcc, tmp_path):
    scalar = _fake_module(
        "scalar",
        'extern "C" __global__ void polyamp_unscale_float32(float* x, int n) '
        "{ int i = threadIdx.x; if (i < n) x[i] *= 2.0f; }",
    )
    _, errors = check_tool.run_checks(scalar, nvcc, ["sm_80"], tmp_path)
    assert errors == ["scalar: kernel polyamp_unscale_float32 lacks 16-byte vector loads/stores"]


def test_headers_nvrtc_cannot_find_fail_the_check(check_tool):
    assert check_tool.check_includes("m", "#include <cuda_fp16.h>\n#include <cuda_bf16.h>") == []
    assert check_tool.check_includes("m", "#include <stdio.h>") == [
        "m: includes <stdio.h>, which NVRTC cannot find"
    ]


def test_kernel_sources_load_without_cupy():
    code = (
        "import sys; from polyamp.backends import _cupy_kernels as k; "
        "assert k.MODULE_SOURCES and 'cupy' not in sys.modules, sorted(sys.modules)"
    )
    subprocess.run([sys.executable, "-c", code], check=True)
