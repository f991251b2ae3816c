"""The engine: a thin stateful shell that executes a sharding plan on torch.distributed.

One module per concern, each with its one job in its docstring:

- `_engine`: the `Engine` class — its `Runtime`, counters and DeepSpeed's surface
  (forward/backward/step, join);
- `_runtime`: `build_runtime`, which builds the engine's parts from explicit arguments
  into a frozen `Runtime`;
- `_accessors`: DeepSpeed's one-line read-only accessors (`fp16_enabled()`, ...), mixed
  into `Engine`;
- `_checkpoints`: DeepSpeed's checkpoint methods (`save_checkpoint`, ...), mixed into
  `Engine`, over `checkpoint_io`;
- `entry`: `fzero.shard`, the functional entry (DeepSpeed's `initialize` is in
  `fzero.compat`);
- `_build`: the plan, the module cast to the compute dtype, each unit's buffers (the
  core's unit builder) bound to the module's parameters;
- `_forward`: the root module's own forward hooks (input casting, autocast, stage 3's
  phase);
- `_step`: the engine's step (the core's rules in `fzero.core.update` over its units) and
  its learning rates;
- `_reduction`: whose backward pass a gradient arrives in (the engine's own, another
  engine's, a plain backward's), driving the core's reductions;
- `_join`: uneven inputs (DDP's `Join`);
- `_scheduler`: stepping a DeepSpeed-style lr scheduler object;
- `_views`: whole-model views of the runtime: consolidated state dicts, memory held
  against the plan, `gathered_parameters`, the engine's `TrainState`, `comm_volume`;
- `optimizer`: the optimizer object `initialize` returns (acts on the engine);
- `checkpoint_io`: `save_checkpoint` / `load_checkpoint` / `save_16bit_model` over
  `fzero.checkpoint`;
- `telemetry`: timers and the step report; `meta_init`: `fzero.init_context`;
- `zero3_attributes`: the `ds_*` attributes DeepSpeed's ZeRO-3 sets on parameters.

The parts that read the engine take a small `Protocol` of what they read; none is wired
in after construction. The layout, stage 3's gathering (`fzero.core.gathering`, driven
by the engine's hooks), precision, update rules and their application (native kernels,
LAMB, the transactional NVMe step) and residency are the functional core's
(`fzero.core`), which `fzero.train_step` runs too.
"""

from fzero.engine._engine import Engine, Precision

__all__ = ["Engine", "Precision"]
