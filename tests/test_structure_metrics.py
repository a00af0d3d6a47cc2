"""tools/structure_metrics.py counts what it says on small synthetic package trees."""

from __future__ import annotations

import importlib.util
import textwrap
from pathlib import Path
from types import ModuleType

import pytest

TOOL = Path(__file__).resolve().parents[1] / "tools" / "structure_metrics.py"

SOURCES = {
    "__init__.py": "from .a import VALUE\nfrom .late import g\n",
    "late.py": "def g():\n    import pkg\n    return pkg.VALUE\n",
    "a.py": "from . import b\n\nVALUE = 1\n",
    "b.py": "def late():\n    from pkg.a import VALUE\n    return VALUE\n",
    "c.py": "import pkg.a\nfrom pkg import VALUE\nfrom .sub import d\n",
    "sub/__init__.py": "",
    "sub/d.py": "def f():\n    from ..c import VALUE\n    from ...a import beyond_top\n    return VALUE\n",
    "mixin.py": """\
        from typing import TYPE_CHECKING


        class Mixin:
            host_a: int
            _host_b: str
            value: int = 3
            if TYPE_CHECKING:
                _host_c: float

            @property
            def _prop(self):
                return 1

            def use(self):
                return (self._host_b, self._host_c, self._prop, self._other, self._own,
                        self.__class__, self.host_a, self._other)


        class Owner:
            mine: int

            def __init__(self):
                self._own = 1
                self.mine = 2
        """,
    "records.py": """\
        import dataclasses
        import typing
        from dataclasses import dataclass
        from typing import NamedTuple, Protocol, TypedDict


        @dataclass
        class D:
            x: int


        @dataclasses.dataclass(frozen=True)
        class E:
            y: int


        class N(NamedTuple):
            z: int


        class P(typing.Protocol[int]):
            w: int


        class Q(Protocol):
            v: int


        class TD(TypedDict):
            a: int


        class TD2(TD):
            b: int


        class TD3(TD2):
            c: int
        """,
    "host.py": """\
        from .mixin import Mixin


        class Host(Mixin):
            def __init__(self, engine):
                self._host_b = "b"
                self._engine = engine
                self.iteration = 0

            def step(self, engine):
                return self._host_b, self._engine.iteration, engine.iteration, self._base_only
        """,
    "engine.py": "def run(x):\n    return x.iteration\n\n\ndef loose(self):\n    return self._no_class\n",
    "long.py": "def long():\n" + "    x = 1\n" * 40 + "\n\ndef short():\n" + "    x = 1\n" * 39,
}


@pytest.fixture(scope="module")
def tool() -> ModuleType:
    spec = importlib.util.spec_from_file_location("structure_metrics", TOOL)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def tree(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("tree") / "pkg"
    for name, text in SOURCES.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(textwrap.dedent(text))
    return root


@pytest.fixture(scope="module")
def modules(tool, tree) -> list:
    return tool.load(str(tree))


def test_modules_are_named_by_their_package_and_lines_are_physical_lines(tool, tree, modules):
    assert sorted(m.name for m in modules) == sorted(
        ["pkg", "pkg.a", "pkg.b", "pkg.c", "pkg.sub", "pkg.sub.d", "pkg.mixin", "pkg.records", "pkg.host",
         "pkg.engine", "pkg.long", "pkg.late"])
    lines = sum(path.read_text().count("\n") for path in tree.rglob("*.py"))
    assert tool.measure(modules)["modules / lines"] == f"12 / {lines}"
    assert [m.name for m in tool.load(str(tree / "sub" / "d.py"))] == ["pkg.sub.d"]
    assert {"other.pkg", "other.pkg.sub.d"} <= {m.name for m in tool.load(f"other.pkg={tree}")}


def test_mixin_declarations_are_counted_and_typed_records_are_not(tool, modules):
    hits, own = tool.declared_host_attributes(modules)
    assert sorted((h.scope, h.name) for h in hits) == [
        ("Mixin", "_host_b"), ("Mixin", "_host_c"), ("Mixin", "host_a"), ("Owner", "mine")]
    assert own == {("Owner", "mine")}


def test_self_reads_of_names_no_class_of_the_module_defines(tool, modules):
    hits = tool.foreign_self_reads(modules)
    assert sorted((h.module, h.scope, h.name) for h in hits) == [
        ("pkg.host", "Host.step", "_base_only"), ("pkg.mixin", "Mixin.use", "_other"),
        ("pkg.mixin", "Mixin.use", "_other")]


def test_a_41_line_function_is_long_and_a_40_line_one_is_not(tool, modules):
    assert [(h.module, h.name, h.line) for h in tool.long_functions(modules)] == [("pkg.long", "long", 41)]


def test_iteration_reads_outside_the_engine(tool, modules):
    hits = tool.iteration_reads(modules, engine="pkg.engine")
    assert sorted(h.name for h in hits) == ["engine.iteration", "self._engine.iteration"]
    assert len(tool.iteration_reads(modules, engine="polyamp.engine")) == 3


def test_mutual_imports_relative_absolute_and_inside_functions(tool, modules, tmp_path):
    pairs = [("pkg", "pkg.late"), ("pkg.a", "pkg.b"), ("pkg.c", "pkg.sub.d")]
    assert tool.mutual_imports(modules) == pairs
    # ``a``: what sub/d.py's ``...a`` would wrongly be; it imports d (f is no module: the longest
    # measured prefix counts)
    (tmp_path / "a.py").write_text("import pkg.sub.d.f\n")
    outside = tool.load(f"a={tmp_path / 'a.py'}")
    assert [m.name for m in outside] == ["a"]
    assert tool.import_graph(modules + outside)["a"] == {"pkg.sub.d"}
    assert tool.mutual_imports(modules + outside) == pairs


def test_largest_class_and_the_printed_table(tool, tree, modules, capsys):
    assert tool.largest_class(modules) == ("pkg.mixin", "", "Mixin", 14)
    tool.main(["--label", "synthetic", "--verbose", str(tree)])
    out = capsys.readouterr().out
    assert out.startswith("| metric | synthetic |\n|---|---|\n")
    assert "| module pairs importing each other | 3 |" in out
    assert "- pkg.a <-> pkg.b" in out and "- pkg.long: long (41 lines)" in out
    with pytest.raises(SystemExit):
        tool.main([str(tree / "missing")])
    assert "'" + str(tree / "missing") + "' does not exist" in capsys.readouterr().err


def test_the_tree_holds_the_redesigns_targets(tool):
    """polyamp's own tree (issue 31's targets): no host attributes declared by mixins, no reads of
    another module's private names, no function over 40 lines, no module pairs importing each
    other, ``Iteration`` at most 300 lines and ``LossScaler`` at most 250."""
    import ast

    root = Path(__file__).resolve().parent.parent
    modules = [m for d in ("polyamp", "compat", "backends") for m in tool.load(str(root / d))]
    assert tool.declared_host_attributes(modules)[0] == []
    assert tool.foreign_self_reads(modules) == []
    assert tool.long_functions(modules) == []
    assert tool.mutual_imports(modules) == []
    sizes = {}
    for name, cls in (("_iteration.py", "Iteration"), ("engine.py", "LossScaler")):
        tree = ast.parse((root / "polyamp" / name).read_text())
        node = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == cls)
        sizes[cls] = node.end_lineno - node.lineno + 1
    assert sizes["Iteration"] <= 300 and sizes["LossScaler"] <= 250, sizes
