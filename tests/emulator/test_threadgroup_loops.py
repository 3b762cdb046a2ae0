"""Kernels that do not synchronise run a threadgroup as one loop over its threads.

Such a kernel needs no scheduler: the binding table gives it a group function
(``tsm_emu::invoke_straight``) that binds its arguments once per threadgroup and calls the
kernel for each thread in order, with the thread's built-ins. ``TSM_EMU_REGIONS=0`` keeps
the call per thread through the runtime, which is the oracle here: both builds must agree
bit for bit, faults and their words included, and agree with NumPy. The running thread is
recorded as an index only (``Group::enter``), in these loops and in barrier regions alike,
so the reports that name a thread are checked here for threads far from the first.
"""
from __future__ import annotations

import re

import numpy as np
import pytest
import torch

from torch_sparse_metal.emulator import KernelFault, _compiler, record

from _schedules import both_ways

SOURCE = r"""
#include <metal_stdlib>
using namespace metal;

// Modifies its pointer and its built-in: each thread must start from its own arguments.
kernel void walks_its_arguments(device const float* x [[buffer(0)]], device float* out [[buffer(1)]],
                                constant uint& n [[buffer(2)]], uint2 gid [[thread_position_in_grid]],
                                uint2 grid [[threads_per_grid]], ushort lane [[thread_index_in_simdgroup]]) {
  const uint i = gid.y * grid.x + gid.x;
  x += i;
  float acc = 0.0f;
  for (uint k = 0; k < 3 && i + k < n; ++k, ++x) acc = fma(acc, 0.5f, *x);
  gid.x += 1;
  out[i] = acc + float(gid.x) * 1e-3f + float(lane) * 1e-5f;
}

// Thread-private use of threadgroup memory needs no barrier.
kernel void private_scratch(device float* out [[buffer(0)]], threadgroup float* scratch [[threadgroup(0)]],
                            uint gid [[thread_position_in_grid]], uint lid [[thread_position_in_threadgroup]]) {
  scratch[lid] = float(gid) * 2.0f;
  out[gid] = scratch[lid] + 1.0f;
}

kernel void reads_past_the_end(device const float* x [[buffer(0)]], device float* out [[buffer(1)]],
                               uint gid [[thread_position_in_grid]]) {
  out[gid] = x[gid == 77 ? 1000 + gid : gid];
}

kernel void reads_through_null(device float* out [[buffer(0)]], device float* device const* pointers [[buffer(1)]],
                               uint gid [[thread_position_in_grid]]) {
  out[gid] = gid == 77 ? *pointers[0] : 0.0f;
}

// Barrier regions record the running thread the same way: a fault after a barrier.
kernel void faults_after_a_barrier(device float* out [[buffer(0)]], threadgroup float* t [[threadgroup(0)]],
                                   uint gid [[thread_position_in_grid]], uint lid [[thread_position_in_threadgroup]],
                                   uint size [[threads_per_threadgroup]]) {
  t[lid] = float(gid);
  threadgroup_barrier(mem_flags::mem_threadgroup);
  const uint other = gid == 77 ? size + 5 : (lid + 1) % size;
  out[gid] = t[other];
}
"""

STRAIGHT = {"walks_its_arguments", "private_scratch", "reads_past_the_end", "reads_through_null"}


def group_functions(text: str, how: str) -> set:
    """The kernels the binding table registers through ``how`` (invoke_straight, invoke_group)."""
    return set(re.findall(rf"::tsm_emu::{how}\(&::(\w+?)(?:__tsm_group)?, params_", text))


def test_kernels_that_do_not_synchronise_get_the_loop(tmp_path, monkeypatch):
    path = tmp_path / "shader.metal"
    path.write_text(SOURCE)
    monkeypatch.setenv("TSM_EMU_REGIONS", "1")
    text = _compiler.generated_cxx(path).text
    assert group_functions(text, "invoke_straight") == STRAIGHT
    assert group_functions(text, "invoke_group") == {"faults_after_a_barrier"}
    monkeypatch.setenv("TSM_EMU_REGIONS", "0")
    text = _compiler.generated_cxx(path).text
    assert group_functions(text, "invoke_straight") == group_functions(text, "invoke_group") == set()


@pytest.fixture(params=[False, True], ids=["plain", "sanitized"])
def builds(request, monkeypatch):
    return both_ways(SOURCE, monkeypatch, request.param)


def launch(lib, kernel: str, args, threads, group, **kw):
    """The launch's outputs, or its fault's kind and message; then its counters (a sanitized
    build's bytes, instructions, FMAs...)."""
    with record() as launches:
        try:
            lib[kernel](*args, threads=threads, group_size=group, **kw)
        except KernelFault as e:
            return ("fault", e.kind, str(e))
    return ("ran",) + tuple(a.clone() for a in args if isinstance(a, torch.Tensor)) + (launches[0].counters,)


def test_arguments_are_each_threads_own(builds):
    x = torch.randn(100)
    results = [launch(lib, "walks_its_arguments", [x, torch.full((100,), float("nan")), 100], (10, 10), (4, 3))
               for lib in builds]
    assert results[0][0] == "ran" and results[1][0] == "ran", results
    assert torch.equal(results[0][2].view(torch.int32), results[1][2].view(torch.int32))
    assert results[0][3] == results[1][3]
    # NumPy: thread (gx, gy) of a 10x10 grid, threadgroups of 4x3 (smaller at the edges).
    xs = x.numpy()
    want = np.empty(100, dtype=np.float32)
    for gy in range(10):
        for gx in range(10):
            i = gy * 10 + gx
            acc = np.float32(0)
            for k in range(3):
                if i + k < 100:
                    acc = np.float32(np.float64(acc) * 0.5 + xs[i + k])  # fma: one rounding
            width = min(4, 10 - gx // 4 * 4)
            lane = ((gy % 3) * width + gx % 4) % 32
            want[i] = acc + np.float32(gx + 1) * np.float32(1e-3) + np.float32(lane) * np.float32(1e-5)
    np.testing.assert_array_equal(results[0][2].numpy(), want)


def test_threadgroup_memory_without_barriers(builds):
    results = [launch(lib, "private_scratch", [torch.zeros(200)], 200, 64, threadgroup_memory=[4 * 64])
               for lib in builds]
    assert torch.equal(results[0][1], results[1][1]) and results[0][2] == results[1][2]
    assert torch.equal(results[0][1], torch.arange(200, dtype=torch.float32) * 2 + 1)


@pytest.mark.parametrize("kernel, kind", [("reads_past_the_end", "out_of_bounds"),
                                          ("faults_after_a_barrier", "out_of_bounds"),
                                          ("reads_through_null", "crash")])
def test_a_fault_names_the_thread_that_made_it(builds, kernel, kind):
    args = {"reads_past_the_end": lambda: [torch.zeros(100), torch.zeros(100)],
            "faults_after_a_barrier": lambda: [torch.zeros(100)],
            "reads_through_null": lambda: [torch.zeros(100), torch.zeros(1, dtype=torch.int64)]}[kernel]
    extra = {"threadgroup_memory": [4 * 32]} if kernel == "faults_after_a_barrier" else {}
    results = [launch(lib, kernel, args(), 100, 32, **extra) for lib in builds]
    assert results[0] == results[1]
    assert results[0][:2] == ("fault", kind), results[0]
    # Thread 77 is the 14th of the third threadgroup.
    assert "thread (77, 0, 0) (index 13 in threadgroup (2, 0, 0))" in results[0][2]
