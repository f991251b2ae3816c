"""Sharded checkpoints: exact resume, resharding N -> M across stages, consolidation,
damage and pickle refused, crash safety, async save."""

from __future__ import annotations

import logging
import os
import pickle
import re
import shutil
import subprocess
import sys
import textwrap
import warnings
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file
from torch import nn

import fzero
from fzero import cli
from fzero.checkpoint import CheckpointError, consolidate, consolidated_state_dict, inspect
from tests._dist import run_world
from tests.models import Awkward, Net, global_batch

ROOT = Path(__file__).resolve().parent.parent
MICRO, LR, GLOBAL = 2, 1e-2, 8


def _engine(stage, precision="fp32", accum=None, world=1, seed=0, model=None, **zero):
    torch.manual_seed(seed)
    config = {
        "train_batch_size": GLOBAL if accum is None else MICRO * accum * world,
        "train_micro_batch_size_per_gpu": MICRO,
        "steps_per_print": 0,
        "zero_optimization": {"stage3_param_persistence_threshold": 0, **zero},
    }
    if precision == "fp16":
        config["fp16"] = {"enabled": True, "initial_scale_power": 12, "loss_scale_window": 2}
    return fzero.shard(
        model or Net(),
        stage=stage,
        optimizer=fzero.optim.adamw(lr=LR, weight_decay=0.01),
        precision=precision,
        config=config,
    )


def _train(engine, rank, world, steps, first_step):
    """`steps` optimizer steps on global batches of GLOBAL rows, whatever the world size."""
    losses = []
    accum = engine.gradient_accumulation_steps()
    for step in range(first_step, first_step + steps):
        x, y = global_batch(step, MICRO * accum * world)
        for i in range(accum):
            rows = slice((i * world + rank) * MICRO, (i * world + rank + 1) * MICRO)
            loss = nn.functional.mse_loss(engine(x[rows]).float(), y[rows])
            engine.backward(loss)
            engine.step()
            losses.append(loss.item())
    return losses


def _snapshot(engine):
    """This rank's masters and optimizer state, and the counters, for bitwise comparison."""
    tensors = []
    for rt in engine.units:
        tensors.append(rt.master.clone())
        tensors.extend(t.clone() for t in rt.state if isinstance(t, torch.Tensor))
    scale = tuple(engine.loss_scale_state) if engine.loss_scale_state else None
    counters = (engine.global_steps, engine.micro_steps, engine.skipped_steps, engine.lr_steps)
    return tensors, scale, counters, [rt.state.step for rt in engine.units]


# ---- exact resume ---------------------------------------------------------------------

CASES = [(stage, precision) for stage in range(4) for precision in ("fp32", "bf16", "fp16")]


def resume_first_run(rank, world, root):
    out = {}
    for stage, precision in CASES:
        engine = _engine(stage, precision, accum=2, world=world)
        _train(engine, rank, world, 3, 0)
        engine.save_checkpoint(f"{root}/{stage}-{precision}", client_state={"epoch": 7})
        draw = torch.rand(2)  # RNG right after the save
        losses = _train(engine, rank, world, 2, 3)
        out[(stage, precision)] = (losses, _snapshot(engine), draw)
    return out


def resume_second_run(rank, world, root):
    out = {}
    for stage, precision in CASES:
        engine = _engine(stage, precision, accum=2, world=world, seed=123)  # other weights
        path, client = engine.load_checkpoint(f"{root}/{stage}-{precision}")
        assert client == {"epoch": 7} and path.endswith("global_step3")
        draw = torch.rand(2)
        losses = _train(engine, rank, world, 2, 3)
        out[(stage, precision)] = (losses, _snapshot(engine), draw)
    return out


def test_resume_is_exact_for_every_stage_and_precision(tmp_path):
    first = run_world(resume_first_run, 2, str(tmp_path))
    second = run_world(resume_second_run, 2, str(tmp_path))
    for case in CASES:
        (losses, (tensors, scale, counters, steps), draw) = first[case]
        (losses2, (tensors2, scale2, counters2, steps2), draw2) = second[case]
        assert losses == losses2, case
        assert all(torch.equal(a, b) for a, b in zip(tensors, tensors2, strict=True)), case
        assert (scale, counters, steps) == (scale2, counters2, steps2), case
        assert torch.equal(draw, draw2), case  # RNG states restored
    assert first[(0, "fp16")][1][1][0] > 2**12  # the fp16 loss scale grew: its state matters


def mid_accumulation_case(rank, world, root):
    engine = _engine(2, accum=2, world=world)
    _train(engine, rank, world, 1, 0)
    x, y = global_batch(1, MICRO * 2 * world)
    rows = slice(rank * MICRO, (rank + 1) * MICRO)
    engine.backward(nn.functional.mse_loss(engine(x[rows]), y[rows]))
    engine.step()  # first micro step of step 1: not a boundary
    engine.save_checkpoint(root)
    rows = slice((world + rank) * MICRO, (world + rank + 1) * MICRO)
    engine.backward(nn.functional.mse_loss(engine(x[rows]), y[rows]))
    engine.step()
    after = _snapshot(engine)[0]
    resumed = _engine(2, accum=2, world=world, seed=5)
    resumed.load_checkpoint(root)
    resumed.backward(nn.functional.mse_loss(resumed(x[rows]), y[rows]))
    resumed.step()
    other_stage = _engine(3, accum=2, world=world)
    with pytest.raises(CheckpointError, match="mid gradient-accumulation"):
        other_stage.load_checkpoint(root)
    return after, _snapshot(resumed)[0]


def test_mid_accumulation_save_resumes_exactly_and_only_into_the_same_layout(tmp_path):
    after, resumed = run_world(mid_accumulation_case, 2, str(tmp_path))
    assert all(torch.equal(a, b) for a, b in zip(after, resumed, strict=True))


# ---- resharding -------------------------------------------------------------------------

K, N = 2, 2


def reference_state():
    torch.manual_seed(0)
    model = Net()
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.01)
    losses = []
    for step in range(K + N):
        x, y = global_batch(step, GLOBAL)
        loss = nn.functional.mse_loss(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses, model.state_dict()


def save_all_stages(rank, world, root):
    for stage in range(4):
        engine = _engine(stage, world=world)
        _train(engine, rank, world, K, 0)
        engine.save_checkpoint(f"{root}/w{world}s{stage}")


def load_every_checkpoint(rank, world, root):
    messages = []
    handler = logging.Handler()
    handler.emit = lambda record: messages.append(record.getMessage())
    logging.getLogger("fzero").addHandler(handler)
    out = {}
    for old_world in (1, 2, 4):
        for old_stage in range(4):
            for stage in range(4):
                engine = _engine(stage, world=world, seed=99)
                engine.load_checkpoint(f"{root}/w{old_world}s{old_stage}")
                _train(engine, rank, world, N, K)
                out[(old_world, old_stage, stage)] = engine.state_dict()
    return out, messages


@pytest.mark.slow
def test_checkpoints_reshard_across_world_sizes_and_stages(tmp_path):
    for world in (1, 2, 4):
        run_world(save_all_stages, world, str(tmp_path))
    _, expected = reference_state()
    for world in (1, 2, 4):
        results, messages = run_world(load_every_checkpoint, world, str(tmp_path))
        assert len(results) == 48
        for case, state in results.items():
            for name, value in expected.items():
                error = ((state[name] - value).abs().max() / value.abs().max()).item()
                assert error <= 1e-5, (world, case, name, error)
        if world == 2:  # from world 4 (accumulation 1) to world 2: accumulation 2
            assert any(
                "saved at world size 4 (gradient_accumulation_steps 1) loaded at world size 2"
                ": gradient_accumulation_steps is now 2" in m
                for m in messages
            )


# ---- consolidation ------------------------------------------------------------------------


def consolidate_case(rank, world, root):
    engine = _engine(
        3, world=world, model=Awkward(), stage3_gather_16bit_weights_on_model_save=True
    )
    x = torch.randint(0, 11, (MICRO, 5), generator=torch.Generator().manual_seed(rank))
    engine.backward(engine(x).float().square().mean())
    engine.step()
    engine.save_checkpoint(root, tag="t1")
    engine.save_16bit_model(f"{root}/export")
    return engine.state_dict(dtype=torch.float32)


def test_consolidation_gives_the_models_own_state_dict(tmp_path, capsys):
    expected = run_world(consolidate_case, 2, str(tmp_path / "ckpt"))
    state = consolidated_state_dict(str(tmp_path / "ckpt"))
    assert list(state) == list(expected)  # the model's keys, tied weights under both names
    assert all(torch.equal(state[k], v) for k, v in expected.items())
    files = consolidate(str(tmp_path / "ckpt"), str(tmp_path / "one"), dtype="bf16")
    assert [Path(f).name for f in files] == ["model.safetensors"]
    model = Awkward()
    model.load_state_dict(load_file(files[0]))  # strict: every key, right shapes
    assert torch.equal(model.head.weight, expected["head.weight"].to(torch.bfloat16).float())
    with safe_open(files[0], "pt") as f:
        assert f.metadata() == {"format": "pt"}
    command = ["checkpoint", "consolidate", str(tmp_path / "ckpt"), str(tmp_path / "sharded")]
    capsys.readouterr()
    assert cli.main([*command, "--tag", "t1", "--max-shard-size", "200B"]) == 0  # `fzero ...`
    printed = capsys.readouterr().out
    index = (tmp_path / "sharded" / "model.safetensors.index.json").read_text()
    shards = sorted((tmp_path / "sharded").glob("model-*-of-*.safetensors"))
    assert len(shards) > 2 and all(str(s) in printed for s in shards)
    merged = {}
    for shard in shards:
        merged.update(load_file(shard))
    assert set(merged) == set(expected) and '"weight_map"' in index
    assert all(torch.equal(merged[k], v) for k, v in expected.items())
    # stage3_gather_16bit_weights_on_model_save and save_16bit_model: whole 16-bit models
    for path in (
        tmp_path / "ckpt" / "t1" / "model.safetensors",
        tmp_path / "ckpt" / "export" / "model.safetensors",
    ):
        model.load_state_dict(load_file(path))
        assert torch.equal(model.block.weight, expected["block.weight"])  # fp32 run: as is


# ---- damage, pickle, missing --------------------------------------------------------------


def small_checkpoint(rank, world, root):
    engine = _engine(2, world=world)
    _train(engine, rank, world, 1, 0)
    engine.save_checkpoint(root, tag="good")


def load_case(rank, world, root, tag, model_name):
    model = {"Net": Net, "Awkward": Awkward}[model_name]()
    engine = _engine(2, world=world, model=model)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            result = engine.load_checkpoint(root, tag=tag)
        except CheckpointError as error:
            return "error", str(error)
    return "ok", (result, [str(w.message) for w in caught])


def _flip_byte(path: Path, at: int) -> None:
    data = bytearray(path.read_bytes())
    data[at] ^= 0xFF
    path.write_bytes(bytes(data))


class _Exploit:
    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    root = tmp_path_factory.mktemp("ckpt")
    run_world(small_checkpoint, 2, str(root))
    return root


def _copy(saved: Path, tmp_path: Path) -> Path:
    shutil.copytree(saved, tmp_path / "c")
    return tmp_path / "c"


def test_inspect_reports_and_verifies(saved):
    report, intact = inspect(str(saved))
    assert intact
    assert "latest: good" in report and "world size 2, stage 2, fp32, step 1" in report
    assert "; plan: strategy flat_even, " in report
    assert "master" in report and "optim.exp_avg_sq" in report and "2 files ok" in report


@pytest.mark.parametrize(
    ("damage", "message"),
    [
        ("flip", r"tensor '.*' in .*rank00001.safetensors fails its xxh3_64 check"),
        ("truncate", r"rank00001.safetensors has \d+ bytes, the index says \d+"),
        ("remove", r"rank00001.safetensors is missing"),
        ("index", r"index.msgpack fails its CRC-32 check"),
    ],
)
def test_damage_is_named(saved, tmp_path, damage, message):
    root = _copy(saved, tmp_path)
    rank_file = root / "good" / "rank00001.safetensors"
    if damage == "flip":
        _flip_byte(rank_file, rank_file.stat().st_size - 3)  # inside the last tensor's bytes
    elif damage == "truncate":
        rank_file.write_bytes(rank_file.read_bytes()[:-8])
    elif damage == "remove":
        rank_file.unlink()
    else:
        index = root / "good" / "index.msgpack"
        _flip_byte(index, index.stat().st_size // 2)  # inside the checksummed body
    status, text = run_world(load_case, 2, str(root), None, "Net")
    assert status == "error" and re.search(message, text), text
    assert not inspect(str(root))[1]


def test_a_different_model_is_named(saved):
    status, text = run_world(load_case, 2, str(saved), None, "Awkward")
    assert status == "error"
    assert "does not fit this model" in text and "missing from the old plan" in text


@pytest.mark.parametrize("victim", ["index.msgpack", "rank00000.safetensors", "latest"])
def test_a_pickle_in_place_of_any_file_is_refused_never_run(saved, tmp_path, victim):
    root = _copy(saved, tmp_path)
    marker = tmp_path / "exploited"
    payload = pickle.dumps(_Exploit(marker))
    (root / victim if victim == "latest" else root / "good" / victim).write_bytes(payload)
    status, text = run_world(load_case, 2, str(root), None, "Net")
    assert status == "error" and victim in text, text  # refused, naming the file
    assert not marker.exists()


def test_no_checkpoint_returns_none_with_a_warning(tmp_path):
    status, (result, caught) = run_world(load_case, 2, str(tmp_path), None, "Net")
    assert status == "ok" and tuple(result) == (None, None)
    assert any("no checkpoint to load" in m for m in caught)


def test_a_tag_that_is_not_there_is_an_error_naming_the_tags_that_are(saved, tmp_path):
    """DeepSpeed asserts when the tag asked for (or the one `latest` names) is missing;
    fzero says which tags there are, and a script never trains on from scratch."""
    status, text = run_world(load_case, 2, str(saved), "nope", "Net")
    assert status == "error" and "nope" in text, text
    assert "tags in" in text and "['good']" in text, text
    root = _copy(saved, tmp_path)
    (root / "latest").write_text("gone")
    status, text = run_world(load_case, 2, str(root), None, "Net")
    assert status == "error" and "gone" in text and "latest" in text, text


def load_faults_case(rank, world, root):
    """A damaged file leaves the engine as it was; a read failing after the checksums
    passed leaves it refusing to go on until a load succeeds; loads read in place."""
    from fzero.checkpoint import _files

    engine = _engine(2, world=world)
    _train(engine, rank, world, 1, 0)
    engine.save_checkpoint(root, tag="good")
    saved = _snapshot(engine)
    continued = _train(engine, rank, world, 1, 1)
    trained = _snapshot(engine)
    buffers = [(rt.master.data_ptr(), rt.state.exp_avg.data_ptr()) for rt in engine.units]
    if rank == 0:
        shutil.copytree(f"{root}/good", f"{root}/bad")
        damaged = Path(f"{root}/bad/rank00001.safetensors")
        _flip_byte(damaged, damaged.stat().st_size - 3)
    torch.distributed.barrier()
    out = {}
    try:
        engine.load_checkpoint(root, tag="bad")
    except CheckpointError as error:
        out["damaged"] = str(error)
    out["untouched"] = _same(_snapshot(engine), trained)

    real = _files.SafetensorsFile.read_into

    def failing(self, key, out_tensor, crc):
        if crc is None and rank == 1:  # the second pass, after every check passed
            raise OSError(5, "Input/output error")
        return real(self, key, out_tensor, crc)

    _files.SafetensorsFile.read_into = failing
    try:
        engine.load_checkpoint(root, tag="good")
    except CheckpointError as error:
        out["partly"] = (type(error).__name__, str(error))
    finally:
        _files.SafetensorsFile.read_into = real
    refusals = []
    for attempt in (
        lambda: engine(global_batch(0, MICRO)[0]),
        lambda: engine.step(),
        lambda: engine.save_checkpoint(root, tag="after"),
    ):
        try:
            attempt()
        except RuntimeError as error:
            refusals.append(str(error))
    out["refusals"] = refusals
    engine.load_checkpoint(root, tag="good")
    out["restored"] = _same(_snapshot(engine), saved)
    out["in_place"] = buffers == [
        (rt.master.data_ptr(), rt.state.exp_avg.data_ptr()) for rt in engine.units
    ]
    out["trains"] = _train(engine, rank, world, 1, 1) == continued
    return out


def _same(a, b) -> bool:
    (ta, *ra), (tb, *rb) = a, b
    return ra == rb and len(ta) == len(tb) and all(torch.equal(x, y) for x, y in zip(ta, tb))


def test_failed_loads_lose_nothing_or_stop_the_engine_and_loads_read_in_place(tmp_path):
    out = run_world(load_faults_case, 2, str(tmp_path))
    assert re.search(r"rank 1: tensor '.*' in .*bad/rank00001.safetensors fails", out["damaged"])
    assert out["untouched"]
    kind, message = out["partly"]
    assert kind == "PartlyRestoredError"
    assert "rank 1:" in message and "after its checksums passed" in message
    assert len(out["refusals"]) == 3
    assert all(
        "partly overwritten" in r and "load a checkpoint again" in r for r in out["refusals"]
    )
    assert out["restored"] and out["in_place"] and out["trains"]


# ---- the DeepSpeed pattern, options, async ------------------------------------------------


def bert_pattern_case(rank, world, root):
    engine = _engine(1, world=world)
    _train(engine, rank, world, 2, 0)

    def checkpoint_model(  # the tutorial's function, unchanged
        PATH,
        ckpt_id,
        model,
        epoch,
        last_global_step,
        last_global_data_samples,
        **kwargs,
    ):
        checkpoint_state_dict = {
            "epoch": epoch,
            "last_global_step": last_global_step,
            "last_global_data_samples": last_global_data_samples,
        }
        checkpoint_state_dict.update(kwargs)
        model.save_checkpoint(PATH, ckpt_id, checkpoint_state_dict)

    def load_training_checkpoint(model, PATH, ckpt_id):
        _, checkpoint_state_dict = model.load_checkpoint(PATH, ckpt_id)
        return (
            checkpoint_state_dict["epoch"],
            checkpoint_state_dict["last_global_step"],
            checkpoint_state_dict["last_global_data_samples"],
        )

    checkpoint_model(root, "epoch1_step2", engine, 1, 2, 32, loss_history=[0.5, torch.ones(2)])
    fresh = _engine(1, world=world, seed=3)
    restored = load_training_checkpoint(fresh, root, "epoch1_step2")
    _, client = fresh.load_checkpoint(root)
    module_only = _engine(1, world=world, seed=3)
    module_only.load_checkpoint(root, load_module_only=True)
    weights_only = _engine(1, world=world, seed=3)
    weights_only.load_checkpoint(root, load_optimizer_states=False)
    return (
        restored,
        client["loss_history"],
        (module_only.global_steps, weights_only.global_steps, fresh.global_steps),
        all(not rt.state.exp_avg.any() for rt in weights_only.units),
        all(torch.equal(a.master, b.master) for a, b in zip(engine.units, module_only.units)),
    )


def test_bert_tutorial_checkpoint_pattern_and_load_options(tmp_path):
    restored, history, steps, fresh_state, same_weights = run_world(
        bert_pattern_case, 2, str(tmp_path)
    )
    assert restored == (1, 2, 32)
    assert history[0] == 0.5 and torch.equal(history[1], torch.ones(2))
    assert steps == (0, 2, 2)  # module only: counters untouched
    assert fresh_state and same_weights


def async_case(rank, world, root):
    engine = _engine(3, world=world)
    _train(engine, rank, world, 2, 0)
    engine.save_checkpoint(f"{root}/async", async_save=True)
    losses = _train(engine, rank, world, 1, 2)  # training goes on while the save is written
    engine.wait_for_checkpoint()
    resumed = _engine(3, world=world, seed=4)
    resumed.load_checkpoint(f"{root}/async")
    resumed_losses = _train(resumed, rank, world, 1, 2)

    from fzero.checkpoint import _save

    def broken(*_args, **_kwargs):
        raise OSError("disk full (injected)")

    working = _save.write_safetensors_stream
    _save.write_safetensors_stream = broken
    try:
        engine.save_checkpoint(f"{root}/broken", async_save=True)
        try:
            engine.save_checkpoint(f"{root}/next")
        except CheckpointError as error:
            failure = str(error)
    finally:  # the rank processes run later cases too
        _save.write_safetensors_stream = working
    return losses, resumed_losses, failure, os.path.exists(f"{root}/broken/latest")


def test_async_save_writes_in_the_background_and_surfaces_errors(tmp_path):
    losses, resumed_losses, failure, committed = run_world(async_case, 2, str(tmp_path))
    assert losses == resumed_losses
    assert "asynchronous checkpoint save failed: disk full (injected)" in failure
    assert not committed


def test_client_state_of_another_type_is_named(tmp_path):
    from fzero.checkpoint._index import encode_client_state

    with pytest.raises(TypeError, match=r"client_state\.opt\.fn is builtin_function_or_method"):
        encode_client_state({"opt": {"fn": print}}, {})


def test_client_state_keeps_tuples_lists_and_tensors_as_they_were():
    """DeepSpeed pickles `client_state`, so a tuple comes back a tuple; msgpack has one
    array type, and fzero marks tuples so that they do too (lists stay lists)."""
    from fzero.checkpoint._index import decode_client_state, encode_client_state, pack, unpack

    value = {
        "betas": (0.9, 0.95),
        "history": [1, (2, [3, (4,)])],
        "empty": (),
        "shape": (torch.tensor([1.5, 2.5]), "x"),
    }
    tensors: dict[str, torch.Tensor] = {}
    body = unpack(pack({"client_state": encode_client_state(value, tensors)}), "index")
    back = decode_client_state(body["client_state"], tensors)
    assert back["betas"] == (0.9, 0.95) and type(back["betas"]) is tuple
    assert back["history"] == [1, (2, [3, (4,)])] and type(back["history"]) is list
    assert type(back["history"][1][1]) is list and back["empty"] == ()
    assert torch.equal(back["shape"][0], value["shape"][0]) and back["shape"][1] == "x"


# ---- crash safety -------------------------------------------------------------------------

CRASH_SCRIPT = textwrap.dedent(
    """
    import os, sys, torch
    import fzero
    from tests.models import Net, global_batch

    root = sys.argv[1]
    fzero.comm.init_distributed()
    rank = torch.distributed.get_rank()
    torch.manual_seed(0)
    engine = fzero.shard(Net(), stage=3, config={"train_micro_batch_size_per_gpu": 2})
    path, _ = engine.load_checkpoint(root)
    print(f"rank {rank} loaded {path} at step {engine.global_steps}", flush=True)
    x, y = global_batch(0, 4)
    engine.backward(torch.nn.functional.mse_loss(engine(x[2 * rank : 2 * rank + 2]), y[:2]))
    engine.step()
    if os.environ.get("FAULT_ON_SAVE") and rank == 1:  # die half-written: rank 1's file is
        import signal  # on disk, the index never is
        from fzero.checkpoint import _save

        write = _save.write_safetensors_stream

        def write_then_die(*args, **kwargs):
            written = write(*args, **kwargs)
            os.kill(os.getpid(), signal.SIGKILL)
            return written

        _save.write_safetensors_stream = write_then_die
    engine.save_checkpoint(root)
    print(f"rank {rank} saved", flush=True)
    """
)


@pytest.mark.slow  # in `make test-slow`: keeps `make test` near 8 minutes
def test_a_rank_killed_mid_save_leaves_the_previous_checkpoint_loadable(tmp_path):
    script = tmp_path / "crash.py"
    script.write_text(CRASH_SCRIPT)
    root = tmp_path / "ckpt"
    env = {**os.environ, "PYTHONPATH": str(ROOT), "FZERO_TIMEOUT_S": "30"}

    def launch(**extra):
        return subprocess.run(
            [sys.executable, "-m", "fzero.cli", "run", "-n", "2", str(script), str(root)],
            env={**env, **extra},
            capture_output=True,
            text=True,
            timeout=240,
        )

    first = launch()
    assert first.returncode == 0, first.stderr
    assert (root / "latest").read_text() == "global_step1"
    crashed = launch(FAULT_ON_SAVE="1")
    assert crashed.returncode != 0
    assert (root / "latest").read_text() == "global_step1"  # untouched
    assert not (root / "global_step2").exists() and (root / ".global_step2.partial").exists()
    again = launch()
    assert again.returncode == 0, again.stderr
    assert "loaded" in again.stdout and "global_step1 at step 1" in again.stdout


# ---- Transformers --------------------------------------------------------------------------


def _tiny_bert():
    from transformers import BertConfig, BertForMaskedLM

    config = BertConfig(
        vocab_size=64,
        hidden_size=16,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=32,
        max_position_embeddings=16,
    )
    torch.manual_seed(0)
    return BertForMaskedLM(config)


def bert_case(rank, world, root):
    model = _tiny_bert()
    engine = _engine(3, world=world, model=model)
    tokens = torch.randint(0, 64, (MICRO, 8), generator=torch.Generator().manual_seed(rank))
    engine.backward(engine(input_ids=tokens, labels=tokens).loss)
    engine.step()
    engine.save_checkpoint(root)
    if rank == 0:
        model.config.save_pretrained(f"{root}/hf")
    return engine.state_dict(dtype=torch.float32)


def test_consolidated_bert_loads_with_from_pretrained(tmp_path):
    transformers = pytest.importorskip("transformers")
    expected = run_world(bert_case, 2, str(tmp_path))
    consolidate(str(tmp_path), str(tmp_path / "hf"))
    loaded = transformers.BertForMaskedLM.from_pretrained(str(tmp_path / "hf"))
    state = loaded.state_dict()
    assert state["cls.predictions.decoder.weight"].data_ptr() == (
        state["bert.embeddings.word_embeddings.weight"].data_ptr()
    )  # still tied after loading
    for key, value in expected.items():
        assert torch.equal(state[key], value), key
