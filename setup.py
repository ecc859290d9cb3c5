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
    class OptionalBuild(BuildExtension):
        """An optional extension that fails to build leaves the Python core: torch's ninja build raises
        RuntimeError, which setuptools' ``optional=True`` does not catch."""

        def build_extension(self, ext) -> None:
            try:
                super().build_extension(ext)
            except Exception as exc:
                if not ext.optional:
                    raise
                self.warn(f"poseidon-torch: the native core did not build against this torch ({exc}); "
                          "the Python core runs instead")

    setup(ext_modules=[CppExtension("poseidon_torch._native", ["csrc/core.cpp"],
                                    extra_compile_args=["-O2"], optional=True)],
          cmdclass={"build_ext": OptionalBuild.with_options(use_ninja=True)})
