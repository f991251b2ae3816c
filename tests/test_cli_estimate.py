"""`fzero estimate` prints the ZeRO memory table from the exact plan."""

from __future__ import annotations

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
