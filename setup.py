"""Builds fzero's native kernels (cffi, API mode) during `pip install`.

The extension is optional: without a C compiler or OpenMP the install still succeeds and
fzero runs its pure-torch kernels (`fzero.native.available()` says which, and why).
"""

import os
import sys

from setuptools import setup
from setuptools.command.build_py import build_py

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "native_src"))
from build import ffibuilder

extension = ffibuilder.distutils_extension(tmpdir="build/cffi")
extension.optional = True


class BuildPy(build_py):
    """Also ship the CUDA source (and the header it shares with the C kernels), which
    fzero.native._cuda compiles with NVRTC at run time."""

    def run(self) -> None:
        super().run()
        if getattr(self, "editable_mode", False):  # an editable install reads native_src/
            return
        here = os.path.dirname(os.path.abspath(__file__))
        target = os.path.join(self.build_lib, "fzero", "native")
        self.mkpath(target)
        for name in ("fzero_kernels.cu", "fzero_common.h"):
            self.copy_file(os.path.join(here, "native_src", name), target)


setup(ext_modules=[extension], cmdclass={"build_py": BuildPy})
