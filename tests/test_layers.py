"""The layers, enforced: every hpctrain module belongs to one layer, and no import goes up.

Lowest first (docs/architecture.md draws them):

1. ``core``: ``hpctrain/core/`` (errors, config fields, environment, cache, run lock, safe
   unpickling, atomic writes, the run directory, the launcher <-> rank protocol, safe opens),
   ``hpctrain/config/`` and ``hpctrain/_version.py``.
2. ``components``: ``models``, ``data``, ``precision``, ``optim``, ``tasks``, ``telemetry``,
   ``checkpoint``, ``weights``, ``evaluation``. They may import each other, but their packages
   form no cycle.
3. ``parallel``: the strategies, the mesh, tensor and pipeline parallel.
4. ``planning``: ``planning/`` (the run layout, ``parallel.strategy=auto``) and ``estimate/``.
5. ``application``: ``train.py``, ``cli/``, ``launch/``, the package's ``__init__`` and ``__main__``.

Every edge counts: module level, deferred (inside a function) and ``if TYPE_CHECKING:``
imports, and a string naming a module (a lazy export, a ``-m`` target); the graph is
:mod:`tests.test_imports`' (which also checks that no two modules import each other, through
any chain). A module outside the table fails until it is placed in a layer.

**Deferred imports say why.** An hpctrain import inside a function exists only to keep torch
(or an optional dependency, or the user's code) off a process that does not need it, a login
node above all, and says so: its own line, or the comment line directly above its group of
consecutive import statements, or any line of that group, holds a comment naming the reason,
one of :data:`REASONS` (case-insensitive: ``torch``, ``login``, ``optional``, ``user code``,
``user's code``). Any other deferred import belongs at the top of the module (a loop it would
close is a layering bug to fix, not to hide).

Each failure is one line: the file and line, the importer, the imported module and their layers.
"""

from __future__ import annotations

import ast
import io
import re
import tokenize
from collections.abc import Iterable
from pathlib import Path

from tests.test_imports import ROOT, Edge, all_edges, module_names, strongly_connected

ORDER = ("core", "components", "parallel", "planning", "application")
# module or package (and everything below it) -> layer; the longest name wins
LAYERS = {
    "hpctrain.core": "core", "hpctrain.config": "core", "hpctrain._version": "core",
    "hpctrain.models": "components", "hpctrain.data": "components", "hpctrain.precision": "components",
    "hpctrain.optim": "components", "hpctrain.tasks": "components", "hpctrain.telemetry": "components",
    "hpctrain.checkpoint": "components", "hpctrain.weights": "components", "hpctrain.evaluation": "components",
    "hpctrain.parallel": "parallel",
    "hpctrain.planning": "planning", "hpctrain.estimate": "planning",
    "hpctrain.train": "application", "hpctrain.cli": "application", "hpctrain.launch": "application",
    "hpctrain.__main__": "application",
}
PACKAGE_ROOT_LAYER = "application"  # hpctrain/__init__.py: the lazy public API names every layer
REASONS = re.compile(r"torch|login|optional|user code|user's code", re.IGNORECASE)


def layer_of(module: str, layers: dict[str, str] = LAYERS) -> str | None:
    """The layer of a dotted module name: its own entry, else its nearest package's; None if unplaced."""
    if module == "hpctrain":
        return PACKAGE_ROOT_LAYER
    name = module
    while name != "hpctrain":
        if name in layers:
            return layers[name]
        name = name.rsplit(".", 1)[0]
    return None


def component_package(module: str) -> str:
    """``hpctrain.checkpoint.layout`` -> ``hpctrain.checkpoint``; ``hpctrain.optim`` stays."""
    return ".".join(module.split(".")[:2])


def _rank(module: str) -> int:
    layer = layer_of(module)
    return ORDER.index(layer) if layer is not None else -1


def _line(edge: Edge, what: str) -> str:
    return (f"{edge.where}: {edge.importer} ({layer_of(edge.importer)}) {what} {edge.imported} "
            f"({layer_of(edge.imported)})")


def _unique(lines: Iterable[str]) -> list[str]:
    return list(dict.fromkeys(lines))


def unplaced(modules: Iterable[str]) -> list[str]:
    return [f"{name}: in no layer; hint: add it (or its package) to tests/test_layers.py LAYERS"
            for name in sorted(modules) if layer_of(name) is None]


def upward(edges: Iterable[Edge]) -> list[str]:
    """Each import of a module in a higher layer than the importer's."""
    return _unique(_line(edge, "imports higher") for edge in edges
            if layer_of(edge.importer) is not None and layer_of(edge.imported) is not None
            and _rank(edge.imported) > _rank(edge.importer))


def component_cycles(edges: Iterable[Edge]) -> list[str]:
    """The packages of the components layer that import each other (through any chain), each
    with the imports that close the loop."""
    edges = [e for e in edges if layer_of(e.importer) == layer_of(e.imported) == "components"
             and component_package(e.importer) != component_package(e.imported)]
    graph: dict[str, set[str]] = {}
    for edge in edges:
        graph.setdefault(component_package(edge.importer), set()).add(component_package(edge.imported))
    found = []
    for group in strongly_connected(graph):
        if len(group) > 1:
            members = set(group)
            found += [_line(e, "imports (a package cycle: " + ", ".join(group) + ")") for e in edges
                      if component_package(e.importer) in members and component_package(e.imported) in members]
    return _unique(found)


def _only_re_exports(tree: ast.Module) -> bool:
    """A module whose body is its docstring, imports, ``__all__`` and ``sys.modules[...] = ...``:
    an alias of another module's names."""
    def plumbing(node: ast.stmt) -> bool:
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            return True
        if isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant):
            return True  # the docstring
        if isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            return all(isinstance(t, ast.Subscript) or (isinstance(t, ast.Name) and t.id == "__all__")
                       for t in targets)
        return False
    return bool(tree.body) and all(plumbing(node) for node in tree.body)


def alias_modules(root: Path) -> list[str]:
    """Each module (not a package's ``__init__``) that only re-exports another's names."""
    return sorted(f"{path}: only re-exports names defined elsewhere; hint: import them from where they live"
                  for path in root.rglob("*.py")
                  if path.name != "__init__.py" and _only_re_exports(ast.parse(path.read_text())))


def _comments(path: Path) -> dict[int, str]:
    """Line number -> the comment on it."""
    tokens = tokenize.generate_tokens(io.StringIO(path.read_text()).readline)
    return {tok.start[0]: tok.string for tok in tokens if tok.type == tokenize.COMMENT}


def _import_group(lines: list[str], line: int) -> range:
    """The lines of the run of consecutive import statements (one per line) around ``line``."""
    def is_import(n: int) -> bool:
        return 1 <= n <= len(lines) and re.match(r"\s*(from \S+ )?import ", lines[n - 1]) is not None
    first = last = line
    while is_import(first - 1):
        first -= 1
    while is_import(last + 1):
        last += 1
    return range(first, last + 1)


def unexplained_deferred(edges: Iterable[Edge]) -> list[str]:
    """Each deferred import statement whose group carries no reason (see the module's docstring)."""
    found, cache = [], {}
    for edge in edges:
        if not (edge.deferred and edge.statement) or edge.type_checking:
            continue
        if edge.path not in cache:
            cache[edge.path] = (edge.path.read_text().splitlines(), _comments(edge.path))
        lines, comments = cache[edge.path]
        group = _import_group(lines, edge.line)
        said = [comments.get(n, "") for n in (group.start - 1, *group)]
        if not any(REASONS.search(text) for text in said):
            found.append(_line(edge, "defers, without a reason comment, its import of"))
    return sorted(set(found))


# ---------------------------------------------------------------- the checks on hpctrain itself


def test_every_module_has_a_layer() -> None:
    missing = unplaced(module_names())
    assert not missing, "\n".join(missing)


def test_no_module_imports_a_higher_layer() -> None:
    found = upward(all_edges())
    assert not found, f"{len(found)} imports go up a layer:\n" + "\n".join(found)


def test_the_components_packages_form_no_cycle() -> None:
    found = component_cycles(all_edges())
    assert not found, "\n".join(found)


def test_no_module_is_an_alias_of_another() -> None:
    found = alias_modules(ROOT / "hpctrain")
    assert not found, "\n".join(found)


def test_every_deferred_import_says_why() -> None:
    found = unexplained_deferred(all_edges())
    assert not found, f"{len(found)} deferred imports give no reason:\n" + "\n".join(found)


# ---------------------------------------------------------------- the checker on a made-up package


def _package(tmp_path: Path, files: dict[str, str]) -> Path:
    root = tmp_path / "hpctrain"
    for name, text in {"__init__.py": "", **files}.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text)
    return root


def test_the_checks_name_each_offence_on_one_line(tmp_path: Path) -> None:
    root = _package(tmp_path, {
        "core/__init__.py": "", "core/x.py": "def f():\n    from hpctrain.tasks import t  # keeps torch off\n",
        "tasks/__init__.py": "", "tasks/t.py": "from hpctrain.evaluation import e\nX = e\n",
        "evaluation/__init__.py": "", "evaluation/e.py": "def g():\n    from hpctrain.tasks import t\n",
        "newfolder/__init__.py": "",
        "core/y.py": '"""Moved."""\nimport sys\nfrom hpctrain.core import x\nsys.modules["y"] = x\n',
    })
    edges = all_edges(root)
    assert unplaced(module_names(root)) == [
        "hpctrain.newfolder: in no layer; hint: add it (or its package) to tests/test_layers.py LAYERS"]
    at = str(tmp_path / "hpctrain")
    assert upward(edges) == [f"{at}/core/x.py:2: hpctrain.core.x (core) imports higher hpctrain.tasks.t (components)"]
    assert component_cycles(edges) == [
        f"{at}/evaluation/e.py:2: hpctrain.evaluation.e (components) imports (a package cycle: hpctrain.evaluation, "
        "hpctrain.tasks) hpctrain.tasks.t (components)",
        f"{at}/tasks/t.py:1: hpctrain.tasks.t (components) imports (a package cycle: hpctrain.evaluation, "
        "hpctrain.tasks) hpctrain.evaluation.e (components)"]
    assert alias_modules(root) == [f"{at}/core/y.py: only re-exports names defined elsewhere; hint: import them "
                                   "from where they live"]
    assert unexplained_deferred(edges) == [
        f"{at}/evaluation/e.py:2: hpctrain.evaluation.e (components) defers, without a reason comment, its import "
        "of hpctrain.tasks.t (components)"]


def test_a_reason_covers_its_group_of_imports(tmp_path: Path) -> None:
    root = _package(tmp_path, {"a.py": "", "b.py": "", "c.py": "", "d.py": "", "m.py": (
        "def f():\n"
        "    # torch: only when called\n"
        "    from hpctrain import a\n"
        "    from hpctrain import b\n"
        "\n"
        "    from hpctrain import c\n"
        "def g():\n"
        "    from hpctrain import d  # the user's code\n")})
    found = unexplained_deferred(all_edges(root))
    assert [line.split(": ")[0].rsplit("/", 1)[1] for line in found] == ["m.py:6"]


def test_the_layer_table_places_packages_and_modules() -> None:
    assert layer_of("hpctrain.core.protocol") == "core"
    assert layer_of("hpctrain.config.train") == "core"
    assert layer_of("hpctrain.checkpoint.layout") == "components"
    assert layer_of("hpctrain.precision") == "components"
    assert layer_of("hpctrain.parallel.fsdp") == "parallel"
    assert layer_of("hpctrain.estimate.flops") == "planning"
    assert layer_of("hpctrain") == "application"
    assert layer_of("hpctrain.cli.ckpt") == "application"
    assert layer_of("hpctrain.somethingnew.x") is None
    assert component_package("hpctrain.checkpoint.layout") == "hpctrain.checkpoint"
    assert ROOT.name == "hpctrain"
