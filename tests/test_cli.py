"""The `fzero` command: `--help` and `--version` answer without importing torch or fzero,
and every subcommand's bad input is one line on stderr and a non-zero exit (a missing or
empty directory, a missing tag, a directory that holds no checkpoint, a bad number)."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import fzero
import fzero_cli
from fzero import partition

FIXTURE = Path(__file__).resolve().parent / "fixtures" / "checkpoint_v0_1"

_IMPORTS_AFTER = """
import sys, fzero_cli
try:
    fzero_cli.main({argv!r})
except SystemExit as exit:
    code = exit.code
heavy = sorted(m for m in sys.modules if m == "torch" or m == "fzero" or m.startswith("fzero."))
print("EXIT", code, "HEAVY", heavy)
"""


@pytest.mark.parametrize(
    "argv",
    [
        ["--help"],
        ["--version"],
        ["run", "--help"],
        ["estimate", "--help"],
        ["checkpoint", "--help"],
        ["checkpoint", "inspect", "--help"],
        ["checkpoint", "consolidate", "--help"],
        ["estimate", "--params", "many"],  # an argument error needs no torch either
    ],
)
def test_help_version_and_argument_errors_import_neither_torch_nor_fzero(argv):
    done = subprocess.run(
        [sys.executable, "-c", _IMPORTS_AFTER.format(argv=argv)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    last = done.stdout.strip().splitlines()[-1]
    code = 2 if argv[-1] == "many" else 0
    assert last == f"EXIT {code} HEAVY []", done.stdout + done.stderr


def test_the_version_is_fzeros(capsys):
    with pytest.raises(SystemExit) as exit:
        fzero_cli.main(["--version"])
    assert exit.value.code == 0
    assert capsys.readouterr().out == f"fzero {fzero.__version__}\n"
    assert fzero_cli.version() == fzero.__version__


def test_the_console_script_and_python_m_are_the_same_command():
    from fzero.cli import main

    assert main is fzero_cli.main
    done = subprocess.run(
        [sys.executable, "-m", "fzero.cli", "--version"], capture_output=True, text=True
    )
    assert done.returncode == 0 and done.stdout == f"fzero {fzero.__version__}\n"


def _one_line_error(capsys, argv: list[str], code: int = 1) -> str:
    """Run `fzero argv`; it must fail with `code` and one line on stderr, nothing else."""
    try:
        result = fzero_cli.main(argv)
    except SystemExit as exit:
        result = exit.code
    out, err = capsys.readouterr()
    assert result == code, (result, out, err)
    assert out == "" and err.endswith("\n") and err.count("\n") == 1, repr(err)
    assert "Traceback" not in err and "[]" not in err
    return err.strip()


@pytest.fixture
def places(tmp_path):
    (tmp_path / "empty").mkdir()
    (tmp_path / "file").write_text("not a directory")
    (tmp_path / "other" / "notes").mkdir(parents=True)  # a directory, but no checkpoint
    shutil.copytree(FIXTURE, tmp_path / "ckpt")
    return tmp_path


@pytest.mark.parametrize(
    ("where", "expected"),
    [
        ("missing", "checkpoint directory {p}/missing does not exist"),
        ("file", "checkpoint directory {p}/file is not a directory"),
        ("empty", "{p}/empty holds no checkpoint: no tag directory, no 'latest' file"),
        ("other", "{p}/other holds no checkpoint: none of its directories (notes) holds an "),
    ],
)
def test_inspect_of_something_that_is_no_checkpoint_is_one_line(capsys, places, where, expected):
    error = _one_line_error(capsys, ["checkpoint", "inspect", str(places / where)])
    assert error.startswith("fzero checkpoint inspect: " + expected.format(p=places)), error


@pytest.mark.parametrize(
    ("where", "tag", "expected"),
    [
        ("missing", None, "checkpoint directory {p}/missing does not exist"),
        ("empty", None, "{p}/empty has no 'latest' file naming its newest tag, so pass a tag "
                        "(it holds no checkpoint)"),
        ("other", None, "{p}/other has no 'latest' file naming its newest tag, so pass a tag "
                        "(tags there: notes)"),
        ("ckpt", "global_step9", "tag 'global_step9' is not in {p}/ckpt (tags there: "
                                 "global_step2)"),
        ("other", "notes", "{p}/other/notes/index.msgpack is missing: {p}/other/notes is not a "
                           "complete checkpoint"),
    ],
)  # fmt: skip
def test_consolidate_names_what_is_missing_in_one_line(capsys, places, where, tag, expected):
    argv = ["checkpoint", "consolidate", str(places / where), str(places / "out")]
    error = _one_line_error(capsys, [*argv, *(["--tag", tag] if tag else [])])
    assert error == "fzero checkpoint consolidate: " + expected.format(p=places)
    assert not (places / "out").exists()  # nothing written


def test_inspect_names_a_latest_file_whose_tag_is_gone(capsys, places):
    (places / "ckpt" / "latest").write_text("global_step7")
    assert fzero_cli.main(["checkpoint", "inspect", str(places / "ckpt")]) == 1
    report = capsys.readouterr().out
    assert "latest: DAMAGED (it names tag 'global_step7', which is not here)" in report
    assert "global_step2: world size" in report and "checksums: " in report


def test_a_good_checkpoint_still_inspects_and_consolidates(capsys, places):
    assert fzero_cli.main(["checkpoint", "inspect", str(places / "ckpt")]) == 0
    assert "latest: global_step2" in capsys.readouterr().out
    argv = ["checkpoint", "consolidate", str(places / "ckpt"), str(places / "out")]
    assert fzero_cli.main(argv) == 0
    assert capsys.readouterr().out.strip() == str(places / "out" / "model.safetensors")


@pytest.mark.parametrize(
    ("argv", "code", "expected"),
    [
        (["estimate"], 1, "fzero estimate: give exactly one of --model module:factory or "
                          "--params N"),
        (["estimate", "--params", "7e9", "--optimizer", "adagrad"], 1,
         "fzero estimate: optimizer 'adagrad' is unknown; allowed: "),
        (["estimate", "--params", "7e9", "--strategy", "nope"], 1,
         "fzero estimate: --strategy is 'nope'; allowed: "),
        (["estimate", "--params", "7e9", "--mesh", "node"], 1,
         "fzero estimate: mesh 'node': 'node' is not 'axis=size'"),
        (["estimate", "--model", "no_such_module:f"], 1,
         "fzero estimate: --model 'no_such_module:f': No module named 'no_such_module'"),
        (["estimate", "--params", "-3"], 2,
         "fzero estimate: argument --params: '-3': expected a finite number >= 0"),
        (["estimate", "--params", "1e6", "--world-sizes", "8,x"], 2,
         "fzero estimate: argument --world-sizes: '8,x' is not a comma-separated list"),
        (["run", "no_such_script.py"], 2, "fzero run: script 'no_such_script.py' is not a file"),
        (["run", "--hostfile", "no_such_hosts", __file__], 2,
         "fzero run: --hostfile 'no_such_hosts' is not a file"),
        (["run", "-n", "0", __file__], 2, "fzero run: nproc_per_node 0 and num_nodes 1 must be"),
        (["checkpoint"], 2, "fzero checkpoint: the following arguments are required: "),
        (["launch"], 2, "fzero: argument COMMAND: invalid choice: 'launch'"),
    ],
)  # fmt: skip
def test_bad_arguments_are_one_line_and_a_nonzero_exit(capsys, argv, code, expected):
    error = _one_line_error(capsys, argv, code)
    assert error.startswith(expected), error


def test_a_plan_of_another_model_names_only_what_differs():
    from torch import nn

    old = partition.plan(partition.describe(nn.Linear(4, 4)), world_size=2, stage=2)
    new = partition.plan(partition.describe(nn.Linear(4, 3)), world_size=2, stage=2)
    with pytest.raises(partition.PlanError) as error:
        partition.reshard_reads(old, new, 0)
    assert str(error.value) == (
        "plans describe different tensors: shape changed "
        "['bias: (4,) -> (3,)', 'weight: (4, 4) -> (3, 4)']"
    )
    mesh = partition.Mesh({"node": 2, "local": 2})
    with pytest.raises(partition.MeshError, match=r"local=2: missing axes \['local'\]$"):
        mesh.rank_at({"node": 1})
