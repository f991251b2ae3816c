"""Smoke tests of the examples: a few steps as under `fzero run -n 2`, the loss falls, and
a checkpoint round-trips."""

from __future__ import annotations

import json
import math
import re
import shutil
from pathlib import Path

import pytest

from tests._dist import run_script

ROOT = Path(__file__).resolve().parent.parent
BERT = ROOT / "examples" / "bert_pretraining"


def _fzero_run(script: Path, *args: str, launcher: tuple = (), processes: int = 2) -> str:
    """The script as `fzero run -n N` runs each process, on the test ranks
    (`tests._dist.run_script`; the launcher itself is tested in test_launcher and
    test_engine_features); returns every rank's stdout."""
    return run_script(*launcher, "-n", str(processes), str(script), *args, cwd=ROOT).stdout


@pytest.mark.slow  # in `make test-slow`: keeps `make test` near 8 minutes
def test_bert_pretraining_zero3_loss_falls_and_resumes(tmp_path):
    pytest.importorskip("transformers")
    config = json.loads((BERT / "ds_config_zero3.json").read_text())
    config["scheduler"]["params"].update(total_steps=12, warmup_proportion=0.1)
    (tmp_path / "ds.json").write_text(json.dumps(config))
    common = ["--deepspeed", "--deepspeed_config", str(tmp_path / "ds.json")]
    common += ["--output_dir", str(tmp_path / "out"), "--print_steps", "1"]
    first = _fzero_run(BERT / "train.py", *common, "--max_steps", "8", "--checkpoint_steps", "4")
    losses = [float(x) for x in re.findall(r"mlm loss ([\d.]+)", first)]
    assert len(losses) == 8 and losses[-1] < losses[0] - 0.05, losses
    checkpoints = tmp_path / "out" / "checkpoints"
    assert (checkpoints / "latest").read_text() == "epoch0_step8"
    resumed = _fzero_run(
        BERT / "train.py", *common, "--max_steps", "10",
        "--load_training_checkpoint", str(checkpoints), "--load_checkpoint_id", "epoch0_step4",
    )  # fmt: skip
    assert "resumed from" in resumed and "at step 4" in resumed
    again = [float(x) for x in re.findall(r"mlm loss ([\d.]+)", resumed)]
    assert again[:4] == losses[4:8]  # the same steps 5-8 as the uninterrupted run


def test_functional_api_example_prints_a_plan_and_memory_equal_to_it(tmp_path):
    script = ROOT / "examples" / "functional_api.py"
    out = _fzero_run(script, "--steps", "20", "--save_dir", str(tmp_path))
    assert "into stage 2, default plan: identical True" in out
    assert "plan: strategy=flat_even stage=3 world_size=2" in out and "unit 4 " in out
    for rank in (0, 1):
        match = re.search(rf"rank {rank}: loss ([\d.]+) -> ([\d.]+); .*\(equal\)", out)
        assert match and float(match[2]) < float(match[1]) / 2, out


def test_bert_classification_learns_and_its_checkpoint_loads_into_the_model(tmp_path):
    transformers = pytest.importorskip("transformers")
    from fzero.checkpoint import consolidated_state_dict

    script = ROOT / "examples" / "bert_classification" / "train.py"
    config = str(ROOT / "examples" / "bert_classification" / "ds_config.json")
    out = _fzero_run(
        script, "--deepspeed_config", config, "--epochs", "5", "--output_dir", str(tmp_path)
    )
    losses = [float(x) for x in re.findall(r"loss ([\d.]+) held-out", out)]
    accuracy = [float(x) for x in re.findall(r"accuracy ([\d.]+)", out)]
    assert len(losses) == 5 and losses[-1] < losses[0] - 0.1 and accuracy[-1] >= 0.8, out
    state = consolidated_state_dict(str(tmp_path / "checkpoints"))
    config = transformers.BertConfig(
        vocab_size=state["bert.embeddings.word_embeddings.weight"].shape[0], hidden_size=128,
        num_hidden_layers=2, num_attention_heads=2, intermediate_size=512,
        max_position_embeddings=128, num_labels=2,
    )  # fmt: skip
    transformers.BertForSequenceClassification(config).load_state_dict(state)  # strict


@pytest.mark.slow  # in `make test-slow`: keeps `make test` near 8 minutes
def test_t5_translation_zero2_offload_auto_config_and_from_pretrained(tmp_path):
    transformers = pytest.importorskip("transformers")
    import torch

    from fzero.checkpoint import consolidated_state_dict

    t5 = ROOT / "examples" / "t5_translation"
    out = _fzero_run(
        t5 / "train.py", "--deepspeed", str(t5 / "ds_config_zero2.json"),
        "--per_device_train_batch_size", "16", "--per_device_eval_batch_size", "16",
        "--do_train", "--do_eval", "--output_dir", str(tmp_path), "--overwrite_output_dir",
        "--max_train_samples", "512", "--max_eval_samples", "64", "--num_train_epochs", "3",
        "--source_lang", "en", "--target_lang", "en_rev",
    )  # fmt: skip
    losses = [float(x) for x in re.findall(r"eval loss ([\d.]+) bleu", out)]
    assert len(losses) == 3 and losses[-1] < losses[0], out
    loaded = transformers.T5ForConditionalGeneration.from_pretrained(str(tmp_path)).state_dict()
    saved = consolidated_state_dict(str(tmp_path / "checkpoints"))
    assert all(torch.equal(loaded[k], saved[k]) for k in saved)


@pytest.mark.slow  # with the other Trainer runs, the suite neared 9 minutes
def test_t5_seq2seq_trainer_zero3_generates_and_evaluates_as_plain_pytorch(tmp_path):
    """`run_translation.py` through `Seq2SeqTrainer --deepspeed` at ZeRO-3: the model made
    inside `zero.Init`, trained, evaluated and predicted with `generate(synced_gpus=True)`;
    `save_model` writes the consolidated weights. Plain Trainer DDP loading them with
    `from_pretrained` evaluates and predicts the same, and so does ZeRO-3 loading them
    (`from_pretrained` inside `zero.Init`, rank 0 loading under GatheredParameters)."""
    pytest.importorskip("accelerate")
    t5 = ROOT / "examples" / "t5_translation"
    common = (
        "--use_cpu", "--report_to", "none", "--per_device_train_batch_size", "8",
        "--per_device_eval_batch_size", "8", "--max_train_samples", "512",
        "--max_eval_samples", "16", "--num_train_epochs", "1", "--learning_rate", "3e-3",
        "--predict_with_generate",
        "--do_eval", "--do_predict",
    )  # fmt: skip
    zero3 = ("--deepspeed", str(t5 / "ds_config_zero3.json"))
    trained = tmp_path / "trained"
    _fzero_run(
        t5 / "run_translation.py", *common, *zero3, "--do_train", "--output_dir", str(trained),
        launcher=("--as-deepspeed",),
    )  # fmt: skip
    runs = {"zero3 trained": trained}
    for name, extra in (("ddp", ()), ("zero3", zero3)):
        out = tmp_path / name
        (out / "tokenizer").mkdir(parents=True)
        shutil.copy(trained / "tokenizer" / "vocab.txt", out / "tokenizer" / "vocab.txt")
        _fzero_run(
            t5 / "run_translation.py", *common, *extra, "--model_name_or_path", str(trained),
            "--output_dir", str(out), launcher=("--as-deepspeed",) if extra else (),
        )  # fmt: skip
        runs[name] = out
    results = {
        name: (
            json.loads((out / "eval_results.json").read_text())["eval_loss"],
            (out / "generated_predictions.txt").read_text(),
        )
        for name, out in runs.items()
    }
    loss, predictions = results["ddp"]
    assert loss < math.log(3000) - 1  # learnt: an untrained model's is about ln(vocab size)
    assert len(predictions.splitlines()) == 16 and predictions.strip()
    for name, (other_loss, other_predictions) in results.items():
        assert other_loss == pytest.approx(loss, rel=1e-5), name
        assert other_predictions == predictions, name


def test_readme_functional_api_example_runs_as_written(tmp_path):
    """The README's functional example, cut out of the README and run under `fzero run
    -n 2` as it stands (tests/test_docs.py runs it in one process): it trains and saves
    a checkpoint the engine's loader reads."""
    readme = (ROOT / "README.md").read_text()
    section = readme[readme.index("## The functional door") :]
    code = section.split("```python\n", 1)[1].split("```", 1)[0]
    script = tmp_path / "train.py"
    script.write_text(code.replace('"ckpt"', repr(str(tmp_path / "ckpt"))))
    out = _fzero_run(script)
    losses = [float(v) for v in re.findall(r"loss ([\d.]+)", out)]
    assert len(losses) == 2 and max(losses) < math.log(4), out  # each rank its own batches
    assert (tmp_path / "ckpt" / "latest").read_text() == "global_step30"


@pytest.mark.slow
def test_custom_partitioning_example_trains_a_mesh_plan_through_both_doors(tmp_path):
    script = ROOT / "examples" / "custom_partitioning.py"
    out = _fzero_run(script, "--steps", "30", "--out", str(tmp_path), processes=4)
    assert "preset=mics_small_whole stage=3 mesh=node=2 x local=2 (4 processes; 2 shards" in out
    assert "params           whole replicate(node, local)" in out  # the small unit
    assert "gradients across replicas       node" in out
    match = re.search(r"loss ([\d.]+) -> ([\d.]+) \(train_step\), ([\d.]+) -> ([\d.]+)", out)
    assert match and float(match[2]) < float(match[1]) / 2, out
    assert match[2] == match[4] and "weights identical: True" in out
    assert "restored under preset mics: identical True" in out
