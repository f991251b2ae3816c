"""Training as functions, part two: `train_step` makes the step `(state, batch) -> (state,
metrics)` over a `TrainState` that `fzero.init` built.

```python
plan = fzero.partition.plan(fzero.partition.describe(model), world_size=W, stage=3)
optimizer = fzero.optim.adamw(lr=1e-3)
state = fzero.init(model, plan, optimizer)

def loss_fn(params, batch):                      # params: fqn -> full tensor
    x, y = batch
    return F.cross_entropy(torch.func.functional_call(model, params, (x,)), y)

step = fzero.train_step(loss_fn, plan, optimizer, config={"gradient_clipping": 1.0})
state, metrics = step(state, batch)
```

The step runs what the engine runs: the plan's layout and reductions (`fzero.partition`,
`fzero.core.layout`), the update's rules and native kernels (`fzero.core.update`: fp16
overflow, global norm, clipping, the in-place update), and stage 3's per-unit gathering
(`fzero.core.gather`). Gradients come from autograd over `loss_fn` or from a `grad_fn`
built with any torch.func transform. The step *donates* its input state (as
`jax.jit(..., donate_argnums=0)`): the returned state reuses its buffers, and passing the
old state again is an error (`fzero.core.donation`) — ZeRO's memory promise does not
survive a second copy of the model state. Copy first
(`tree_map_only(torch.Tensor, torch.clone, state)`) to keep one.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import torch
from torch import Tensor

from fzero import comm, partition
from fzero.config import Config, accumulation_steps
from fzero.core.apply import OptimizerApplication, StepClock
from fzero.core.donation import adopt_memory, check_state, donate
from fzero.core.gather import Placeholders, StateShards, placeholder
from fzero.core.gathering import GatherSettings, UseTrace
from fzero.core.groups import check_same_plan, groups_of
from fzero.core.init import check_optimizer, config_for_plan, optimizer_of, schedule_of
from fzero.core.layout import UnitRuntime, gather_pieces
from fzero.core.precision import gradient_wire_dtype, loss_scaler, precision_of, run_plan
from fzero.core.publish import attach_params, runtime_of, views
from fzero.core.reduce import Reduction, any_rank, reduce_to_optimizer_shards
from fzero.core.reduce_pieces import reduction_piece
from fzero.core.residency import Residency
from fzero.core.state import Counters, TrainState, UnitState, owned_grad, partition_numel
from fzero.core.swap_units import SwapFileUnits
from fzero.core.update import decide_step, grad_stats, skips_nonfinite
from fzero.optim import Optimizer, adamw
from fzero.partition import Placement, Plan

__all__ = ["train_step"]

LossFn = Callable[[dict[str, Tensor], Any], Any]
GradFn = Callable[[dict[str, Tensor], Any], tuple[Tensor, Mapping[str, Tensor]]]


# ---- the step ------------------------------------------------------------------------------


def train_step(
    loss_fn: LossFn | None = None,
    plan: Plan | None = None,
    optimizer: Optimizer | None = None,
    config: Config | Mapping[str, Any] | str | None = None,
    *,
    grad_fn: GradFn | None = None,
    schedule: Callable[[int, float], float] | None = None,
    has_aux: bool = False,
    join: bool = False,
) -> Callable[[TrainState, Any], tuple[TrainState, dict[str, Any]]]:
    """The step `(state, batch) -> (state, metrics)` of one micro-batch on this rank.

    - `loss_fn(params, batch) -> loss` (or `(loss, aux)` with `has_aux`): `params` maps
      each trained parameter's name to its full tensor; call the model with
      `torch.func.functional_call(model, params, args)`. Floating inputs are not cast:
      with bf16/fp16 cast them to the parameters' dtype. At stage 3 the tensors are
      placeholders whose unit is gathered when an operation uses them, and at most
      `stage3_max_live_parameters` elements stay gathered. As in the engine, the first
      call records the order units are used in; later calls prefetch along it
      (`stage3_prefetch_bucket_size`) and keep a unit gathered from forward into
      backward when backward uses it again within `stage3_max_reuse_distance` elements
      (else backward gathers it again). A `torch.compile`d `loss_fn` gets whole
      parameters instead: every unit is gathered for the call (as with `grad_fn`), since
      the per-operation swap would break its graph at every operation.
    - `grad_fn(params, batch) -> (loss, grads)` instead: gradients of the full parameters
      by any torch.func transform (`vmap(grad(...))` for per-sample gradients); `grads`
      maps names to gradients of `loss` (missing names count as zero). At stage 3 every
      unit is gathered while `grad_fn` runs: the whole model's compute-dtype parameters
      at once, released when it returns. fp16 needs `loss_fn` (the loss scale applies to
      a backward fzero runs).

    Gradients are averaged over ranks as the plan says (stages 0-1 at the accumulation
    boundary, 2-3 per micro-batch into shards); every `gradient_accumulation_steps`-th
    call is a boundary, where an fp16 overflow or gradients that are not finite skip
    (`fzero.core.update.skips_nonfinite`), `gradient_clipping` clips and the
    optimizer updates. `config` is a DeepSpeed config (dict, JSON path or `Config`);
    `optimizer` defaults to its `optimizer` block, else AdamW's defaults (as `fzero.shard`);
    `schedule(step, base_lr)` to its `scheduler` block. `metrics`: `loss`, `stepped`,
    `skipped`, `grad_norm` (None off a boundary), `lr`, `loss_scale`,
    `gathered_peak_numel` and `gathers` (stage 3: unit all-gathers this call), `aux`.

    With `join=True` (uneven inputs, DDP's `Join`), each call first agrees with the other
    ranks that this one still trains (one element all-reduced), and a rank out of data
    calls `state = step.join(state)`, which serves the others' micro-steps with zero
    gradients until every rank has joined. At stage 3 the others' forward and backward
    gather parameters, so a rank that has joined runs `loss_fn` again on the last batch
    it trained on, its loss weighted 0: the same gathers in the same order (a model whose
    program does not depend on its data), no contribution.
    """
    if (loss_fn is None) == (grad_fn is None):
        raise TypeError("train_step takes exactly one of loss_fn and grad_fn")
    if plan is None:
        raise TypeError("train_step needs the plan the state was built with (plan=...)")
    plan = partition.validate(plan)
    cfg = config_for_plan(config, plan)
    plan, _ = run_plan(plan, cfg, precision_of(cfg), door="fzero.train_step")  # (`_take`)
    check_same_plan(plan, "fzero.train_step")
    optimizer = optimizer_of(cfg, optimizer, default=adamw())
    check_optimizer(optimizer)
    schedule = schedule_of(cfg, schedule)
    runner = _Step(loss_fn, grad_fn, plan, optimizer, cfg, schedule, has_aux, join)
    return runner


class _Step:
    """`train_step`'s result: a callable holding what the caller passed in, and what it
    keeps between calls: the stage-3 use trace (`UseTrace`), the reduction buckets and
    the update's host buffer pools (`application`)."""

    def __init__(
        self,
        loss_fn: LossFn | None,
        grad_fn: GradFn | None,
        plan: Plan,
        optimizer: Optimizer,
        config: Config,
        schedule: Callable[[int, float], float] | None,
        has_aux: bool,
        join: bool = False,
    ) -> None:
        self.loss_fn, self.grad_fn, self.plan = loss_fn, grad_fn, plan
        self.optimizer, self.config, self.schedule, self.has_aux = (
            optimizer,
            config,
            schedule,
            has_aux,
        )
        self.accumulation = accumulation_steps(config, plan.processes)
        self.uneven = join  # each call first says this rank still trains (`join`)
        self.last_batch: Any = None  # stage 3 with `join`: what `join` runs again
        self.trace = UseTrace()  # stage 3: the order units are used in, from the first call
        bucket_numel = int(config.zero_optimization.reduce_bucket_size)
        self.buckets = partition.reduction_buckets(plan, bucket_numel)
        self.piece = reduction_piece(plan, bucket_numel)
        self._applications: dict[Any, OptimizerApplication] = {}
        self._records: list[UnitRuntime] = []  # the update's, over the last state's buffers

    def application(
        self, state: TrainState, dtype: torch.dtype, device: torch.device
    ) -> OptimizerApplication:
        """The core's update over `state`'s units (the engine's too): through its swap file
        with NVMe offload, else through host buffers of this step's own."""
        swap = state.residence.residency if isinstance(state.residence, SwapFileUnits) else None
        swapped = any(self.plan.optimizer_memory(u) == "nvme" for u in self.plan.units)
        if swapped != (swap is not None):
            held = "in a swap file" if swap is not None else "in memory"
            raise ValueError(
                f"train_step: the plan keeps {'some' if swapped else 'no'} unit's optimizer "
                f"on 'nvme' but the state's optimizer partitions are {held}: build the "
                "state (fzero.init) and the step with the same plan and config"
            )
        key = (id(swap), dtype, device)
        if key not in self._applications:
            self._applications.clear()  # one at a time: a pool of host buffers each
            residency = swap or Residency(
                self.config,
                self.plan,
                rank=state.rank,
                optimizer=self.optimizer,
                partition_numel=functools.partial(partition_numel, self.plan, rank=state.rank),
            )
            self._applications[key] = OptimizerApplication(
                self.plan,
                state.rank,
                optimizer=self.optimizer,
                schedule=self.schedule,
                residency=residency,
                compute_dtype=dtype,
                device=device,
            )
        return self._applications[key]

    def records(self, state: TrainState) -> list[UnitRuntime]:
        """The runtime records the update runs over `state`'s units: the swap file's own
        (NVMe: they hold each unit's current slot), else records over the state's buffers,
        made when a state with other buffers arrives and kept while the states passed in
        are the ones this step returned (their buffers are updated in place): no record
        is made per step."""
        optimizer, plan = self.optimizer, state.plan
        if isinstance(state.residence, SwapFileUnits):
            records = state.residence.units
            for rt, u in zip(records, state.units):
                rt.grad, rt.hparams = u.grad, optimizer.hparams
                if not state.residence.holds(rt.index):  # a unit the plan keeps in memory
                    rt.master, rt.state = u.master, u.optim
                attach_params(plan, rt, u)
            return records
        if not (
            len(self._records) == len(state.units)
            and all(views(rt, u) for rt, u in zip(self._records, state.units))
        ):
            self._records = [runtime_of(plan, i, u) for i, u in enumerate(state.units)]
        for rt in self._records:
            rt.hparams = optimizer.hparams
        return self._records

    def _operation(self, state: TrainState, name: str = "train_step") -> Any:
        """The named operation of one micro-step (`comm.named_operation`), its collectives
        checked against the last micro-step's at the same place in the window."""
        boundary = (state.counters.micro_steps + 1) % self.accumulation == 0
        track = f"train_step|grad={torch.is_grad_enabled()}|boundary={boundary}"
        return comm.named_operation(f"{name} (micro-step {state.counters.micro_steps})", track)

    def __call__(self, state: TrainState, batch: Any) -> tuple[TrainState, dict[str, Any]]:
        with self._operation(state):
            if self.uneven:
                any_rank(True, self.plan.processes, _STILL_TRAINING, _device(state))
                if self.plan.stage == 3:
                    self.last_batch = batch
            return self._call(state, batch)

    def join(self, state: TrainState) -> TrainState:
        """Uneven inputs (`train_step(..., join=True)`, DDP's `Join`): this rank is out of
        data. It takes part in the other ranks' micro-steps with zero gradients (their
        reductions and, at boundaries, their updates) until every rank has called
        `join`, and returns the state after the last of them: what a run where this
        rank adds nothing from here gives (gradients still averaged over the world)."""
        if not self.uneven:
            raise ValueError("step.join(state) needs the step built with train_step(join=True)")
        while True:  # each of the others' micro-steps is one here, checked as theirs
            with self._operation(state, "train_step.join"):
                if not any_rank(False, self.plan.processes, _STILL_TRAINING, _device(state)):
                    return state
                state = self._shadow(state)

    def _shadow(self, state: TrainState) -> TrainState:
        """A micro-step of the others, with no batch here (zero gradients; stage 3: the
        last batch again, weighted 0, for the others' gathers)."""
        self._take(state)
        run = _Micro(self, state)
        if self.plan.stage == 3:
            if self.last_batch is None:
                raise ValueError(
                    "step.join(state) at stage 3 runs loss_fn again on this rank's last "
                    "batch to serve the others' gathers, but this rank ran no step yet"
                )
            run.weight = 0.0
            with _rng(state.rng):  # drawn from and put back: this rank adds nothing
                run.gradients(self.last_batch)
        else:
            run.reduction.finish()
        counters = state.counters._replace(micro_steps=state.counters.micro_steps + 1)
        metrics: dict[str, Any] = {"lr": self._lrs(counters.lr_steps)}
        units, loss_scale = state.units, state.loss_scale
        if counters.micro_steps % self.accumulation == 0:
            counters, loss_scale, units = run.boundary(counters, metrics)
        new = state.replace(units=units, counters=counters, loss_scale=loss_scale)
        donate(state)
        return new

    def _call(self, state: TrainState, batch: Any) -> tuple[TrainState, dict[str, Any]]:
        self._take(state)
        # NVMe: a step whose I/O fails on any rank is rolled back on every rank (commit
        # two_slots) and raises OSError; the gradients are put back as they were before
        # the call too, so the state is as before it and the same call may be run again
        boundary = (state.counters.micro_steps + 1) % self.accumulation == 0
        kept = None
        if state.residence is not None and boundary:
            kept = [u.grad.clone() for u in state.units]
        try:
            return self._run(state, batch)
        except OSError:
            for u, grad in zip(state.units, kept or ()):
                u.grad.copy_(grad)
            raise

    def _run(self, state: TrainState, batch: Any) -> tuple[TrainState, dict[str, Any]]:
        run = _Micro(self, state)
        with _rng(state.rng) as rng:
            loss, aux = run.gradients(batch)
            new_rng = rng()
        counters = state.counters._replace(micro_steps=state.counters.micro_steps + 1)
        metrics: dict[str, Any] = {
            "loss": loss.detach(),
            "stepped": False,
            "skipped": False,
            "grad_norm": None,
            "lr": self._lrs(counters.lr_steps),
            "loss_scale": state.loss_scale.scale if state.loss_scale else 1.0,
        }
        if run.gatherer is not None:
            metrics["gathered_peak_numel"] = run.gatherer.peak_numel
            metrics["gathers"] = run.gatherer.gathers
        if self.has_aux:
            metrics["aux"] = aux
        loss_scale, units = state.loss_scale, state.units
        if counters.micro_steps % self.accumulation == 0:
            counters, loss_scale, units = run.boundary(counters, metrics)
        new = state.replace(units=units, counters=counters, loss_scale=loss_scale, rng=new_rng)
        donate(state)
        return new, metrics

    def _take(self, state: TrainState) -> None:
        """Check `state` fits this step and was not given to a step before. A state whose
        plan says more of where its states live and their dtypes than the step's (what
        `fzero.init`'s `precision` said) is the step's plan from then on."""
        if state.plan is not self.plan and isinstance(state, TrainState):
            self.plan = adopt_memory(self.plan, state.plan)
        check_state(state, self.plan, "train_step")

    def _lrs(self, lr_steps: int) -> list[float]:
        base = self.optimizer.hparams.lr
        if self.schedule is None:
            return [base]
        return [self.schedule(lr_steps, base)]


@contextlib.contextmanager
def _rng(state: Tensor | None) -> Iterator[Callable[[], Tensor | None]]:
    """Draw from `state` inside the block (the process generator is left as it was);
    yields a function returning the generator's state after the draws."""
    if state is None:
        yield lambda: None
        return
    with torch.random.fork_rng(devices=[]):
        torch.set_rng_state(state)
        yield torch.get_rng_state


class _Micro:
    """One call of the step: gradients of one micro-batch, and at a boundary the update."""

    def __init__(self, step: _Step, state: TrainState) -> None:
        self.step, self.state, self.plan = step, state, step.plan
        self.rank, self.world = state.rank, self.plan.world_size
        self.weight = 1.0  # of this micro-batch's loss (0: `join`'s stage-3 replay)
        self.device = _device(state)
        # the compute dtype: the parameters', or the master's where it serves as them
        self.dtype = next(
            (u.params.dtype if u.params is not None else u.master.dtype for u in state.units),
            torch.float32,
        )
        self.gatherer: Placeholders | None = None
        self.releases = False  # whether a unit goes once its gradients are in
        if self.plan.stage == 3:
            zero = step.config.zero_optimization
            self.gatherer = Placeholders(
                self.plan,
                StateShards(state.units),
                dtype=self.dtype,
                device=self.device,
                settings=GatherSettings(
                    max_live=int(zero.stage3_max_live_parameters),
                    prefetch_numel=int(zero.stage3_prefetch_bucket_size),
                    max_reuse=int(zero.stage3_max_reuse_distance),
                    quantized=zero.zero_quantized_weights,
                ),
                trace=step.trace,
            )
        # reductions: bucket by bucket in launch order (`fzero.core.reduce`), stages 0-1
        # only in the micro-step that ends an accumulation window
        at_boundary = (state.counters.micro_steps + 1) % step.accumulation == 0
        units = state.units
        self.reduction = Reduction(
            self.plan,
            self.rank,
            step.buckets,
            sizes=[len(unit.placements) for unit in self.plan.units],
            accumulator=lambda i: units[i].grad,
            keep=lambda i, part, at: units[i].grad[at : at + part.numel()].add_(part),
            device=self.device,
            quantized=self.plan.stage >= 2
            and step.config.zero_optimization.zero_quantized_gradients,
            bits=step.config.zero_optimization.zero_quantized_gradients_bits,
            wire_dtype=gradient_wire_dtype(step.config),
            piece=step.piece,
        )
        self.reduction.begin(reduce=at_boundary)  # units at stages 2-3 reduce every pass

    # ---- gradients of the micro-batch ----

    def gradients(self, batch: Any) -> tuple[Tensor, Any]:
        if self.step.grad_fn is not None:
            return self._by_grad_fn(batch)
        if self.gatherer is None:
            return self._by_loss_fn(batch)
        with self.gatherer.running():
            return self._by_loss_fn(batch)

    def _by_loss_fn(self, batch: Any) -> tuple[Tensor, Any]:
        scale = self.state.loss_scale.scale if self.state.loss_scale else 1.0
        # a compiled loss_fn gets whole parameters: the per-operation swap of placeholders
        # and the saved-tensor hooks would break its graph at every operation
        whole = self.gatherer is not None and _compiled(self.step.loss_fn)
        leaves = self._leaves(whole)
        swap = self.gatherer is not None and not whole
        self.releases = swap
        context = self.gatherer.active() if swap else contextlib.nullcontext()
        with context, _transforms_named():
            out = self.step.loss_fn(dict(leaves), batch)
        loss, aux = out if self.step.has_aux else (out, None)
        _check_loss(loss)
        if swap:
            self.gatherer.end_forward()  # backward gathers again what it released
        hooks = [
            leaf.register_post_accumulate_grad_hook(self._on_grad(fqn))
            for fqn, leaf in leaves.items()
        ]
        try:
            (loss.float() * (scale * self.weight / self.step.accumulation)).backward()
        finally:
            for hook in hooks:
                hook.remove()
            if self.gatherer is not None:
                self.gatherer.end_step()
        self.reduction.finish()  # units this pass did not use reduce zeros
        return loss, aux

    def _leaves(self, whole: bool) -> dict[str, Tensor]:
        """What `loss_fn` gets: leaf views of whole units, or stage 3's placeholders
        (with `whole`, every unit gathered instead, for the whole call)."""
        leaves: dict[str, Tensor] = {}
        self.where: dict[str, tuple[int, Placement]] = {}
        if whole:
            assert self.gatherer is not None
            self.gatherer.widen(_numel(self.plan))
        for index, unit in enumerate(self.plan.units):
            params = self.state.units[index].params
            if whole and not self._whole(unit):
                params = self.gatherer.full(index)
            for pl in unit.placements:
                shape = self.plan.manifest[pl.fqn].shape
                self.where[pl.fqn] = (index, pl)
                if whole or self._whole(unit):
                    leaf = gather_pieces(params, pl, shape).detach().requires_grad_()
                else:
                    assert self.gatherer is not None
                    leaf = placeholder(shape, self.dtype, self.device)
                    self.gatherer.placeholders[id(leaf)] = (index, pl, shape)
                leaves[pl.fqn] = leaf
        return leaves

    def _whole(self, unit: partition.Unit) -> bool:
        return self.plan.stage_of(unit) < 3

    def _on_grad(self, fqn: str) -> Callable[[Tensor], None]:
        def hook(leaf: Tensor) -> None:
            assert leaf.grad is not None
            index, pl = self.where[fqn]
            grad, leaf.grad = leaf.grad, None
            # the unit's last gradient: autograd is done with its gathered buffer, which
            # goes before the bucket's buffer is made (as the engine's hooks do)
            complete = self.reduction.arrived(index, launch=False)
            if complete and self.releases:
                assert self.gatherer is not None
                self.gatherer.release(index)
            self.reduction.add(index, pl, grad)
            del grad
            if complete:
                self.reduction.launch_ready()

        return hook

    def _by_grad_fn(self, batch: Any) -> tuple[Tensor, Any]:
        if self.state.loss_scale is not None:
            raise ValueError("fp16 needs loss_fn (its loss scale applies to fzero's backward)")
        params: dict[str, Tensor] = {}
        self.where = {}
        for index, unit in enumerate(self.plan.units):
            for pl in unit.placements:
                shape = self.plan.manifest[pl.fqn].shape
                self.where[pl.fqn] = (index, pl)
                if self._whole(unit):
                    params[pl.fqn] = gather_pieces(self.state.units[index].params, pl, shape)
                else:
                    assert self.gatherer is not None
                    self.gatherer.widen(_numel(self.plan))
                    params[pl.fqn] = self.gatherer.tensor(index, pl, shape)
        params = {k: v.detach() for k, v in params.items()}
        out = self.step.grad_fn(params, batch)
        if self.gatherer is not None:
            self.gatherer.end_step()
        loss, grads = _check_grads(out, self.plan)
        for fqn, grad in grads.items():
            index, pl = self.where[fqn]
            self.reduction.add(index, pl, grad.detach() * (self.weight / self.step.accumulation))
        self.reduction.finish()
        return loss, None

    # ---- the update at an accumulation boundary ----

    def boundary(
        self, counters: Counters, metrics: dict[str, Any]
    ) -> tuple[Counters, Any, tuple[UnitState, ...]]:
        config, plan = self.step.config, self.plan  # gradients reduced in backward
        scaler = loss_scaler(config) if self.state.loss_scale is not None else None
        dynamic = scaler is not None and scaler.dynamic
        grads = [u.grad for u in self.state.units]
        wire = gradient_wire_dtype(config)
        whole = self.reduction.reduced_whole  # ZeRO-1 units all-reduced beside stage 0's
        reduce_to_optimizer_shards(plan, self.rank, grads, groups_of(plan), wire, whole)
        stats = [
            grad_stats(self._owned_grad(i), clipping=config.gradient_clipping, dynamic=dynamic)
            for i in range(len(plan.units))
        ]
        decision = decide_step(
            stats,
            loss_scaler=scaler,
            loss_scale=self.state.loss_scale,
            clipping=config.gradient_clipping,
            device=self.device,
            world_size=self.world,
            processes=plan.processes,
            group=groups_of(plan).shard,
            step=counters.global_steps + 1,
            skipped=counters.skipped_steps,
            check_finite=skips_nonfinite(config, plan.stage),
        )
        metrics.update(grad_norm=decision.norm, skipped=decision.skip, stepped=not decision.skip)
        if decision.loss_scale is not None:
            metrics["loss_scale"] = decision.loss_scale.scale
        counters = counters._replace(global_steps=counters.global_steps + 1)
        units = self.state.units
        if decision.skip:
            counters = counters._replace(skipped_steps=counters.skipped_steps + 1)
        else:
            clock = StepClock(counters.lr_steps, counters.global_steps)
            units = self._update(decision.factor, metrics["lr"][0], clock)
            counters = counters._replace(lr_steps=counters.lr_steps + 1)
        for u in units:
            u.grad.zero_()
        return counters, decision.loss_scale, units

    def _owned_grad(self, index: int) -> Tensor:
        unit = self.plan.units[index]
        return owned_grad(self.plan, unit, self.rank, self.state.units[index].grad)

    def _update(self, factor: float, lr: float, clock: StepClock) -> tuple[UnitState, ...]:
        """Every unit's optimizer update (in place, through the core's
        `OptimizerApplication` as the engine's) and new parameters; the new units."""
        state, plan = self.state, self.plan
        runtimes = self.step.records(state)
        groups = 1 + max((u.group for u in plan.units), default=0)
        self.step.application(state, self.dtype, self.device).apply(
            runtimes, factor, [{"lr": lr}] * groups, clock
        )
        return tuple(
            u._replace(master=rt.master, optim=rt.state) for u, rt in zip(state.units, runtimes)
        )


_STILL_TRAINING = "join: whether any rank still trains"


def _device(state: TrainState) -> torch.device:
    return state.units[0].grad.device if state.units else torch.device("cpu")


def _compiled(fn: Any) -> bool:
    """Whether `fn` is `torch.compile`'s (a compiled function or module)."""
    return hasattr(fn, "_torchdynamo_orig_callable") or isinstance(
        fn, torch._dynamo.eval_frame.OptimizedModule
    )


@contextlib.contextmanager
def _transforms_named() -> Iterator[None]:
    """torch.func's refusal of saved-tensor hooks, said as what to do at stage 3 (only
    stage 3 runs `loss_fn` under hooks: they gather each unit again in backward)."""
    try:
        yield
    except RuntimeError as error:
        if "don't yet support saved tensor hooks" not in str(error):
            raise
        raise RuntimeError(
            "train_step at ZeRO stage 3: loss_fn ran a torch.func transform (grad, vjp, "
            "jacrev, hessian), which cannot run under the saved-tensor hooks stage 3 uses to "
            "gather each unit again in backward. Give the transform as train_step(grad_fn=...) "
            "instead: grad_fn(params, batch) -> (loss, grads) runs with every unit gathered "
            "and any torch.func transform composes there (or train at stage 0-2)"
        ) from error


def _numel(plan: Plan) -> int:
    return sum(unit.numel for unit in plan.units)


def _check_loss(loss: Any) -> None:
    if not isinstance(loss, Tensor) or loss.numel() != 1:
        what = f"a tensor of shape {tuple(loss.shape)}" if isinstance(loss, Tensor) else repr(loss)
        raise ValueError(f"loss_fn returned {what}; expected a scalar tensor (or (loss, aux))")
    if not loss.requires_grad:
        raise ValueError("loss_fn's loss does not depend on params (it does not require grad)")


def _check_grads(out: Any, plan: Plan) -> tuple[Tensor, dict[str, Tensor]]:
    if not (isinstance(out, tuple) and len(out) == 2 and isinstance(out[1], Mapping)):
        raise ValueError("grad_fn must return (loss, grads) with grads a mapping name -> tensor")
    loss, grads = out
    unknown = sorted(set(grads) - set(plan.manifest.fqns))
    wrong = [
        f"{k}: {tuple(v.shape)} (parameter {plan.manifest[k].shape})"
        for k, v in grads.items()
        if k not in unknown and tuple(v.shape) != plan.manifest[k].shape
    ]
    if unknown or wrong:
        raise ValueError(
            f"grad_fn's grads do not fit the plan: unknown names {unknown}, shapes {wrong}; "
            f"allowed names: the plan's parameters ({len(plan.manifest.fqns)})"
        )
    return torch.as_tensor(loss), dict(grads)
