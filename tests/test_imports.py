"""Import hygiene: no cycle among hpctrain's modules, and commands that need no torch import none.

The graph is read from the source with :mod:`ast`, not from a live interpreter, so it sees
every import a module may run: module level and inside functions alike (a deferred import
that closes a loop is still a cycle, only a later-failing one). Imports under
``if TYPE_CHECKING:`` count too: they never run, but a type checker follows them, and two
modules that need each other's types are one concern split in two. ``from pkg import name`` is an edge to
``pkg.name`` when that is a module, else to ``pkg`` itself. A string naming an hpctrain
module is an edge too: a lazy export (``_EXPORTS = {"name": "hpctrain.module"}`` read by a
PEP 562 ``__getattr__``), the CLI's table of subcommands, a ``python -m`` target. A package
``__init__`` importing its own submodule is an ordinary edge: it is a cycle only when
something below imports the package back.
"""

from __future__ import annotations

import ast
import importlib
import os
import re
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

import hpctrain

ROOT = Path(hpctrain.__file__).parent
Graph = dict[str, set[str]]


# ---------------------------------------------------------------- the graph


def module_names(root: Path = ROOT) -> dict[str, Path]:
    """Every module of the package by dotted name (a package by its own name)."""
    names = {}
    for path in sorted(root.rglob("*.py")):
        parts = list(path.relative_to(root.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        names[".".join(parts)] = path
    return names


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or \
        (isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


@dataclass(frozen=True)
class Edge:
    """One import of an hpctrain module: who, what, where, and how it runs."""

    importer: str
    imported: str
    path: Path
    line: int
    deferred: bool  # inside a function: runs when the function is called
    type_checking: bool  # under ``if TYPE_CHECKING:``: runs only for a type checker
    statement: bool = True  # an import statement; False: a string naming the module

    @property
    def where(self) -> str:
        shown = self.path.relative_to(ROOT.parent) if self.path.is_relative_to(ROOT.parent) else self.path
        return f"{shown}:{self.line}"


def _nodes(tree: ast.AST, deferred: bool = False, type_checking: bool = False) -> Iterator[tuple[ast.AST, bool, bool]]:
    """Every node at any depth, with whether it sits in a function and under ``if TYPE_CHECKING:``."""
    for node in ast.iter_child_nodes(tree):
        yield node, deferred, type_checking
        in_function = deferred or isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
        if isinstance(node, ast.If) and _is_type_checking(node.test):
            for child in node.body:
                yield child, in_function, True
                yield from _nodes(child, in_function, True)
            for child in node.orelse:
                yield child, in_function, type_checking
                yield from _nodes(child, in_function, type_checking)
            continue
        yield from _nodes(node, in_function, type_checking)


def _absolute(module: str, node: ast.ImportFrom, is_package: bool) -> str:
    if not node.level:
        return node.module or ""
    base = module.split(".")
    base = base[: len(base) - node.level + (1 if is_package else 0)]
    return ".".join(base + ([node.module] if node.module else []))


def _named_module(node: ast.AST) -> str | None:
    """A string naming an hpctrain module (``"hpctrain.core.env"``, ``"hpctrain.cli.bench:add_parser"``):
    a lazy export, a command table entry, a ``-m`` target; each loads that module when used."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        match = re.fullmatch(r"(hpctrain(?:\.\w+)+)(?::\w+)?", node.value)
        return match.group(1) if match else None
    return None


def _imported_names(module: str, node: ast.AST, is_package: bool, known: set[str]) -> list[str]:
    if isinstance(node, ast.Import):
        return [alias.name for alias in node.names]
    if isinstance(node, ast.ImportFrom):
        base = _absolute(module, node, is_package)
        return [f"{base}.{alias.name}" if f"{base}.{alias.name}" in known else base for alias in node.names]
    named = _named_module(node)
    return [named] if named is not None and named in known else []


def edges_of(module: str, path: Path, known: set[str]) -> list[Edge]:
    """Every import of an hpctrain module in ``module``: module level, in functions, under
    ``if TYPE_CHECKING:``, and the strings that name a module (see the module's docstring)."""
    found: list[Edge] = []
    is_package = path.name == "__init__.py"
    for node, deferred, type_checking in _nodes(ast.parse(path.read_text(), str(path))):
        for name in _imported_names(module, node, is_package, known):
            if name.split(".")[0] != "hpctrain" or (target := _nearest_module(name, known)) == module:
                continue
            found.append(Edge(module, target, path, getattr(node, "lineno", 0), deferred, type_checking,
                              isinstance(node, (ast.Import, ast.ImportFrom))))
    return found


def imports_of(module: str, path: Path, known: set[str]) -> set[str]:
    """The hpctrain modules ``module`` imports, at any depth, TYPE_CHECKING blocks included."""
    return {edge.imported for edge in edges_of(module, path, known)}


def _nearest_module(name: str, known: set[str]) -> str:
    while name not in known and "." in name:
        name = name.rsplit(".", 1)[0]
    return name


def all_edges(root: Path = ROOT) -> list[Edge]:
    modules = module_names(root)
    return [edge for name, path in modules.items() for edge in edges_of(name, path, set(modules))]


def import_graph(root: Path = ROOT) -> Graph:
    modules = module_names(root)
    return {name: imports_of(name, path, set(modules)) for name, path in modules.items()}


def strongly_connected(graph: Graph) -> list[list[str]]:
    """Tarjan's algorithm: the strongly connected components, each sorted. Recursive: the
    depth is at most the number of modules, far below Python's limit."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    components: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        for child in sorted(graph.get(node, ())):
            if child not in index:
                visit(child)
                low[node] = min(low[node], low[child])
            elif child in stack:
                low[node] = min(low[node], index[child])
        if low[node] == index[node]:
            split = stack.index(node)
            components.append(sorted(stack[split:]))
            del stack[split:]

    for start in sorted(graph):
        if start not in index:
            visit(start)
    return components


def cycle_in(graph: Graph, component: list[str]) -> list[str]:
    """One concrete loop through a strongly connected component, for the failure message."""
    members = set(component)
    start = component[0]
    paths = {start: [start]}
    frontier = [start]
    while frontier:  # breadth first: the shortest way back to the start
        nxt = []
        for node in frontier:
            for child in sorted(graph[node] & members):
                if child == start:
                    return paths[node] + [start]
                if child not in paths:
                    paths[child] = paths[node] + [child]
                    nxt.append(child)
        frontier = nxt
    return component


def cycles(graph: Graph) -> list[list[str]]:
    """One loop through each strongly connected component of more than one module."""
    return [cycle_in(graph, c) for c in strongly_connected(graph) if len(c) > 1]


def _describe(graph: Graph, component: list[str]) -> str:
    loop = cycle_in(graph, component)
    rest = sorted(set(component) - set(loop))
    return " -> ".join(loop) + (f"\n    (and through it: {', '.join(rest)})" if rest else "")


def test_the_graph_sees_what_python_sees() -> None:
    graph = import_graph()
    assert "hpctrain.launch.slurm" in graph["hpctrain.cli.launch"]  # in a function: `from hpctrain.launch import slurm`
    assert "hpctrain.core.errors" in graph["hpctrain.core.section"]
    assert "hpctrain.core.env" in graph["hpctrain"]  # a lazy export
    assert "hpctrain.cli.estimate" in graph["hpctrain.cli"]  # the command table
    # `from hpctrain.checkpoint import layout` is the submodule, not the package's __init__,
    # so a package exporting from its submodules is no cycle by itself
    assert "hpctrain.checkpoint.layout" in graph["hpctrain.cli.ckpt"]
    assert "hpctrain.checkpoint" not in graph["hpctrain.cli.ckpt"]
    assert "hpctrain.checkpoint.layout" in graph["hpctrain.checkpoint"]


def test_type_checking_imports_and_imports_in_functions_are_edges(tmp_path: Path) -> None:
    pkg = tmp_path / "hpctrain"
    pkg.mkdir()
    (pkg / "__init__.py").write_text('_EXPORTS = {"thing": "hpctrain.c"}\n')
    (pkg / "a.py").write_text("from hpctrain import b\n")
    (pkg / "b.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from hpctrain.a import X\n")
    (pkg / "c.py").write_text("def f():\n    from .a import thing\n")
    assert import_graph(pkg) == {"hpctrain": {"hpctrain.c"}, "hpctrain.a": {"hpctrain.b"}, "hpctrain.b": {"hpctrain.a"},
                                 "hpctrain.c": {"hpctrain.a"}}
    kinds = {(e.importer, e.imported): (e.line, e.deferred, e.type_checking) for e in all_edges(pkg)}
    assert kinds == {("hpctrain", "hpctrain.c"): (1, False, False), ("hpctrain.a", "hpctrain.b"): (1, False, False),
                     ("hpctrain.b", "hpctrain.a"): (3, False, True), ("hpctrain.c", "hpctrain.a"): (2, True, False)}
    assert cycles(import_graph(pkg)) == [["hpctrain.a", "hpctrain.b", "hpctrain.a"]]


def test_tarjan_finds_a_loop_and_names_it() -> None:
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert cycles(graph) == [["a", "b", "c", "a"]]


def test_no_import_cycles() -> None:
    graph = import_graph()
    found = [_describe(graph, c) for c in strongly_connected(graph) if len(c) > 1]
    assert not found, "import cycles (one loop of each):\n" + "\n".join(found)


# ---------------------------------------------------------------- what a command imports


def importtime_tree(stderr: str) -> list[tuple[int, str]]:
    """``-X importtime`` lines as (depth, module), in the order imports finished: a module
    is listed before the one whose import triggered it, one indent level deeper."""
    found = []
    for line in stderr.splitlines():
        match = re.match(r"import time:\s+\d+ \|\s+\d+ \|( *)(\S+)$", line)
        if match:
            found.append((len(match.group(1)) // 2, match.group(2)))
    return found


def chain_to(tree: list[tuple[int, str]], wanted: str) -> list[str] | None:
    """Which import pulled ``wanted`` in: the outermost module first, ``wanted`` last."""
    for i, (depth, name) in enumerate(tree):
        if name == wanted:
            chain = [name]
            for later_depth, later in tree[i + 1:]:
                if later_depth < depth:
                    chain.insert(0, later)
                    depth = later_depth
            return chain
    return None


def imports_of_command(argv: list[str], cwd: Path | None = None) -> list[tuple[int, str]]:
    """What ``hpctrain ARGV`` imports, as :func:`importtime_tree` reads it; the command must succeed."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTHON")}
    proc = subprocess.run([sys.executable, "-X", "importtime", "-m", "hpctrain", *argv], capture_output=True,
                          text=True, timeout=300, cwd=cwd, env=env)
    assert proc.returncode == 0, f"hpctrain {' '.join(argv)} failed ({proc.returncode}):\n{proc.stderr[-3000:]}"
    return importtime_tree(proc.stderr)


def _committed_checkpoint(run: Path) -> Path:
    step = run / "checkpoints" / "step-000000007"
    step.mkdir(parents=True)
    (step / "manifest.json").write_text('{"files": {}, "step": 7, "epoch": 0, "world_size": 2}')
    return run


COMMANDS = {
    "help": ["--help"],
    "config show": ["config", "show", "data.batch_size=8"],
    "config doc": ["config", "doc"],
    "estimate by params": ["estimate", "--params", "7B", "--tokens", "1T", "--gpus", "64", "--strategy", "zero3"],
    "estimate by shape": ["estimate", "--layers", "32", "--hidden", "4096", "--heads", "32", "--seq-len", "4096",
                          "--vocab", "32000", "--tokens", "1T", "--gpus", "64", "--tp", "2", "--json"],
    "slurm dry run": ["slurm", "--dry-run", "--nodes", "2", "--time", "01:00:00", "--gpus-per-node", "4",
                                   "data.name=synthetic_tiny", "run.dir=runs/x"],
    "ckpt list": ["ckpt", "list", "RUN"],
}


@pytest.mark.parametrize("argv", list(COMMANDS.values()), ids=list(COMMANDS))
def test_commands_that_need_no_torch_import_none(argv: list[str], tmp_path: Path) -> None:
    run = _committed_checkpoint(tmp_path / "run")
    argv = [str(run) if a == "RUN" else a for a in argv]
    tree = imports_of_command(argv, cwd=tmp_path)
    for heavy in ("torch", "numpy"):
        chain = chain_to(tree, heavy)
        assert chain is None, f"hpctrain {' '.join(argv)} imports {heavy}: {' -> '.join(chain)}"


def test_importtime_chain_names_who_pulled_a_module_in() -> None:
    stderr = "\n".join([
        "import time: self [us] | cumulative | imported package",
        "import time:        10 |         10 |       torch._C",
        "import time:        20 |         30 |     torch",
        "import time:         5 |         35 |   hpctrain.optim",
        "import time:         1 |          1 |   hpctrain.core.section",
        "import time:         2 |         38 | hpctrain.config",
    ])
    assert chain_to(importtime_tree(stderr), "torch") == ["hpctrain.config", "hpctrain.optim", "torch"]
    assert chain_to(importtime_tree(stderr), "numpy") is None


# ---------------------------------------------------------------- lazy exports


def _type_checking_names(path: Path) -> dict[str, str]:
    """``{name: module}`` of a module's ``if TYPE_CHECKING:`` imports."""
    names = {}
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.If) and _is_type_checking(node.test):
            for imp in node.body:
                if isinstance(imp, ast.ImportFrom):
                    names |= {alias.asname or alias.name: imp.module or "" for alias in imp.names}
    return names


def test_the_package_exports_what_type_checkers_see() -> None:
    """hpctrain's names load on first use (``_EXPORTS``); the TYPE_CHECKING imports that give
    them their types must name the same modules, and every name must resolve."""
    assert _type_checking_names(ROOT / "__init__.py") == hpctrain._EXPORTS
    assert set(hpctrain.__all__) == set(hpctrain._EXPORTS)
    for name in hpctrain.__all__:
        assert getattr(hpctrain, name) is getattr(sys.modules[hpctrain._EXPORTS[name]], name)
    with pytest.raises(AttributeError, match="no_such_name"):
        hpctrain.no_such_name  # noqa: B018


def test_subpackages_stay_attributes_of_a_bare_import() -> None:
    """``import hpctrain`` used to load (and so bind) most subpackages; they still resolve."""
    code = "import hpctrain; hpctrain.core.env.detect(); hpctrain.estimate.lookup('h100')"
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


@pytest.mark.parametrize("package", ["hpctrain.checkpoint", "hpctrain.models"])
def test_lazy_packages_resolve_every_exported_name(package: str) -> None:
    module = importlib.import_module(package)
    for name in module.__all__:
        assert getattr(module, name) is not None
    with pytest.raises(AttributeError, match="no_such_name"):
        module.no_such_name  # noqa: B018
