"""`fzero estimate` prints the ZeRO memory table from the exact plan."""

from __future__ import annotations

import pytest
import torch

from fzero.cli import main


def tiny_model() -> torch.nn.Module:
    return torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Linear(64, 8))


def test_estimate_from_param_count(capsys):
    """The ZeRO paper's figure 1 (gradients in fp16), and what fzero keeps by default
    (fp32 gradient accumulators: 2 more bytes per parameter where they are whole)."""
    args = ["estimate", "--params", "7.5e9", "--world-sizes", "64"]
    assert main([*args, "--grad-dtype", "fp16"]) == 0
    out = capsys.readouterr().out
    for expected in ("120.00 GB", "31.41 GB", "16.64 GB", "1.88 GB"):
        assert expected in out
    assert main(args) == 0
    out = capsys.readouterr().out
    for expected in ("135.00 GB", "46.41 GB", "16.88 GB", "2.11 GB"):
        assert expected in out


def test_estimate_from_a_model_built_on_meta(capsys):
    assert (
        main(
            [
                "estimate",
                "--model",
                "tests.test_cli_estimate:tiny_model",
                "--world-sizes",
                "1,2",
                "--precision",
                "fp32",
            ]
        )
        == 0
    )
    out = capsys.readouterr().out
    assert "4,680 params" in out
    # stage 0, 1 rank, fp32 Adam: (4,680 + padding to 16) x 16 bytes
    assert "0.08 MB" in out


def test_estimate_takes_a_strategy(capsys):
    """Per-tensor rows pad each tensor (64 + 8 rows here) where flat_even pads the unit."""
    args = ["estimate", "--model", "tests.test_cli_estimate:tiny_model", "--world-sizes", "64"]
    assert main([*args, "--precision", "fp32"]) == 0
    flat = capsys.readouterr().out
    assert main([*args, "--precision", "fp32", "--strategy", "per_tensor_dim0"]) == 0
    rows = capsys.readouterr().out
    assert flat != rows and "4,680 params" in rows


def test_estimate_on_a_mesh(capsys):
    """Ψ = 7.5B fp16 on 8 nodes of 8: MiCS holds ZeRO-3's states over 8 ranks (16.88 GB,
    as stage 3 at N = 8: the MiCS paper's model/shard-size), hpZ ZeRO-3's over 64 plus
    Ψ/8 fp16 parameters (2.11 + 1.88 GB); per step MiCS all-reduces gradient shards over
    `node` (2 x 7/8 x 30 GB / 8) and hpZ's backward gather stays on `local`."""
    args = ["estimate", "--params", "7.5e9", "--mesh", "node=8,local=8"]
    assert main([*args, "--preset", "mics,hpz,zero3"]) == 0
    out = capsys.readouterr().out
    assert "on mesh node=8 x local=8 (64 ranks)" in out
    lines = [" ".join(line.split()) for line in out.splitlines()]
    assert "mics - 16.88 GB 0.00 MB 0" in lines  # the worst rank is rank 0
    assert "hpz - 3.98 GB 0.00 MB 0" in lines
    assert "zero3 - 2.11 GB 0.00 MB 0" in lines
    assert "mics node 0 B 0 B 6.56 GB" in lines
    assert "mics local 26.25 GB 26.25 GB 14 B" in lines  # + the norm, over the shards
    assert "hpz local 13.13 GB 0 B 0 B" in lines  # backward, from the in-node copy
    assert "hpz node+local 14.77 GB 29.53 GB 20 B" in lines  # forward + reduce-scatter
    assert "zero3 node+local 29.53 GB 29.53 GB 20 B" in lines


def first_layer_in_node(mesh, unit):
    """A rule of one's own: the first layer MiCS-style within `local`, the second ZeRO-3
    over every rank (units on their own axes)."""
    from fzero import partition

    split = mesh.sharding("local") if unit.module == "0" else mesh.split_everywhere
    return partition.UnitSharding(split, split, split)


def test_estimate_on_a_mesh_takes_a_preset_of_ones_own(capsys):
    """`--preset module:name`: priced beside the built-ins, with the wire bytes on each
    unit's own axes (the first layer's within `local`, the second's over the world)."""
    args = ["estimate", "--model", "tests.test_cli_estimate:tiny_model", "--mesh", "node=2,local=2"]
    own = "tests.test_cli_estimate:first_layer_in_node"
    assert main([*args, "--preset", f"zero3,{own}", "--persistence-threshold", "0"]) == 0
    lines = [" ".join(line.split()) for line in capsys.readouterr().out.splitlines()]
    assert any(line.startswith(f"{own} - ") for line in lines), lines
    axes = {line.split()[1] for line in lines if line.startswith(f"{own} ")}
    assert {"local", "node", "node+local"} <= axes, lines  # within, across, over the world


def test_estimate_on_a_mesh_from_a_model(capsys):
    args = ["estimate", "--model", "tests.test_cli_estimate:tiny_model", "--mesh", "node=2,local=2"]
    assert main(args) == 0
    out = capsys.readouterr().out
    for preset in ("zero0", "zero1", "zero2", "zero3", "mics", "hpz"):
        assert f" {preset} " in out
    assert " zero0 cpu" not in " ".join(out.split())  # nothing to offload unsplit


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--mesh", "node=2,local"], "'local' is not 'axis=size'"),
        (["--mesh", "node=2,local=2", "--preset", "fsdp"], "--preset is 'fsdp'; allowed: zero0"),
        (["--mesh", "node=2,local=2", "--preset", "tests:nope"], "cannot be loaded"),
        (["--preset", "mics"], "--preset needs --mesh"),
        (["--mesh", "node=2", "--world-sizes", "2"], "give --mesh or --world-sizes"),
        (["--mesh", "node=2,gpu=2", "--preset", "zero3", "--strategy", "x"], "--strategy"),
    ],
)
def test_estimate_mesh_errors(capsys, extra, message):
    assert main(["estimate", "--params", "1000", *extra]) == 1
    err = capsys.readouterr().err
    assert err.startswith("fzero estimate: ") and message in err and err.count("\n") == 1
