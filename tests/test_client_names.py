"""Every `deepspeed.*` name the DeepSpeed clients reference is served or refused by name.

The installed sources of Transformers, Accelerate, Lightning, TRL and PEFT are parsed
(`import deepspeed...`, `from deepspeed... import x`, and attribute chains on names
bound to `deepspeed` modules); each name found must resolve under
`fzero.compat.install()`, or fail with an error that says fzero does not support it
(an ImportError on import, or a NotImplementedError naming it when called). A client
upgrade that starts using a new DeepSpeed name fails here until fzero serves or refuses
it. `python -m tests.test_client_names` prints the table.
"""

from __future__ import annotations

import ast
import importlib
import importlib.util
from collections import defaultdict
from pathlib import Path
from typing import Any

import pytest

from fzero import compat

CLIENTS = ("transformers", "accelerate", "lightning", "pytorch_lightning", "trl", "peft")

# served names that refuse when called: the arguments, what the refusal must say
REFUSED_CALLS = {
    "deepspeed.tp_model_init": ((), "tensor parallelism"),
    "deepspeed.utils.zero_to_fp32.get_model_state_file": (("ckpt", 2), "hold no pickle"),
    "deepspeed.utils.zero_to_fp32.get_optim_files": (("ckpt",), "hold no pickle"),
}


def _names_in(tree: ast.AST) -> set[str]:
    found: set[str] = set()
    bound: dict[str, str] = {}  # local name -> deepspeed module path
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] == "deepspeed":
                    found.add(alias.name)
                    bound[alias.asname or "deepspeed"] = alias.name if alias.asname else "deepspeed"
        elif (
            isinstance(node, ast.ImportFrom)
            and node.level == 0
            and (node.module or "").split(".")[0] == "deepspeed"
        ):
            for alias in node.names:
                name = f"{node.module}.{alias.name}"
                found.add(name)
                bound[alias.asname or alias.name] = name
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute):
            chain = []
            value: ast.AST = node
            while isinstance(value, ast.Attribute):
                chain.append(value.attr)
                value = value.value
            if isinstance(value, ast.Name) and value.id in bound:
                found.add(".".join([bound[value.id], *reversed(chain)]))
    return found


def referenced_names() -> dict[str, set[str]]:
    """Each `deepspeed.*` name the installed clients reference, with who references it."""
    names: dict[str, set[str]] = defaultdict(set)
    for client in CLIENTS:
        spec = importlib.util.find_spec(client)
        if spec is None or spec.origin is None:
            continue
        for path in Path(spec.origin).parent.rglob("*.py"):
            try:
                text = path.read_text(encoding="utf-8")
                if "deepspeed" not in text:
                    continue
                tree = ast.parse(text)
            except (SyntaxError, UnicodeDecodeError):
                continue
            for name in _names_in(tree):
                names[name].add(client)
    return names


def resolve(name: str) -> tuple[str, str]:
    """("served", what) or ("refused", the error), with `import deepspeed` served."""
    parts = name.split(".")
    module, depth = None, len(parts)
    while depth:
        try:
            module = importlib.import_module(".".join(parts[:depth]))
            break
        except ImportError as error:
            if "not supported by fzero" in str(error):
                return "refused", str(error)
            if not isinstance(error, ModuleNotFoundError):
                raise
            depth -= 1
    obj: Any = module
    for attr in parts[depth:]:
        try:
            obj = getattr(obj, attr)
        except NotImplementedError as error:
            return "refused", str(error)
        except AttributeError:
            return "missing", f"{name}: no attribute {attr!r}"
    if name in REFUSED_CALLS:
        args, says = REFUSED_CALLS[name]
        try:
            obj(*args)
        except NotImplementedError as error:
            if says in str(error):
                return "refused", str(error)
            raise
        raise AssertionError(f"{name}() did not refuse")
    return "served", type(obj).__name__


@pytest.fixture
def served():
    was = compat.installed()
    compat.install()
    yield
    if not was:
        compat.uninstall()


def test_every_deepspeed_name_the_clients_reference_is_served_or_refused(served):
    names = referenced_names()
    if not names:
        pytest.skip("no DeepSpeed client installed")
    assert len(names) >= 20, sorted(names)  # the scan itself still finds them
    results = {name: resolve(name) for name in sorted(names)}
    missing = {n: (r, sorted(names[n])) for n, r in results.items() if r[0] == "missing"}
    assert not missing, missing
    for name, (verdict, detail) in results.items():
        if verdict == "refused":
            assert "fzero" in detail, (name, detail)


def test_the_scan_sees_imports_aliases_and_attribute_chains():
    tree = ast.parse(
        "import deepspeed\nfrom deepspeed.utils import groups as g\n"
        "deepspeed.zero.Init(); g._get_group(); import deepspeed.comm as dist; dist.get_rank()"
    )
    assert _names_in(tree) == {
        "deepspeed",
        "deepspeed.zero.Init",
        "deepspeed.zero",
        "deepspeed.utils.groups",
        "deepspeed.utils.groups._get_group",
        "deepspeed.comm",
        "deepspeed.comm.get_rank",
    }


def test_an_unknown_name_is_missing_and_a_refused_module_says_so(served):
    assert resolve("deepspeed.utils.no_such_helper")[0] == "missing"
    verdict, detail = resolve("deepspeed.pipe.PipelineModule")
    assert verdict == "refused" and "pipeline" in detail


if __name__ == "__main__":
    compat.install()
    for name, clients in sorted(referenced_names().items()):
        verdict, detail = resolve(name)
        print(f"| `{name}` | {verdict} | {', '.join(sorted(clients))} |")
