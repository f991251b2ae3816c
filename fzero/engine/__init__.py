"""The engine: a thin stateful shell that executes a sharding plan on torch.distributed.

One module per concern, each with its one job in its docstring:

- `_engine`: the `Engine` class — DeepSpeed's surface (forward/backward/step, accessors,
  checkpoint wrappers) wiring the parts below together;
- `_build`: the plan, each unit's buffers filled and placed, the hooks installed;
- `_forward`: the root module's own forward hooks (input casting, autocast, stage 3's
  phase);
- `_step`: the step's rules — fp16 overflow, global norm, clipping — shared with
  `fzero.train_step`, the engine's step and its learning rates;
- `_units`: each unit's buffers on this rank and how the module's parameters view them;
- `_stage3`: stage 3's gathering before use, prefetch along the recorded trace, release,
  and where parameter shards live between uses;
- `_residency`: where optimizer partitions live between steps (device, host, NVMe swap
  slots), gradient accumulators on disk, the host buffer pool;
- `_reduction`: gradient buckets and reductions, and whose backward pass a gradient
  arrives in (the engine's own, another engine's, a plain backward's);
- `_apply`: applying the optimizer — each unit's update (native kernels, LAMB), the
  transactional NVMe step, writing new parameters back;
- `_precision`: compute dtypes, input casting, the fp16 loss scale's setup;
- `_views`: whole-model views: consolidated state dicts, memory held against the plan,
  `gathered_parameters`, the engine's `TrainState`.

`fzero.train_step` runs `_step`, `_apply`'s native update and `_units`' layout helpers
too: one implementation, two front doors.
"""

from fzero.engine._engine import Engine, Precision

__all__ = ["Engine", "Precision"]
