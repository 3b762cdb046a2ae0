"""The emulator's C++ compiler comes from TSM_EMU_CXX, not $CXX (which drives the macOS
extension's build), else from the platform's usual compilers: the first with _Float16."""
import shutil
import stat
import sys

import pytest

from torch_sparse_metal.emulator import MetalCompileError, _compiler

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


CLANG = next((c for c in ("clang++-19", "clang++") if shutil.which(c)), None)
# A kernel of each execution mode: barrier regions, fibers (a SIMD-group function), a plain loop.
MODES_SOURCE = r"""
#include <metal_stdlib>
using namespace metal;
kernel void regions(device float* out [[buffer(0)]], uint lid [[thread_position_in_threadgroup]],
                    uint gid [[thread_position_in_grid]]) {
  threadgroup float t[64];
  float v = float(gid) * 0.5f;
  for (uint s = 0; s < 3; ++s) {
    t[lid] = v;
    threadgroup_barrier(mem_flags::mem_threadgroup);
    v = fma(v, 0.25f, t[(lid + 1 + s) % 64]);
    threadgroup_barrier(mem_flags::mem_threadgroup);
  }
  out[gid] = v;
}
kernel void fibers(device float* out [[buffer(0)]], uint gid [[thread_position_in_grid]]) {
  out[gid] = simd_sum(float(gid) / 3.0f) + simd_shuffle_down(float(gid), 1u);
}
kernel void plain(device float* out [[buffer(0)]], uint gid [[thread_position_in_grid]]) {
  out[gid] = sqrt(float(gid)) / 7.0f;
}
"""
RUN_MODES = r"""
import sys, torch
from torch_sparse_metal.emulator import compile_shader
lib = compile_shader(sys.stdin.read())
outs = []
for name in ("regions", "fibers", "plain"):
    out = torch.zeros(256)
    lib[name](out, threads=256, group_size=64)
    outs.append(out)
torch.save(outs, sys.argv[1])
"""


@pytest.mark.skipif(CLANG is None, reason="no clang++ on PATH (.ci/run installs clang-19)")
def test_clang_builds_and_runs_every_mode_as_gcc_does(tmp_path):
    """The emulator's C++ (barrier regions, fibers, plain loops) with clang as with g++, to
    the bit. Each in a process of its own: the compiler is chosen once per process."""
    import os
    import subprocess

    import torch

    results = []
    for compiler in (HOST_CXX, CLANG):
        out = tmp_path / f"{compiler}.pt"
        env = dict(os.environ, TSM_EMU_CXX=compiler)
        done = subprocess.run([sys.executable, "-c", RUN_MODES, str(out)], input=MODES_SOURCE, env=env,
                              capture_output=True, text=True, timeout=600)
        assert done.returncode == 0, done.stderr[-3000:]
        results.append(torch.load(out))
    for gcc, clang in zip(*results):
        assert torch.equal(gcc, clang)
