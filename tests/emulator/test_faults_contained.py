"""A kernel that faults (wild access, stack overflow) raises
KernelFault(kind="crash"); the Python process lives on and the library stays usable."""
import pytest
import torch

from torch_sparse_metal.metal import KernelFault, compile_shader

SOURCE = r"""
#include <metal_stdlib>
using namespace metal;
kernel void wild_write(device float* x [[buffer(0)]], uint i [[thread_position_in_grid]]) {
  x[i + (i == 77 ? 400000000u : 0u)] = 1.0f;
}
kernel void overflow_fiber_stack(device int* x [[buffer(0)]], uint i [[thread_position_in_grid]]) {
  volatile int big[1 << 20];  // 4 MB on a fiber stack of 256 KB
  big[i] = 1;
  x[i] = big[i];
  threadgroup_barrier(mem_flags::mem_none);
}
kernel void fill(device int* x [[buffer(0)]], uint i [[thread_position_in_grid]]) {
  x[i] = int(i);
}
"""


@pytest.fixture(scope="module")
def lib():
    return compile_shader(SOURCE)


@pytest.mark.parametrize("kernel, make, signal, thread", [
    ("wild_write", lambda: torch.zeros(100), "SIGSEGV", "thread (77, 0, 0)"),
    ("overflow_fiber_stack", lambda: torch.zeros(64, dtype=torch.int32), "SIGSEGV", "thread ("),
])
def test_fault_is_reported_not_fatal(lib, kernel, make, signal, thread):
    for _ in range(2):  # and again: the worker that faulted is usable afterwards
        with pytest.raises(KernelFault) as info:
            t = make()
            getattr(lib, kernel)(t, threads=t.numel(), group_size=32)
        assert info.value.kind == "crash"
        assert signal in str(info.value) and thread in str(info.value)
        assert kernel in str(info.value)
    out = torch.full((1000,), -1, dtype=torch.int32)
    lib.fill(out, threads=1000, group_size=64)
    assert torch.equal(out, torch.arange(1000, dtype=torch.int32))
