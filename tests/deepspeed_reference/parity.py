"""What a step does with gradients that are not finite, `module.apply` inside
`zero.Init`, and every `zero_optimization` key at its default, run the same under
DeepSpeed and under fzero (`--fzero`: `import deepspeed` served by fzero).

One process. Per ZeRO stage and precision (fp32; bf16; bf16 with
`check_grad_overflow: false`; fp32 with `compute_grad_norm: false`): three steps with a
warmup schedule, the second on a batch holding an inf; each step's global and skipped
step counts, whether it was applied, its lr, and whether the weights stay finite. Then a
model built under `zero.Init` that re-initialises its layers by `module.apply`, seen
whole; and a config with every `zero_optimization`, `checkpoint` and `aio` key at its
default; the config's schedules at DeepSpeed's defaults, OneCycle's stairs and cycled
betas; the optimizer blocks' defaults (torch_adam's AdamW, Lamb's eps); the throughput
timer's counts; DeepSpeed's timers; the engine accessors of the config; and a batch-size
ramp
(`set_train_batch_size`, `set_train_micro_batch_size`). Prints one JSON line.
"""

import argparse
import json

import torch
from torch import nn

parser = argparse.ArgumentParser()
parser.add_argument("--fzero", action="store_true")
args = parser.parse_args()
if args.fzero:
    from fzero import compat

    compat.install()
import deepspeed  # noqa: E402

deepspeed.init_distributed(dist_backend="gloo")

# DeepSpeed 0.19.8's `zero_optimization` keys (its aliases where it has them) at their
# defaults, but the blocks and the deprecated ones
EVERY_ZERO_KEY = {
    "allgather_bucket_size": 500000000, "allgather_partitions": True,
    "stage3_allgather_sequential": False, "compute_grad_norm": True,
    "contiguous_gradients": True, "elastic_checkpoint": False, "enable_sanity_checks": False,
    "stage3_gather_16bit_weights_on_model_save": False, "ignore_unused_parameters": True,
    "legacy_stage1": False, "load_from_fp32_weights": True, "log_trace_cache_warnings": False,
    "stage3_max_live_parameters": 1000000000, "stage3_max_reuse_distance": 1000000000,
    "memory_efficient_linear": True, "stage3_model_persistence_threshold": 9223372036854775807,
    "stage3_module_granularity_threshold": 0, "override_module_apply": True,
    "stage3_param_persistence_threshold": 100000, "parameter_alignment": False,
    "pipeline_loading_checkpoint": False, "stage3_prefetch_bucket_size": 50000000,
    "reduce_bucket_size": 500000000, "reduce_scatter": True, "round_robin_gradients": False,
    "save_muon_momentum_buffer_in_memory": False, "sub_group_size": 1000000000,
    "stage3_use_all_reduce_for_fetch_params": False, "use_multi_rank_bucket_allreduce": True,
    "zero_hpz_partition_size": 1, "zero_quantized_gradients": False,
    "zero_quantized_nontrainable_weights": False, "zero_quantized_weights": False,
}  # fmt: skip


def config(stage: int, precision: str, clipping: float | None = 0.0, **zero: object) -> dict:
    out = {
        "train_micro_batch_size_per_gpu": 2,
        "steps_per_print": 1000,
        "optimizer": {"type": "Adam", "params": {"lr": 1e-2}},
        "scheduler": {
            "type": "WarmupLR",
            "params": {"warmup_num_steps": 10, "warmup_max_lr": 1e-2},
        },
        "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0, **zero},
    }
    if clipping is not None:
        out["gradient_clipping"] = clipping
    if precision.startswith("bf16"):
        out["bf16"] = {"enabled": True}
        if precision == "bf16, no check":
            out["bf16"]["check_grad_overflow"] = False
    return out


def weights(engine, stage: int) -> torch.Tensor:
    params = list(engine.module.parameters())
    if stage == 3:
        with deepspeed.zero.GatheredParameters(params):
            return torch.cat([p.detach().float().flatten() for p in params])
    return torch.cat([p.detach().float().flatten() for p in params])


def run(stage: int, precision: str, clipping: float | None = 0.0, **zero: object) -> dict:
    torch.manual_seed(0)
    settings = config(stage, precision, clipping, **zero)
    engine, *_ = deepspeed.initialize(model=nn.Linear(3, 2), config=settings)
    dtype = torch.bfloat16 if precision.startswith("bf16") else torch.float32
    steps, before = [], None
    for i in range(3):
        x = torch.randn(2, 3).to(dtype)
        if i == 1:
            x[0, 0] = float("inf")
            before = weights(engine, stage)
        engine.backward(engine(x).float().square().mean())
        engine.step()
        counts = [engine.global_steps, engine.skipped_steps, engine.was_step_applied()]
        steps.append([*counts, engine.get_lr()[0]])
        if i == 1:
            after = weights(engine, stage)
            kept = bool(torch.equal(before, after))
    finite = bool(torch.isfinite(weights(engine, stage)).all())
    return {"steps": steps, "finite": finite, "kept": kept}


out: dict = {}
for stage in range(4):
    for precision in ("fp32", "bf16", "bf16, no check"):
        out[f"{stage} {precision}"] = run(stage, precision)
out["2 fp32, compute_grad_norm false"] = run(2, "fp32", compute_grad_norm=False)
out["1 bf16, compute_grad_norm false"] = run(1, "bf16", compute_grad_norm=False)
try:  # without gradient_clipping, DeepSpeed clips at 1.0, which compute_grad_norm refuses
    run(2, "fp32", compute_grad_norm=False, clipping=None)
    out["compute_grad_norm false, default clipping"] = "accepted"
except ValueError:
    out["compute_grad_norm false, default clipping"] = "refused"

seen = []


def constant(module: nn.Module) -> None:
    if isinstance(module, nn.Linear):
        seen.append(list(module.weight.shape))
        nn.init.constant_(module.weight, 0.5)


for override in (True, False):
    seen.clear()
    zero = {"stage": 3, "stage3_param_persistence_threshold": 0, "override_module_apply": override}
    settings = {"train_micro_batch_size_per_gpu": 1, "zero_optimization": zero}
    with deepspeed.zero.Init(config_dict_or_path=settings):
        model = nn.Sequential(nn.Linear(4, 6), nn.Linear(6, 2))
        model.apply(constant)
    with deepspeed.zero.GatheredParameters(list(model.parameters())):
        applied = bool((model[0].weight == 0.5).all())
    out[f"apply, override {override}"] = {"seen": list(seen), "applied": applied}

every = {"train_micro_batch_size_per_gpu": 2, "steps_per_print": 1000,
         "optimizer": {"type": "Adam", "params": {"lr": 1e-2}},
         "zero_optimization": {"stage": 3, **EVERY_ZERO_KEY},
         "checkpoint": {"tag_validation": "Warn", "load_universal": False,
                        "use_node_local_storage": False,
                        "parallel_write": {"pipeline_stage": False}},
         "aio": {"block_size": 1048576, "queue_depth": 8, "intra_op_parallelism": 1,
                 "single_submit": False, "overlap_events": True, "use_gds": False}}  # fmt: skip
engine, *_ = deepspeed.initialize(model=nn.Linear(3, 2), config=every)
out["every zero key"] = engine.zero_optimization_stage()
# DeepSpeed 0.19.8's other top-level keys at their defaults, or switched off
top = {"train_micro_batch_size_per_gpu": 2, "steps_per_print": 1000,
       "optimizer": {"type": "Adam", "params": {"lr": 1e-2}},
       "zero_optimization": {"stage": 2}, "zero_force_ds_cpu_optimizer": True,
       "disable_allgather": False, "disable_python_gc": False,
       "managed_gradient_accumulation": True, "gradient_allreduce_op": "mean",
       "log_level": "warning", "sequence_parallel_size": 1,
       "seq_parallel_communication_data_type": "fp32",
       "use_data_before_expert_parallelism": False, "vocabulary_size": 32000,
       "timers": {"throughput": {"enabled": True, "synchronized": True}},
       "pipeline": {"stages": 2, "partition": "best"}, "compile": {"deepcompile": False},
       "tensor_parallel": {"autotp_size": 0}, "expert_parallel": {"autoep_size": 1},
       "datastates_ckpt": False, "dump_state": False, "hybrid_engine": {"enabled": False},
       "autotuning": {"enabled": False}, "data_efficiency": {"enabled": False}}  # fmt: skip
torch.manual_seed(0)
engine, *_ = deepspeed.initialize(model=nn.Linear(3, 2), config=top)
for _ in range(2):
    engine.backward(engine(torch.randn(2, 3)).pow(2).mean())
    engine.step()
out["top-level keys"] = {
    "weights": weights(engine, 2).tolist(),
    "gradient_average": engine.gradient_average,
    "collect_python_gc": type(engine.collect_python_gc()).__name__,
}
legacy = {"train_micro_batch_size_per_gpu": 2, "steps_per_print": 1000,
          "optimizer": {"type": "Adam", "params": {"lr": 1e-2}},
          "zero_optimization": {"stage": 2, "cpu_offload": True}}  # fmt: skip
engine, *_ = deepspeed.initialize(model=nn.Linear(3, 2), config=legacy)
out["cpu_offload"] = engine.zero_cpu_offload()
# what backward returns: the loss divided by the accumulation steps (or not)
torch.manual_seed(0)
settings = {**config(2, "fp32"), "gradient_accumulation_steps": 4}
engine, *_ = deepspeed.initialize(model=nn.Linear(3, 2), config=settings)
loss = engine(torch.randn(2, 3)).pow(2).sum()
returned = [engine.backward(loss).item() / loss.item()]
loss = engine(torch.randn(2, 3)).pow(2).sum()
returned.append(engine.backward(loss, scale_wrt_gas=False).item() / loss.item())
out["backward returns"] = returned
# the config's schedules, at DeepSpeed's defaults where a script leaves them out (WarmupLR
# warms up to the optimizer's lr), OneCycle's stairs and cycled betas: lrs, betas, weights
SCHEDULES = (
    ("WarmupLR", {"warmup_num_steps": 5}),
    ("WarmupDecayLR", {"warmup_num_steps": 3, "total_num_steps": 8}),
    ("OneCycle", {"cycle_min_lr": 0.01, "cycle_max_lr": 0.1, "cycle_first_step_size": 3}),
    ("OneCycle", {"cycle_min_lr": 0.01, "cycle_max_lr": 0.1, "cycle_first_step_size": 4,
                  "cycle_first_stair_count": 2, "cycle_second_step_size": 2,
                  "cycle_second_stair_count": 1, "decay_step_size": 2, "decay_lr_rate": 0.5,
                  "decay_mom_rate": 0.1}),
)  # fmt: skip
schedules = {}
for name, params in SCHEDULES:
    torch.manual_seed(0)
    settings = {"train_micro_batch_size_per_gpu": 2, "steps_per_print": 1000,
                "optimizer": {"type": "Adam", "params": {"lr": 0.1}},
                "scheduler": {"type": name, "params": params}}  # fmt: skip
    engine, optimizer, _, scheduler = deepspeed.initialize(model=nn.Linear(3, 2), config=settings)
    lrs, betas = [scheduler.get_lr()[0]], [list(optimizer.param_groups[0]["betas"])]
    for _ in range(9):
        engine.backward(engine(torch.randn(2, 3)).sum())
        engine.step()
        lrs.append(scheduler.get_last_lr()[0])
        betas.append(list(optimizer.param_groups[0]["betas"]))
    schedules[f"{name} {json.dumps(params)}"] = {
        "lrs": lrs, "betas": betas, "mom": [list(m) for m in engine.get_mom()],
        "weights": weights(engine, 0).tolist(),
    }  # fmt: skip
out["schedules"] = schedules
# the config's optimizer blocks at DeepSpeed's defaults where a script leaves them out:
# torch_adam builds torch's AdamW (weight decay 0.01 by default, FusedAdam's 0.0), the
# switches that only pick an implementation and amsgrad false change nothing; weights
# after three steps from non-zero ones (weight decay shows)
BLOCKS = (
    ("AdamW", {"lr": 0.05, "torch_adam": True}),
    ("Adam", {"lr": 0.05, "torch_adam": True, "adam_w_mode": False, "foreach": None}),
    ("AdamW", {"lr": 0.05, "amsgrad": False, "weight_decay": 0.1}),
    ("Adam", {"lr": 0.05, "amsgrad": False, "fp32_optimizer_states": True}),
    ("Adagrad", {}),
)
blocks = {}
for name, params in BLOCKS:
    torch.manual_seed(0)
    settings = {"train_micro_batch_size_per_gpu": 2, "steps_per_print": 1000,
                "optimizer": {"type": name, "params": params}}  # fmt: skip
    engine, *_ = deepspeed.initialize(model=nn.Linear(3, 2), config=settings)
    for _ in range(3):
        engine.backward(engine(torch.randn(2, 3)).square().mean())
        engine.step()
    blocks[f"{name} {json.dumps(params)}"] = weights(engine, 0).tolist()
out["optimizer blocks"] = blocks
# the throughput timer scripts read and advance (DeepSpeed-Chat's update_epoch_count)
settings = {**config(2, "fp32"), "gradient_accumulation_steps": 2, "steps_per_print": 3}
engine, *_ = deepspeed.initialize(model=nn.Linear(3, 2), config=settings)
timer = engine.tput_timer
counts = [[timer.initialized, timer.batch_size, timer.start_step, timer.steps_per_output]]
for _ in range(2):
    for _ in range(5):
        engine.backward(engine(torch.randn(2, 3)).square().mean())
        engine.step()
        counts.append([timer.epoch_count, timer.micro_step_count, timer.global_step_count])
    timer.update_epoch_count()
counts.append([timer.epoch_count, timer.micro_step_count, timer.avg_samples_per_sec() > 0])
out["tput_timer"] = counts
# DeepSpeed's timers as research code uses them: named timers, elapsed ms and its reset,
# the trimmed mean (the durations themselves vary, their arithmetic does not)
from deepspeed.utils.timer import SynchronizedWallClockTimer, trim_mean  # noqa: E402

timers = SynchronizedWallClockTimer()
for _ in range(3):
    timers("fwd").start()
    timers("fwd").stop()
running = timers("bwd")
running.start()
out["timers"] = {
    "names": sorted(timers.get_timers()),
    "counted": len(timers("fwd").event_timers),
    "positive": timers("fwd").elapsed(reset=True) >= 0,
    "after reset": timers("fwd").elapsed(),
    "still running": running.elapsed() >= 0 and running.started_,
    "trim_mean": trim_mean([5.0, 1.0, 3.0, 100.0, 2.0, 4.0, 0.0, 3.0, 3.0, 3.0], 0.1),
}
# the names scripts hand torch.serialization.add_safe_globals, and DeepSpeed's dynamic
# loss scaler stepped through overflows (hysteresis 2, window 2)
from deepspeed.runtime.fp16.loss_scaler import DynamicLossScaler, LossScaler  # noqa: E402
from deepspeed.runtime.zero.config import ZeroStageEnum  # noqa: E402

torch.serialization.add_safe_globals([LossScaler, ZeroStageEnum])
scaler, scales = DynamicLossScaler(2**16, 2, 1, 2, False), []
for overflow in (True, False, False, False, True, True, False, True, True):
    scaler.update_scale(overflow)
    scales.append([scaler.cur_scale, scaler.cur_hysteresis, scaler.cur_iter])
out["loss scaler"] = {
    "dynamic": scales,
    "static": [LossScaler(8).loss_scale, LossScaler().has_overflow([])],
    "stages": [[e.name, int(e)] for e in ZeroStageEnum] + [ZeroStageEnum.max_stage.name],
}
# RepeatingLoader past its loader's end, and move_to_device with a criterion
from deepspeed.runtime.dataloader import RepeatingLoader  # noqa: E402
from deepspeed.runtime.utils import move_to_device  # noqa: E402

loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.arange(5)), 2)
pair = torch.ones(2)
nested = move_to_device(
    [pair, (torch.zeros(1),)], "cpu", lambda t: torch.is_tensor(t) and t.numel() == 2
)
out["loaders and devices"] = {
    "repeating": [b[0].tolist() for _, b in zip(range(5), RepeatingLoader(loader))],
    "moved": [nested[0] is pair, type(nested[1]).__name__, nested[1][0].tolist()],
}
# Lamb's default eps (DeepSpeed builds FusedLamb, which has no CPU kernel: its signature)
if args.fzero:
    settings = {"train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "Lamb", "params": {}}}
    engine, optimizer, *_ = deepspeed.initialize(model=nn.Linear(3, 2), config=settings)
    out["Lamb eps"] = optimizer.param_groups[0]["eps"]
else:
    import inspect

    from deepspeed.ops.lamb import FusedLamb

    out["Lamb eps"] = inspect.signature(FusedLamb).parameters["eps"].default
ACCESSORS = (
    "dp_world_size", "mp_world_size", "zero_optimization_partition_gradients",
    "zero_optimization_partition_weights", "dynamic_loss_scale", "wall_clock_breakdown",
    "memory_breakdown", "postscale_gradients", "gradient_predivide_factor",
    "dataloader_drop_last", "optimizer_name", "optimizer_params", "scheduler_name",
    "scheduler_params", "zero_reduce_bucket_size", "zero_allgather_bucket_size",
    "zero_reduce_scatter", "zero_contiguous_gradients", "zero_overlap_comm",
    "zero_sub_group_size", "zero_max_live_parameters", "zero_max_reuse_distance",
    "zero_prefetch_bucket_size", "zero_param_persistence_threshold",
    "zero_load_from_fp32_weights", "zero_elastic_checkpoint", "zero_ignore_unused_parameters",
    "zero_hpz_partition_size", "zero_quantized_weights", "zero_quantized_gradients",
    "checkpoint_tag_validation_enabled", "checkpoint_tag_validation_fail",
    "load_universal_checkpoint", "gradient_average", "flops_profiler_enabled",
    "autotuning_enabled", "curriculum_learning_enabled", "zero_cpu_offload", "mpu", "loss_scale",
    "has_moe_layers",
)  # fmt: skip
for stage in (1, 3):
    settings = {
        **config(stage, "fp32"),
        "gradient_accumulation_steps": 2,
        "checkpoint": {"tag_validation": "fail"},
    }
    settings["zero_optimization"].update(reduce_bucket_size=1000, stage3_max_live_parameters=77)
    engine, *_ = deepspeed.initialize(model=nn.Linear(3, 2), config=settings)
    values = {}
    for name in ACCESSORS:
        value = getattr(engine, name)
        values[name] = [callable(value), value() if callable(value) else value]
    # (get_batch_info is left out: DeepSpeed 0.19.8's returns its three methods, uncalled)
    values["data types"] = [str(t) for t in engine.get_data_types()]
    out[f"accessors, stage {stage}"] = values
# the loader initialize builds from training_data, and the engine's attribute for it
data = torch.utils.data.TensorDataset(torch.arange(10).float().unsqueeze(1), torch.arange(10))
torch.manual_seed(0)
loaded = {**config(0, "fp32"), "train_micro_batch_size_per_gpu": 3}
engine, _, loader, _ = deepspeed.initialize(
    model=nn.Linear(1, 1), config=loaded, training_data=data
)
out["loader"] = {
    "batches": [b[1].tolist() for b in loader],
    "attribute": engine.training_dataloader is loader,
}
# engine.deepspeed_io: the micro-batch by default, a batch size and collate_fn of the
# script's, the eval route (in order), the config's drop_last
labels = lambda rows: torch.stack([row[1] for row in rows])  # noqa: E731
out["deepspeed_io"] = {
    "default": [b[1].tolist() for b in engine.deepspeed_io(data)],
    "sized": [b.tolist() for b in engine.deepspeed_io(data, batch_size=4, collate_fn=labels)],
    "eval": [b[1].tolist() for b in engine.deepspeed_io(data, route="eval")],
    "length": len(engine.deepspeed_io(data, batch_size=4)),
}
engine, *_ = deepspeed.initialize(
    model=nn.Linear(1, 1), config={**loaded, "dataloader_drop_last": True}
)
out["deepspeed_io"]["drop_last"] = [b[1].tolist() for b in engine.deepspeed_io(data)]

# a batch-size ramp: accumulation 1, then 2 (set_train_batch_size), then a smaller micro
settings = {**config(2, "fp32"), "train_micro_batch_size_per_gpu": 2}
torch.manual_seed(0)
engine, *_ = deepspeed.initialize(model=nn.Linear(3, 2), config=settings)
ramp = []
for i in range(6):
    if i == 2:
        engine.set_train_batch_size(4)
    if i == 4:
        engine.set_train_micro_batch_size(1)
    x = torch.randn(engine.train_micro_batch_size_per_gpu(), 3)
    engine.backward(engine(x).square().mean())
    engine.step()
    sizes = [engine.train_batch_size(), engine.gradient_accumulation_steps()]
    ramp.append([engine.global_steps, engine.global_samples, *sizes])
out["batch ramp"] = {"steps": ramp, "weights": weights(engine, 2).tolist()}
print("RESULT " + json.dumps(out), flush=True)
# Without this a gloo process may abort at interpreter teardown ("terminate called
# without an active exception", seen under DeepSpeed in CI): torch's advice.
torch.distributed.destroy_process_group()
