"""Training as functions, part three: `eval_step` runs a function of the full
parameters over a `TrainState` without changing it (stage 3: the units gathered as
`train_step` gathers them, optionally kept gathered across calls for generation)."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import Tensor

from fzero import comm
from fzero.config import Config
from fzero.core.donation import adopt_memory, check_state
from fzero.core.gather import Placeholders, StateShards
from fzero.core.gathering import GatherSettings
from fzero.core.groups import check_same_plan
from fzero.core.init import config_for_plan
from fzero.core.layout import gather_pieces
from fzero.core.precision import precision_of, run_plan
from fzero.core.state import TrainState
from fzero.partition import Plan

__all__ = ["eval_step"]


def eval_step(
    fn: Callable[[dict[str, Tensor], Any], Any],
    plan: Plan,
    config: Config | Mapping[str, Any] | str | None = None,
) -> Callable[[TrainState, Any], Any]:
    """`evaluate(state, batch) -> fn(params, batch)` under `torch.no_grad()`, with
    `params` as `train_step` gives them (stage 3: units gathered while used, at most
    `stage3_max_live_parameters` elements at once). The state is read, not changed or
    donated. Collective at stage 3 (every rank evaluates).

    With `stage3_eval_live_parameters` (config), up to that many elements of gathered
    units stay gathered from one call to the next on the same state (generation calls
    `evaluate` once per token): each unit is gathered once, not once per call. A call
    with another state (a step returns a new one) drops them first."""
    cfg = config_for_plan(config, plan)
    plan, _ = run_plan(
        plan, cfg, precision_of(cfg), door="fzero.eval_step"
    )  # the state may say more
    check_same_plan(plan, "fzero.eval_step")
    zero = cfg.zero_optimization
    max_live, keep = int(zero.stage3_max_live_parameters), int(zero.stage3_eval_live_parameters)
    kept = _Kept()

    entry = "first" if plan.stage == 3 else "never"  # collective at stage 3 only

    def evaluate(state: TrainState, batch: Any) -> Any:
        where = f"eval_step (after micro-step {state.counters.micro_steps})"
        with comm.named_operation(where, entry=entry):
            return _evaluate(state, batch)

    def _evaluate(state: TrainState, batch: Any) -> Any:
        check_state(state, adopt_memory(plan, state.plan), "eval_step")
        device = state.units[0].grad.device if state.units else torch.device("cpu")
        dtype = next(  # the parameters', or the master's where it serves as them
            (u.params.dtype if u.params is not None else u.master.dtype for u in state.units),
            torch.float32,
        )
        gatherer = None
        if plan.stage == 3:
            gatherer = kept.gatherer_for(state, keep)
            if gatherer is None:
                gatherer = Placeholders(
                    plan,
                    StateShards(state.units),
                    dtype=dtype,
                    device=device,
                    settings=GatherSettings(
                        max_live=max_live, quantized=zero.zero_quantized_weights
                    ),
                )
            gatherer.placeholders.clear()
        params: dict[str, Tensor] = {}
        for index, unit in enumerate(plan.units):
            for pl in unit.placements:
                shape = plan.manifest[pl.fqn].shape
                if gatherer is None or plan.stage_of(unit) < 3:
                    params[pl.fqn] = gather_pieces(state.units[index].params, pl, shape)
                else:
                    params[pl.fqn] = torch.empty_strided(
                        shape, (0,) * len(shape), dtype=dtype, device=device
                    )
                    gatherer.placeholders[id(params[pl.fqn])] = (index, pl, shape)
        active = gatherer.active() if gatherer is not None else contextlib.nullcontext()
        try:
            with torch.no_grad(), active:
                return fn(params, batch)
        finally:
            if gatherer is not None:
                kept.keep(state, gatherer, keep)

    return evaluate


class _Kept:
    """The gathered units `eval_step` keeps between calls on one state (see there)."""

    def __init__(self) -> None:
        self.state: TrainState | None = None
        self.gatherer: Placeholders | None = None

    def gatherer_for(self, state: TrainState, keep: int) -> Placeholders | None:
        """The kept gatherer when `state` is the one it gathered from, else None (and
        whatever was kept is dropped: another state's parameters)."""
        if keep > 0 and self.gatherer is not None and self.state is state:
            return self.gatherer
        if self.gatherer is not None:
            self.gatherer.release_all()
        self.state = self.gatherer = None
        return None

    def keep(self, state: TrainState, gatherer: Placeholders, keep: int) -> None:
        """After a call: release the least recently used units down to `keep` elements."""
        while gatherer.live and gatherer.live_numel > keep:
            gatherer.release(next(iter(gatherer.live)))
        gatherer.placeholders.clear()
        self.state, self.gatherer = (state, gatherer) if keep > 0 else (None, None)
