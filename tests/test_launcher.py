"""`fzero run`: host selection, slurm command lines, and two nodes on loopback."""

from __future__ import annotations

import re
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from fzero.cli import main
from fzero.cli.launcher import Host, filter_hosts
from tests._dist import run_script

ROOT = Path(__file__).resolve().parent.parent
HOSTS = [Host("worker-0", 4), Host("worker-1", 4), Host("worker-2", 4)]


@pytest.mark.parametrize(
    ("include", "exclude", "expected"),
    [
        ("worker-1", "", [Host("worker-1", 4)]),
        ("worker-0:0,1@worker-2", "", [Host("worker-0", 2), Host("worker-2", 4)]),
        ("", "worker-1", [Host("worker-0", 4), Host("worker-2", 4)]),
        ("", "worker-2:3", [Host("worker-0", 4), Host("worker-1", 4), Host("worker-2", 3)]),
    ],
)
def test_include_and_exclude_select_hosts_and_slots(include, exclude, expected):
    assert filter_hosts(HOSTS, include, exclude) == expected


@pytest.mark.parametrize(
    ("include", "exclude", "message"),
    [
        ("worker-9", "", r"hosts \['worker-9'\] are not in the hostfile"),
        ("worker-0:7", "", r"worker-0 has slots 0..3; asked for \[7\]"),
        ("worker-0", "worker-1", "cannot be used together"),
        ("worker-0:x", "", "expected host or host:slot"),
    ],
)
def test_bad_selections_are_named(include, exclude, message):
    with pytest.raises(ValueError, match=message):
        filter_hosts(HOSTS, include, exclude)


def _dry_run(capsys, *args: str) -> subprocess.CompletedProcess:
    """`fzero run --dry-run ...` in this process (`python -m fzero.cli` calls the same
    `main`): what it printed, and its exit code."""
    code = main(["run", "--dry-run", *args])
    printed = capsys.readouterr()
    return subprocess.CompletedProcess(args, code, printed.out, printed.err)


def test_slurm_and_hostfile_dry_runs(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(ROOT)
    hostfile = tmp_path / "hosts"
    hostfile.write_text("node-a slots=2\nnode-b slots=2\nnode-c slots=2\n")
    run = _dry_run(
        capsys,
        "--launcher",
        "slurm",
        "--hostfile",
        str(hostfile),
        "--exclude",
        "node-c",
        "t.py",
    )
    assert run.returncode == 0, run.stderr
    assert run.stdout.startswith("srun --nodes=2 --ntasks-per-node=1 ")
    assert (
        "--nproc-per-node=2 --nnodes=2 --rdzv-backend=c10d --rdzv-endpoint=node-a:29500"
        in run.stdout
    )
    bad = _dry_run(capsys, "--include", "node-a", "t.py")
    assert bad.returncode == 2 and "select hosts of a --hostfile" in bad.stderr


@pytest.mark.parametrize(("gpus", "expected"), [(0, 1), (4, 4)])
def test_processes_per_node_default_to_one_per_visible_gpu(monkeypatch, gpus, expected):
    import torch

    from fzero import cli

    commands = []
    monkeypatch.setattr(torch.cuda, "device_count", lambda: gpus)
    monkeypatch.setattr(
        "fzero.cli.launcher._call", lambda command, env, dry: commands.append(command)
    )
    cli.main(["run", "--dry-run", "t.py"])
    assert f"--nproc-per-node={expected}" in commands[0]


def _losses(output: str) -> list[float]:
    return [float(x) for x in re.findall(r"epoch \d+ loss ([\d.]+)", output)]


@pytest.mark.slow
def test_two_nodes_on_loopback_train_like_one_node_with_two_processes():
    script = str(ROOT / "examples" / "regression" / "train.py")
    single = run_script("-n", "2", script, "--epochs", "3", cwd=ROOT)  # the test ranks
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = str(s.getsockname()[1])

    def node(rank: int) -> subprocess.Popen:
        launcher = ["-n", "1", "--num_nodes", "2", "--node_rank", str(rank)]
        launcher += ["--master_addr", "127.0.0.1", "--master_port", port]
        return subprocess.Popen(
            [sys.executable, "-m", "fzero.cli", "run", *launcher, script, "--epochs", "3"],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            cwd=ROOT,
        )

    nodes = [node(0), node(1)]
    outputs = [node.communicate(timeout=240) for node in nodes]
    assert all(node.returncode == 0 for node in nodes), [err[-2000:] for _, err in outputs]
    multi = _losses(outputs[0][0]) or _losses(outputs[1][0])
    assert len(_losses(single.stdout)) == 3 and multi == _losses(single.stdout)


def test_the_launcher_and_import_fzero_import_no_torch_and_deepspeeds_module_names_hold():
    """`fzero run` starts processes and needs nothing of torch (2 s and 220 MB a launch):
    `import fzero` imports its public names on first use. DeepSpeed's module names
    (`import fzero.zero`, ...) are `fzero.compat`'s modules themselves, however reached."""
    script = (
        "import sys\n"
        "import fzero, fzero.cli, fzero.cli.launcher\n"
        "assert 'torch' not in sys.modules, 'torch imported'\n"
        "assert fzero.cli.main(['run', '--dry-run', '-n', '2', 'train.py']) == 0\n"
        "assert 'torch' not in sys.modules, 'torch imported by the launcher'\n"
        "assert 'fzero.native' not in sys.modules\n"
        "assert callable(fzero.native.available)\n"  # a subpackage, as attribute
        "assert fzero.native is sys.modules['fzero.native']\n"
        "from fzero import checkpointing\n"
        "import fzero.zero, fzero.accelerator, fzero.checkpointing\n"
        "import fzero.compat as compat\n"
        "assert checkpointing is fzero.checkpointing is compat.checkpointing\n"
        "assert fzero.zero is compat.zero and fzero.accelerator is compat.accelerator\n"
        "assert sys.modules['fzero.zero'] is compat.zero and fzero.compat is compat\n"
        "assert fzero.DeepSpeedEngine is fzero.Engine and callable(fzero.shard)\n"
        "assert set(fzero.__all__) == {'__version__', *fzero._PUBLIC} <= set(dir(fzero))\n"
        "try:\n"
        "    fzero.no_such_name\n"
        "except AttributeError as error:\n"
        "    assert 'no_such_name' in str(error)\n"
        "else:\n"
        "    raise AssertionError('fzero.no_such_name resolved')\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr[-3000:]
