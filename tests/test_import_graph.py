"""fzero's modules import one another in one direction only: no cycles, eager or lazy,
and the layers of docs/architecture.md ("Layers") point down.

Every `import fzero...` / `from fzero... import ...` in every module counts, including
those inside functions and under `TYPE_CHECKING`: a cycle hidden in a function is still
two modules that each need the other to be understood. Importing `a.b.c` runs
`a/b/__init__` too, so the graph has that edge as well (the package's `__init__` is what
pulls the rest of a layer in). Two edges are left out: to a package the importing module
sits in (Python has run its `__init__` already), and to the top-level `fzero`, the public
facade that imports every layer.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _modules(root: Path = ROOT) -> dict[str, Path]:
    found = {}
    for path in (root / "fzero").rglob("*.py"):
        parts = list(path.relative_to(root).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        found[".".join(parts)] = path
    return found


def _target(name: str, modules: dict[str, Path]) -> str | None:
    """The fzero module `name` refers to (a submodule if it is one, else its package)."""
    while name and name not in modules:
        name = name.rpartition(".")[0]
    return name or None


def _packages_run(target: str, importer: str, modules: dict[str, Path]) -> list[str]:
    """The package `__init__`s importing `target` runs, beyond those `importer` sits in
    (and the top-level facade)."""
    parts = target.split(".")
    parents = [".".join(parts[:i]) for i in range(2, len(parts))]
    return [
        p for p in parents if p in modules and not (importer == p or importer.startswith(p + "."))
    ]


def import_graph(root: Path = ROOT) -> dict[str, set[str]]:
    """Module -> the fzero modules it imports anywhere in its source, and the packages
    whose `__init__` those imports run."""
    modules = _modules(root)
    graph: dict[str, set[str]] = {name: set() for name in modules}
    for name, path in modules.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        for node in ast.walk(ast.parse(path.read_text())):
            targets: list[str] = []
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    anchor = package
                    for _ in range(node.level - 1):
                        anchor = anchor.rpartition(".")[0]
                    base = f"{anchor}.{base}" if base else anchor
                targets = [f"{base}.{alias.name}" for alias in node.names] + [base]
                # `from fzero import comm` is fzero.comm; `from fzero.x import f` is fzero.x
                if any(t in modules for t in targets[:-1]):
                    targets = [t for t in targets[:-1] if t in modules]
                else:
                    targets = [base]
            for target in targets:
                if target.startswith("fzero"):
                    resolved = _target(target, modules)
                    if resolved and resolved != name:
                        graph[name].add(resolved)
                        graph[name].update(_packages_run(resolved, name, modules))
    return graph


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle, as the list of modules around it, or None."""
    state: dict[str, int] = {}  # 1 on the current path, 2 done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                return [*path[path.index(nxt) :], nxt]
            if nxt not in state and (found := visit(nxt)):
                return found
        path.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (found := visit(node)):
            return found
    return None


def test_the_import_graph_has_no_cycles():
    graph = import_graph()
    assert "fzero.engine" in graph and graph["fzero.engine.entry"]  # the walk found the package
    cycle = _cycle(graph)
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_the_cycle_finder_finds_a_cycle():
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": set()}) == ["a", "b", "c", "a"]
    assert _cycle({"a": {"b"}, "b": set()}) is None


def test_the_pure_layers_import_no_engine_or_io():
    graph = import_graph()
    for name, imports in graph.items():
        if name.startswith(("fzero.partition", "fzero.optim")):
            bad = {i for i in imports if not i.startswith(("fzero.partition", "fzero.optim"))}
            assert not bad, f"{name} imports {sorted(bad)}"


def _reachable(graph: dict[str, set[str]], start: str) -> set[str]:
    seen, todo = set(), [start]
    while todo:
        for nxt in graph[todo.pop()] - seen:
            seen.add(nxt)
            todo.append(nxt)
    return seen


def test_checkpoints_reach_no_engine_and_touch_no_private_engine_attribute():
    """The checkpoint package saves and restores a TrainState: nothing it imports, even
    indirectly, is the engine, and where it takes an engine (its wrappers) it reads only
    public attributes."""
    graph = import_graph()
    for name in (n for n in graph if n == "fzero.checkpoint" or n.startswith("fzero.checkpoint.")):
        engine = {m for m in _reachable(graph, name) if m.startswith("fzero.engine")}
        assert not engine, f"{name} reaches {sorted(engine)}"
    for path in (ROOT / "fzero" / "checkpoint").glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            name = getattr(getattr(node, "value", None), "id", None)
            if isinstance(node, ast.Attribute) and name == "engine":
                assert not node.attr.startswith("_"), f"{path.name}: engine.{node.attr}"


# The layer rule: a layer reaches only layers below it (docs/architecture.md, "Layers"); the pure
# layers (partition, optim) are held to their own test above.
_NOT_BELOW = {
    "fzero.core": ("fzero.engine", "fzero.compat", "fzero.checkpoint", "fzero.cli"),
    "fzero.checkpoint": ("fzero.engine", "fzero.compat", "fzero.cli"),
    "fzero.engine": ("fzero.compat", "fzero.cli"),
    "fzero.config": ("fzero.core", "fzero.engine", "fzero.compat", "fzero.checkpoint", "fzero.cli"),
}


def layer_violations(graph: dict[str, set[str]]) -> list[str]:
    """Each module that reaches, even through other modules and package `__init__`s, a
    layer its own must not: `module -> reached module`."""
    found = []
    for name in sorted(graph):
        for layer, banned in _NOT_BELOW.items():
            if name != layer and not name.startswith(layer + "."):
                continue
            for reached in sorted(_reachable(graph, name)):
                if reached.startswith(banned):
                    found.append(f"{name} -> {reached}")
    return found


def test_each_layer_reaches_only_the_layers_below_it():
    violations = layer_violations(import_graph())
    assert not violations, "layer rule broken:\n" + "\n".join(violations)


def _copy_tree(tmp_path: Path) -> Path:
    for path in (ROOT / "fzero").rglob("*.py"):
        target = tmp_path / path.relative_to(ROOT)
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(path.read_text())
    return tmp_path


def test_the_checks_catch_the_old_cycle_through_a_package_init(tmp_path):
    """Mutation check: plant the cycle fzero had (the functional core importing the
    engine's unit helpers, whose package `__init__` imports the engine, which imports the
    core back) as a lazy import in a copy of the tree; both checks must fail on it."""
    root = _copy_tree(tmp_path)
    assert _cycle(import_graph(root)) is None and not layer_violations(import_graph(root))
    init = root / "fzero" / "core" / "init.py"
    init.write_text(
        init.read_text() + "\n\ndef _planted():\n    from fzero.engine._build import build_units\n"
    )
    graph = import_graph(root)
    assert "fzero.engine" in graph["fzero.core.init"]  # the package edge
    cycle = _cycle(graph)
    assert cycle is not None and "fzero.engine" in cycle and "fzero.core.init" in cycle
    assert "fzero.core.init -> fzero.engine" in layer_violations(graph)


def test_the_layer_rule_catches_a_core_module_reaching_checkpoints(tmp_path):
    root = _copy_tree(tmp_path)
    layout = root / "fzero" / "core" / "layout.py"
    layout.write_text(layout.read_text() + "\n\nfrom fzero.checkpoint import CheckpointError\n")
    assert "fzero.core.layout -> fzero.checkpoint" in layer_violations(import_graph(root))


def _unit_record_fields() -> set[str]:
    """The fields of `UnitRuntime` (the engine's per-unit runtime record)."""
    source = (ROOT / "fzero" / "core" / "layout.py").read_text()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ClassDef) and node.name == "UnitRuntime":
            return {
                s.target.id
                for s in node.body
                if isinstance(s, ast.AnnAssign) and isinstance(s.target, ast.Name)
            }
    raise AssertionError("UnitRuntime not found in fzero/core/layout.py")


def record_writes(root: Path = ROOT) -> list[str]:
    """Assignments to a unit record's field (`rt.<field> = ...`, `setattr(rt, ...)`)
    outside `fzero/core`: `path:line rt.field`."""
    fields, found = _unit_record_fields(), []
    for path in sorted((root / "fzero").rglob("*.py")):
        if (root / "fzero" / "core") in path.parents:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            targets: list[ast.expr] = []
            if isinstance(node, ast.Assign):
                targets = [t for target in node.targets for t in _flat_targets(target)]
            elif isinstance(node, ast.AugAssign | ast.AnnAssign):
                targets = [node.target]
            elif (
                isinstance(node, ast.Call)
                and getattr(node.func, "id", None) == "setattr"
                and getattr(node.args[0], "id", None) == "rt"
            ):
                found.append(f"{path.relative_to(root)}:{node.lineno} setattr(rt, ...)")
            for t in targets:
                if (
                    isinstance(t, ast.Attribute)
                    and getattr(t.value, "id", None) == "rt"
                    and t.attr in fields
                ):
                    found.append(f"{path.relative_to(root)}:{node.lineno} rt.{t.attr}")
    return found


def _flat_targets(target: ast.expr) -> list[ast.expr]:
    if isinstance(target, ast.Tuple | ast.List):
        return [t for element in target.elts for t in _flat_targets(element)]
    return [target]


def test_only_the_core_writes_a_unit_record():
    """The engine and the checkpoint wrappers read each unit's runtime record
    (`fzero.core.layout.UnitRuntime`) and call the core to change it."""
    writes = record_writes()
    assert not writes, "unit records written outside fzero/core:\n" + "\n".join(writes)


def test_the_record_rule_catches_an_engine_write(tmp_path):
    root = _copy_tree(tmp_path)
    step = root / "fzero" / "engine" / "_step.py"
    step.write_text(step.read_text() + "\n\ndef _planted(rt):\n    rt.grad_on_disk, x = 1, 2\n")
    assert record_writes(root) == ["fzero/engine/_step.py:" + _last_line(step) + " rt.grad_on_disk"]


def _last_line(path: Path) -> str:
    return str(len(path.read_text().splitlines()))
