"""Compile the cupy backend's CUDA kernels: a kernel that does not compile cannot land.

Needs no GPU and no cupy: the sources are plain strings in ``polyamp.backends._cupy_kernels``
(cupy compiles the same strings with NVRTC at run time). For each NVRTC module it checks:

* it includes only headers NVRTC can find (``cuda_fp16.h``, ``cuda_bf16.h``);
* a cubin builds for every ``--arch`` (ptxas included; warnings are errors) and no kernel
  spills registers to local memory;
* the PTX defines every kernel the Python side launches, and each unscale (and unscale-and-count)
  kernel moves its data with 16-byte vector loads and stores (what the bandwidth target relies on).

Two compilers, the first found unless ``--compiler`` picks one: a CUDA toolkit's ``nvcc``
(``--nvcc``, PATH, $CUDA_HOME, $CUDA_PATH), else NVIDIA's PyPI wheels, which CI installs pinned
(.ci/run), so that no machine needs a toolkit: NVRTC (``nvidia-cuda-nvrtc-cu12``, cupy's own
run-time compiler) writes the PTX, with the headers of ``nvidia-cuda-runtime-cu12``, and the
``ptxas`` of ``nvidia-cuda-nvcc-cu12`` assembles it for each arch; else /usr/local/cuda's nvcc.

Exit status: 0 all passed, 1 a check failed, 2 no compiler found.
Run: ``python tools/check_cuda_kernels.py [--compiler auto|nvcc|wheels] [--nvcc PATH]
[--arch sm_80 ...] [--keep DIR]``
"""

from __future__ import annotations

import argparse
import ctypes
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


def find_nvcc(explicit: str | None, default_root: bool = True) -> str | None:
    """The nvcc to use: ``--nvcc``, PATH, $CUDA_HOME / $CUDA_PATH, then /usr/local/cuda."""
    if explicit:
        return explicit if Path(explicit).is_file() else shutil.which(explicit)
    found = shutil.which("nvcc")
    if found:
        return found
    roots = (os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH"), default_root and "/usr/local/cuda")
    for root in roots:
        if root and (Path(root) / "bin" / "nvcc").is_file():
            return str(Path(root) / "bin" / "nvcc")
    return None


class Nvcc:
    """A CUDA toolkit's nvcc: ``ptx`` and ``cubin`` (ptxas -v output in its stderr)."""

    def __init__(self, path: str) -> None:
        self.path = path

    def __str__(self) -> str:
        return self.path

    def archs(self, wanted: list[str]) -> list[str]:
        return supported_archs(self.path, wanted)

    def ptx(self, src: Path, arch: str, out: Path) -> tuple[bool, str]:
        proc = subprocess.run([self.path, "--ptx", f"-arch={arch}", "-std=c++17", "-o", str(out), str(src)],
                              capture_output=True, text=True)
        return proc.returncode == 0, proc.stderr.strip()

    def cubin(self, src: Path, arch: str, out: Path) -> tuple[bool, str]:
        cmd = [self.path, "--cubin", f"-arch={arch}", "-std=c++17", "-Werror", "all-warnings",
               "-Xptxas", "-v", "-o", str(out), str(src)]
        return _run(cmd)


def _run(cmd: list[str]) -> tuple[bool, str]:
    """(ok, stderr): the ptxas -v report when it worked, the command and its errors when not."""
    proc = subprocess.run(cmd, capture_output=True, text=True)
    return (True, proc.stderr) if proc.returncode == 0 else (False, f"{' '.join(cmd)}\n{proc.stderr.strip()}")


def _wheel_dir(package: str) -> Path | None:
    """The folder of an ``nvidia.*`` wheel package (found without importing it), or None."""
    try:
        spec = importlib.util.find_spec(package)
    except ModuleNotFoundError:
        return None
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(next(iter(spec.submodule_search_locations)))


class WheelCompiler:
    """NVRTC and ptxas from NVIDIA's PyPI wheels (no toolkit, no host compiler): NVRTC writes the
    PTX for the arch's virtual architecture, ptxas assembles it (``-v``, warnings as errors)."""

    PACKAGES = ("nvidia.cuda_nvrtc", "nvidia.cuda_runtime", "nvidia.cuda_nvcc")

    def __init__(self, nvrtc: Path, include: Path, ptxas: Path) -> None:
        self.nvrtc, self.include, self.ptxas = nvrtc, include, ptxas
        self._lib = ctypes.CDLL(str(nvrtc))

    @classmethod
    def find(cls) -> WheelCompiler | None:
        """The wheels' compiler when all three are installed, else None."""
        dirs = [_wheel_dir(p) for p in cls.PACKAGES]
        if None in dirs:
            return None
        nvrtc_dir, runtime_dir, nvcc_dir = dirs
        libs = sorted((nvrtc_dir / "lib").glob("libnvrtc.so.*"))
        ptxas = nvcc_dir / "bin" / "ptxas"
        if not libs or not ptxas.is_file() or not (runtime_dir / "include" / "cuda_fp16.h").is_file():
            return None
        return cls(libs[0], runtime_dir / "include", ptxas)

    def __str__(self) -> str:
        major, minor = ctypes.c_int(), ctypes.c_int()
        self._lib.nvrtcVersion(ctypes.byref(major), ctypes.byref(minor))
        return f"NVRTC {major.value}.{minor.value} ({self.nvrtc}) + {self.ptxas} (PyPI wheels)"

    def archs(self, wanted: list[str]) -> list[str]:
        count = ctypes.c_int()
        self._lib.nvrtcGetNumSupportedArchs(ctypes.byref(count))
        known = (ctypes.c_int * count.value)()
        self._lib.nvrtcGetSupportedArchs(known)
        return [a for a in wanted if int(a.removeprefix("sm_")) in set(known)]

    def ptx(self, src: Path, arch: str, out: Path) -> tuple[bool, str]:
        """NVRTC's PTX for ``arch`` written to ``out``; compiled once more when NVRTC reports success
        but hands back no PTX (seen once in CI, not reproduced: a second program is independent)."""
        ok, log = self._ptx_once(src, arch, out)
        if not ok and ": no PTX (" in log:
            ok, log = self._ptx_once(src, arch, out)
        return ok, log

    def _ptx_once(self, src: Path, arch: str, out: Path) -> tuple[bool, str]:
        lib, prog = self._lib, ctypes.c_void_p()
        lib.nvrtcCreateProgram(ctypes.byref(prog), src.read_bytes(), src.name.encode(), 0, None, None)
        try:
            options = [f"-arch={arch.replace('sm_', 'compute_')}", "-std=c++17", f"-I{self.include}"]
            status = lib.nvrtcCompileProgram(prog, len(options), (ctypes.c_char_p * len(options))(
                *(o.encode() for o in options)))
            size = ctypes.c_size_t()
            lib.nvrtcGetProgramLogSize(prog, ctypes.byref(size))
            log = ctypes.create_string_buffer(size.value)
            lib.nvrtcGetProgramLog(prog, log)
            text = log.value.decode().strip()
            if status or "warning" in text:  # nvcc's -Werror all-warnings
                return False, f"NVRTC {' '.join(options)} {src.name}\n{text}"
            ptx_size = ctypes.c_size_t()
            status = lib.nvrtcGetPTXSize(prog, ctypes.byref(ptx_size))
            ptx = ctypes.create_string_buffer(ptx_size.value)
            status = status or lib.nvrtcGetPTX(prog, ptx)
            code = ptx.raw[:max(ptx_size.value - 1, 0)]  # the size counts the closing NUL
            if status or b".version" not in code:  # seen once in CI: an empty PTX after success
                return False, (f"NVRTC {' '.join(options)} {src.name}: no PTX (nvrtcGetPTX status "
                               f"{status}, {len(code)} bytes)\n{text}")
            out.write_bytes(code)
            return True, text
        finally:
            lib.nvrtcDestroyProgram(ctypes.byref(prog))

    def cubin(self, src: Path, arch: str, out: Path) -> tuple[bool, str]:
        ptx = out.with_suffix(".ptx")
        ok, log = self.ptx(src, arch, ptx)
        if not ok:
            return False, log
        cmd = [str(self.ptxas), f"-arch={arch}", "-v", "--warning-as-error", "-o", str(out), str(ptx)]
        return _run(cmd)


def find_compiler(choice: str = "auto", explicit_nvcc: str | None = None) -> Nvcc | WheelCompiler | None:
    """``--compiler``: nvcc (``--nvcc``, PATH, $CUDA_HOME, $CUDA_PATH), else the PyPI wheels, else
    /usr/local/cuda's nvcc; ``nvcc`` or ``wheels`` only that one. None when there is none."""
    if choice == "wheels":
        return WheelCompiler.find()
    nvcc = find_nvcc(explicit_nvcc, default_root=choice == "nvcc")
    if nvcc is not None or choice == "nvcc":
        return Nvcc(nvcc) if nvcc else None
    wheels = WheelCompiler.find()
    if wheels is not None:
        return wheels
    nvcc = find_nvcc(None)
    return Nvcc(nvcc) if nvcc else None


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


def _compiler(compiler: Nvcc | WheelCompiler | str) -> Nvcc | WheelCompiler:
    return Nvcc(compiler) if isinstance(compiler, str) else compiler


def compile_cubin(compiler: Nvcc | WheelCompiler | str, src: Path, arch: str) -> tuple[str, list[str]]:
    """A cubin for one arch, ptxas -v read for spills: (log line, errors)."""
    start = time.perf_counter()
    ok, log = _compiler(compiler).cubin(src, arch, src.with_suffix(f".{arch}.cubin"))
    took = time.perf_counter() - start
    if not ok:
        return f"FAIL {src.stem:<9} {arch} cubin", [log]
    spills = re.findall(r"Function properties for (\w+)\n\s*\d+ bytes stack frame, "
                        r"(\d+) bytes spill stores", log)
    errors = [f"{src.stem} {arch}: kernel {k} spills {n} bytes" for k, n in spills if int(n)]
    regs = ", ".join(f"{k}={r}" for k, r in re.findall(
        r"entry function '(\w+)' for.*?Used (\d+) registers", log, re.S))
    return f"ok   {src.stem:<9} {arch} cubin ({took:.1f} s; registers {regs})", errors


def check_ptx(compiler: Nvcc | WheelCompiler | str, src: Path, arch: str, kernels: tuple[str, ...],
              unscale: set[str]) -> tuple[str, list[str]]:
    """The PTX: every expected kernel is an entry; unscale kernels use 16-byte vectors."""
    out = src.with_suffix(f".{arch}.ptx")
    ok, log = _compiler(compiler).ptx(src, arch, out)
    if not ok:
        return f"FAIL {src.stem:<9} {arch} ptx", [log]
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
    parser.add_argument("--compiler", choices=("auto", "nvcc", "wheels"), default="auto",
                        help="nvcc, or NVRTC + ptxas from the PyPI wheels (default: auto, the first found)")
    parser.add_argument("--nvcc", help="path to nvcc (default: PATH, $CUDA_HOME, /usr/local/cuda)")
    parser.add_argument("--arch", action="append", help=f"sm_XX (default: {DEFAULT_ARCHS})")
    parser.add_argument("--keep", help="write sources and outputs here instead of a temp dir")
    args = parser.parse_args(argv)
    compiler = find_compiler(args.compiler, args.nvcc)
    if compiler is None:
        print("check_cuda_kernels: no CUDA compiler found: no nvcc (set --nvcc, PATH or CUDA_HOME) and no "
              "NVRTC/ptxas wheels. Fix: pip install -c .ci/constraints.txt nvidia-cuda-nvrtc-cu12 "
              "nvidia-cuda-runtime-cu12 nvidia-cuda-nvcc-cu12", file=sys.stderr)
        return 2
    kern = load_kernels()
    archs = compiler.archs(args.arch or list(DEFAULT_ARCHS))
    if not archs:
        print(f"check_cuda_kernels: {compiler} supports none of {args.arch}", file=sys.stderr)
        return 1
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(args.keep or tmp)
        work.mkdir(parents=True, exist_ok=True)
        lines, errors = run_checks(kern, compiler, archs, work)
    print(f"compiler: {compiler}")
    print("\n".join(lines))
    for error in errors:
        print(f"ERROR {error}", file=sys.stderr)
    n_mod = len(kern.MODULE_SOURCES)
    print(f"{'FAILED' if errors else 'passed'}: {n_mod} modules x {len(archs)} archs")
    return 1 if errors else 0


def run_checks(kern: ModuleType, compiler: Nvcc | WheelCompiler | str, archs: list[str],
               work: Path) -> tuple[list, list]:
    """Every check on every module, compiler runs in parallel; (log lines, errors)."""
    nvcc = _compiler(compiler)
    unscale = set(kern.UNSCALE_KERNELS.values()) | set(getattr(kern, "COUNT_KERNELS", {}).values())
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
