"""Measure the structure of Python package trees (standard library ``ast`` only); print a Markdown table.

One row per metric: modules and lines (total physical lines of the ``.py`` files, blank and comment
lines included); the largest class; a host's attributes declared by mixins (``x: T`` without a value
in the body, ``if TYPE_CHECKING:`` blocks included, of a class that is no dataclass, NamedTuple,
Protocol or TypedDict; the cell also says how many of them the declaring class sets as ``self.x``
itself); ``self._x`` loads where no class of the reading module defines ``_x`` (as ``self._x = ...``,
a class-level assignment, annotation or def; dunders excluded); functions over 40 lines;
``.iteration`` loads outside ``polyamp.engine`` (``--engine``); pairs of measured modules that import
each other (relative imports and imports inside functions included; ``from pkg import sub`` imports
``pkg.sub``, not ``pkg``, as in tests/test_import_graph.py). ``--verbose`` lists what was counted. Run:

    python tools/structure_metrics.py [--label NAME] [--verbose] [PATH ...]

A PATH is a package folder or a ``.py`` file, or ``NAME=PATH`` to give its dotted import name; it
defaults to the repository's ``polyamp compat backends`` (installed as polyamp, polyamp.compat and
polyamp.backends). Other trees work too, e.g. an installed torch's ``torch/amp/grad_scaler.py``.
"""

from __future__ import annotations

import argparse
import ast
from collections.abc import Iterator
from pathlib import Path
from typing import NamedTuple

ROOT = Path(__file__).resolve().parents[1]
REPO_PACKAGES = {ROOT / "polyamp": "polyamp", ROOT / "compat": "polyamp.compat",
                 ROOT / "backends": "polyamp.backends"}
LONG_FUNCTION = 40  # a function of more lines than this is counted as long
NOT_MIXIN_BASES = {"NamedTuple", "Protocol", "TypedDict"}


class Module(NamedTuple):
    name: str  # dotted import name (``pkg/__init__.py`` is ``pkg``)
    path: Path
    tree: ast.Module
    lines: int  # physical lines


class Hit(NamedTuple):
    module: str
    scope: str  # enclosing class or function qualname ("" at module level)
    name: str
    line: int


def _package_name(folder: Path) -> str:
    """A folder's dotted name: the repository's own mapping, else its chain of ``__init__.py`` parents."""
    folder = folder.resolve()
    if folder in REPO_PACKAGES:
        return REPO_PACKAGES[folder]
    parts = [folder.name]
    while (folder.parent / "__init__.py").is_file():
        folder = folder.parent
        parts.insert(0, folder.name)
    return ".".join(parts)


def load(spec: str) -> list[Module]:
    """The modules of one PATH argument (a folder, a ``.py`` file, or ``NAME=PATH``)."""
    name, _, rest = spec.rpartition("=")
    path = Path(rest)
    if not path.exists():
        raise ValueError(f"path {rest!r} does not exist; pass a package folder or a .py file")
    if path.is_file() and name:
        base, files = name, {path: []}
    elif path.is_file():
        base = _package_name(path.parent)
        files = {path: [] if path.name == "__init__.py" else [path.stem]}
    else:
        base = name or _package_name(path)
        files = {p: list(p.relative_to(path).with_suffix("").parts) for p in sorted(path.rglob("*.py"))}
    modules = []
    for file, parts in files.items():
        text = file.read_text(encoding="utf-8")
        parts = [base, *parts[:-1]] if parts and parts[-1] == "__init__" else [base, *parts]
        modules.append(Module(".".join(parts), file, ast.parse(text, str(file)), len(text.splitlines())))
    return modules


def _walk(node: ast.AST, scope: tuple[str, ...] = (), cls: str | None = None) -> Iterator:
    """Every node below ``node`` with its enclosing qualname and innermost enclosing class."""
    for child in ast.iter_child_nodes(node):
        yield child, scope, cls
        if isinstance(child, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            inner = child.name if isinstance(child, ast.ClassDef) else cls
            yield from _walk(child, (*scope, child.name), inner)
        else:
            yield from _walk(child, scope, cls)


def _body(cls: ast.ClassDef) -> Iterator[ast.stmt]:
    """A class body's statements, through ``if``/``try``/``with`` blocks but not into defs."""
    todo = list(cls.body)
    while todo:
        stmt = todo.pop(0)
        yield stmt
        if isinstance(stmt, (ast.If, ast.Try, ast.With)):
            for field in ("body", "orelse", "finalbody", "handlers"):
                todo.extend(getattr(stmt, field, []))
        elif isinstance(stmt, ast.ExceptHandler):
            todo.extend(stmt.body)


def _terminal(node: ast.expr) -> str:
    """``a.b.C`` -> ``C``; ``C[T]`` and ``C(...)`` -> ``C``."""
    while isinstance(node, (ast.Subscript, ast.Call)):
        node = node.value if isinstance(node, ast.Subscript) else node.func
    return node.attr if isinstance(node, ast.Attribute) else getattr(node, "id", "")


def _classes(modules: list[Module]) -> Iterator[tuple[Module, tuple[str, ...], ast.ClassDef]]:
    for module in modules:
        for node, scope, _ in _walk(module.tree):
            if isinstance(node, ast.ClassDef):
                yield module, scope, node


def largest_class(modules: list[Module]) -> Hit | None:
    """The class of most lines (``end_lineno - lineno + 1``); ``Hit.line`` holds its line count."""
    best = None
    for module, scope, cls in _classes(modules):
        size = cls.end_lineno - cls.lineno + 1
        if best is None or size > best.line:
            best = Hit(module.name, ".".join(scope), cls.name, size)
    return best


def _self_assigned(cls: ast.ClassDef) -> set[str]:
    return {n.attr for n in ast.walk(cls) if isinstance(n, ast.Attribute) and isinstance(n.ctx, ast.Store)
            and isinstance(n.value, ast.Name) and n.value.id == "self"}


def declared_host_attributes(modules: list[Module]) -> tuple[list[Hit], set[tuple[str, str]]]:
    """``x: T`` without a value in non-dataclass/NamedTuple/Protocol/TypedDict class bodies.

    Also returns the (class qualname, name) pairs the declaring class itself assigns as ``self.x``.
    """
    classes = list(_classes(modules))
    typed_dicts = {c.name for _, _, c in classes if any(_terminal(b) == "TypedDict" for b in c.bases)}
    for _ in range(len(classes)):  # a subclass of a TypedDict is a TypedDict
        typed_dicts |= {c.name for _, _, c in classes if any(_terminal(b) in typed_dicts for b in c.bases)}
    hits, own = [], set()
    for module, scope, cls in classes:
        if (any(_terminal(d) == "dataclass" for d in cls.decorator_list)
                or any(_terminal(b) in NOT_MIXIN_BASES | typed_dicts for b in cls.bases)):
            continue
        qualname, assigned = ".".join((*scope, cls.name)), _self_assigned(cls)
        for stmt in _body(cls):
            if isinstance(stmt, ast.AnnAssign) and stmt.value is None and isinstance(stmt.target, ast.Name):
                hits.append(Hit(module.name, qualname, stmt.target.id, stmt.lineno))
                if stmt.target.id in assigned:
                    own.add((qualname, stmt.target.id))
    return hits, own


def _class_defined(cls: ast.ClassDef) -> set[str]:
    """Names a class defines: ``self.x = ...`` anywhere in it, and class-level assignments and defs."""
    names = _self_assigned(cls)
    for stmt in _body(cls):
        if isinstance(stmt, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(stmt.name)
        targets = stmt.targets if isinstance(stmt, ast.Assign) else [getattr(stmt, "target", None)]
        for target in targets:
            names |= {n.id for n in ast.walk(target) if isinstance(n, ast.Name)} if target else set()
    return names


#: NamedTuple's own methods and attributes (defined by the standard library, not by another module of
#: the measured tree).
NAMEDTUPLE_API = frozenset({"_replace", "_asdict", "_fields", "_make", "_field_defaults"})


def foreign_self_reads(modules: list[Module]) -> list[Hit]:
    """``self._x`` loads in a class of module M where no class of M defines ``_x`` (dunders and
    NamedTuple's ``_replace``-style API excluded)."""
    hits = []
    for module in modules:
        defined: set[str] = set()
        for _, _, cls in _classes([module]):
            defined |= _class_defined(cls)
        for node, scope, cls in _walk(module.tree):
            if (cls is not None and isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Load)
                    and isinstance(node.value, ast.Name) and node.value.id == "self"
                    and node.attr.startswith("_") and not node.attr.endswith("__")
                    and node.attr not in defined and node.attr not in NAMEDTUPLE_API):
                hits.append(Hit(module.name, ".".join(scope), node.attr, node.lineno))
    return hits


def long_functions(modules: list[Module], limit: int = LONG_FUNCTION) -> list[Hit]:
    """Functions and methods of more than ``limit`` lines; ``Hit.line`` holds the line count."""
    hits = []
    for module in modules:
        for node, scope, _ in _walk(module.tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                size = node.end_lineno - node.lineno + 1
                if size > limit:
                    hits.append(Hit(module.name, ".".join(scope), node.name, size))
    return hits


def iteration_reads(modules: list[Module], engine: str = "polyamp.engine") -> list[Hit]:
    """Loads of an attribute named ``iteration`` in every module but ``engine``."""
    return [Hit(m.name, ".".join(scope), ast.unparse(node), node.lineno)
            for m in modules if m.name != engine for node, scope, _ in _walk(m.tree)
            if isinstance(node, ast.Attribute) and node.attr == "iteration"
            and isinstance(node.ctx, ast.Load)]


def _imported(module: Module, node: ast.AST, names: set[str]) -> set[str]:
    """The measured modules one import statement loads (``from m import sub`` loads ``m.sub``)."""
    if isinstance(node, ast.Import):
        bases, subs = [alias.name for alias in node.names], []
    elif isinstance(node, ast.ImportFrom):
        base = node.module or ""
        if node.level:
            package = module.name.split(".")
            package = package if module.path.name == "__init__.py" else package[:-1]
            if node.level - 1 > len(package) - 1:
                return set()
            base = ".".join([*package[: len(package) - node.level + 1], *([base] if base else [])])
        subs = [f"{base}.{alias.name}" for alias in node.names]
        bases = [base] if any(sub not in names for sub in subs) else []
    else:
        return set()
    found = {sub for sub in subs if sub in names}
    for base in bases:  # ``import a.b.c`` runs the longest measured prefix
        parts = base.split(".")
        found |= next(({".".join(parts[:i])} for i in range(len(parts), 0, -1)
                       if ".".join(parts[:i]) in names), set())
    return found


def import_graph(modules: list[Module]) -> dict[str, set[str]]:
    """Module -> the measured modules it imports anywhere in its source (itself excluded)."""
    names = {m.name for m in modules}
    return {m.name: set().union(*(_imported(m, n, names) for n in ast.walk(m.tree))) - {m.name}
            for m in modules}


def mutual_imports(modules: list[Module]) -> list[tuple[str, str]]:
    """Pairs of measured modules each of which imports the other, anywhere in its source."""
    graph = import_graph(modules)
    return sorted((a, b) for a in graph for b in graph[a] if a < b and a in graph[b])


def measure(modules: list[Module], engine: str = "polyamp.engine") -> dict[str, str]:
    """Metric name -> the table cell for these modules."""
    big = largest_class(modules)
    declared, own = declared_host_attributes(modules)
    return {
        "modules / lines": f"{len(modules)} / {sum(m.lines for m in modules)}",
        "largest class (lines)": f"`{big.name}` ({big.module}): {big.line}" if big else "none",
        "host attributes declared by mixins": f"{len(declared)} ({len(own)} also set by the class itself)",
        "`self._x` reads defined in another module": str(len(foreign_self_reads(modules))),
        f"functions over {LONG_FUNCTION} lines": str(len(long_functions(modules))),
        f"`.iteration` reads outside {engine}": str(len(iteration_reads(modules, engine))),
        "module pairs importing each other": str(len(mutual_imports(modules))),
    }


def details(modules: list[Module], engine: str = "polyamp.engine") -> Iterator[str]:
    """The ``--verbose`` listing: what each count counted."""
    declared, own = declared_host_attributes(modules)
    sections = [
        ("Host attributes declared by mixins", [f"{h.module}: {h.scope}.{h.name} (line {h.line})"
                                               + (" [set by the class]" if (h.scope, h.name) in own else "")
                                               for h in declared]),
        ("`self._x` reads defined in another module",
         [f"{h.module}:{h.line} {h.scope}: self.{h.name}" for h in foreign_self_reads(modules)]),
        (f"Functions over {LONG_FUNCTION} lines",
         [f"{h.module}: {'.'.join(filter(None, (h.scope, h.name)))} ({h.line} lines)"
          for h in long_functions(modules)]),
        ("`.iteration` reads", [f"{h.module}:{h.line} {h.name}" for h in iteration_reads(modules, engine)]),
        ("Module pairs importing each other", [f"{a} <-> {b}" for a, b in mutual_imports(modules)]),
    ]
    for title, lines in sections:
        yield f"\n### {title} ({len(lines)})\n"
        yield from (f"- {line}" for line in lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("paths", nargs="*", help="package folders or .py files, or NAME=PATH")
    parser.add_argument("--label", help="the table's column header (default: the paths)")
    parser.add_argument("--engine", default="polyamp.engine",
                        help="the module whose .iteration reads are not counted")
    parser.add_argument("--verbose", "-v", action="store_true", help="list what each count counted")
    args = parser.parse_args(argv)
    paths = args.paths or [f"{name}={folder}" for folder, name in REPO_PACKAGES.items()]
    try:
        modules = list({m.name: m for spec in paths for m in load(spec)}.values())
    except (ValueError, SyntaxError) as exc:
        parser.error(str(exc))
    default = " + ".join(spec.rpartition("=")[2] for spec in args.paths) or "polyamp + compat + backends"
    label = args.label or default
    print(f"| metric | {label} |\n|---|---|")
    for metric, cell in measure(modules, args.engine).items():
        print(f"| {metric} | {cell} |")
    if args.verbose:
        print("\n".join(details(modules, args.engine)))


if __name__ == "__main__":
    main()
