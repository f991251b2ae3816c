"""DeepSpeed scripts run unchanged: `fzero run --as-deepspeed -n 2 script.py --deepspeed
--deepspeed_config ds.json`, each script written for DeepSpeed (`import deepspeed`, its
names and calls) with nothing changed but its data, its results against plain torch.

The scripts (tests/ds_scripts/) take the shapes of the four kinds a new user brought:
a CIFAR classifier (loader from `initialize`, `get_accelerator`), a GAN of two engines
(client optimizers, raw-module forwards, `optimizer.step()`), bf16 with a PyTorch-style
`loss.backward()`, and masked-LM pre-training (`zero.Init`, ZeRO-3 + CPU offload,
checkpoint save and resume).
"""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

from tests._dist import run_script as run_fzero_script

SCRIPTS = Path(__file__).resolve().parent / "ds_scripts"
ROOT = SCRIPTS.parent.parent


@pytest.fixture(autouse=True)
def scripts_importable():
    """The scripts' models and data, imported here with `deepspeed` served by fzero."""
    from fzero import compat

    was_installed = compat.installed()
    compat.install()
    sys.path.insert(0, str(SCRIPTS))
    yield
    sys.path.remove(str(SCRIPTS))
    for name in ("cifar", "gan", "mlm_offload"):
        sys.modules.pop(name, None)
    if not was_installed:
        compat.uninstall()


def run_script(tmp_path: Path, script: str, config: dict, *args: str) -> str:
    """Run `script` as `fzero run --as-deepspeed -n 2` runs it, on the test ranks
    (`tests._dist.run_script`); returns its stderr."""
    config_path = tmp_path / "ds_config.json"
    config_path.write_text(json.dumps(config))
    done = run_fzero_script(
        "--as-deepspeed", "-n", "2", str(SCRIPTS / script),
        "--deepspeed", "--deepspeed_config", str(config_path), *args, cwd=ROOT,
    )  # fmt: skip
    return done.stderr


def test_cifar_classifier_matches_torch(tmp_path):
    import cifar

    config = {
        "train_batch_size": 8,
        "train_micro_batch_size_per_gpu": 4,
        "steps_per_print": 100,
        "gradient_clipping": 0.0,  # against unclipped torch (DeepSpeed's default is 1.0)
        "optimizer": {"type": "Adam", "params": {"lr": 0.01, "weight_decay": 0.01}},
        "zero_optimization": {"stage": 1},
    }
    stderr = run_script(tmp_path, "cifar.py", config, "--out", str(tmp_path / "out.json"))
    first = next(line for line in stderr.splitlines() if "fzero" in line)
    assert "`import deepspeed` is served by fzero" in first  # the first word from fzero
    result = json.loads((tmp_path / "out.json").read_text())

    torch.manual_seed(0)
    net = cifar.Net()
    opt = torch.optim.AdamW(net.parameters(), lr=0.01, weight_decay=0.01)
    data = cifar.dataset()
    order = torch.randperm(len(data), generator=torch.Generator().manual_seed(0))
    per_rank = [order[r::2] for r in range(2)]  # DistributedSampler, shuffle, seed 0
    losses, norms = [], []
    for step in range(len(per_rank[0]) // 4):
        rows = torch.cat([idx[4 * step : 4 * step + 4] for idx in per_rank])
        images, labels = data.tensors[0][rows], data.tensors[1][rows]
        opt.zero_grad()
        loss = nn.functional.cross_entropy(net(images), labels)
        loss.backward()
        norms.append(torch.sqrt(sum(p.grad.double().square().sum() for p in net.parameters())))
        opt.step()
        losses.append(loss.item())
    torch.testing.assert_close(result["losses"], losses, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(result["norms"], [n.item() for n in norms], rtol=1e-4, atol=0)
    assert result["lr"] == 0.01


def test_two_engine_gan_matches_torch(tmp_path):
    import gan

    config = {"train_batch_size": 8, "zero_optimization": {"stage": 3}, "steps_per_print": 0}
    run_script(tmp_path, "gan.py", config, "--out", str(tmp_path / "out.json"))
    result = json.loads((tmp_path / "out.json").read_text())

    net_g, net_d = gan.models()
    opt_d = torch.optim.Adam(net_d.parameters(), lr=0.01, betas=(0.5, 0.999))
    opt_g = torch.optim.Adam(net_g.parameters(), lr=0.01, betas=(0.5, 0.999))
    bce = nn.BCELoss()
    for step in range(3):
        pieces = [gan.batch(step, rank, 4) for rank in range(2)]
        real, noise = torch.cat([p[0] for p in pieces]), torch.cat([p[1] for p in pieces])
        net_d.zero_grad()
        bce(net_d(real), torch.ones(8, 1)).backward()
        fake = net_g(noise)
        bce(net_d(fake.detach()), torch.zeros(8, 1)).backward()
        opt_d.step()
        net_g.zero_grad()
        bce(net_d(fake), torch.ones(8, 1)).backward()
        opt_g.step()
    expected = {
        **{f"g.{k}": v for k, v in net_g.state_dict().items()},
        **{f"d.{k}": v for k, v in net_d.state_dict().items()},
    }
    assert result.keys() == expected.keys()
    for name, value in expected.items():
        torch.testing.assert_close(torch.tensor(result[name]), value, rtol=1e-5, atol=1e-6)


def test_torch_style_backward_equals_engine_backward_in_bf16(tmp_path):
    config = {
        "train_micro_batch_size_per_gpu": 4,
        "gradient_accumulation_steps": 2,
        "bf16": {"enabled": True},
        "torch_autocast": {"enabled": True, "dtype": "torch.bfloat16"},  # as DeepSpeed's example
        "zero_optimization": {"stage": 2},
        "optimizer": {"type": "AdamW", "params": {"lr": 0.01}},
        "scheduler": {"type": "WarmupLR", "params": {"warmup_max_lr": 0.01, "warmup_num_steps": 3}},
        "steps_per_print": 0,
    }
    run_script(tmp_path, "torch_style.py", config, "--out", str(tmp_path / "torch.json"))
    run_script(
        tmp_path, "torch_style.py", config, "--engine-backward", "--out", str(tmp_path / "e.json")
    )
    plain = json.loads((tmp_path / "torch.json").read_text())
    classic = json.loads((tmp_path / "e.json").read_text())
    assert plain == classic  # bitwise: the same reduction, the same 1/accumulation
    assert plain["losses"][-1] < plain["losses"][0]


@pytest.mark.parametrize("stage", [3])
def test_mlm_zero3_offload_checkpoint_resume_matches_torch(tmp_path, stage):
    import mlm_offload

    config = {
        "train_batch_size": 4,
        "train_micro_batch_size_per_gpu": 2,
        "steps_per_print": 0,
        "gradient_clipping": 0.0,  # against unclipped torch (DeepSpeed's default is 1.0)
        "optimizer": {"type": "AdamW", "params": {"lr": 0.01, "weight_decay": 0.01}},
        "zero_optimization": {
            "stage": stage,
            "offload_optimizer": {"device": "cpu"},
            "stage3_param_persistence_threshold": 0,
        },
    }
    out = str(tmp_path)
    run_script(tmp_path, "mlm_offload.py", config, "--output_dir", out, "--save_at", "3")
    run_script(tmp_path, "mlm_offload.py", config, "--output_dir", out, "--resume")
    full = json.loads((tmp_path / "run.json").read_text())
    resumed = json.loads((tmp_path / "resumed.json").read_text())
    assert resumed["losses"] == full["losses"][3:]  # exact resume
    assert resumed["state"] == full["state"]

    torch.manual_seed(0)
    model = mlm_offload.TinyMLM()
    opt = torch.optim.AdamW(model.parameters(), lr=0.01, weight_decay=0.01)
    losses = []
    for step in range(6):
        pieces = [mlm_offload.batch(step, rank, 2) for rank in range(2)]
        per_rank = [model(tokens, labels) for tokens, labels in pieces]
        loss = sum(per_rank) / 2  # each rank's mean, averaged: what the engine reduces
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    torch.testing.assert_close(full["losses"], losses, rtol=1e-5, atol=1e-6)
    for name, value in model.state_dict().items():
        torch.testing.assert_close(torch.tensor(full["state"][name]), value, rtol=1e-4, atol=1e-5)


def _trainer(tmp_path: Path, out: str, *args: str, deepspeed: dict | None = None) -> Path:
    """The Trainer script under `fzero run -n 2`: with `deepspeed`, as DeepSpeed runs it
    (`--as-deepspeed`, `--deepspeed ds_config.json`); without, plain Trainer DDP."""
    command: list[str] = []
    extra: list[str] = []
    if deepspeed is not None:
        (tmp_path / "ds_config.json").write_text(json.dumps(deepspeed))
        command.append("--as-deepspeed")
        extra = ["--deepspeed", str(tmp_path / "ds_config.json")]
    command += ["-n", "2", str(SCRIPTS / "hf_trainer.py"), "--output_dir", str(tmp_path / out)]
    command += ["--max_steps", "4", "--per_device_train_batch_size", "4", "--use_cpu"]
    command += ["--report_to", "none", "--save_steps", "2", *extra, *args]
    run_fzero_script(*command, cwd=ROOT)
    return tmp_path / out


@pytest.mark.slow  # in `make test-slow`: keeps `make test` near 8 minutes
def test_transformers_trainer_zero2_offload_and_zero3_match_ddp_and_resume_exactly(tmp_path):
    """`--deepspeed` with an "auto" config, ZeRO-2 with CPU optimizer offload: Accelerate
    drives fzero's engine (a scheduler callable, caller-managed accumulation boundaries);
    the weights equal plain Trainer DDP's to fp32 rounding, and `--resume_from_checkpoint`
    from the step-2 checkpoint ends bitwise where the uninterrupted run did. ZeRO-3 (the
    model built by its constructor; `save_model` through the 16-bit consolidation) equals
    DDP's too, and so does ZeRO-2 with offload and no optimizer block (the Trainer's own
    torch AdamW, handed over by Accelerate)."""
    pytest.importorskip("accelerate")
    transformers = pytest.importorskip("transformers")
    from safetensors.torch import load_file

    config = {
        "train_batch_size": "auto",
        "train_micro_batch_size_per_gpu": "auto",
        "gradient_accumulation_steps": "auto",
        "gradient_clipping": "auto",
        "zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"}},
        "optimizer": {"type": "AdamW", "params": {"lr": "auto", "weight_decay": "auto"}},
    }
    zero = _trainer(tmp_path, "zero2", deepspeed=config)
    ddp = _trainer(tmp_path, "ddp")
    stage3 = {"stage": 3, "stage3_gather_16bit_weights_on_model_save": True}
    zero3 = _trainer(tmp_path, "zero3", deepspeed={**config, "zero_optimization": stage3})
    assert (zero / "checkpoint-2" / "latest").read_text() == "global_step2"
    ours, theirs = load_file(zero / "model.safetensors"), load_file(ddp / "model.safetensors")
    loaded = transformers.BertForSequenceClassification.from_pretrained(zero).state_dict()
    assert all(torch.equal(loaded[k], v) for k, v in ours.items())
    assert ours.keys() == theirs.keys()
    for name, value in theirs.items():
        torch.testing.assert_close(ours[name], value, rtol=0, atol=1e-6, msg=name)
    consolidated = load_file(zero3 / "model.safetensors")
    for name, value in theirs.items():
        torch.testing.assert_close(consolidated[name], value, rtol=0, atol=1e-6, msg=name)
    # no optimizer block: the Trainer's own torch AdamW, through Accelerate, offloaded
    client = {k: v for k, v in config.items() if k != "optimizer"}
    torch_adamw = load_file(_trainer(tmp_path, "client", deepspeed=client) / "model.safetensors")
    for name, value in theirs.items():
        torch.testing.assert_close(torch_adamw[name], value, rtol=0, atol=1e-6, msg=name)
    resumed = tmp_path / "resumed"
    resumed.mkdir()
    shutil.copytree(zero / "checkpoint-2", resumed / "checkpoint-2")
    _trainer(
        tmp_path, "resumed", "--resume_from_checkpoint", str(resumed / "checkpoint-2"),
        deepspeed=config,
    )  # fmt: skip
    again = load_file(resumed / "model.safetensors")
    for name, value in ours.items():
        assert torch.equal(again[name], value), name


@pytest.mark.slow  # with the other Trainer runs, the suite neared 9 minutes
def test_transformers_from_config_inside_zero_init_initialises_like_hf_and_trains_like_ddp(
    tmp_path,
):
    """ZeRO-3 with `from_config`: Transformers builds the model inside
    `deepspeed.zero.Init` (patching `partition_parameters`), re-initialises it on rank 0
    under `GatheredParameters(modifier_rank=0)`; every rank starts from rank 0's weights,
    which are Transformers' own initialisation (normal(0, 0.02) matrices, zero biases,
    unit LayerNorm), and training from them equals plain Trainer DDP's from the same."""
    pytest.importorskip("accelerate")
    from safetensors.torch import load_file

    config = {
        "train_batch_size": "auto",
        "train_micro_batch_size_per_gpu": "auto",
        "gradient_accumulation_steps": "auto",
        "gradient_clipping": "auto",
        "zero_optimization": {"stage": 3, "stage3_gather_16bit_weights_on_model_save": True},
        "optimizer": {"type": "AdamW", "params": {"lr": "auto", "weight_decay": "auto"}},
    }
    init = str(tmp_path / "init")
    zero3 = _trainer(tmp_path, "zero3", "--from_config", "--save_init", init, deepspeed=config)
    first, second = load_file(f"{init}-rank0.safetensors"), load_file(f"{init}-rank1.safetensors")
    assert all(torch.equal(first[k], second[k]) for k in first)
    query = first["bert.encoder.layer.0.attention.self.query.weight"]
    assert abs(float(query.std()) - 0.02) < 0.004
    assert not first["bert.encoder.layer.0.attention.self.query.bias"].any()
    assert torch.equal(first["bert.embeddings.LayerNorm.weight"], torch.ones(32))
    ddp = _trainer(tmp_path, "ddp", "--init_from", f"{init}-rank0.safetensors")
    ours, theirs = load_file(zero3 / "model.safetensors"), load_file(ddp / "model.safetensors")
    for name, value in theirs.items():
        torch.testing.assert_close(ours[name], value, rtol=0, atol=1e-6, msg=name)


# DeepSpeed's bf16 master-weight example's two configs (training/bf16_master_weight/configs)
_BF16_BASELINE = {
    "train_micro_batch_size_per_gpu": 4,
    "gradient_accumulation_steps": 1,
    "steps_per_print": 100,
    "optimizer": {
        "type": "AdamW",
        "params": {"lr": 1e-3, "betas": [0.9, 0.999], "eps": 1e-8, "weight_decay": 0.01},
    },
    "bf16": {"enabled": True},
    "zero_optimization": {
        "stage": 3,
        "overlap_comm": True,
        "contiguous_gradients": True,
        "reduce_bucket_size": 5e7,
        "stage3_param_persistence_threshold": 0,
    },
    "torch_autocast": {"enabled": False},
}
_BF16_FULL = {
    **_BF16_BASELINE,
    "bf16": {
        "enabled": True,
        "bf16_master_weights_and_grads": True,
        "bf16_optimizer_states": True,
    },
    "torch_autocast": {"enabled": True, "dtype": "torch.bfloat16"},
}


@pytest.mark.slow  # two 2-rank launches of 40 steps (about 35 s)
def test_deepspeed_bf16_master_weight_example_trains_like_its_baseline(tmp_path):
    """The bf16 master-weight example's shape (`--deepspeed_config` file, plain
    `loss.backward()`, autocast from the JSON) with its own two configs, ZeRO-3 on 2
    ranks: both learn the pattern, bf16 masters and states end within 5% of fp32's."""
    final = {}
    for name, config in (("baseline", _BF16_BASELINE), ("bf16_full", _BF16_FULL)):
        path = tmp_path / f"{name}.json"
        path.write_text(json.dumps(config))
        log = tmp_path / f"{name}.csv"
        done = run_fzero_script(
            "--as-deepspeed", "-n", "2", str(SCRIPTS / "bf16_master_weight.py"),
            "--deepspeed_config", str(path), "--num_steps", "40", "--loss_log_file", str(log),
            cwd=ROOT,
        )  # fmt: skip
        assert f"SUMMARY: config={path} params=" in done.stdout
        losses = [float(line.split(",")[1]) for line in log.read_text().splitlines()[1:]]
        assert len(losses) == 40 and sum(losses[-5:]) < 0.5 * sum(losses[:5])
        final[name] = sum(losses[-10:]) / 10
    assert abs(final["bf16_full"] - final["baseline"]) < 0.05 * final["baseline"]
