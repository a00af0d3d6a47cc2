"""Every python block of README.md runs as written, and the test command is what CI runs."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest

README = Path(__file__).resolve().parents[1] / "README.md"
BLOCKS = re.findall(r"```python\n(.*?)```", README.read_text(), re.S)


def _run_block(code: str) -> dict:
    namespace: dict = {"__name__": "__readme__"}
    exec(compile(code, str(README), "exec"), namespace)
    return namespace


def _block(marker: str) -> str:
    (code,) = [b for b in BLOCKS if marker in b]
    return code


@pytest.mark.parametrize("code", BLOCKS, ids=[f"block{i}" for i in range(len(BLOCKS))])
def test_every_python_block_runs_as_written(code, capsys):
    if re.search(r"^import paddle", code, re.M):
        pytest.importorskip("paddle")
    _run_block(code)


def test_readme_numpy_loop_trains(capsys):
    namespace = _run_block(_block("import numpy as np"))
    assert namespace["loss"] < 1e-3
    assert namespace["scaler"].skipped_steps >= 1  # the scale calibrated itself
    assert "loss" in capsys.readouterr().out


def test_readme_paddle_loop_trains_on_cpu(capsys):
    pytest.importorskip("paddle")
    code = _block("import paddle")
    assert "scaled.backward()" in code and "scaler.minimize(optimizer, scaled)" in code
    namespace = _run_block(code)
    assert float(namespace["loss"]) < 1e-4
    assert namespace["scaler"].skipped_steps == 0
    assert capsys.readouterr().out.startswith("loss ")


def test_every_python_block_is_tested_for_what_it_shows():
    assert len(BLOCKS) == 2  # a new block needs its own test above


def test_readme_test_command_is_what_ci_runs():
    """The test command README shows (after ``&&``) is a line of .ci/run, after the same install."""
    ci = (README.parent / ".ci" / "run").read_text()
    (shown,) = re.findall(r'^pip install -e "\.\[test\]" && (.+)$', README.read_text(), re.M)
    assert shown == "python -m pytest -n auto"  # on every core (pytest-xdist)
    assert 'pip install -q -c .ci/constraints.txt -e ".[test]"' in ci and f"\n{shown}\n" in ci
    assert ci.index('-e ".[test]"') < ci.index(f"\n{shown}\n")


def test_readme_puts_the_cpu_build_of_torch_first():
    """A literal reader without a GPU meets the CPU line before any ``.[test]`` install."""
    text = README.read_text()
    cpu = "pip install torch --index-url https://download.pytorch.org/whl/cpu"
    assert text.index(cpu) < text.index('pip install -e ".[test]"')
    # every ``.[test]`` install README shows is in a block that starts with the CPU line
    for block in re.findall(r"```bash\n(.*?)```", text, re.S):
        if '".[test]"' in block:
            assert block.startswith(cpu), block


def test_readme_says_what_the_test_extra_brings():
    text = " ".join(README.read_text().split())
    for name in ("paddlepaddle", "numba", "Open MPI", "matplotlib", "jaxlib", "scipy",
                 "tools/install_size.py"):
        assert name in text, name


def _install_size():
    """tools/install_size.py, loaded by path (tools are not a package)."""
    import importlib.util

    path = README.parent / "tools" / "install_size.py"
    spec = importlib.util.spec_from_file_location("polyamp_install_size", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.slow
def test_readme_install_size_is_what_the_test_extra_takes():
    """Issue 34 item 1: the figures README states are measured, on the platform it names (Linux
    x86-64, torch's CPU build), where every package of the test extra is installed."""
    import platform

    torch = pytest.importorskip("torch")
    if sys.platform != "linux" or platform.machine() != "x86_64" or "+cpu" not in torch.__version__:
        pytest.skip("README's sizes are for Linux x86-64 with torch's CPU build")
    found, missing = _install_size().sizes("test")
    if missing:
        pytest.skip(f"not every package of the test extra is installed here: {missing}")
    text = " ".join(README.read_text().split())
    (total,) = re.findall(r"about ([\d.]+) GB in all with torch's CPU build", text)
    (without,) = re.findall(r"([\d.]+) GB of it on top of torch", text)
    measured = sum(found.values())
    assert float(total) * 1e9 == pytest.approx(measured, rel=0.05), measured
    others = measured - found["torch"]
    assert float(without) * 1e9 == pytest.approx(others, rel=0.05), others
    for name, shown in re.findall(r"(torch|paddlepaddle|jaxlib|scipy) ([\d.]+) MB", text):
        assert float(shown) * 1e6 == pytest.approx(found[name], rel=0.05), name


def _install_and_run_block() -> tuple[str, str]:
    """README's "Install and run" commands (the bash block with ``polyamp inspect``) and the output
    it shows after them."""
    text = README.read_text()
    (match,) = [m for m in re.finditer(r"```bash\n(.*?)```", text, re.S) if "polyamp inspect" in m.group(1)]
    shown = re.search(r"```text\n(.*?)```", text[match.end():], re.S).group(1)
    return match.group(1), shown


@pytest.mark.slow
def test_readme_run_block_runs_as_written_in_a_fresh_folder(tmp_path):
    """Issue 34 item 6: every command of the block, in order, in an empty folder (no checkpoint to
    inspect there until the block saves one), and the last one prints what README shows."""
    import shlex
    import shutil
    import subprocess

    block, shown = _install_and_run_block()
    commands = [line.partition("  #")[0].strip() for line in block.strip().splitlines()]
    assert not any(c.startswith("pip ") for c in commands)  # runnable once installed, as written
    bin_dir = str(Path(sys.executable).parent)
    for command in commands:
        words = shlex.split(command)
        exe = sys.executable if words[0] == "python" else (
            shutil.which(words[0], path=bin_dir) or shutil.which(words[0]))
        done = subprocess.run([exe, *words[1:]], cwd=tmp_path, capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, f"{command}: {done.stderr[-2000:]}"
    assert [line.split() for line in done.stdout.strip().splitlines()] == \
        [line.split() for line in shown.strip().splitlines()]


def test_readme_demo_output_is_the_one_getting_started_shows():
    """The README top shows the demo's output as docs/getting-started.md does: the docs tests run
    the command once for both (tests/docs/test_code_blocks.py), so neither goes stale alone."""
    def pair(page):
        text = page.read_text()
        shown = re.search(r"<!-- test: output-of-command -->\n```text\n(.*?)```", text, re.S)
        command = re.findall(r"```bash\n(polyamp demo[^\n]*)\n```", text[:shown.start()])[-1]
        return command.partition("  #")[0].strip(), shown.group(1)

    assert pair(README) == pair(README.parent / "docs" / "getting-started.md")


def _slug(heading: str) -> str:
    """MkDocs' anchor of a heading (the toc extension's default slugify)."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).strip().replace(" ", "-")


def test_readme_links_reach_existing_pages_and_headings():
    """README is not part of the site, so its links are checked here: each relative link names a file
    that exists and, with ``#anchor``, a heading of that file."""
    links = re.findall(r"\]\(((?:docs/|\.)[^)#\s]*)(?:#([^)\s]+))?\)", README.read_text())
    assert len(links) > 30
    for path, anchor in links:
        target = README.parent / path
        assert target.exists(), path
        if anchor:
            headings = re.findall(r"^#+ (.+)$", target.read_text(), re.M)
            assert anchor in {_slug(h) for h in headings}, f"{path}#{anchor}"


def test_readme_top_says_what_polyamp_adds_each_with_its_page():
    """Issue 34 item 1: one sentence, then what polyamp does that torch.amp, paddle.amp and jmp do
    not, each point linking its page, then the commands."""
    text = README.read_text()
    top = text[: text.index("## Try it")]
    points = re.findall(r"^- \*\*(.+?)\*\*(.*?)(?=^- |\Z)", top, re.M | re.S)
    assert len(points) >= 8
    for name, rest in points[:-1]:  # the last, NumPy and CuPy, points at the demo below
        assert "](docs/" in rest, name
    for word in ("guard", "Megatron", "JAX", "inspect", "Logger", "Distributed", "bf16"):
        assert word in top, word
    test = 'pip install -e ".[test]" && python -m pytest'
    assert text.index("polyamp demo --output demo.png") < text.index(test)


def test_readme_says_how_to_keep_a_cpu_install_small():
    """The CPU build of torch first, then the test command: the extras' torch range keeps it."""
    from packaging.requirements import Requirement

    text = README.read_text()
    cpu = "pip install torch --index-url https://download.pytorch.org/whl/cpu"
    test = 'pip install -e ".[test]" && python -m pytest -n auto'
    (block,) = [b for b in re.findall(r"```bash\n(.*?)```", text, re.S) if cpu in b]
    assert block.index(cpu) < block.index(test)
    tomllib = pytest.importorskip("tomllib")  # Python >= 3.11
    project = tomllib.loads((README.parent / "pyproject.toml").read_text())["project"]
    for extra in ("test", "torch"):
        (torch_req,) = [Requirement(r) for r in project["optional-dependencies"][extra]
                        if Requirement(r).name == "torch"]
        # any torch 2.x build, CPU ones (2.13.0+cpu) included, satisfies it: pip keeps it
        assert torch_req.specifier.contains("2.13.0+cpu") and not torch_req.url, torch_req
        assert all(s.operator == ">=" for s in torch_req.specifier), torch_req


def test_readme_says_how_ci_pins_versions():
    text = " ".join(README.read_text().split())
    assert "pins `torch==2.13.0`" not in text
    assert "The extras give version ranges" in text and ".ci/constraints.txt" in text
