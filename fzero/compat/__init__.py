"""Run DeepSpeed scripts unchanged: `import deepspeed` served by fzero, on request.

`install()` (or `fzero run --as-deepspeed`) puts an import finder first on
`sys.meta_path` that resolves `deepspeed` and `deepspeed.<name>` to
`fzero.compat.deepspeed[.<name>]` for this process, and answers package-metadata
lookups (`importlib.metadata.version("deepspeed")`, which Transformers and Accelerate
check) with fzero's DeepSpeed-compatible version, `<deepspeed version>+fzero.<version>`,
so the answer itself says that fzero stands in. It is never implicit: nothing is
written to disk, and when a real DeepSpeed is installed the first log line says that
fzero stands in for it. `import fzero as deepspeed` works without it.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import importlib.metadata
import importlib.util
import os
import sys
import types
from typing import Any

__all__ = ["install", "installed", "uninstall"]

_PREFIX = "deepspeed"
_TARGET = "fzero.compat.deepspeed"


class _Alias(importlib.abc.Loader):
    """Loads `deepspeed.<name>` as the already importable fzero module behind it."""

    def __init__(self, target: str) -> None:
        self.target = target

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> Any:
        return importlib.import_module(self.target)

    def exec_module(self, module: Any) -> None:
        """The module ran when `create_module` imported it."""


class _Distribution(importlib.metadata.Distribution):
    """The `deepspeed` distribution as fzero answers for it: metadata only, no files."""

    def read_text(self, filename: str) -> str | None:
        if filename != "METADATA":
            return None
        from fzero.compat.deepspeed import __version__

        return (
            "Metadata-Version: 2.1\n"
            f"Name: {_PREFIX}\n"
            f"Version: {__version__}\n"
            "Summary: served by fzero's DeepSpeed compatibility layer (fzero.compat)\n"
        )

    def locate_file(self, path: Any) -> Any:
        return None


class _DeepSpeedFinder(importlib.abc.MetaPathFinder):
    """`deepspeed[.x]` -> `fzero.compat.deepspeed[.x]`; names fzero lacks are not found."""

    def find_distributions(self, context: Any = None) -> list[importlib.metadata.Distribution]:
        """The `deepspeed` distribution, when that is the name asked for (metadata API)."""
        name = getattr(context, "name", None)
        if name is None or name.lower().replace("_", "-") != _PREFIX:
            return []
        return [_Distribution()]

    def find_spec(self, fullname: str, path: Any = None, target: Any = None) -> Any:
        if fullname != _PREFIX and not fullname.startswith(_PREFIX + "."):
            return None
        real = _TARGET + fullname[len(_PREFIX) :]
        if importlib.util.find_spec(real) is None:
            # a module the served package holds as an attribute (`deepspeed.zero` is
            # `fzero.compat.zero`): `import deepspeed.zero` works as `deepspeed.zero` does
            parent, _, name = real.rpartition(".")
            try:
                attribute = getattr(importlib.import_module(parent), name, None)
            except NotImplementedError:  # a name the served module refuses
                return None
            if not isinstance(attribute, types.ModuleType):
                return None
            real = attribute.__name__
        return importlib.util.spec_from_loader(fullname, _Alias(real), is_package=True)


def installed() -> bool:
    """Whether `import deepspeed` resolves to fzero in this process."""
    return any(isinstance(finder, _DeepSpeedFinder) for finder in sys.meta_path)


def install() -> None:
    """Make `import deepspeed` (and its submodules) resolve to fzero in this process.

    Call it before anything imports `deepspeed`. Raises if a real DeepSpeed is already
    imported; where one is installed, says that fzero stands in for it.
    """
    if installed():
        return
    loaded = sys.modules.get(_PREFIX)
    if loaded is not None and not getattr(loaded, "__name__", "").startswith(_TARGET):
        raise RuntimeError(
            f"a real DeepSpeed is already imported ({getattr(loaded, '__file__', '?')}); "
            "install fzero's compatibility layer before anything imports deepspeed"
        )
    real = importlib.util.find_spec(_PREFIX)
    sys.meta_path.insert(0, _DeepSpeedFinder())
    if int(os.environ.get("RANK", 0)) == 0:
        from fzero._version import __version__

        note = f"; the DeepSpeed installed at {real.origin} is not used" if real else ""
        print(
            f"fzero {__version__}: `import deepspeed` is served by fzero's compatibility "
            f"layer{note}",
            file=sys.stderr,
            flush=True,
        )


def uninstall() -> None:
    """Undo `install()` and forget the `deepspeed` modules it served."""
    sys.meta_path[:] = [f for f in sys.meta_path if not isinstance(f, _DeepSpeedFinder)]
    for name in [n for n in sys.modules if n == _PREFIX or n.startswith(_PREFIX + ".")]:
        # served by `fzero.compat.deepspeed...` or, as `deepspeed.zero` and
        # `deepspeed.checkpointing`, by another `fzero` module
        if sys.modules[name].__name__.split(".")[0] == "fzero":
            del sys.modules[name]
