"""DeepSpeed's ZeRO-3 leaf-module flags (`set_z3_leaf_modules`, used for MoE blocks).

DeepSpeed gathers a leaf module's parameters once for its whole forward instead of
submodule by submodule, so ranks routing to different experts of an MoE block gather the
same parameters. fzero's stage 3 gathers by unit (`fzero.partition`): the engine reads
the flag (`_z3_leaf`, as DeepSpeed's) through `fzero.partition.leaf_modules` and puts a
leaf's parameters in one unit where its usual unit (the first numbered block: a
Transformers MoE layer already holds its experts) is smaller. Flag before the engine is
built, as with DeepSpeed.
"""

from __future__ import annotations

from torch import nn

__all__ = [
    "get_z3_leaf_modules",
    "set_z3_leaf_module",
    "set_z3_leaf_modules",
    "unset_z3_leaf_modules",
    "z3_leaf_module",
    "z3_leaf_parameter",
]


def z3_leaf_module(model: nn.Module) -> bool:
    """Whether `model` is flagged as a ZeRO-3 leaf."""
    return bool(getattr(model, "_z3_leaf", False))


def z3_leaf_parameter(model: nn.Parameter) -> bool:
    """Whether a parameter belongs to a leaf module (DeepSpeed's attribute test)."""
    return hasattr(model, "ds_z3_leaf_module")


def get_z3_leaf_modules(model: nn.Module) -> list[nn.Module]:
    """The submodules of `model` flagged as leaves."""
    return [module for module in model.modules() if z3_leaf_module(module)]


def set_z3_leaf_module(model: nn.Module, flag: bool) -> None:
    model._z3_leaf = flag


def _set(
    model: nn.Module,
    leaf_module_classes: list[type] | list[str],
    flag: bool,
    raise_if_not_found: bool,
) -> list[nn.Module]:
    def matches(module: nn.Module) -> bool:
        cls = type(module)
        for wanted in leaf_module_classes:
            if isinstance(wanted, str):
                if wanted in (cls.__name__, f"{cls.__module__}.{cls.__qualname__}"):
                    return True
            elif isinstance(module, wanted):
                return True
        return False

    found = [module for module in model.modules() if matches(module)]
    for module in found:
        set_z3_leaf_module(module, flag)
    if not found and raise_if_not_found:
        raise ValueError(f"no module of {leaf_module_classes} found in {type(model).__name__}")
    return found


def set_z3_leaf_modules(
    model: nn.Module, leaf_module_classes: list[type] | list[str], raise_if_not_found: bool = True
) -> list[nn.Module]:
    """Flag every submodule of the given classes (types, class names or qualified names)."""
    return _set(model, leaf_module_classes, True, raise_if_not_found)


def unset_z3_leaf_modules(
    model: nn.Module, leaf_module_classes: list[type] | list[str], raise_if_not_found: bool = True
) -> list[nn.Module]:
    """Clear the flag of every submodule of the given classes."""
    return _set(model, leaf_module_classes, False, raise_if_not_found)
