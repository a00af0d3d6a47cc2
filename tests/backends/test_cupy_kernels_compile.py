"""The CI check that compiles the cupy backend's CUDA kernels with nvcc (no GPU needed)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest


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


# -- without a CUDA toolkit: NVRTC and ptxas from NVIDIA's PyPI wheels (what CI installs) ---------
@pytest.fixture(scope="session")
def wheels(check_tool):
    """The wheels' compiler; the test skips, saying so, when they are not installed."""
    compiler = check_tool.WheelCompiler.find()
    if compiler is None:
        pytest.skip("the NVRTC/ptxas wheels are not installed (.ci/run installs them: pip install -c "
                    ".ci/constraints.txt nvidia-cuda-nvrtc-cu12 nvidia-cuda-runtime-cu12 "
                    "nvidia-cuda-nvcc-cu12)")
    return compiler


def test_without_nvcc_on_path_the_check_finds_the_wheels_compiler(check_tool, wheels):
    """No nvcc on PATH and no $CUDA_HOME / $CUDA_PATH (a fresh CI machine): the check still runs,
    every kernel for sm_75, sm_80 and sm_90, with the pinned wheels."""
    path = os.pathsep.join(d for d in os.environ.get("PATH", "").split(os.pathsep)
                           if d and not (Path(d) / "nvcc").exists())
    env = {k: v for k, v in os.environ.items() if k not in ("CUDA_HOME", "CUDA_PATH")}
    env["PATH"] = path
    proc = subprocess.run([sys.executable, str(check_tool.__file__)], capture_output=True, text=True,
                          timeout=900, env=env)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stdout.startswith("compiler: NVRTC ") and "(PyPI wheels)" in proc.stdout.splitlines()[0]
    for arch in check_tool.DEFAULT_ARCHS:
        assert re.search(rf"^ok   main +{arch} cubin", proc.stdout, re.M), arch
    for names in check_tool.load_kernels().MODULE_KERNELS.values():
        assert all(name in proc.stdout for name in names)
    assert "passed: 2 modules x 3 archs" in proc.stdout


def test_the_wheels_compiler_fails_a_broken_kernel_and_one_without_vector_loads(check_tool, wheels, tmp_path):
    broken = _fake_module(
        "broken",
        'extern "C" __global__ void polyamp_unscale_float32(float* x) { x[0] = no_such_name; }',
    )
    _, errors = check_tool.run_checks(broken, wheels, ["sm_80"], tmp_path)
    assert errors and all("no_such_name" in e for e in errors)
    scalar = _fake_module(
        "scalar",
        'extern "C" __global__ void polyamp_unscale_float32(float* x, int n) '
        "{ int i = threadIdx.x; if (i < n) x[i] *= 2.0f; }",
    )
    _, errors = check_tool.run_checks(scalar, wheels, ["sm_80"], tmp_path)
    assert errors == ["scalar: kernel polyamp_unscale_float32 lacks 16-byte vector loads/stores"]


def test_the_wheels_compiler_treats_warnings_as_errors(check_tool, wheels, tmp_path):
    src = tmp_path / "warn.cu"
    src.write_text('extern "C" __global__ void k(float* x) { int unused; x[0] = 1.0f; }')
    ok, log = wheels.ptx(src, "sm_80", tmp_path / "warn.ptx")
    assert not ok and "unused" in log
