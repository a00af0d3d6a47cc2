"""Every Python block of README.md and docs/ runs as written.

The blocks of one page run in order in one namespace, as a reader pasting them in turn would
run them, in a temporary folder. A block preceded by ``<!-- test: gpu -->`` needs a CUDA device:
it runs on its own (so it must be self-contained) and skips with the reason where there is none.
``<!-- test: launch=train.py -->`` marks a complete multi-process script: it is written to
``train.py`` in a temporary folder and started with the command of the one-line ``bash`` block the
page shows after it (``torchrun --standalone --nproc-per-node 2 train.py``, or ``mpirun ... python
train.py``), exactly as written, nothing added: the script initialises its own process group.
(``torchrun`` runs as ``python -m torch.distributed.run``, what its console script does, and
``python`` as this interpreter, so that the suite's environment is the one tested.)
``<!-- test: processes=N -->`` is for a page that shows fragments to run after
``init_process_group`` and says so (docs/distributed.md): the harness runs the block in N
processes on torch.distributed (gloo, 127.0.0.1) after initialising the group itself.
``<!-- test: needs=lightning,timm -->`` marks a block
that needs trainer frameworks (the ``integrations`` extra): where one is absent the block is
skipped and the page's test reports it skipped, with the reason, after running the others.
Marks combine, space-separated: ``<!-- test: launch=train.py needs=lightning -->``.

What a page shows a block printing is checked against what it prints, so no figure goes stale:
a ``print(...)  # out`` line's comment is that call's output; a ``text`` block introduced by a
line "prints" is the whole output of the python block before it; a ``text`` block preceded by
``<!-- test: output-of-command -->`` is the stdout of the one-line ``bash`` block before it, run
as written in a temporary folder (slow). In expected output, runs of spaces match any spacing
and a table's rule of dashes any width (tables may be re-aligned), ``...`` matches any text
within a line, and a token written with a leading ``~`` (``~1.4s``) matches any token: the
visible mark for values that vary by machine.
"""

from __future__ import annotations

import builtins
import importlib.util
import io
import os
import re
import shlex
import shutil
import subprocess
import sys
import textwrap
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
FENCE = re.compile(r"(?:<!--\s*test:\s*(?P<mark>[^>]*?)\s*-->\s*\n)?```python\n(?P<code>.*?)```", re.S)


TEXT = re.compile(
    r"(?P<lead>[^\n]*)\n\n(?:<!--\s*test:\s*(?P<mark>[^>]*?)\s*-->\s*\n)?```text\n(?P<out>.*?)```", re.S
)
BASH = re.compile(r"```bash\n(?P<code>.*?)```", re.S)
PRINT = re.compile(r"^\s*print\(.*\)\s{2,}#\s(?P<out>.+)$")


@dataclass(frozen=True)
class Block:
    page: Path
    line: int
    code: str
    mark: str
    output: str | None = None  # what the page shows the whole block printing ("prints" + text block)
    end: int = 0  # where the block's closing fence ends in the page's text


def blocks_of(page: Path) -> list[Block]:
    text = page.read_text()
    found = [(m.end(), m.start("code"), m.group("code"), (m.group("mark") or "").strip())
             for m in FENCE.finditer(text)]
    shown = {}
    for m in TEXT.finditer(text):
        before = [end for end, *_ in found if end <= m.start()]
        if m.group("lead").strip() in ("prints", "prints:") and before:
            shown[before[-1]] = m.group("out")
    return [Block(page, text.count("\n", 0, start) + 1, code, mark, shown.get(end), end)
            for end, start, code, mark in found]


def launch_command(block: Block, script: str) -> str:
    """The one-line ``bash`` block after ``block`` (before the next python block) that runs ``script``."""
    text = block.page.read_text()
    nxt = text.find("```python\n", block.end)
    after = text[block.end: None if nxt < 0 else nxt]
    commands = [m.group("code").strip() for m in BASH.finditer(after)]
    commands = [c.partition("  #")[0].strip() for c in commands if len(c.splitlines()) == 1]
    found = [c for c in commands if script in shlex.split(c)]
    where = f"{block.page.name}:{block.line}"
    assert found, f"{where}: no one-line bash block after it says how to launch {script}"
    return found[0]


def _launch(block: Block, script: str, tmp_path: Path) -> None:
    """Write the block to ``script`` and run the page's launch command as written."""
    (tmp_path / script).write_text(block.code)
    command = launch_command(block, script)
    words = shlex.split(command)
    if words[0] == "torchrun":
        argv = [sys.executable, "-m", "torch.distributed.run", *words[1:]]
    elif words[0] == "mpirun":
        launcher = shutil.which("mpirun", path=str(Path(sys.executable).parent)) or shutil.which("mpirun")
        if launcher is None:
            pytest.skip("mpirun is not installed")
        argv = [launcher, *(sys.executable if w == "python" else w for w in words[1:])]
    else:
        raise AssertionError(f"{block.page.name}:{block.line}: launch with torchrun or mpirun: {command!r}")
    try:
        done = subprocess.run(argv, cwd=tmp_path, capture_output=True, text=True, timeout=300)
    except subprocess.TimeoutExpired as exc:
        raise AssertionError(f"{block.page.name}:{block.line}: {command} ran past 300 s") from exc
    assert done.returncode == 0, (
        f"{block.page.name}:{block.line} failed under {command!r}:\n"
        f"{done.stdout[-3000:]}\n{done.stderr[-5000:]}"
    )


def command_outputs(page: Path) -> list[tuple[int, str, str]]:
    """``(line, command, shown output)`` for each text block marked ``output-of-command``."""
    text, out = page.read_text(), []
    for m in TEXT.finditer(text):
        if (m.group("mark") or "").strip() == "output-of-command":
            commands = [b for b in BASH.finditer(text) if b.end() <= m.start()]
            assert commands, f"{page.name}: an output-of-command block with no bash block before it"
            lines = commands[-1].group("code").strip().splitlines()
            assert len(lines) == 1, f"{page.name}: the bash block before an output must be one command"
            command = lines[0].partition("  #")[0].strip()
            out.append((text.count("\n", 0, m.start("out")) + 1, command, m.group("out")))
    return out


def _pattern(expected: str) -> re.Pattern:
    """A regex for one line of expected output (see the module docstring)."""
    parts = []
    for token in expected.split():
        if token.startswith("~") and len(token) > 1:
            parts.append(r"\S+")
        elif len(token) > 1 and set(token) == {"-"}:  # a table's rule: as wide as its column
            parts.append("-+")
        else:
            parts.append(".*?".join(re.escape(piece) for piece in token.split("...")))
    return re.compile(r"\s+".join(parts))


def assert_output(expected: str, actual: str, where: str) -> None:
    """``actual`` matches the page's ``expected`` output, line by line."""
    want = [line for line in expected.strip("\n").splitlines()]
    got = [line for line in actual.strip("\n").splitlines()]
    detail = f"{where}: the page shows\n{expected}\nbut it printed\n{actual}"
    assert len(want) == len(got), detail
    for w, g in zip(want, got):
        assert _pattern(w).fullmatch(g.strip()), f"{detail}\n(first difference: {w!r} vs {g!r})"


def expected_prints(block: Block) -> dict[int, str]:
    """{line in the block: output shown in its comment} for ``print(...)  # output`` lines."""
    return {i: m.group("out") for i, line in enumerate(block.code.splitlines(), 1)
            if (m := PRINT.match(line))}


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


def _page_params() -> list:
    """Each page with blocks; one that starts ranks (``processes=``, ``launch=``) marked ``ranks``,
    so that xdist runs it with the other multi-process tests, one at a time (tests/conftest.py)."""
    def ranks(page: Path) -> bool:
        keys = {t.partition("=")[0] for b in blocks_of(page) for t in b.mark.split()}
        return bool(keys & {"processes", "launch"})

    return [pytest.param(p, marks=[pytest.mark.ranks] if ranks(p) else []) for p in _pages_with_blocks()]


@pytest.mark.parametrize("page", _page_params(), ids=lambda p: str(p.relative_to(ROOT)))
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
        if "launch" in marks:
            pytest.importorskip("torch.distributed")
            _launch(block, marks["launch"], tmp_path)
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
    unknown = set(marks) - {"gpu", "processes", "launch", "needs"}
    assert not unknown, f"{block.page.name}:{block.line}: unknown test mark {block.mark!r}"
    return marks


def _exec(block: Block, namespace: dict) -> None:
    """Run the block; then check what it printed against what the page shows."""
    filename = f"{block.page}:{block.line}"
    everything, by_line = io.StringIO(), {}

    def recording_print(*args, **kwargs):  # print's output, by the block's line that called it
        if kwargs.get("file") is not None:
            return builtins.print(*args, **kwargs)
        text = io.StringIO()
        builtins.print(*args, **{**kwargs, "file": text})
        caller = sys._getframe(1)
        if caller.f_code.co_filename == filename:
            by_line[caller.f_lineno] = by_line.get(caller.f_lineno, "") + text.getvalue()
        everything.write(text.getvalue())
        sys.stdout.write(text.getvalue())

    namespace["print"] = recording_print
    stdout = sys.stdout
    sys.stdout = tee = _Tee(everything, stdout)
    try:
        exec(compile(block.code, filename, "exec"), namespace)
    except Exception as exc:
        raise AssertionError(f"the block at {block.page.name}:{block.line} failed: {exc!r}") from exc
    finally:
        sys.stdout = stdout
        namespace.pop("print", None)
    for line, shown in expected_prints(block).items():
        where = f"{block.page.name}:{block.line + line - 1}"
        assert line in by_line, f"{where}: this print(...) never ran"
        assert_output(shown, by_line[line], where)
    if block.output is not None:
        assert_output(block.output, tee.text(), f"{block.page.name}:{block.line} (the text block after it)")


class _Tee(io.TextIOBase):
    """sys.stdout during a block: what anything writes (print, a CLI's output) is kept."""

    def __init__(self, keep: io.StringIO, real) -> None:
        self._keep, self._real = keep, real

    def write(self, text: str) -> int:
        if sys._getframe(1).f_code.co_name != "recording_print":  # print's text is kept already
            self._keep.write(text)
        return self._real.write(text)

    def flush(self) -> None:
        self._real.flush()

    def text(self) -> str:
        return self._keep.getvalue()


GPU_BLOCKS = [b for p in PAGES for b in blocks_of(p) if "gpu" in _marks(b)]


@pytest.mark.gpu
@pytest.mark.parametrize("block", GPU_BLOCKS, ids=lambda b: f"{b.page.relative_to(ROOT)}:{b.line}")
def test_gpu_block(block: Block, tmp_path, monkeypatch):
    reason = _cuda_reason() or _frameworks().require(*filter(None, _marks(block).get("needs", "").split(",")))
    if reason:
        pytest.skip(reason)
    monkeypatch.chdir(tmp_path)
    _exec(block, {"__name__": "__main__"})


def free_names(code: str) -> set[str]:
    """Names a block reads but neither imports, assigns, defines nor gets from builtins."""
    import ast

    defined, used = set(dir(builtins)) | {"__file__"}, set()
    for node in ast.walk(ast.parse(code)):
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            defined |= {(a.asname or a.name).split(".")[0] for a in node.names}
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            defined.add(node.name)
        elif isinstance(node, ast.arg):
            defined.add(node.arg)
        elif isinstance(node, ast.ExceptHandler) and node.name:
            defined.add(node.name)
        elif isinstance(node, ast.Name):
            (used if isinstance(node.ctx, ast.Load) else defined).add(node.id)
    return used - defined


CONTINUE_ONE_ANOTHER = "The blocks of this page continue one another"
# Pages whose dependent blocks do not say so yet: none (keep the set for a page in transition).
NOT_YET: set[str] = set()


def test_a_block_that_continues_earlier_ones_says_so():
    """A reader who copies one block sees, in visible text, when it needs the blocks before it."""
    assert free_names("import numpy as np\nx = np.ones(2)\nprint(x, y)") == {"y"}
    for page in PAGES:
        if page.name in NOT_YET:
            continue
        text = page.read_text()
        says = CONTINUE_ONE_ANOTHER in " ".join(text.split())
        previous_end = 0
        for block in blocks_of(page):
            start = len("".join(text.splitlines(keepends=True)[: block.line - 1]))
            lead = text[previous_end:start]
            previous_end = block.end
            missing = free_names(block.code)
            if missing and "launch" not in _marks(block):
                assert says or "continu" in lead, (
                    f"{page.name}:{block.line} uses {sorted(missing)} from earlier blocks: say so in the "
                f"text before it ('continuing the block above') or on the page ({CONTINUE_ONE_ANOTHER!r})"
                )
            if "launch" in _marks(block):  # a script launched on its own must be complete
                assert not missing, f"{page.name}:{block.line}: a launched script uses {sorted(missing)}"


def test_every_block_is_found():
    """The fence pattern sees every python fence (a typo in a marker must not hide a block)."""
    for page in PAGES:
        text = page.read_text()
        assert len(blocks_of(page)) == text.count("```python\n"), page


def _commands() -> list[tuple[Path, int, str, str]]:
    """Every page's (page, line, command, shown output), a pair shown on two pages run once (README
    shows the demo's output as docs/getting-started.md does: one run checks both)."""
    found, seen = [], set()
    for page in PAGES:
        for line, command, shown in command_outputs(page):
            if (command, shown.strip()) not in seen:
                seen.add((command, shown.strip()))
                found.append((page, line, command, shown))
    return found


COMMANDS = _commands()


@pytest.mark.slow
@pytest.mark.parametrize(("page", "line", "command", "shown"), COMMANDS,
                         ids=[f"{p.relative_to(ROOT)}:{line}" for p, line, *_ in COMMANDS])
def test_command_output_is_what_the_page_shows(page, line, command, shown, tmp_path):
    """The command as the page writes it, in a fresh folder (folders of its --output made)."""
    words = shlex.split(command)
    for i, word in enumerate(words[:-1]):
        if word == "--output":
            (tmp_path / words[i + 1]).parent.mkdir(parents=True, exist_ok=True)
    exe = shutil.which(words[0], path=str(Path(sys.executable).parent)) or shutil.which(words[0])
    assert exe, f"{page.name}:{line}: {words[0]} is not installed"
    done = subprocess.run([exe, *words[1:]], cwd=tmp_path, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    assert_output(shown, done.stdout, f"{page.name}:{line} ({command})")


def test_expected_output_patterns():
    """The matching rules themselves: spacing, ``...`` and ``~`` tokens; a wrong figure fails."""
    assert_output("a   1.0  ~3.2s\nwritten to .../demo.png", "a 1.0 9.9s\nwritten to /x/y/demo.png", "t")
    assert_output("[2. 2.] ...", "[2. 2.] anything", "t")
    assert_output("---  -----", "--- ---", "t")
    for wrong in ("a 1.1 3.2s", "a 1.0", "a 1.0 3.2s extra"):
        with pytest.raises(AssertionError):
            assert_output("a 1.0 ~3.2s", wrong, "t")
    with pytest.raises(AssertionError):
        assert_output("one\ntwo", "one", "t")
