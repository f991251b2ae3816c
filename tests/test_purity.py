"""The pure layers stay pure: no process group, no file I/O (docs/architecture.md, rule 1).
An in-memory `io.BytesIO()` is not I/O (`partition.plot_plan` returns PNG bytes)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
FORBIDDEN = re.compile(
    r"torch\.distributed|import\s+os\b|from\s+os\b|\bopen\(|pathlib|shutil|ProcessGroup|"
    r"safetensors|\bio\b\.(?!BytesIO\(\))|tempfile|socket|subprocess|torch\.save|torch\.load|"
    r"import pickle|pickle\."
)


@pytest.mark.parametrize("package", ["partition", "optim"])
def test_pure_packages_do_no_io(package):
    offenders = []
    for path in sorted((ROOT / "fzero" / package).glob("**/*.py")):
        for number, line in enumerate(path.read_text().splitlines(), start=1):
            if FORBIDDEN.search(line.split("#")[0]):
                offenders.append(f"{path.relative_to(ROOT)}:{number}: {line.strip()}")
    assert not offenders, "\n".join(offenders)


def test_no_pickle_anywhere_in_fzero():
    hits = [
        str(p.relative_to(ROOT))
        for p in (ROOT / "fzero").glob("**/*.py")
        if re.search(
            r"torch\.(save|load)\(|\bimport pickle|pickle\.\w+\(|weights_only=False", p.read_text()
        )
    ]
    assert not hits, hits
