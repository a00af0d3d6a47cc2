"""Every Python block of README.md and docs/ runs as written.

The blocks of one page run in order in one namespace, as a reader pasting them in turn would
run them, in a temporary folder. A block preceded by ``<!-- test: gpu -->`` needs a CUDA device:
it runs on its own (so it must be self-contained) and skips with the reason where there is none.
``<!-- test: processes=N -->`` runs the block in N processes on torch.distributed (gloo,
127.0.0.1), as its page says to launch it. ``<!-- test: needs=lightning,timm -->`` marks a block
that needs trainer frameworks (the ``integrations`` extra): where one is absent the block is
skipped and the page's test reports it skipped, with the reason, after running the others.
Marks combine, space-separated: ``<!-- test: processes=2 needs=lightning -->``.
"""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
import textwrap
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
FENCE = re.compile(r"(?:<!--\s*test:\s*(?P<mark>[^>]*?)\s*-->\s*\n)?```python\n(?P<code>.*?)```", re.S)


@dataclass(frozen=True)
class Block:
    page: Path
    line: int
    code: str
    mark: str


def blocks_of(page: Path) -> list[Block]:
    text = page.read_text()
    return [
        Block(page, text.count("\n", 0, m.start("code")) + 1, m.group("code"),
              (m.group("mark") or "").strip())
        for m in FENCE.finditer(text)
    ]


def _cuda_reason() -> str | None:
    """Why no CUDA device can run a block here, or None when one can."""
    try:
        import cupy

        if cupy.cuda.runtime.getDeviceCount() > 0:
            return None
    except Exception as exc:  # noqa: BLE001 - any failure means no usable device
        return f"no CUDA device: {type(exc).__name__}: {exc}"[:200]
    return "no CUDA device"


def _pages_with_blocks() -> list[Path]:
    return [p for p in PAGES if blocks_of(p)]


def _run_in_processes(block: Block, n: int, tmp_path: Path) -> None:
    """Run ``block`` on n gloo ranks (subprocesses), each failing the test with its output."""
    script = tmp_path / "block.py"
    script.write_text(block.code)
    # The rank leaves through os._exit: a gloo group still referenced at interpreter exit can
    # abort the process after destroy_process_group(), which would fail a block that worked.
    runner = textwrap.dedent(
        """
        import os, runpy, sys, datetime, traceback
        import torch.distributed as dist
        dist.init_process_group("gloo", rank=int(sys.argv[2]), world_size=int(sys.argv[3]),
                                timeout=datetime.timedelta(seconds=60))
        status = 0
        try:
            runpy.run_path(sys.argv[1], run_name="__main__")
            dist.destroy_process_group()
        except BaseException:
            traceback.print_exc()
            status = 1
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(status)
        """
    )
    (tmp_path / "runner.py").write_text(runner)
    env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()), GLOO_SOCKET_IFNAME="lo")
    procs = [
        subprocess.Popen(
            [sys.executable, str(tmp_path / "runner.py"), str(script), str(rank), str(n)],
            cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        )
        for rank in range(n)
    ]
    try:
        outputs = [p.communicate(timeout=240)[0] for p in procs]
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
    for rank, (proc, out) in enumerate(zip(procs, outputs)):
        assert proc.returncode == 0, f"{block.page.name}:{block.line} failed on rank {rank}:\n{out}"


def _frameworks():
    """tests/integrations/frameworks.py, loaded by path (tests are not a package)."""
    name = "polyamp_tests_frameworks"
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, ROOT / "tests/integrations/frameworks.py")
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    return sys.modules[name]


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize("page", _pages_with_blocks(), ids=lambda p: str(p.relative_to(ROOT)))
def test_page_blocks_run(page: Path, tmp_path, monkeypatch, capsys, registry_restored):
    monkeypatch.chdir(tmp_path)
    namespace: dict = {"__name__": "__main__"}
    skipped = []
    for block in blocks_of(page):
        marks = _marks(block)
        if "gpu" in marks:
            continue  # test_gpu_block runs it
        if "needs" in marks:
            reason = _frameworks().require(*marks["needs"].split(","))
            if reason:
                skipped.append(f"{page.name}:{block.line}: {reason}")
                continue
        if "processes" in marks:
            pytest.importorskip("torch.distributed")
            _run_in_processes(block, int(marks["processes"]), tmp_path)
            continue
        _exec(block, namespace)
    if skipped:
        pytest.skip("; ".join(skipped))


def _marks(block: Block) -> dict[str, str]:
    """A block's test marks, e.g. ``processes=2 needs=lightning`` -> {"processes": "2", ...}."""
    marks = dict(t.partition("=")[::2] for t in block.mark.split())
    unknown = set(marks) - {"gpu", "processes", "needs"}
    assert not unknown, f"{block.page.name}:{block.line}: unknown test mark {block.mark!r}"
    return marks


def _exec(block: Block, namespace: dict) -> None:
    try:
        exec(compile(block.code, f"{block.page}:{block.line}", "exec"), namespace)
    except Exception as exc:
        raise AssertionError(f"the block at {block.page.name}:{block.line} failed: {exc!r}") from exc


GPU_BLOCKS = [b for p in PAGES for b in blocks_of(p) if "gpu" in _marks(b)]


@pytest.mark.gpu
@pytest.mark.parametrize("block", GPU_BLOCKS, ids=lambda b: f"{b.page.relative_to(ROOT)}:{b.line}")
def test_gpu_block(block: Block, tmp_path, monkeypatch):
    reason = _cuda_reason() or _frameworks().require(*filter(None, _marks(block).get("needs", "").split(",")))
    if reason:
        pytest.skip(reason)
    monkeypatch.chdir(tmp_path)
    _exec(block, {"__name__": "__main__"})


def test_every_block_is_found():
    """The fence pattern sees every python fence (a typo in a marker must not hide a block)."""
    for page in PAGES:
        text = page.read_text()
        assert len(blocks_of(page)) == text.count("```python\n"), page
