"""kvflow's imports point down only, and no two modules import each other, however indirectly.

Every import statement of every module under kvflow/ counts: at the top, inside functions, under
`if TYPE_CHECKING:`. A function-local import still makes the importer depend on the imported; it only
hides the dependency from a reader of the file's head. The layers, top first, are the README's ("Layout").
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "kvflow"

# One entry per layer, top first; a module may import its own layer's modules and any layer below.
LAYERS: list[set[str]] = [
    {"__main__", "cli", "launch", "bench"},  # what a user runs: the commands, the launcher of agent CLIs, the benchmarks
    {"server"},  # the HTTP APIs
    {"llm", "cli_options"},  # the Python API; the engine options every command shares
    {"machine"},  # the machine's limits (probe, rooflines): shown by the server's page and the benchmarks
    {"engine", "spec"},  # the request life cycle; speculation's draft sources are the engine's
    {"executors"},  # how a step runs: plans, loads and prepares a model, picks the kernels
    {"distributed"},  # tensor parallelism: the process group, the shards, the step channel
    {"loader"},  # reads files into weights
    {"models"},  # one file per family
    {"layers"},  # norm, rotary, attention backends, quantized linears, sampler
    {"sampling_params", "structured"},  # what a request asks for, grammars included
    {"kernels"},  # C++ kernels and their bindings
    {"config", "errors", "outputs", "rope_scaling"},  # plain data every layer passes around
]
RANK = {name: rank for rank, names in enumerate(LAYERS) for name in names}


def module_name(path: Path, root: Path = PACKAGE) -> str:
    parts = ["kvflow", *path.relative_to(root).with_suffix("").parts]
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def all_modules(root: Path = PACKAGE) -> dict[str, Path]:
    return {module_name(p, root): p for p in sorted(root.rglob("*.py"))}


def _owner(name: str, modules: dict[str, Path]) -> str | None:
    """The module a dotted name lives in (`kvflow.a.b.Thing` -> `kvflow.a.b`), None outside kvflow."""
    while name and name not in modules:
        name = name.rpartition(".")[0]
    return name or None


def imports_of(name: str, path: Path, modules: dict[str, Path]) -> Iterator[tuple[str, int]]:
    """(imported kvflow module, line) for every import statement in the file, wherever it stands."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: from .x import y
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([node.module] if node.module else []))
            # `from kvflow.a import b` imports the module kvflow.a.b when there is one, else a name of kvflow.a
            targets = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base for alias in node.names]
        else:
            continue
        for target in targets:
            owner = _owner(target, modules) if target.split(".")[0] == "kvflow" else None
            if owner is not None and owner != name:
                yield owner, node.lineno


def import_graph(root: Path = PACKAGE) -> dict[str, dict[str, int]]:
    """module -> {module it imports: first line importing it}."""
    modules = all_modules(root)
    graph: dict[str, dict[str, int]] = {}
    for name, path in modules.items():
        edges = graph.setdefault(name, {})
        for target, line in imports_of(name, path, modules):
            edges[target] = min(line, edges.get(target, line))
    return graph


def layer_of(module: str) -> str:
    """`kvflow.engine.scheduler` -> `engine`, `kvflow.config` -> `config`; the root package is ``""``."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else ""


def upward_imports(graph: dict[str, dict[str, int]]) -> list[str]:
    found = []
    for module, edges in graph.items():
        for target, line in edges.items():
            # The root package is the top, and only re-exports the public names (LLM lazily): a module that
            # imports it wants kvflow's __version__ or SamplingParams, not a layer above its own.
            below, above = layer_of(module), layer_of(target)
            if "" not in (below, above) and RANK[below] > RANK[above]:
                found.append(f"{module}:{line} imports {target} ({below} is below {above})")
    return found


def import_circles(graph: dict[str, dict[str, int]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    circles = []
    for start in graph:
        if start in index:
            continue
        work = [(start, iter(graph[start]))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(graph.get(child, {}))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                parent = work[-1][0]
                low[parent] = min(low[parent], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    circles.append(sorted(component))
    return circles


def test_every_package_and_top_level_module_has_a_layer() -> None:
    unplaced = sorted({layer_of(m) for m in all_modules()} - set(RANK) - {""})
    assert not unplaced, f"place these in LAYERS (tests/test_layers.py) and the README's layout: {unplaced}"


def test_imports_point_down_only() -> None:
    upward = upward_imports(import_graph())
    assert not upward, "imports that point up:\n" + "\n".join(upward)


def test_no_import_circles() -> None:
    circles = import_circles(import_graph())
    assert not circles, f"modules that import each other (directly or through others): {circles}"


@pytest.fixture
def fake_package(tmp_path: Path) -> Path:
    root = tmp_path / "kvflow"
    for rel, text in {
        "__init__.py": "",
        "kernels/__init__.py": "",
        "kernels/paged.py": "def f():\n    from kvflow.layers import norm\n",  # up, inside a function
        "layers/__init__.py": "",
        "layers/norm.py": "from kvflow.kernels import paged\n",
        "server/__init__.py": "",
        "server/a.py": "from . import b\n",
        "server/b.py": "if True:\n    import kvflow.server.a\n",
    }.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text)
    return root


def test_the_checks_find_what_they_look_for(fake_package: Path) -> None:
    graph = import_graph(fake_package)
    assert graph["kvflow.kernels.paged"] == {"kvflow.layers.norm": 2}
    assert upward_imports(graph) == [
        "kvflow.kernels.paged:2 imports kvflow.layers.norm (kernels is below layers)"]
    assert sorted(import_circles(graph)) == [["kvflow.kernels.paged", "kvflow.layers.norm"],
                                             ["kvflow.server.a", "kvflow.server.b"]]
