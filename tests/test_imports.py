"""The import graph of the ``leanfa`` package is acyclic, and every module imports on its own.

The graph is read from the source with :mod:`ast`: every ``import``/``from ... import`` of a
leanfa module, at module level and inside functions alike (a lazy import is still a
dependency), relative imports resolved. ``from P import name`` is an edge to ``P.name`` when
that is a module, else to ``P``. The names ``leanfa/__init__.py`` loads on first use
(``_EXPORTS``, through :func:`importlib.import_module`) are edges of ``leanfa`` too. Imports
under ``if TYPE_CHECKING:`` are left out (they never run). A package's ``__init__`` running
before its submodules is not an edge (that is how every package imports).
"""

from __future__ import annotations

import ast
import os
import subprocess
import sys
from graphlib import CycleError, TopologicalSorter
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "leanfa"


def _modules() -> dict[str, Path]:
    """Dotted name → file of every module of the package."""
    found = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = list(path.relative_to(ROOT).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        found[".".join(parts)] = path
    return found


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _import_nodes(tree: ast.AST):
    """Every Import/ImportFrom node, at any depth, except under ``if TYPE_CHECKING:``."""
    stack = [tree]
    while stack:
        node = stack.pop()
        if isinstance(node, ast.If) and _is_type_checking(node.test):
            stack.extend(node.orelse)
            continue
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            yield node
        stack.extend(ast.iter_child_nodes(node))


def _deepest_module(dotted: str, modules) -> str | None:
    parts = dotted.split(".")
    while parts:
        name = ".".join(parts)
        if name in modules:
            return name
        parts.pop()
    return None


def import_graph() -> dict[str, set[str]]:
    """Module → the leanfa modules it imports (module-level and function-level)."""
    modules = _modules()
    graph: dict[str, set[str]] = {name: set() for name in modules}
    for name, path in modules.items():
        tree = ast.parse(path.read_text(), filename=str(path))
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        for node in _import_nodes(tree):
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            else:
                if node.level:
                    base = package.split(".")
                    base = base[:len(base) - (node.level - 1)]
                    source = ".".join(base + ([node.module] if node.module else []))
                else:
                    source = node.module or ""
                targets = [f"{source}.{alias.name}" if f"{source}.{alias.name}" in modules else source
                           for alias in node.names]
            for target in targets:
                if target.split(".")[0] != "leanfa":
                    continue
                resolved = _deepest_module(target, modules)
                assert resolved is not None, f"{name} imports {target}, which is not a leanfa module"
                if resolved != name:
                    graph[name].add(resolved)
        if name == "leanfa":  # the lazily loaded public names
            for node in ast.walk(tree):
                if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "_EXPORTS" for t in node.targets):
                    graph[name].update(f"leanfa.{m}" for m in ast.literal_eval(node.value).values())
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    try:
        tuple(TopologicalSorter(graph).static_order())
    except CycleError as e:
        return list(e.args[1])
    return None


def knots(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan)."""
    index, low, on_stack, stack, sccs = {}, {}, set(), [], []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            scc = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                scc.append(w)
                if w == v:
                    break
            if len(scc) > 1:
                sccs.append(sorted(scc))

    sys.setrecursionlimit(max(sys.getrecursionlimit(), 10_000))
    for v in sorted(graph):
        if v not in index:
            visit(v)
    return sccs


def describe(graph: dict[str, set[str]]) -> str:
    """For each knot: one cycle through it, then every import edge inside it."""
    lines = []
    for scc in knots(graph):
        inside = {v: graph[v] & set(scc) for v in scc}
        lines.append(f"{len(scc)} modules; a cycle: " + " -> ".join(find_cycle(inside)))
        lines += [f"    {v} -> {w}" for v in scc for w in sorted(inside[v])]
    return "\n".join(lines)


def test_graph_sees_function_level_and_relative_imports():
    graph = import_graph()
    # module level, relative two levels up
    assert "leanfa.kernels.launcher" in graph["leanfa.kernels.hopper.plan_cache"]
    # function level (dispatch loads the Hopper package on first use)
    assert "leanfa.kernels.hopper" in graph["leanfa.kernels.dispatch"]
    # the public names leanfa/__init__ loads on first use
    assert "leanfa.api" in graph["leanfa"]


def test_finder_reports_a_cycle():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": set()}) is not None
    assert knots({"a": {"b"}, "b": {"a"}, "c": {"d"}, "d": {"c"}, "e": set()}) == [["a", "b"], ["c", "d"]]
    assert knots({"a": {"b"}, "b": {"c"}, "c": set()}) == []
    assert find_cycle({"a": {"b"}, "b": set()}) is None


def test_import_graph_is_acyclic():
    graph = import_graph()
    assert not knots(graph), "import cycles in leanfa:\n" + describe(graph)


#: the layers of docs/design.md §3.2, lowest first: a module imports only modules of its own
#: layer or of lower ones (and the first layer imports no leanfa module at all)
LAYERS = (
    ("foundation", ("leanfa.problem", "leanfa.scales", "leanfa.hadamard", "leanfa._versions", "leanfa.activations")),
    ("kernels", ("leanfa.kernels",)),
    ("host", ("leanfa.checks", "leanfa.quant")),
    ("ops", ("leanfa.ops", "leanfa.sink_split")),
    ("api", ("leanfa.api",)),
    ("analysis", ("leanfa.reference", "leanfa.accuracy_model")),
    ("front ends", ("leanfa", "leanfa.flash_attn_interface", "leanfa.compat", "leanfa.integrations", "leanfa.cli",
                    "leanfa.bench", "leanfa.distributed")),
)


def layer_of(module: str) -> int:
    """The layer of a module: the most specific entry of LAYERS that names it or a package above it."""
    best = None
    for rank, (_, names) in enumerate(LAYERS):
        for name in names:
            if module == name or module.startswith(name + "."):
                if best is None or len(name) > best[1]:
                    best = (rank, len(name))
    assert best is not None, f"{module} is in no layer of LAYERS: place it (and in docs/design.md §3.2)"
    return best[0]


def test_layers_import_only_downward():
    graph = import_graph()
    upward = [f"{a} ({LAYERS[layer_of(a)][0]}) -> {b} ({LAYERS[layer_of(b)][0]})"
              for a in sorted(graph) for b in sorted(graph[a]) if layer_of(b) > layer_of(a)]
    assert not upward, "imports from a lower layer to a higher one:\n" + "\n".join(upward)
    foundation = [f"{a} -> {b}" for a in sorted(graph) for b in sorted(graph[a]) if layer_of(a) == 0]
    assert not foundation, "the foundation layer imports leanfa modules:\n" + "\n".join(foundation)


def test_layer_table_places_each_module():
    assert layer_of("leanfa.kernels.varlen_v") == 1
    assert layer_of("leanfa.bench.commands") == layer_of("leanfa") == len(LAYERS) - 1
    assert layer_of("leanfa.quant") > layer_of("leanfa.kernels.quantize")


def test_every_module_imports_in_dependency_order():
    order = list(TopologicalSorter(import_graph()).static_order())
    script = ("import importlib, sys\n"
              f"for name in {order!r}:\n"
              "    try:\n"
              "        importlib.import_module(name)\n"
              "    except Exception as e:\n"
              "        sys.exit(f'{name}: {type(e).__name__}: {e}')\n")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    env.setdefault("TRITON_INTERPRET", "1")
    done = subprocess.run([sys.executable, "-c", script], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0, done.stdout + done.stderr
