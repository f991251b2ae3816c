"""What a functional step takes: the checks a `TrainState` passes before `train_step` or
`eval_step` runs over it, and donation.

`train_step` *donates* its input state (as `jax.jit(..., donate_argnums=0)`): the state it
returns reuses the input's buffers, updated in place, so the input must not be stepped
again. `donate` remembers each state a step consumed and `check_state` refuses it after;
`check_state` also holds a state to the plan the step was made for (naming the
difference where only where it lives differs) and to a swap file that still holds a whole
step. `adopt_memory` lets a step take the plan of a state that `fzero.init` built with
more said of where its states live and in which dtype (`Plan.memory`).

Both doors of the functional core check here: `fzero.core.step` (`train_step`, which
donates) and `fzero.core.evaluate` (`eval_step`, which only reads).
"""

from __future__ import annotations

import dataclasses
import weakref

from fzero import partition
from fzero.core.state import TrainState
from fzero.partition import Plan

__all__ = ["adopt_memory", "check_state", "donate"]

_DONATED: dict[int, weakref.ref] = {}  # states a step has consumed, by id


def adopt_memory(plan: Plan, state_plan: Plan) -> Plan:
    """`state_plan` where it is `plan` with fields of `Plan.memory` that `plan` leaves at
    the defaults stated, else `plan` (`check_state` then names the difference)."""
    try:
        merged = partition.with_memory(plan, state_plan.memory, "the state's plan")
    except partition.PlanError:
        return plan
    return state_plan if merged == state_plan else plan


def check_state(state: TrainState, plan: Plan, where: str) -> None:
    """`state` is a TrainState of `plan`, not given to a step before (NVMe: its file
    holds a whole step)."""
    if not isinstance(state, TrainState):
        raise TypeError(f"{where}: state is a {type(state).__name__}; expected fzero.TrainState")
    if state.plan is not plan and state.plan != plan:
        said = ""
        if dataclasses.replace(state.plan, memory=plan.memory) == plan:  # only where it lives
            said = "".join(
                f"; state.plan.memory.{f.name} is {getattr(state.plan.memory, f.name)!r}, the "
                f"step's {getattr(plan.memory, f.name)!r}"
                for f in dataclasses.fields(plan.memory)
                if getattr(state.plan.memory, f.name) != getattr(plan.memory, f.name)
            )
            said += ": build the state (fzero.init) and the step with the same plan and config"
        raise ValueError(f"{where}: state.plan is not the plan this step was made for{said}")
    if state.residence is not None:
        state.residence.check_usable()
    seen = _DONATED.get(id(state))
    if seen is not None and seen() is state:
        raise ValueError(
            f"{where}: this TrainState (micro-step {state.counters.micro_steps}) was given to "
            "a step already, which updated its buffers in place: use the state that step "
            "returned (copy with tree_map_only(torch.Tensor, torch.clone, state) to keep one)"
        )


def donate(state: TrainState) -> None:
    """Remember that `state`'s buffers now belong to the state a step returned."""
    key = id(state)
    _DONATED[key] = weakref.ref(state, lambda _: _DONATED.pop(key, None))
