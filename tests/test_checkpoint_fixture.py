"""A checkpoint written by fzero 0.1.0 (before the functional-core redesign) still loads:
into the stage it was saved from and into another stage and world size, and training
continues from it as it did when it was written."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from torch import nn

import fzero
from tests._dist import run_world
from tests.models import Net, global_batch

FIXTURE = Path(__file__).resolve().parent / "fixtures" / "checkpoint_v0_1"


def resume_case(rank: int, world: int, stage: int, directory: str) -> dict:
    torch.manual_seed(1)  # other weights than the checkpoint's: loading must replace them
    config = {"train_micro_batch_size_per_gpu": 4 // world, "steps_per_print": 0}
    engine = fzero.shard(Net(), stage=stage, optimizer=fzero.optim.adamw(lr=1e-2), config=config)
    _, client = engine.load_checkpoint(directory)
    loaded = engine.state_dict()
    x, y = global_batch(2, 4)
    rows = slice(rank * 4 // world, (rank + 1) * 4 // world)
    engine.backward(nn.functional.mse_loss(engine(x[rows]), y[rows]))
    engine.step()
    return {
        "client": client,
        "loaded": loaded,
        "next": engine.state_dict(),
        "steps": engine.global_steps,
    }


@pytest.mark.parametrize(("world", "stage"), [(1, 2), (2, 3)])
def test_a_checkpoint_of_the_previous_format_loads_and_resumes(tmp_path, world, stage):
    directory = tmp_path / "checkpoint"
    shutil.copytree(FIXTURE, directory)  # loading never writes, but keep the fixture pristine
    result = run_world(resume_case, world, stage, str(directory))
    assert result["client"] == {"note": "fzero 0.1.0 format"} and result["steps"] == 3
    for name, expected in load_file(FIXTURE / "expected_step2.safetensors").items():
        assert torch.equal(result["loaded"][name], expected), name
    # the step after it, as when it was written, to fp32 rounding: the restore above is
    # bitwise, but ATen's kernels round differently on different CPUs (measured: one
    # element of 13 one ulp off on another machine, with fzero's native kernels off too)
    for name, expected in load_file(FIXTURE / "expected_step3.safetensors").items():
        torch.testing.assert_close(result["next"][name], expected, rtol=1e-6, atol=1e-6)


def test_the_previous_formats_crc32_checksums_still_verify_and_name_damage(tmp_path):
    """Checkpoints written before XXH3 name no algorithm: their CRC-32s are checked."""
    from fzero.checkpoint import CheckpointError, inspect
    from fzero.checkpoint._format import Reader, checksum_algorithm, read_index
    from fzero.partition import from_bytes

    report, intact = inspect(str(FIXTURE))
    assert intact and "files ok" in report
    directory = tmp_path / "checkpoint"
    shutil.copytree(FIXTURE, directory)
    tag = (directory / "latest").read_text()
    index = read_index(str(directory / tag))
    assert checksum_algorithm(index) == "crc32"
    rank_file = directory / tag / "rank00000.safetensors"
    data = bytearray(rank_file.read_bytes())
    data[-3] ^= 0xFF  # inside the last tensor
    rank_file.write_bytes(bytes(data))
    assert not inspect(str(directory))[1]
    last = index["ranks"][0]["slices"][-1]
    with Reader(str(directory / tag), index, from_bytes(index["plan"])) as reader:
        out = torch.empty(last["stop"] - last["start"])
        with pytest.raises(CheckpointError, match=r"rank00000.safetensors fails its crc32 check"):
            reader.read_whole(0, last["key"], out)
