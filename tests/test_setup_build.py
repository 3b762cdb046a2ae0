"""setup.py's decisions, checked on any machine: the Metal launcher is built on macOS only,
a failed build of it warns instead of failing the install, and requirements.txt pins torch
on Linux only."""
from __future__ import annotations

import runpy
import sys
from pathlib import Path

import pytest
import setuptools
import torch
from packaging.requirements import Requirement
from setuptools import Distribution, Extension
from setuptools.command.build_ext import build_ext
from setuptools.errors import CompileError

import torch_sparse_metal._metal_backend as mb

REPO = Path(__file__).resolve().parents[1]


def run_setup(monkeypatch, platform: str):
    """setup.py's module namespace and the keywords it passes to setup()."""
    recorded = {}
    monkeypatch.setattr(setuptools, "setup", lambda **kw: recorded.update(kw))
    monkeypatch.setattr(sys, "platform", platform)
    monkeypatch.chdir(REPO)
    return runpy.run_path(str(REPO / "setup.py"), run_name="setup_under_test"), recorded


class Failing(build_ext):
    def build_extension(self, ext):
        raise CompileError("clang: error: no such SDK")


class Succeeding(build_ext):
    built = []

    def build_extension(self, ext):
        self.built.append(ext.name)


def _command(cls):
    cmd = cls(Distribution({"name": "demo"}))
    cmd.warnings = []
    cmd.warn = cmd.warnings.append
    return cmd


def _in(tmp_path, cmd):
    """Build in place under ``tmp_path`` (an editable install's layout)."""
    cmd.inplace = True
    cmd.get_ext_fullpath = lambda name: str(tmp_path / (name.replace(".", "/") + ".so"))
    return cmd


def test_a_failed_extension_build_warns_and_the_install_goes_on(monkeypatch, tmp_path):
    namespace, _ = run_setup(monkeypatch, "linux")
    cmd = _in(tmp_path, _command(namespace["optional_build_ext"](Failing)))
    cmd.build_extension(Extension("torch_sparse_metal._metal_launcher", ["launcher.mm"]))
    (warning,) = cmd.warnings
    assert "torch_sparse_metal._metal_launcher was not built (CompileError: clang: error: no " \
           "such SDK)" in warning
    assert "emulator and reference backends work" in warning
    assert "pip install -v --no-build-isolation --no-deps -e ." in warning
    # pip shows no build output without -v: the reason waits where the package looks.
    record = tmp_path / "torch_sparse_metal" / "_metal_launcher.build-error.txt"
    assert record.read_text().strip() == warning
    assert record.name == Path(mb.BUILD_ERROR).name


def test_a_successful_build_is_untouched_and_clears_an_old_failure(monkeypatch, tmp_path):
    namespace, _ = run_setup(monkeypatch, "linux")
    old = tmp_path / "x" / "_ext.build-error.txt"
    old.parent.mkdir()
    old.write_text("an earlier failure")
    cmd = _in(tmp_path, _command(namespace["optional_build_ext"](Succeeding)))
    cmd.build_extension(Extension("x._ext", ["x.mm"]))
    assert Succeeding.built == ["x._ext"] and cmd.warnings == []
    assert not old.exists()


def test_build_isolation_on_macos_stops_with_a_clear_message(monkeypatch):
    """pip's isolated build has no torch to compile against: say so, do not install a
    package whose GPU path silently is not there."""
    monkeypatch.setitem(sys.modules, "torch.utils.cpp_extension", None)  # import fails
    with pytest.raises(SystemExit, match="torch is not importable in this build.*"
                                         "--no-build-isolation"):
        run_setup(monkeypatch, "darwin")


def test_building_without_metal_on_purpose(monkeypatch, capsys):
    monkeypatch.setenv("TSM_BUILD_WITHOUT_METAL", "1")
    monkeypatch.setitem(sys.modules, "torch.utils.cpp_extension", None)
    _, kw = run_setup(monkeypatch, "darwin")
    assert kw["ext_modules"] == []
    assert "TSM_BUILD_WITHOUT_METAL is set" in capsys.readouterr().err


def test_linux_builds_no_extension(monkeypatch):
    _, kw = run_setup(monkeypatch, "linux")
    assert kw["ext_modules"] == [] and "build_ext" not in kw["cmdclass"]


def test_macos_builds_the_launcher_through_the_optional_build_ext(monkeypatch):
    from torch.utils.cpp_extension import BuildExtension
    monkeypatch.setattr(torch.backends.mps, "is_built", lambda: True)
    _, kw = run_setup(monkeypatch, "darwin")
    (ext,) = kw["ext_modules"]
    assert ext.name == "torch_sparse_metal._metal_launcher"
    assert ext.sources == ["csrc/metal/launcher.mm"]
    command = kw["cmdclass"]["build_ext"]
    assert issubclass(command, BuildExtension) and command.__name__ == "OptionalBuildExt"


@pytest.mark.parametrize("platform, pinned", [("linux", True), ("darwin", False)])
def test_requirements_pin_torch_on_linux_only(platform, pinned):
    lines = [ln.strip() for ln in (REPO / "requirements.txt").read_text().splitlines()
             if ln.strip() and not ln.startswith("#")]
    active = [Requirement(ln) for ln in lines]
    active = [r for r in active if r.marker is None or r.marker.evaluate({"sys_platform": platform})]
    (torch_req,) = [r for r in active if r.name == "torch"]
    assert (str(torch_req.specifier) == "==2.13.0") is pinned
    if not pinned:  # a Mac's torch is kept if the launcher was checked against its release
        checked = ("2.4.1", "2.7.1", "2.13.0", "2.14.1", "2.15.0")
        assert all(torch_req.specifier.contains(v) for v in checked)
        assert not torch_req.specifier.contains("2.3.1")   # no register_fake
        assert not torch_req.specifier.contains("2.16.0")  # not checked yet


def test_pyproject_admits_the_same_torch_releases():
    import tomllib
    deps = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["dependencies"]
    (torch_dep,) = [Requirement(d) for d in deps if Requirement(d).name == "torch"]
    mac = [Requirement(ln.strip()) for ln in (REPO / "requirements.txt").read_text().splitlines()
           if ln.startswith("torch") and "!=" in ln]
    assert [str(torch_dep.specifier)] == [str(r.specifier) for r in mac]
