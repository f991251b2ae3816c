"""The README and the documentation site stay true to the code.

Every fenced ```python block in README.md and docs/ carries a marker on the line before
it: `<!-- test: python -->` (this test runs it as a script in a fresh directory, one
process), `<!-- test: fzero run -n N -->` (run on N processes by `fzero run`), or
`<!-- not run: why -->` for a fragment (a sketch of a call, a script that needs a
cluster). A runnable block must define what it uses and exit 0. The configuration
reference is generated from `fzero.config`; every key it lists has a description.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
MARKER = re.compile(r"^<!-- (?:test: (?P<run>python|fzero run -n (?P<n>\d+))|not run: .+) -->$")
FENCE = re.compile(r"^(?P<indent> *)```(?P<lang>\S*)")


@dataclass(frozen=True)
class Snippet:
    path: Path
    line: int  # of the opening fence, 1-based
    code: str
    marker: str | None  # the marker line before the fence, if any
    processes: int  # 0: not run

    @property
    def id(self) -> str:
        return f"{self.path.relative_to(ROOT)}:{self.line}"


def pages() -> list[Path]:
    """The markdown the project shows: the README, the changelog and the docs pages."""
    docs = sorted(p for p in (ROOT / "docs").rglob("*.md") if "_hooks" not in p.parts)
    return [ROOT / "README.md", ROOT / "CHANGELOG.md", *docs]


def snippets(path: Path) -> list[Snippet]:
    """Every fenced python block of a page, with the marker line before it."""
    lines = path.read_text().splitlines()
    found, index = [], 0
    while index < len(lines):
        fence = FENCE.match(lines[index])
        if not fence:
            index += 1
            continue
        end = index + 1
        closing = fence["indent"] + "```"
        while end < len(lines) and lines[end].rstrip() != closing:
            end += 1
        if fence["lang"] == "python":
            before = lines[index - 1].strip() if index else ""
            marker = before if before.startswith("<!--") else None
            match = MARKER.match(marker or "")
            processes = 0
            if match and match["run"]:
                processes = int(match["n"] or 1)
            body = [line.removeprefix(fence["indent"]) for line in lines[index + 1 : end]]
            found.append(Snippet(path, index + 1, "\n".join(body) + "\n", marker, processes))
        index = end + 1
    return found


ALL = [s for page in pages() for s in snippets(page)]
RUNNABLE = [s for s in ALL if s.processes]


def test_every_python_block_says_whether_it_runs():
    unmarked = [s.id for s in ALL if s.marker is None or not MARKER.match(s.marker)]
    assert not unmarked, (
        "python blocks without a marker line before them (`<!-- test: python -->`, "
        "`<!-- test: fzero run -n 2 -->` or `<!-- not run: why -->`): " + ", ".join(unmarked)
    )


def test_the_readme_snippets_all_run():
    readme = [s for s in ALL if s.path.name == "README.md"]
    assert readme and all(s.processes for s in readme), [s.id for s in readme]


def test_the_snippet_finder_reads_markers_fences_and_indentation(tmp_path):
    page = tmp_path / "page.md"
    page.write_text(
        "text\n<!-- test: fzero run -n 2 -->\n```python\nprint(1)\n```\n"
        "- item:\n\n  <!-- not run: a sketch -->\n  ```python\n  call(x)\n  ```\n"
        "```\nnot python\n```\n```python\nbare()\n```\n"
    )
    found = snippets(page)
    assert [(s.line, s.code, s.processes) for s in found] == [
        (3, "print(1)\n", 2),
        (9, "call(x)\n", 0),
        (15, "bare()\n", 0),
    ]
    assert found[2].marker is None


@pytest.mark.parametrize("snippet", RUNNABLE, ids=lambda s: s.id)
def test_a_runnable_snippet_runs(snippet, tmp_path):
    script = tmp_path / "snippet.py"
    script.write_text(snippet.code)
    if snippet.processes == 1:
        command = [sys.executable, str(script)]
    else:
        command = [sys.executable, "-m", "fzero.cli", "run", "-n", str(snippet.processes)]
        command.append(str(script))
    done = subprocess.run(command, cwd=tmp_path, capture_output=True, text=True, timeout=600)
    output = f"{done.stdout[-3000:]}\n{done.stderr[-5000:]}"
    assert done.returncode == 0, f"{snippet.id} failed:\n{output}"


def _reference_hook():
    spec = importlib.util.spec_from_file_location(
        "docs_reference_hook", ROOT / "docs" / "_hooks" / "reference.py"
    )
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while defined
    spec.loader.exec_module(module)
    return module


def test_every_config_key_in_the_reference_says_what_it_does():
    import fzero.config

    hook = _reference_hook()
    keys = list(hook.config_keys())
    undescribed = [k.path for k in keys if not k.description]
    assert not undescribed, (
        "config keys without a description (a docstring under the field in "
        "fzero/config, or the why of no_effect/only_default): " + ", ".join(undescribed)
    )
    paths = {k.path for k in keys}
    assert {"train_batch_size", "zero_optimization.stage", "bf16.bf16_optimizer_states"} <= paths
    assert "zero_optimization.offload_optimizer.commit" in paths  # nested sections too
    refused = {k.path for k in keys if k.status == "refused"}
    assert "expert_parallel" in refused and "zero_optimization.zeropp_loco_param" in refused
    fields = {f.name for f in dataclasses.fields(fzero.config.Config)}
    assert fields <= paths  # every top-level field is listed
    table = hook.config_table()
    assert table.count("\n") == len(keys) + 1 and "**Only the default is accepted:**" in table


def test_the_cli_reference_has_every_subcommand():
    text = _reference_hook().cli_help()
    for command in ("", " run", " estimate", " checkpoint inspect", " checkpoint consolidate"):
        title = f"fzero{command} --help"
        assert f"## `{title}`" in text
    assert "--version" in text and "--as-deepspeed" in text
