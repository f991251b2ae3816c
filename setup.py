"""Builds fzero's native kernels (cffi, API mode) during `pip install`.

The extension is optional: without a C compiler or OpenMP the install still succeeds and
fzero runs its pure-torch kernels (`fzero.native.available()` says which, and why).
"""

import os
import sys

from setuptools import setup

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "native_src"))
from build import ffibuilder

extension = ffibuilder.distutils_extension(tmpdir="build/cffi")
extension.optional = True

setup(ext_modules=[extension])
