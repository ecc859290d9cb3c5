"""Builds the native core (csrc/) against the installed torch; all other metadata lives in pyproject.toml.

The extension is optional: without torch in the build environment (an isolated build) or without a
compiler, the package installs without it and runs its Python core (and says so once at run time).
Install with ``pip install --no-build-isolation`` so the extension is built against the torch you have.
"""
from setuptools import setup

try:
    from torch.utils.cpp_extension import BuildExtension, CppExtension
except ImportError:  # no torch here (an isolated build): the pure-Python package
    setup()
else:
    setup(ext_modules=[CppExtension("poseidon_torch._native", ["csrc/core.cpp"],
                                    extra_compile_args=["-O2"], optional=True)],
          cmdclass={"build_ext": BuildExtension.with_options(use_ninja=True)})
