"""The runtime's rules (docs/architecture.md), held by tests: parts take what they need,
never the whole engine typed `Any`; nothing is wired after construction; the one patch
of torch fzero makes lives exactly as long as an engine that needs it; the engine stays
thin."""

from __future__ import annotations

import ast
import gc
import weakref
from pathlib import Path

import pytest
import torch
from torch import nn

import fzero

ROOT = Path(__file__).resolve().parent.parent / "fzero"


def _sources() -> list[tuple[Path, ast.Module]]:
    return [(path, ast.parse(path.read_text())) for path in sorted(ROOT.rglob("*.py"))]


def test_no_part_takes_the_engine_typed_any():
    """A part names what it reads (a Protocol, explicit arguments): no `Engine = Any`
    alias and no parameter called `engine` or `owner` annotated `Any`."""
    found = []
    for path, tree in _sources():
        for node in ast.walk(tree):
            if isinstance(node, ast.Assign) and isinstance(node.value, ast.Name):
                names = [t.id for t in node.targets if isinstance(t, ast.Name)]
                if node.value.id == "Any" and "Engine" in names:
                    found.append(f"{path.name}:{node.lineno} Engine = Any")
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                for arg in (*node.args.args, *node.args.kwonlyargs):
                    typed_any = isinstance(arg.annotation, ast.Name) and arg.annotation.id == "Any"
                    if arg.arg in ("engine", "owner") and typed_any:
                        found.append(f"{path.name}:{node.lineno} {node.name}({arg.arg}: Any)")
    assert not found, found


def test_the_runtime_is_built_from_explicit_parts_and_never_rewired():
    """`build_runtime` returns a frozen record; no module assigns an attribute of another
    part after building it (the old `self.stage3.units = self.residency.units = ...`)."""
    from dataclasses import FrozenInstanceError

    engine = fzero.shard(nn.Linear(4, 3), stage=2)
    try:
        engine.runtime.units = []  # type: ignore[misc]
    except FrozenInstanceError:
        pass
    else:
        raise AssertionError("Runtime is not frozen")
    chained = []
    for path, tree in _sources():
        for node in ast.walk(tree):
            if isinstance(node, ast.Assign) and len(node.targets) > 1:
                owners = {ast.dump(t.value) for t in node.targets if isinstance(t, ast.Attribute)}
                if len(owners) > 1:  # one value set on two objects: a link patched in
                    chained.append(f"{path.name}:{node.lineno}")
    assert not chained, chained


def test_the_engine_class_stays_thin():
    tree = ast.parse((ROOT / "engine" / "_engine.py").read_text())
    engine = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "Engine")
    init = next(n for n in engine.body if isinstance(n, ast.FunctionDef) and n.name == "__init__")
    assert engine.end_lineno - engine.lineno + 1 <= 350
    assert init.end_lineno - init.lineno + 1 <= 40


def _patched() -> bool:
    return "__getattr__" in torch.Tensor.__dict__


def _stage3(seed: int) -> fzero.Engine:
    torch.manual_seed(seed)
    config = {"zero_optimization": {"stage3_param_persistence_threshold": 0}}
    return fzero.shard(nn.Sequential(nn.Linear(4, 8), nn.Linear(8, 2)), stage=3, config=config)


def test_the_tensor_patch_lives_only_while_a_stage3_engine_needs_it():
    """Re-created tensors answer `ds_*` as their stage-3 parameter (see
    `fzero.engine.zero3_attributes`) only while such an engine lives: installed by the
    first, removed by the last one's `destroy()`; a stage-2 engine never installs it."""
    gc.collect()  # engines of earlier tests in this process, dropped without destroy()
    assert not _patched()
    plain = fzero.shard(nn.Linear(4, 2), stage=2)
    assert not _patched()
    first, second = _stage3(0), _stage3(1)
    assert _patched()
    first.destroy()
    assert _patched()  # the second still needs it
    second.destroy()
    assert not _patched()
    plain.destroy()


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_a_dropped_engine_is_collected(stage):
    """Hooks torch keeps from C++ (parameter hooks) hold the engine weakly: an engine
    dropped without `destroy()` is freed with its buffers, not kept until exit; the
    last stage-3 one takes the ds_* answer with it."""
    config = {"zero_optimization": {"stage3_param_persistence_threshold": 0}}
    engine = fzero.shard(
        nn.Sequential(nn.Linear(4, 8), nn.Linear(8, 2)), stage=stage, config=config
    )
    engine.backward(engine(torch.randn(2, 4)).sum())
    engine.step()
    ref = weakref.ref(engine)
    del engine
    gc.collect()
    assert ref() is None
    assert not _patched()  # and with the last stage-3 engine, the ds_* answer


# Module-level state that changes while fzero runs: each entry says why it is process-wide.
MUTABLE_MODULE_STATE = {
    "_traffic.py": {
        "_traffic": "bytes and calls per collective: comm.traffic() is process-wide",
        "labels": "the names traffic is reported under, per group",
        "_mesh_groups": "mesh subgroups are created once per process group and reused",
        "_profiler": "the comms logger timing collectives, while one is configured",
    },
    "_watch.py": {
        "_active": "the watch of the default process group fzero started or adopted",
    },
    "checkpoint/_files.py": {"_HASHING": "one hashing thread per process"},
    "checkpoint/_save.py": {
        "_SAVES": "asynchronous saves in flight, by engine",
        "_WAIT_AT_EXIT": "saves the process waits for at exit",
    },
    "compat/accelerator.py": {"_ACCELERATOR": "DeepSpeed's get_accelerator() is a singleton"},
    "compat/checkpointing.py": {
        "_settings": "deepspeed.checkpointing.configure() is process-wide in DeepSpeed",
        "_timings": "its timers, as DeepSpeed's",
    },
    "core/donation.py": {"_DONATED": "states a step consumed, to refuse their reuse"},
    "core/gather.py": {"_RUNNING": "placeholders of the train_step running now (nested)"},
    "core/zero3_params.py": {
        "DESCRIBED": "parameters carrying ds_* attributes, partitioned or an engine's (weak)"
    },
    "engine/_reduction.py": {"_EXPLICIT": "engines inside backward(loss) now"},
    "engine/zero3_attributes.py": {"_ANSWERING": "engines needing the ds_* answer (weak)"},
    "native/_cuda.py": {"_state": "NVRTC, the driver and compiled modules, loaded once"},
}
_MUTATORS = {
    "append", "add", "clear", "update", "pop", "popitem", "setdefault", "extend", "insert",
    "remove", "discard", "appendleft", "popleft",
}  # fmt: skip


def _mutated_module_names(tree: ast.Module) -> set[str]:
    """Module-level names the module rebinds (`global`) or changes in place (a mutating
    method, an item or an attribute assigned or deleted)."""
    names = set()
    for node in tree.body:
        targets = node.targets if isinstance(node, ast.Assign) else []
        if isinstance(node, ast.AnnAssign) and node.value is not None:
            targets = [node.target]
        names.update(t.id for t in targets if isinstance(t, ast.Name))
    mutated = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Global):
            mutated.update(node.names)
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
            owner = node.func.value
            if isinstance(owner, ast.Name) and node.func.attr in _MUTATORS:
                mutated.add(owner.id)
        elif isinstance(node, ast.Assign | ast.AugAssign | ast.Delete):
            targets = node.target if isinstance(node, ast.AugAssign) else node.targets
            for target in targets if isinstance(targets, list) else [targets]:
                inner = target.value if isinstance(target, ast.Subscript | ast.Attribute) else None
                if isinstance(inner, ast.Name):
                    mutated.add(inner.id)
    return mutated & names


def test_module_level_state_is_only_what_the_allow_list_names():
    """No hidden process-wide state: a module-level name fzero changes at run time is in
    MUTABLE_MODULE_STATE with why it is process-wide (and the list holds nothing stale)."""
    found = {}
    for path in sorted(ROOT.rglob("*.py")):
        names = _mutated_module_names(ast.parse(path.read_text()))
        if names:
            found[path.relative_to(ROOT).as_posix()] = names
    allowed = {module: set(names) for module, names in MUTABLE_MODULE_STATE.items()}
    assert found == allowed
