"""Vector code lanes at once (``torch_sparse_metal/emulator/_lanes.py``, ``tsm_emu/lanes.h``): a
loop over a SIMD-group's lanes the C++ compiler vectorises.

Two things make it so. A thread's array used only through subscripts lives in element-major
slots (``LaneSlots``: element i of thread t at i * n + t), so one statement's access of it by
consecutive lanes is contiguous. And a run of statements that can fault only alike in every
thread (every index the same in all of them, under conditions the same in all of them, only
Metal's functions called) runs, when every thread runs, without each thread's test, entering
and catch: the first thread's fault is the one fibers raise.

Every launch must give the bits of the regions' rounds and of fibers, and a fault the words
fibers give; the multiply-adds of such a run must be vector instructions.
"""
from __future__ import annotations

import platform
import re
import shutil
import subprocess

import pytest
import torch

from torch_sparse_metal.emulator import _compiler, compile_shader

from _schedules import fault_of, same_bits_each_way, three_ways, translated

HEADER = "#include <metal_stdlib>\nusing namespace metal;\n"

KERNELS = HEADER + r"""
inline float sum4(thread const float* v) {
  return v[0] + v[1] + v[2] + v[3];
}

// Each lane keeps 8 sums in an array and 8 weights in a 2-D array of vectors, fed by a
// SIMD-group function per step. The multiply-adds between two of them index both with the
// step's `r` and the uniform `from` only: a run that faults only alike. `q` goes to a function
// as a pointer, so it keeps a slot per thread; `scale`, each thread's own, is constructed from
// its initialiser.
kernel void lane_sums(device const float* x [[buffer(0)]], device float* out [[buffer(1)]],
                      constant uint& steps [[buffer(2)]], constant uint& from [[buffer(3)]],
                      uint gid [[thread_position_in_grid]], uint lane [[thread_index_in_simdgroup]]) {
  const float scale[4] = {1.0f, 0.5f, 0.25f * x[gid], 0.125f};
  float acc[8];
  float2 w[2][4];
  float q[4];
  for (uint r = 0; r < 8; ++r) {
    acc[r] = 0.0f;
    w[r / 4][r % 4] = float2(x[gid] * float(r + 1), 1.0f - 0.25f * float(r));
  }
  for (uint r = 0; r < 4; ++r) {
    q[r] = x[gid] - float(r);
  }
  float b;
  for (uint s = 0; s < steps; ++s) {
    for (uint r = 0; r < 8; ++r) {
      w[r / 4][r % 4].x += acc[(r + from) % 8] * scale[r % 4];
      if (s % 2 == 0) {
        b = simd_broadcast(w[r / 4][r % 4].x, ushort((s + r) % 32));
      } else {
        b = simd_shuffle_xor(w[r / 4][r % 4].y, ushort(r + 1));
      }
      acc[r] = fma(b, w[1 - r / 4][r % 4].y, acc[r]);
    }
  }
  float total = simd_sum(acc[lane % 8]);
  for (uint r = 0; r < 8; ++r) {
    total += acc[r] * float(r + 1);
  }
  out[gid] = total + w[lane % 2][lane % 4].x + sum4(q);
}

// `k` is one value in every thread: its fault is every running thread's, the first's reported.
// Threads before `first` return, so from there not every thread runs.
kernel void uniform_fault(device float* out [[buffer(0)]], constant uint& k [[buffer(1)]],
                          constant uint& first [[buffer(2)]], uint lid [[thread_position_in_threadgroup]]) {
  if (lid < first) {
    return;
  }
  float acc[8];
  for (uint r = 0; r < 8; ++r) {
    acc[r] = float(lid + r);
  }
  const float v = simd_sum(acc[0]);
  if (k < 100) {
    acc[1] = simd_max(acc[1]);
  }
  acc[k] += v;  // (a run of its own, between two structures)
  if (k < 100) {
    acc[2] = simd_min(acc[2]);
  }
  out[lid] = simd_sum(acc[k % 8]);
}

// Not alike: `k` is one value in every thread, but indexes only where a thread's own condition
// holds (mode 0), or a pointer each thread has its own of (mode 1).
kernel void own_faults(device const float* x [[buffer(0)]], device float* out [[buffer(1)]],
                       constant uint& k [[buffer(2)]], constant uint& who [[buffer(3)]],
                       constant uint& mode [[buffer(4)]], uint lid [[thread_position_in_threadgroup]]) {
  float acc[8];
  for (uint r = 0; r < 8; ++r) {
    acc[r] = float(lid + r);
  }
  device const float* p = x + lid;
  const float v = simd_sum(acc[0]);
  if (mode == 0 && lid == who) {
    acc[k] = v;
  }
  const float u = simd_sum(acc[1]);
  if (mode == 1) {
    acc[0] += p[k] + u;
  }
  out[lid] = simd_sum(acc[who % 8]);
}
"""


def generated(tmp_path) -> str:
    cxx = translated(KERNELS, tmp_path)
    assert cxx.lanes == {"lane_sums", "uniform_fault", "own_faults"}
    return cxx.text


def lanes_body(text: str, kernel: str) -> str:
    """The lanes-at-once body of ``kernel``'s group function (its first instantiation)."""
    start = text.index(f"void {kernel}__tsm_group(")
    body = text.index("::tsm_emu::Lanes __tsm_lanes(", start)
    return text[body:text.index("__tsm_lanes.settle(); }", body)]


def test_arrays_used_by_subscript_only_are_element_major(tmp_path):
    body = lanes_body(generated(tmp_path), "lane_sums")
    slots = {m.group(2): m.group(1) for m in re.finditer(r"::tsm_emu::(LaneSlots|Slots)<[^;]*?> __tsm_l(\d+)\(", body)}
    names = {m.group(2): m.group(1) for m in re.finditer(r"auto&& (\w+)__tsm\d+ = __tsm_l(\d+)\[", body)}
    kinds = {names[index]: kind for index, kind in slots.items() if index in names}
    assert kinds["acc"] == kinds["w"] == kinds["scale"] == "LaneSlots"
    assert kinds["q"] == "Slots"  # (its address goes to sum4)


def test_runs_that_fault_alike_have_a_loop_without_each_threads_test(tmp_path):
    text = generated(tmp_path)
    fast = lanes_body(text, "lane_sums").split("__tsm_lanes.all_running()")[1:]
    # the multiply-adds' run, and no run that reads x at a thread's own index
    assert any("fma(b__tsm" in run.split(" else ")[0] for run in fast)
    assert not any("x[gid]" in run.split(" else ")[0] for run in fast)
    # `acc[k] += v`; not the runs that hand over or read back a SIMD-group function's value
    fast = lanes_body(text, "uniform_fault").split("__tsm_lanes.all_running()")[1:]
    assert len(fast) == 1 and "+= v__tsm" in fast[0].split(" else ")[0]


@pytest.mark.parametrize("threads, group", [(256, 64), (96, 96), (70, 70), (40, 40)])
@pytest.mark.parametrize("steps, start", [(0, 0), (1, 3), (6, 5)])
def test_element_major_arrays_and_runs_that_fault_alike_agree_with_rounds_and_fibers(monkeypatch, threads, group,
                                                                                     steps, start):
    x = torch.randn(threads, generator=torch.Generator().manual_seed(threads + steps)).float()

    def launch(lib):
        out = torch.full((threads,), float("nan"))
        lib.lane_sums(x, out, steps, start, threads=threads, group_size=group)
        return out
    out = same_bits_each_way(three_ways(KERNELS, monkeypatch), launch)
    if threads % 32 == 0:  # (a partial SIMD-group's missing lanes read poison)
        assert torch.isfinite(out).all()


@pytest.mark.parametrize("first", [0, 5, 33])
def test_a_fault_every_thread_makes_names_the_first_running_thread_as_fibers_do(monkeypatch, first):
    ways = three_ways(KERNELS, monkeypatch)
    faults = [fault_of(lib, "uniform_fault", torch.zeros(64), 9, first, threads=64, group_size=64) for lib in ways]
    assert faults[0] is not None and faults[0][0] == "out_of_bounds"
    assert faults[0] == faults[1] == faults[2]
    assert f"index {first} in threadgroup" in faults[0][1] and "`acc`" in faults[0][1], faults[0][1]
    def launch(lib):  # in bounds: the same bits
        out = torch.full((64,), float("nan"))
        lib.uniform_fault(out, 3, first, threads=64, group_size=64)
        return out
    same_bits_each_way(ways, launch)


# The packed multiply-adds of the host (the emulator compiles with -mfma on x86-64).
_VECTOR_FMA = {"x86_64": r"\bvfn?m(?:add|sub)\w*ps\b", "aarch64": r"\bfml[as]\s+v\d+\.4s"}


def test_the_multiply_adds_between_two_simd_group_functions_are_vector_code(monkeypatch):
    """Slots by thread put a lane's `acc[8]` 32 bytes from the next lane's, and each thread's
    test and entering kept g++ from vectorising the loop; the group function's only vector
    multiply-adds are that loop's."""
    pattern = _VECTOR_FMA.get(platform.machine())
    objdump = shutil.which("objdump")
    if pattern is None or objdump is None:
        pytest.skip("needs objdump (binutils) on x86-64 or AArch64")
    if "g++" not in _compiler.compiler() and "c++" not in _compiler.compiler():
        pytest.skip("what the C++ compiler vectorises is g++'s here")
    monkeypatch.delenv("TSM_EMU_LANES", raising=False)
    lib = compile_shader(KERNELS)
    listing = subprocess.run([objdump, "-d", "-C", "--no-show-raw-insn", str(lib.path)], capture_output=True,
                             text=True, check=True).stdout
    functions = re.split(r"\n(?=[0-9a-f]+ <)", listing)
    group = [f for f in functions if re.match(r"[0-9a-f]+ <[^>]*lane_sums__tsm_group", f)]
    assert group, "no group function of lane_sums in the library"
    assert any(re.search(pattern, f) for f in group)


@pytest.mark.parametrize("mode, k, who, named", [(0, 9, 7, 7), (0, 8, 40, 40), (1, 40, 0, 24)])
def test_a_fault_not_every_thread_makes_names_its_own_thread(monkeypatch, mode, k, who, named):
    ways = three_ways(KERNELS, monkeypatch)
    faults = [fault_of(lib, "own_faults", torch.zeros(64), torch.zeros(64), k, who, mode, threads=64, group_size=64)
              for lib in ways]
    assert faults[0] is not None and faults[0][0] == "out_of_bounds"
    assert faults[0] == faults[1] == faults[2]
    assert f"index {named} in threadgroup" in faults[0][1], faults[0][1]
