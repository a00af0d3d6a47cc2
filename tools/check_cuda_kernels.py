"""Compile the cupy backend's CUDA kernels with nvcc: a kernel that does not compile cannot land.

Needs no GPU and no cupy: the sources are plain strings in ``polyamp.backends._cupy_kernels``
(cupy compiles the same strings with NVRTC at run time). For each NVRTC module it checks:

* it includes only headers NVRTC can find (``cuda_fp16.h``, ``cuda_bf16.h``);
* ``nvcc --cubin`` succeeds for every ``--arch`` (ptxas included; warnings are errors) and no
  kernel spills registers to local memory;
* the PTX defines every kernel the Python side launches, and each unscale kernel moves its
  data with 16-byte vector loads and stores (what the bandwidth target relies on).

Exit status: 0 all passed, 1 a check failed, 2 nvcc not found.
Run: ``python tools/check_cuda_kernels.py [--nvcc PATH] [--arch sm_80 ...] [--keep DIR]``
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from types import ModuleType

DEFAULT_ARCHS = ("sm_75", "sm_80", "sm_90")
NVRTC_HEADERS = {"cuda_fp16.h", "cuda_bf16.h"}
ROOT = Path(__file__).resolve().parent.parent


def load_kernels() -> ModuleType:
    """``polyamp.backends._cupy_kernels``, imported, or loaded from the source tree by path."""
    try:
        from polyamp.backends import _cupy_kernels
    except ImportError:
        path = ROOT / "backends" / "_cupy_kernels.py"
        spec = importlib.util.spec_from_file_location("_polyamp_cupy_kernels", path)
        if spec is None or spec.loader is None:
            raise
        _cupy_kernels = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = _cupy_kernels
        spec.loader.exec_module(_cupy_kernels)
    return _cupy_kernels


def find_nvcc(explicit: str | None) -> str | None:
    """The nvcc to use: ``--nvcc``, PATH, $CUDA_HOME / $CUDA_PATH, then /usr/local/cuda."""
    if explicit:
        return explicit if Path(explicit).is_file() else shutil.which(explicit)
    found = shutil.which("nvcc")
    if found:
        return found
    for root in (os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH"), "/usr/local/cuda"):
        if root and (Path(root) / "bin" / "nvcc").is_file():
            return str(Path(root) / "bin" / "nvcc")
    return None


def supported_archs(nvcc: str, wanted: list[str]) -> list[str]:
    """The wanted sm_XX this nvcc can build (CUDA 13 dropped everything below sm_75)."""
    out = subprocess.run([nvcc, "--list-gpu-arch"], capture_output=True, text=True).stdout
    known = {a.replace("compute_", "sm_") for a in out.split()}
    return [a for a in wanted if not known or a in known]


def check_includes(name: str, source: str) -> list[str]:
    """Errors for any #include NVRTC (with cupy's include path) could not resolve."""
    headers = re.findall(r"#\s*include\s*[<\"]([^>\"]+)[>\"]", source)
    return [f"{name}: includes <{h}>, which NVRTC cannot find" for h in headers
            if h not in NVRTC_HEADERS]


def compile_cubin(nvcc: str, src: Path, arch: str) -> tuple[str, list[str]]:
    """nvcc --cubin for one arch: (log line, errors)."""
    out = src.with_suffix(f".{arch}.cubin")
    cmd = [nvcc, "--cubin", f"-arch={arch}", "-std=c++17", "-Werror", "all-warnings",
           "-Xptxas", "-v", "-o", str(out), str(src)]
    start = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True)
    took = time.perf_counter() - start
    if proc.returncode:
        return f"FAIL {src.stem:<9} {arch} cubin", [f"{' '.join(cmd)}\n{proc.stderr.strip()}"]
    spills = re.findall(r"Function properties for (\w+)\n\s*\d+ bytes stack frame, "
                        r"(\d+) bytes spill stores", proc.stderr)
    errors = [f"{src.stem} {arch}: kernel {k} spills {n} bytes" for k, n in spills if int(n)]
    regs = ", ".join(f"{k}={r}" for k, r in re.findall(
        r"entry function '(\w+)' for.*?Used (\d+) registers", proc.stderr, re.S))
    return f"ok   {src.stem:<9} {arch} cubin ({took:.1f} s; registers {regs})", errors


def check_ptx(nvcc: str, src: Path, arch: str, kernels: tuple[str, ...],
              unscale: set[str]) -> tuple[str, list[str]]:
    """nvcc --ptx: every expected kernel is an entry; unscale kernels use 16-byte vectors."""
    out = src.with_suffix(f".{arch}.ptx")
    proc = subprocess.run([nvcc, "--ptx", f"-arch={arch}", "-std=c++17", "-o", str(out),
                           str(src)], capture_output=True, text=True)
    if proc.returncode:
        return f"FAIL {src.stem:<9} {arch} ptx", [proc.stderr.strip()]
    bodies = dict(re.findall(r"\.entry\s+(\w+)\((.*?)(?=\.entry|\Z)", out.read_text(), re.S))
    errors = [f"{src.stem}: kernel {k} missing from the PTX" for k in kernels if k not in bodies]
    vector = re.compile(r"\b(ld|st)(\.global)?\.v[24]\.(f32|f64|u32|b32)")
    for name in sorted(unscale & bodies.keys()):
        kinds = {m.group(1) for m in vector.finditer(bodies[name])}
        if kinds != {"ld", "st"}:
            errors.append(f"{src.stem}: kernel {name} lacks 16-byte vector loads/stores")
    return f"ok   {src.stem:<9} {arch} ptx   (entries: {', '.join(sorted(bodies))})", errors


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nvcc", help="path to nvcc (default: PATH, $CUDA_HOME, /usr/local/cuda)")
    parser.add_argument("--arch", action="append", help=f"sm_XX (default: {DEFAULT_ARCHS})")
    parser.add_argument("--keep", help="write sources and outputs here instead of a temp dir")
    args = parser.parse_args(argv)
    nvcc = find_nvcc(args.nvcc)
    if nvcc is None:
        print("check_cuda_kernels: nvcc not found (set --nvcc, PATH or CUDA_HOME)", file=sys.stderr)
        return 2
    kern = load_kernels()
    archs = supported_archs(nvcc, args.arch or list(DEFAULT_ARCHS))
    if not archs:
        print(f"check_cuda_kernels: {nvcc} supports none of {args.arch}", file=sys.stderr)
        return 1
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(args.keep or tmp)
        work.mkdir(parents=True, exist_ok=True)
        lines, errors = run_checks(kern, nvcc, archs, work)
    print(f"nvcc: {nvcc}")
    print("\n".join(lines))
    for error in errors:
        print(f"ERROR {error}", file=sys.stderr)
    n_mod = len(kern.MODULE_SOURCES)
    print(f"{'FAILED' if errors else 'passed'}: {n_mod} modules x {len(archs)} archs")
    return 1 if errors else 0


def run_checks(kern: ModuleType, nvcc: str, archs: list[str], work: Path) -> tuple[list, list]:
    """Every check on every module, nvcc runs in parallel; (log lines, errors)."""
    unscale = set(kern.UNSCALE_KERNELS.values())
    lines: list[str] = []
    errors: list[str] = []
    jobs = []
    with ThreadPoolExecutor(max_workers=os.cpu_count() or 2) as pool:
        for name, source in kern.MODULE_SOURCES.items():
            errors += check_includes(name, source)
            src = work / f"{name}.cu"
            src.write_text(source)
            jobs += [pool.submit(compile_cubin, nvcc, src, arch) for arch in archs]
            jobs.append(pool.submit(check_ptx, nvcc, src, archs[0],
                                    kern.MODULE_KERNELS[name], unscale))
        for job in jobs:
            line, errs = job.result()
            lines.append(line)
            errors += errs
    return lines, errors


if __name__ == "__main__":
    sys.exit(main())
