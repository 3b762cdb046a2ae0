"""Build of torch_sparse_metal: what ``pyproject.toml`` (the project's metadata) cannot say.

* Everywhere: the pure-Python package, plus copies of ``shaders/`` and ``csrc/emulator/``
  under ``torch_sparse_metal/_data/`` in built wheels and regular installs (an editable
  install reads them from the checkout; see ``torch_sparse_metal/_paths.py``).
* On macOS only: the Objective-C++ extension ``torch_sparse_metal._metal_launcher`` from
  ``csrc/metal/launcher.mm``, built with torch's ``BuildExtension``. torch is imported on
  that branch only, so a Linux build needs no torch at build time. A failed build of the
  extension does not fail the install: it warns, and the package installs with the
  emulator and reference backends (MPS tensors then run on the reference). pip hides a
  build's output unless ``-v`` is given, so the compiler's message is also written next to
  where the extension would be (``_metal_launcher.build-error.txt``), where the first op on
  an MPS tensor (its one warning) and ``python -m torch_sparse_metal.doctor`` read it.

Install with ``pip install --no-build-isolation -e .``: the Mac build compiles against the
torch already installed, which is the one that will load the extension. pip's default
build isolation hides that torch, so on macOS the build stops and says so (an extension
built against another torch would not load); ``TSM_BUILD_WITHOUT_METAL=1`` installs
without the extension on purpose.
"""
from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path

from setuptools import find_namespace_packages, setup
from setuptools.command.build_py import build_py
from setuptools.command.sdist import sdist

ROOT = Path(__file__).resolve().parent
PACKAGE = "torch_sparse_metal"

# Non-Python trees the package reads at run time, relative to the repository root; a wheel
# carries them under torch_sparse_metal/_data/<same path>.
DATA_TREES = ("shaders", os.path.join("csrc", "emulator"))
_IGNORED = shutil.ignore_patterns("__pycache__", "*.pyc", "*.o", "*.so", "*.dylib", ".*")


class build_py_with_data(build_py):
    """Also copy the shader and emulator sources into ``<build>/torch_sparse_metal/_data``."""

    def run(self) -> None:
        super().run()
        if getattr(self, "editable_mode", False):
            return  # an editable install reads them from the checkout
        for tree in DATA_TREES:
            source = ROOT / tree
            if not source.is_dir():
                self.warn(f"{tree}/ not found; the built package will not contain it")
                continue
            target = Path(self.build_lib) / PACKAGE / "_data" / tree
            if target.exists():
                shutil.rmtree(target)
            shutil.copytree(source, target, ignore=_IGNORED)

    def get_outputs(self, include_bytecode: bool = True) -> list:
        outputs = list(super().get_outputs(include_bytecode))
        data = Path(self.build_lib) / PACKAGE / "_data"
        if data.is_dir():
            outputs.extend(str(p) for p in sorted(data.rglob("*")) if p.is_file())
        return outputs


class sdist_with_sources(sdist):
    """Put ``shaders/``, ``csrc/`` and ``requirements.txt`` in source distributions too."""

    def make_release_tree(self, base_dir, files) -> None:
        extra = [p.relative_to(ROOT).as_posix()
                 for tree in ("shaders", "csrc") for p in sorted((ROOT / tree).rglob("*"))
                 if p.is_file() and "__pycache__" not in p.parts and p.suffix not in (".o", ".so")]
        if (ROOT / "requirements.txt").is_file():
            extra.append("requirements.txt")
        files = list(files)
        super().make_release_tree(base_dir, files + [f for f in extra if f not in files])


cmdclass = {"build_py": build_py_with_data, "sdist": sdist_with_sources}
ext_modules = []


BUILD_ERROR_SUFFIX = ".build-error.txt"  # _metal_backend.BUILD_ERROR_SUFFIX reads it


def optional_build_ext(base):
    """``base`` (a build_ext command) made to warn instead of failing when an extension does
    not build: the Metal launcher is optional, the rest of the package works without it.
    The failure is also written to ``<extension>.build-error.txt`` beside where the
    extension would be (removed by a later build that succeeds), since pip shows no build
    output without ``-v``."""

    class OptionalBuildExt(base):
        def build_extension(self, ext) -> None:
            record = Path(self.get_ext_fullpath(ext.name))
            record = record.with_name(ext.name.rsplit(".", 1)[-1] + BUILD_ERROR_SUFFIX)
            try:
                super().build_extension(ext)
            except Exception as exc:  # noqa: BLE001 -- compiler, SDK, headers, linker: any cause
                message = (f"torch_sparse_metal: {ext.name} was not built ({type(exc).__name__}: "
                           f"{exc}). The package installs without it: the emulator and "
                           "reference backends work, and MPS tensors run on the plain-torch "
                           "reference. Fix the error and rerun `pip install -v "
                           "--no-build-isolation --no-deps -e .` to build it.")
                self.warn(message)
                try:
                    record.parent.mkdir(parents=True, exist_ok=True)
                    record.write_text(message + "\n")
                except OSError:
                    pass  # the warning above still says it
            else:
                record.unlink(missing_ok=True)

    return OptionalBuildExt


def _metal_extension():
    """The launcher extension and torch's BuildExtension; macOS only (imports torch)."""
    if os.environ.get("TSM_BUILD_WITHOUT_METAL", "").strip().lower() in ("1", "true", "yes", "on"):
        print("torch_sparse_metal: TSM_BUILD_WITHOUT_METAL is set: building without the Metal "
              "launcher", file=sys.stderr)
        return None, None
    try:
        import torch
        from torch.utils.cpp_extension import BuildExtension, CppExtension
    except ImportError as exc:
        # pip's build isolation (the default) hides the installed torch: an extension built
        # against the torch pip would fetch instead would not load into the user's.
        raise SystemExit(
            f"torch_sparse_metal: cannot build the Metal extension: torch is not importable "
            f"in this build ({exc}). It compiles against the torch you have installed, which "
            "pip's build isolation hides: install torch first, then run `pip install "
            "--no-build-isolation -e .` (or set TSM_BUILD_WITHOUT_METAL=1 to install without "
            "the GPU kernels).") from None

    if not torch.backends.mps.is_built():
        # BuildExtension only accepts .mm sources when torch was built with MPS.
        print("torch_sparse_metal: this torch has no MPS support; building without the "
              "Metal launcher", file=sys.stderr)
        return None, None
    extension = CppExtension(
        name=f"{PACKAGE}._metal_launcher",
        sources=["csrc/metal/launcher.mm"],
        # -fobjc-arc: launcher.mm relies on ARC (and #errors without it).
        # No -std flag on purpose: BuildExtension appends the standard the installed torch
        # builds its extensions with (-std=c++17 in the 2.1 era, -std=c++20 in 2.13) unless
        # one is given, so a hard-coded c++17 would override what newer torch headers expect.
        extra_compile_args=["-fobjc-arc"],
        extra_link_args=["-framework", "Metal", "-framework", "Foundation"],
    )
    return extension, BuildExtension


if sys.platform == "darwin":  # torch is imported on this branch only
    _extension, _build_ext = _metal_extension()
    if _extension is not None:
        ext_modules.append(_extension)
        cmdclass["build_ext"] = optional_build_ext(_build_ext)

setup(
    packages=find_namespace_packages(
        include=[PACKAGE, f"{PACKAGE}.*"],
        exclude=[f"{PACKAGE}._data", f"{PACKAGE}._data.*", "*.__pycache__"]),
    ext_modules=ext_modules,
    cmdclass=cmdclass,
    zip_safe=False,
)
