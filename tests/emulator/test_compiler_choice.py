"""The emulator's C++ compiler comes from TSM_EMU_CXX, not $CXX (which drives the macOS
extension's build), else from the platform's usual compilers: the first with _Float16."""
import shutil
import stat
import sys

import pytest

from torch_sparse_metal.metal import MetalCompileError, _compiler

HOST_CXX = _compiler.compiler()  # the one this run uses: a compiler that works


@pytest.fixture(autouse=True)
def fresh_choice(monkeypatch):
    monkeypatch.delenv(_compiler.COMPILER_VARIABLE, raising=False)
    _compiler.compiler.cache_clear()
    yield
    _compiler.compiler.cache_clear()


def fake_compiler(directory, name, exit_code):
    path = directory / name
    path.write_text(f"#!/bin/sh\nexit {exit_code}\n")
    path.chmod(path.stat().st_mode | stat.S_IXUSR)
    return str(path)


def test_variable_chooses_the_compiler_and_cxx_does_not(monkeypatch):
    default = _compiler.compiler()
    assert default in _compiler.default_compilers()
    _compiler.compiler.cache_clear()
    monkeypatch.setenv("CXX", "no-such-compiler-for-the-extension")
    assert _compiler.compiler() == default
    _compiler.compiler.cache_clear()
    chosen = shutil.which(HOST_CXX)
    monkeypatch.setenv(_compiler.COMPILER_VARIABLE, chosen)
    assert _compiler.compiler() == chosen


def test_missing_compiler_is_named(monkeypatch):
    monkeypatch.setenv(_compiler.COMPILER_VARIABLE, "no-such-c++")
    with pytest.raises(MetalCompileError, match=r"TSM_EMU_CXX='no-such-c\+\+': no such compiler on PATH"):
        _compiler.compiler()


def test_compiler_without_float16_is_refused_or_skipped(monkeypatch, tmp_path):
    old = fake_compiler(tmp_path, "old-c++", 1)  # fails every compile, as g++ 12 on AArch64 fails _Float16
    monkeypatch.setenv(_compiler.COMPILER_VARIABLE, old)
    with pytest.raises(MetalCompileError, match="has no _Float16"):
        _compiler.compiler()
    monkeypatch.delenv(_compiler.COMPILER_VARIABLE)
    _compiler.compiler.cache_clear()
    monkeypatch.setattr(_compiler, "default_compilers", lambda: (old, HOST_CXX))
    assert _compiler.compiler() == HOST_CXX
    _compiler.compiler.cache_clear()
    monkeypatch.setattr(_compiler, "default_compilers", lambda: (old,))
    with pytest.raises(MetalCompileError, match=r"found, but without _Float16.*set TSM_EMU_CXX"):
        _compiler.compiler()


def test_platform_defaults(monkeypatch):
    monkeypatch.setattr(sys, "platform", "darwin")
    assert _compiler.default_compilers() == ("clang++",)
    monkeypatch.setattr(sys, "platform", "linux")
    assert _compiler.default_compilers() == ("g++", "c++", "clang++")
