"""DeepSpeed-style config: the tutorials' configs unchanged, errors, batch arithmetic, auto."""

from __future__ import annotations

import argparse
import ast
import dataclasses
import json
import re
import sys
import typing
import warnings
from pathlib import Path

import pytest

import fzero
from fzero import add_config_arguments, resolve_auto
from fzero.config import AUTO, Config, ConfigError, batch_sizes, load_config
from fzero.config.auto import check_resolved, unresolved_auto

REGRESSION = """
{"train_batch_size": 32, "fp16": {"enabled": true},
 "zero_optimization": {"stage": 1, "allgather_partitions": true, "reduce_scatter": true,
   "allgather_bucket_size": 2e8, "overlap_comm": true},
 "optimizer": {"type": "Adam", "params": {"lr": 0.001, "betas": [0.9, 0.999], "eps": 1e-8,
   "weight_decay": 3e-7}}}
"""
BERT = """
{"train_batch_size": 4096, "train_micro_batch_size_per_gpu": 64, "steps_per_print": 1000,
 "optimizer": {"type": "Adam", "params": {"lr": 2e-4, "max_grad_norm": 1.0, "weight_decay": 0.01,
   "bias_correction": false}},
 "fp16": {"enabled": true, "loss_scale": 0, "initial_scale_power": 16}}
"""
T5_ZERO2 = """
{"zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu", "pin_memory": true},
   "allgather_partitions": true, "allgather_bucket_size": 2e8, "overlap_comm": true,
   "reduce_scatter": true, "reduce_bucket_size": 2e8, "contiguous_gradients": true},
 "gradient_accumulation_steps": "auto", "gradient_clipping": "auto", "steps_per_print": 20,
 "train_batch_size": "auto", "train_micro_batch_size_per_gpu": "auto",
 "wall_clock_breakdown": false,
 "fp16": {"enabled": "auto", "loss_scale": 0, "loss_scale_window": 1000,
   "initial_scale_power": 16, "hysteresis": 2, "min_loss_scale": 1},
 "bf16": {"enabled": "auto"},
 "optimizer": {"type": "AdamW", "params": {"lr": "auto", "betas": "auto", "eps": "auto",
   "weight_decay": "auto"}},
 "scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": "auto", "warmup_max_lr": "auto",
   "warmup_num_steps": "auto"}}}
"""
ZERO3 = """
{"zero_optimization": {"stage": 3, "offload_optimizer": {"device": "cpu", "pin_memory": true},
   "offload_param": {"device": "cpu", "pin_memory": true}, "overlap_comm": true,
   "contiguous_gradients": true, "sub_group_size": 1e9, "reduce_bucket_size": "auto",
   "stage3_prefetch_bucket_size": "auto", "stage3_param_persistence_threshold": "auto",
   "stage3_max_live_parameters": 1e9, "stage3_max_reuse_distance": 1e9,
   "stage3_gather_16bit_weights_on_model_save": true},
 "gradient_accumulation_steps": "auto", "gradient_clipping": "auto", "steps_per_print": 20,
 "train_batch_size": "auto", "train_micro_batch_size_per_gpu": "auto",
 "wall_clock_breakdown": false}
"""


def test_regression_tutorial_config(tmp_path):
    path = tmp_path / "ds_config.json"
    path.write_text(REGRESSION)
    config = load_config(str(path))
    assert config.train_batch_size == 32 and config.fp16.enabled
    assert config.zero_optimization.stage == 1
    assert config.zero_optimization.allgather_bucket_size == 200_000_000
    assert isinstance(config.zero_optimization.allgather_bucket_size, int)
    assert config.optimizer.type == "Adam" and config.optimizer.params["lr"] == 0.001
    assert batch_sizes(config, 2).micro_batch_size == 16


def test_bert_tutorial_config_moves_max_grad_norm_with_a_warning():
    with pytest.warns(FutureWarning, match="max_grad_norm.*deprecated"):
        config = load_config(json.loads(BERT))
    assert config.gradient_clipping == 1.0
    assert "max_grad_norm" not in config.optimizer.params
    assert config.fp16.loss_scale == 0.0 and config.fp16.initial_scale_power == 16
    assert batch_sizes(config, 8).gradient_accumulation_steps == 8


def test_t5_zero2_config_with_auto_values():
    config = load_config(json.loads(T5_ZERO2))
    assert config.zero_optimization.offload_optimizer.device == "cpu"
    assert set(unresolved_auto(config)) == {
        "train_batch_size",
        "train_micro_batch_size_per_gpu",
        "gradient_accumulation_steps",
        "gradient_clipping",
        "optimizer.params.lr",
        "optimizer.params.betas",
        "optimizer.params.eps",
        "optimizer.params.weight_decay",
        "scheduler.params.warmup_min_lr",
        "scheduler.params.warmup_max_lr",
        "scheduler.params.warmup_num_steps",
        "fp16.enabled",
        "bf16.enabled",
    }
    with pytest.raises(ConfigError, match=r'still "auto".*train_batch_size'):
        check_resolved(config)
    resolved = resolve_auto(
        config,
        world_size=2,
        micro_batch_size=4,
        gradient_accumulation_steps=2,
        lr=3e-4,
        betas=(0.9, 0.98),
        eps=1e-8,
        weight_decay=0.0,
        warmup_steps=10,
        max_grad_norm=1.0,
        fp16=False,
        bf16=True,
    )
    check_resolved(resolved)
    assert resolved.train_batch_size == 16
    assert resolved.optimizer.params == {
        "lr": 3e-4,
        "betas": [0.9, 0.98],
        "eps": 1e-8,
        "weight_decay": 0.0,
    }
    assert resolved.scheduler.params == {
        "warmup_min_lr": 0.0,
        "warmup_max_lr": 3e-4,
        "warmup_num_steps": 10,
    }
    assert resolved.bf16.enabled is True and resolved.fp16.enabled is False
    assert config.train_batch_size == AUTO  # the original is a value, untouched


def test_zero3_config_resolves_bucket_sizes_from_hidden_size():
    config = load_config(json.loads(ZERO3))
    assert config.zero_optimization.offload_param.device == "cpu"
    assert config.zero_optimization.stage3_max_live_parameters == 1_000_000_000
    resolved = resolve_auto(
        config,
        world_size=1,
        micro_batch_size=2,
        gradient_accumulation_steps=1,
        max_grad_norm=0.5,
        hidden_size=512,
    )
    zero = resolved.zero_optimization
    assert zero.reduce_bucket_size == 512 * 512
    assert zero.stage3_prefetch_bucket_size == int(0.9 * 512 * 512)
    assert zero.stage3_param_persistence_threshold == 5120
    assert check_resolved(resolved).zero_optimization.stage3_gather_16bit_weights_on_model_save


def test_unresolved_key_left_when_value_not_given():
    config = resolve_auto(load_config(json.loads(ZERO3)), micro_batch_size=2)
    assert "gradient_accumulation_steps" in unresolved_auto(config)


@pytest.mark.parametrize(
    ("raw", "message"),
    [
        ({"zero_optimisation": {"stage": 2}}, "did you mean 'zero_optimization'"),
        ({"zero_optimization": {"stagee": 2}}, "'zero_optimization.stagee'.*did you mean 'stage'"),
        ({"zero_optimization": {"stage": 5}}, "stage' is 5; allowed: 0-3"),
        ({"zero_optimization": {"stage": "2"}}, "must be an integer, found '2'"),
        ({"zero_optimization": {"reduce_bucket_size": 1.5}}, "whole number, found 1.5"),
        ({"fp16": {"enabled": 1}}, "'fp16.enabled' must be true or false, found 1"),
        ({"fp16": {"enabled": True}, "bf16": {"enabled": True}}, "both true"),
        ({"train_batch_size": 0}, "'train_batch_size' is 0"),
        (
            {"expert_parallel": {"enabled": True, "autoep_size": 2}},
            r"'expert_parallel' is not supported yet.*\(off: `false`, `null`, or a block",
        ),
        ({"compile": {"deepcompile": True}}, "'compile' is not supported yet"),
        ({"tensor_parallel": {"autotp_size": 2}}, "'tensor_parallel' is not supported yet"),
        ({"tensor_parallel": {"tp": {"tp_size": 2}}}, "'tensor_parallel' is not supported yet"),
        (
            {"weight_quantization": {"quantized_initialization": {"num_bits": 8}}},
            "'weight_quantization' is not supported yet",
        ),
        ({"datastates_ckpt": {"host_cache_size": 16}}, "'datastates_ckpt' is not supported yet"),
        ({"log_level": "verbose"}, r"'log_level' is 'verbose'; allowed: \['debug'"),
        ({"tensorboard": {"enabled": True, "path": "x"}}, "'tensorboard.path'.*'output_path'"),
        ({"comms_logger": {"enabled": "yes"}}, "'comms_logger.enabled' must be true or false"),
        ({"flops_profiler": {"profile_step": 1.5}}, "'flops_profiler.profile_step'.*whole"),
        ({"fp16": {"auto_cast": True}}, "'fp16.auto_cast' is not supported yet"),
        ({"zero_optimization": {"offload_optimizer": {"device": "gpu"}}}, "allowed: \\['none'"),
        (
            {"zero_optimization": {"zero_quantized_gradients_bits": 2}},
            r"'zero_optimization.zero_quantized_gradients_bits' is 2; allowed: \[4, 8\]",
        ),
        ({"zero_optimization": {"stage": 3, "offload_param": {"device": "nvme"}}}, "no nvme_path"),
        ({"zero_optimization": {"stage": 2, "offload_param": {"device": "cpu"}}}, "needs stage 3"),
        ({"optimizer": {"type": "Adafactor"}}, "allowed: Adam, AdamW, Lamb, SGD, Muon, Adagrad"),
        ({"optimizer": {"type": "Adam", "params": {"betas1": 0.9}}}, "did you mean 'betas'"),
        ({"scheduler": {"type": "WarmupLR", "params": {"total_num_steps": 9}}}, "total_num_steps"),
        ({"scheduler": {"type": "Cosine"}}, "allowed: WarmupLR"),
        (
            {
                "optimizer": {"type": "Adam", "params": {"max_grad_norm": 1.0}},
                "gradient_clipping": 2.0,
            },
            "give one of them",
        ),
        # DeepSpeed's own refusals of compute_grad_norm false, and of a deprecated key
        # beside the one replacing it
        (
            {"zero_optimization": {"stage": 3, "compute_grad_norm": False}},
            "'zero_optimization.compute_grad_norm' is false but it is supported only at "
            r"ZeRO stages 1 and 2 \(stage 3\)",
        ),
        (
            {
                "gradient_clipping": 1.0,
                "zero_optimization": {"stage": 2, "compute_grad_norm": False},
            },
            r"needs gradient_clipping 0 \(found 1.0\)",
        ),
        (
            {
                "zero_optimization": {
                    "stage": 1,
                    "compute_grad_norm": False,
                    "offload_optimizer": {"device": "cpu"},
                }
            },
            "does not run with offload_optimizer.device 'cpu'",
        ),
        (
            {"zero_optimization": {"stage": 2, "cpu_offload": True, "offload_optimizer": {}}},
            r"'zero_optimization.cpu_offload' \(deprecated\) and 'zero_optimization.offload_opt",
        ),
        (
            {"zero_optimization": {"stage": 3, "cpu_offload_param": "yes"}},
            "'zero_optimization.cpu_offload_param' must be true, false or null, found 'yes'",
        ),
        ({"zero_optimization": {"cpu_offload_params": True}}, "unknown config key"),
    ],
)
def test_bad_configs_name_the_key(raw, message):
    with pytest.raises(ConfigError, match=message), warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        load_config(raw)


def test_switched_off_unsupported_blocks_are_accepted():
    """Off as DeepSpeed reads each block: most are off without `"enabled": true` (its
    default is false), `compile` without `deepcompile`, `tensor_parallel` at size 0 or
    1; `pipeline` is read only for a PipelineModule, which fzero does not serve."""
    config = load_config(
        {
            "train_batch_size": 8,
            "bfloat16": {"enabled": True},
            "pipeline": {"stages": 2, "partition": "best"},
            "expert_parallel": {"autoep_size": 1},
            "autotuning": {"fast": True},
            "hybrid_engine": {"max_out_tokens": 512},
            "data_efficiency": {"seed": 1234},
            "compile": {"deepcompile": False, "offload_opt_states": True},
            "tensor_parallel": {"autotp_size": 0, "tp": {"tp_size": 1}},
            "weight_quantization": {"quantized_initialization": None},
            "datastates_ckpt": False,
            "dump_state": False,
            "zero_optimization": {"zenflow": None},
        }
    )
    assert config.bf16.enabled and config.pipeline == {"stages": 2, "partition": "best"}


def test_quantized_gradient_bits_read_as_declared():
    config = load_config({"zero_optimization": {"zero_quantized_gradients_bits": 4.0}})
    assert type(config.zero_optimization.zero_quantized_gradients_bits) is int
    assert load_config({}).zero_optimization.zero_quantized_gradients_bits == 8


def test_missing_and_malformed_files(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(str(tmp_path / "nope.json"))
    bad = tmp_path / "bad.json"
    bad.write_text("{")
    with pytest.raises(ConfigError, match="not valid JSON"):
        load_config(bad)


@pytest.mark.parametrize(
    ("given", "world", "expected"),
    [
        ({"train_batch_size": 32}, 2, (32, 16, 1)),
        ({"train_micro_batch_size_per_gpu": 4}, 2, (8, 4, 1)),
        ({"train_batch_size": 32, "train_micro_batch_size_per_gpu": 4}, 2, (32, 4, 4)),
        ({"train_batch_size": 32, "gradient_accumulation_steps": 4}, 2, (32, 4, 4)),
        ({"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 3}, 2, (24, 4, 3)),
        (
            {
                "train_batch_size": 24,
                "train_micro_batch_size_per_gpu": 4,
                "gradient_accumulation_steps": 3,
            },
            2,
            (24, 4, 3),
        ),
    ],
)
def test_batch_arithmetic(given, world, expected):
    got = batch_sizes(load_config(given), world)
    assert (got.train_batch_size, got.micro_batch_size, got.gradient_accumulation_steps) == expected


def test_batch_arithmetic_errors_show_the_equation():
    config = load_config(
        {
            "train_batch_size": 32,
            "train_micro_batch_size_per_gpu": 4,
            "gradient_accumulation_steps": 3,
        }
    )
    with pytest.raises(ConfigError, match="32 != 4 x 3 x 2 = 24"):
        batch_sizes(config, 2)
    with pytest.raises(ConfigError, match="cannot be split"):
        batch_sizes(load_config({"train_batch_size": 30, "train_micro_batch_size_per_gpu": 4}), 2)
    with pytest.raises(ConfigError, match="give train_batch_size"):
        batch_sizes(load_config({"gradient_accumulation_steps": 2}), 2)


def test_add_config_arguments_accepts_deepspeed_flags():
    parser = add_config_arguments(argparse.ArgumentParser())
    args = parser.parse_args(["--deepspeed", "--deepspeed_config", "ds.json"])
    assert args.deepspeed and args.deepspeed_config == "ds.json" and not args.fzero
    args = parser.parse_args(["--fzero", "--fzero_config", "c.json"])
    assert args.fzero and args.fzero_config == "c.json"


def test_steps_per_print_inf_means_never_as_transformers_writes_it():
    assert load_config({"steps_per_print": float("inf")}).steps_per_print == 0
    with pytest.raises(ConfigError, match=r"'steps_per_print' must be a whole number, found nan"):
        load_config({"steps_per_print": float("nan")})


def _sections(cls: type) -> list[type]:
    """`cls` and every config section nested in it."""
    found = [cls]
    for spec in dataclasses.fields(cls):
        for hint in typing.get_args(typing.get_type_hints(cls)[spec.name]) or (
            typing.get_type_hints(cls)[spec.name],
        ):
            if dataclasses.is_dataclass(hint) and hint not in found:
                found += [s for s in _sections(hint) if s not in found]
    return found


def _names_read_outside_the_config() -> set[str]:
    """Every attribute name and string constant in fzero's code outside `fzero.config`'s
    definitions and checks (its public functions, such as the batch arithmetic, count)."""
    root = Path(fzero.__file__).parent
    names: set[str] = set()
    for path in root.rglob("*.py"):
        tree = ast.parse(path.read_text())
        nodes: list[ast.AST] = [tree]
        if path.is_relative_to(root / "config"):
            nodes = [
                node
                for node in tree.body
                if isinstance(node, ast.FunctionDef) and not node.name.startswith("_")
            ]
        for node in (n for top in nodes for n in ast.walk(top)):
            if isinstance(node, ast.Attribute):
                names.add(node.attr)
            elif isinstance(node, ast.Constant) and isinstance(node.value, str):
                names.add(node.value)
    return names


def test_every_config_key_is_read_or_says_why_it_changes_nothing():
    """No silent leftovers: each key of each section is read by fzero outside the config
    package, or is marked as changing nothing (with why) or as accepted only at its
    default (with why another value is refused)."""
    read = _names_read_outside_the_config()
    silent = [
        f"{section.__name__}.{spec.name}"
        for section in _sections(Config)
        for spec in dataclasses.fields(section)
        if spec.name not in read and not spec.metadata
    ]
    assert not silent, f"config keys parsed and never read: {silent}"
    marked = [s for c in _sections(Config) for s in dataclasses.fields(c) if s.metadata]
    assert len(marked) >= 18 and all(len(next(iter(s.metadata.values()))) > 30 for s in marked)


@pytest.mark.parametrize(
    ("raw", "key", "allowed"),
    [
        ({"prescale_gradients": True}, "'prescale_gradients' is True", "only False"),
        ({"gradient_predivide_factor": 8}, "'gradient_predivide_factor' is 8.0", "only 1.0"),
        (
            {"zero_optimization": {"load_from_fp32_weights": False}},
            "'zero_optimization.load_from_fp32_weights' is False",
            "only True",
        ),
        (
            {"zero_optimization": {"ignore_unused_parameters": False}},
            "'zero_optimization.ignore_unused_parameters' is False",
            "only True",
        ),
        (
            {"zero_optimization": {"offload_optimizer": {"device": "cpu", "ratio": 0.5}}},
            "'zero_optimization.offload_optimizer.ratio' is 0.5",
            "only 1.0",
        ),
        (
            {"zero_optimization": {"offload_optimizer": {"super_offload": True}}},
            "'zero_optimization.offload_optimizer.super_offload' is True",
            "only False",
        ),
        (
            {"zero_optimization": {"stage3_model_persistence_threshold": 1000}},
            "'zero_optimization.stage3_model_persistence_threshold' is 1000",
            f"only {sys.maxsize}",
        ),
        (
            {"zero_optimization": {"model_persistence_threshold": 1000}},  # DeepSpeed's name
            "'zero_optimization.model_persistence_threshold' is 1000",
            f"only {sys.maxsize}",
        ),
        (
            {"zero_optimization": {"zero_quantized_nontrainable_weights": True}},
            "'zero_optimization.zero_quantized_nontrainable_weights' is True",
            "only False",
        ),
        (
            {"managed_gradient_accumulation": False},
            "'managed_gradient_accumulation' is False",
            "only True",
        ),
        ({"gradient_allreduce_op": "sum"}, "'gradient_allreduce_op' is 'sum'", "only 'mean'"),
        ({"sequence_parallel_size": 2}, "'sequence_parallel_size' is 2", "only 1"),
    ],
)
def test_keys_fzero_takes_only_at_their_default_refuse_other_values(raw, key, allowed):
    with pytest.raises(ConfigError, match=f"{re.escape(key)}; fzero allows {allowed}: "):
        load_config(raw)
    load_config(  # each at its default
        {
            "prescale_gradients": False,
            "gradient_predivide_factor": 1,
            "zero_optimization": {"load_from_fp32_weights": True, "ignore_unused_parameters": True},
        }
    )


def test_keys_that_change_nothing_take_any_value_of_their_type():
    config = load_config(
        {
            "memory_breakdown": True,
            "zero_allow_untested_optimizer": True,
            "zero_force_ds_cpu_optimizer": False,
            "disable_allgather": True,
            "disable_python_gc": True,
            "seq_parallel_communication_data_type": "bf16",
            "use_data_before_expert_parallelism": True,
            "vocabulary_size": 50257,
            "timers": {"throughput": {"enabled": False}},
            "zero_optimization": {"contiguous_gradients": False, "reduce_scatter": False},
        }
    )
    assert config.memory_breakdown is True
    assert config.zero_optimization.contiguous_gradients is False
    with pytest.raises(ConfigError, match="'memory_breakdown' must be true or false, found 3"):
        load_config({"memory_breakdown": 3})


def test_deepspeeds_field_names_and_deprecated_offload_keys_read_as_deepspeed_reads_them():
    """DeepSpeed's config takes its fields' own names beside the stage3_ keys, and reads
    `cpu_offload` / `cpu_offload_param` as the offload blocks (every key it knows, at its
    default, initialises under both: tests/deepspeed_reference)."""
    zero = load_config(
        {
            "zero_optimization": {
                "stage": 3,
                "max_live_parameters": 7,
                "max_reuse_distance": 8,
                "param_persistence_threshold": 9,
                "prefetch_bucket_size": 10,
                "gather_16bit_weights_on_model_save": True,
                "cpu_offload_param": True,
                "cpu_offload": True,
                "cpu_offload_use_pin_memory": True,
                "memory_efficient_linear": True,
                "use_multi_rank_bucket_allreduce": True,
                "stage3_module_granularity_threshold": 0,
                "override_module_apply": False,
            }
        }
    ).zero_optimization
    assert (zero.stage3_max_live_parameters, zero.stage3_max_reuse_distance) == (7, 8)
    assert (zero.stage3_param_persistence_threshold, zero.stage3_prefetch_bucket_size) == (9, 10)
    assert zero.stage3_gather_16bit_weights_on_model_save
    assert zero.offload_param.device == zero.offload_optimizer.device == "cpu"
    assert zero.override_module_apply is False
    with pytest.raises(ConfigError, match="given twice"):
        load_config(
            {"zero_optimization": {"max_live_parameters": 7, "stage3_max_live_parameters": 7}}
        )
    off = load_config({"zero_optimization": {"stage": 2, "cpu_offload": False}}).zero_optimization
    assert off.offload_optimizer.device == "none"
    # DeepSpeed's checkpoint block (any case of its modes) and aio's 0.19 name
    config = load_config(
        {"checkpoint": {"tag_validation": "fail"}, "aio": {"intra_op_parallelism": 4}}
    )
    assert (config.checkpoint.tag_validation, config.aio.thread_count) == ("fail", 4)
    with pytest.raises(ConfigError, match=r"'checkpoint\.tag_validation' is 'maybe'; allowed"):
        load_config({"checkpoint": {"tag_validation": "maybe"}})
    with pytest.raises(ConfigError, match=r"'checkpoint\.load_universal' is True; fzero allows"):
        load_config({"checkpoint": {"load_universal": True}})


def test_the_config_and_the_optimizer_registry_share_one_list_of_params():
    """`fused` (a torch/DeepSpeed implementation switch) is accepted by both; an unknown
    param is refused by the config with the registry's list."""
    config = load_config({"optimizer": {"type": "AdamW", "params": {"lr": 0.1, "fused": True}}})
    optimizer = fzero.optim.optimizer_from_name(config.optimizer.type, config.optimizer.params)
    assert optimizer.hparams.lr == 0.1
    assert fzero.optim.OPTIMIZER_PARAMS["sgd"] == {
        "lr", "momentum", "dampening", "weight_decay", "nesterov"
    }  # fmt: skip
    with pytest.raises(ConfigError, match=r"optimizer.params.\(sgd\).fused"):
        load_config({"optimizer": {"type": "SGD", "params": {"fused": True}}})


def test_optimizer_params_deepspeed_takes_at_one_value_here_are_accepted_there_only():
    """`amsgrad` false, Lamb's `eps_inside_sqrt` false and `fp32_optimizer_states` true
    (DeepSpeed's FusedAdam / FusedLamb / CPU Adam arguments) are accepted and change
    nothing; another value is refused naming the key, the value and the allowed one.
    `torch_adam` builds torch's AdamW in DeepSpeed, so its default weight decay (0.01)
    applies where the block leaves it out; Lamb's eps defaults to FusedLamb's 1e-8.
    (`make test-deepspeed` trains these blocks under DeepSpeed and compares.) A value of
    the wrong type is refused naming the key, the value and the type ("auto" is left
    for `resolve_auto`, and refused where an optimizer is built from it)."""
    build = fzero.optim.optimizer_from_name
    for kind, params in (
        ("Adam", {"amsgrad": False, "fp32_optimizer_states": True, "foreach": None}),
        ("Lamb", {"amsgrad": False, "eps_inside_sqrt": False}),
    ):
        config = load_config({"optimizer": {"type": kind, "params": params}})
        assert build(kind, config.optimizer.params).hparams == build(kind, {}).hparams
    for kind, key, value, allowed in (
        ("AdamW", "amsgrad", True, "False"),
        ("Lamb", "eps_inside_sqrt", True, "False"),
        ("Adam", "fp32_optimizer_states", False, "True"),
    ):
        block = {"type": kind, "params": {key: value}}
        with pytest.raises(ConfigError, match=rf"'optimizer.params.{key}' is {value}; allowed: "
                           rf"{allowed}"):  # fmt: skip
            load_config({"optimizer": block})
        with pytest.raises(ValueError, match=rf"'optimizer.params.{key}' is {value}"):
            build(kind, {key: value})
    for kind, key, want in (
        ("AdamW", {"lr": "1e-3"}, "'optimizer.params.lr' must be a number, found '1e-3'"),
        ("Lamb", {"betas": [0.9, 0.99, 0.9]},
         "'optimizer.params.betas' must be a list of 2 values, found [0.9, 0.99, 0.9]"),
        ("SGD", {"nesterov": "yes"}, "'optimizer.params.nesterov' must be true or false"),
        ("Muon", {"exclude": ["embed", 3]}, "'optimizer.params.exclude[1]' must be a string"),
    ):  # fmt: skip
        with pytest.raises(ConfigError, match=re.escape(want)):
            load_config({"optimizer": {"type": kind, "params": key}})
    for params, message in (
        ({"warmup_max_lr": "1e-3"}, "'scheduler.params.warmup_max_lr' must be a number, "
         "found '1e-3'"),
        ({"warmup_type": "cubic"}, "'scheduler.params.warmup_type' is 'cubic'; allowed: "
         "['log', 'linear']"),  # DeepSpeed warns and warms up logarithmically
    ):  # fmt: skip
        with pytest.raises(ConfigError, match=re.escape(message)):
            load_config({"scheduler": {"type": "WarmupLR", "params": params}})
    steps = {"warmup_num_steps": 1e3, "total_num_steps": 1e4}  # JSON's 1e3: DeepSpeed's too
    load_config({"scheduler": {"type": "WarmupDecayLR", "params": steps}})
    load_config({"optimizer": {"type": "AdamW", "params": {"lr": "auto", "betas": "auto"}}})
    with pytest.raises(ValueError, match=r"'optimizer.params.lr' is still \"auto\""):
        build("AdamW", {"lr": "auto"})
    assert build("AdamW", {"torch_adam": True}).hparams.weight_decay == 0.01
    assert build("Adam", {"torch_adam": True}).hparams.weight_decay == 0.01  # AdamW mode
    assert build("Adam", {"torch_adam": True, "adam_w_mode": False}).hparams.weight_decay == 0.0
    assert build("AdamW", {"torch_adam": True, "weight_decay": 0.2}).hparams.weight_decay == 0.2
    assert build("AdamW", {}).hparams.weight_decay == 0.0  # FusedAdam's
    assert build("Lamb", {}).hparams.eps == 1e-8


def test_hpz_and_mics_groups_beside_a_whole_world_plan_agree_with_it_or_are_refused():
    """A plan of the whole world runs groups of every rank; a smaller group asks for a
    plan on a mesh (the engine makes one; `fzero.init`/`train_step` are given one)."""
    from fzero.config import load_config
    from fzero.core.init import check_group_keys

    for zero in (
        {"stage": 3, "zero_hpz_partition_size": 1, "mics_shard_size": -1},
        {"stage": 3, "zero_hpz_partition_size": 4},
        {"stage": 3, "mics_shard_size": 4, "mics_hierarchical_params_gather": True},
        {"stage": 2, "zero_hpz_partition_size": 2},  # no effect below stage 3 (DeepSpeed)
    ):
        check_group_keys(load_config({"zero_optimization": zero}), 4)
    for key, value in (("zero_hpz_partition_size", 2), ("mics_shard_size", 2)):
        config = load_config({"zero_optimization": {"stage": 3, key: value}})
        with pytest.raises(ValueError, match=rf"{key} is 2 on 4 ranks, but the plan is of"):
            check_group_keys(config, 4)
