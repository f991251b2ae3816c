"""The optimizer object `fzero.initialize` returns (DeepSpeed returns its ZeRO optimizer).

Scripts written for DeepSpeed treat it as a `torch.optim.Optimizer`: they read and edit
`param_groups[i]["lr"]`, call `step()` and `zero_grad()` on it, save its `state_dict()`.
Here each of those acts on the engine: `param_groups` are the engine's live groups,
`step()` is `engine.step()`, and the state dict holds this rank's shards of the fp32
master weights and optimizer state (as DeepSpeed's ZeRO optimizer does), restorable
into an engine of the same plan. Checkpoints that reshard are `engine.save_checkpoint`.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, Protocol

import torch
from torch import Tensor

from fzero.core.layout import UnitRuntime
from fzero.core.publish import install_unit
from fzero.core.residency import Residency
from fzero.optim import Optimizer
from fzero.partition import Plan


class Engine(Protocol):
    """What the optimizer object reads of its engine (`fzero.engine.Engine`; this module
    sits below it)."""

    plan: Plan
    plan_rank: int
    stage: int
    units: list[UnitRuntime]
    residency: Residency
    functional_optimizer: Optimizer
    current_loss_scale: float

    @property
    def param_groups(self) -> list[dict[str, Any]]: ...

    def was_step_skipped(self) -> bool: ...

    def step(self) -> None: ...

    def zero_grad(self, set_to_none: bool = True) -> None: ...

    def publish_master(self, rt: UnitRuntime) -> None: ...

    def finish_publish(self) -> None: ...


__all__ = ["DeepSpeedOptimizer", "EngineOptimizer", "ZeROOptimizer"]


class DeepSpeedOptimizer:
    """DeepSpeed's marker base of its optimizer wrappers (`runtime.base_optimizer`):
    clients test `isinstance(x, DeepSpeedOptimizer)`."""


class ZeROOptimizer(DeepSpeedOptimizer):
    """DeepSpeed's marker base of its ZeRO optimizers."""


class EngineOptimizer(torch.optim.Optimizer, ZeROOptimizer):
    """A `torch.optim.Optimizer` view of an engine's optimizer: an instance of the class
    (so torch's LR schedulers accept it, as DeepSpeed's basic optimizer is one), with
    every method acting on the engine. `torch.optim.Optimizer.__init__` is not run: the
    parameters and their state live in the engine's shards, not here."""

    def __init__(self, engine: Engine) -> None:  # no super().__init__: see the docstring
        self._engine = engine
        self.state: dict[Any, Any] = {}  # per-parameter state is the engine's (state_dict)

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        """The engine's live param groups: an edited `lr` is the next step's lr."""
        return self._engine.param_groups

    @property
    def defaults(self) -> dict[str, Any]:
        hparams = self._engine.functional_optimizer.hparams
        return {name: getattr(hparams, name) for name in hparams.__dataclass_fields__}

    @property
    def loss_scale(self) -> float:
        return self._engine.current_loss_scale

    cur_scale = loss_scale

    @property
    def overflow(self) -> bool:
        """Whether fp16 overflow skipped the last step (DeepSpeed's `optimizer.overflow`)."""
        return self._engine.was_step_skipped()

    def step(self, closure: Callable[[], Any] | None = None) -> None:
        """`engine.step()`: the update at the accumulation boundary."""
        if closure is not None:
            raise ValueError("fzero's optimizer step takes no closure (the engine ran backward)")
        self._engine.step()

    def zero_grad(self, set_to_none: bool = True) -> None:
        self._engine.zero_grad(set_to_none)

    def state_dict(self) -> dict[str, Any]:
        """This rank's shards: per unit the fp32 master, the optimizer state tensors and
        its step; the param groups without their params; the plan's rank/world/stage."""
        engine = self._engine
        state: dict[int, dict[str, Any]] = {}
        for rt in engine.units:
            with engine.residency.resident(rt, write_back=False):
                tensors = {"master": rt.master, **_state_tensors(rt.state)}
                state[rt.index] = {k: v.detach().clone() for k, v in tensors.items()}
                state[rt.index]["step"] = rt.state.step
        return {
            "state": state,
            "param_groups": [
                {k: v for k, v in g.items() if k != "params"} for g in engine.param_groups
            ],
            "zero": {
                "rank": engine.plan_rank,
                "world_size": engine.plan.world_size,
                "stage": engine.stage,
                "units": len(engine.units),
            },
        }

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Restore `state_dict()` of an engine with the same plan on the same rank; the
        module's parameters follow the restored master weights. Collective."""
        engine = self._engine
        zero = state_dict.get("zero", {})
        here = {
            "rank": engine.plan_rank,
            "world_size": engine.plan.world_size,
            "stage": engine.stage,
            "units": len(engine.units),
        }
        if dict(zero) != here:
            raise ValueError(
                f"optimizer state_dict is of {dict(zero)}, this engine is {here}; an optimizer "
                "state dict holds one rank's shards: load_checkpoint reshards between plans"
            )
        for rt in engine.units:
            saved = state_dict["state"][rt.index]
            with engine.residency.resident(rt, write_back=True):
                install_unit(rt, saved)
                engine.publish_master(rt)
        engine.finish_publish()
        for group, saved in zip(engine.param_groups, state_dict["param_groups"]):
            group.update({k: v for k, v in saved.items() if k != "params"})

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Refused: the engine's param groups are fixed when it is built (its plan holds
        every parameter)."""
        raise NotImplementedError(
            "EngineOptimizer.add_param_group: fzero's engine plans its parameters when it is "
            "built; pass every group in model_parameters=[{'params': ...}, ...] to "
            "fzero.initialize (edit a group's lr or weight_decay in param_groups instead)"
        )

    def __repr__(self) -> str:
        name = self._engine.functional_optimizer.name
        return f"EngineOptimizer({name}, groups={len(self.param_groups)})"


def _no_hooks(name: str) -> Callable[..., Any]:
    def refuse(self: EngineOptimizer, *args: Any, **kwargs: Any) -> Any:
        raise NotImplementedError(
            f"EngineOptimizer.{name}: the engine's optimizer runs no torch.optim hooks; wrap "
            "engine.step() (or hook the module) to run code around a step"
        )

    refuse.__name__ = name
    refuse.__doc__ = "Refused: the engine's optimizer runs no torch.optim hooks."
    return refuse


for _hook in (
    "register_step_pre_hook",
    "register_step_post_hook",
    "register_state_dict_pre_hook",
    "register_state_dict_post_hook",
    "register_load_state_dict_pre_hook",
    "register_load_state_dict_post_hook",
):
    setattr(EngineOptimizer, _hook, _no_hooks(_hook))


def _state_tensors(state: Any) -> dict[str, Tensor]:
    return {k: v for k, v in state._asdict().items() if isinstance(v, Tensor)}
