"""The functional core: one rank's training state and the functions over it, which both
front doors run (`fzero.train_step` from `functional_call`, the engine from its hooks).

- `state`: `TrainState` (a pytree: plan, counters, per-unit shards, loss scale, RNG);
- `init`: building a `TrainState` from a model and a plan; what a door runs when the
  call and the config name no optimizer or schedule; consolidated weights;
- `step`: `train_step`; `evaluate`: `eval_step`; `donation`: what both check of a state
  they take, and `train_step`'s donation of it;
- `layout`: each unit's flat buffers and how a tensor's pieces sit in them;
- `build`: the one unit builder (a unit's buffers on this rank from its values), which
  `init` and the engine use;
- `gathering`: a stage-3 unit's state machine and the one `Gatherer` (gather, prefetch
  along the recorded trace, reuse, the live bound, hpZ, qwZ, swap-file reads);
- `stage3`: the engine's driver of the `Gatherer` (module hooks, saved-tensor hooks);
- `gather`: `train_step`'s driver of the `Gatherer` (placeholders swapped inside a
  function);
- `param_shards`: where stage 3's parameter shards live between uses (device, host,
  swap file);
- `update`: the update's rules (fp16 overflow, global norm, clipping, scheduled
  hyper-parameters) and the in-place update through the native kernels;
- `apply`: applying the update to every unit (native kernels, LAMB's two halves, the
  transactional and in-place NVMe steps) and publishing new parameters — the one update
  loop both doors run, over `layout.UnitRuntime` records;
- `whole_tensors`: the update of an optimizer that needs whole tensors (`WholeTensors`,
  e.g. Muon), which `apply` runs unit by unit;
- `publish`: writing updated masters back to the compute-dtype parameters (the step's
  overlapped all-gathers, restores);
- `residency`: where optimizer partitions live between steps (device, host, NVMe swap
  slots), host buffer pools, gradient accumulators on disk;
- `precision`: compute dtypes and the fp16 loss scale's setup;
- `nvme`: the swap file and its host buffer pool (the native async I/O);
- `groups`: the process groups a plan on a mesh runs on (its shard group, replicas,
  hpZ's secondary group);
- `construction`: `init_context`, partitioning a model as it is constructed;
  `partitioned`: such parameters (their partitions, where they live, gathering them
  whole, a modifier's edits and loads by byte range); `zero3_params`: DeepSpeed's `ds_*`
  attributes; `tensor_files`: safetensors read by byte range, and the file bytes a
  mapped tensor shows; `load_weights`: `load_safetensors`, each rank reading its bytes.

The core imports nothing from the engine, the DeepSpeed surface or the checkpoint
package (`tests/test_import_graph.py` holds it to that, package `__init__`s included).
"""
