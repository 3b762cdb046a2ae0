"""A kernel that faults (a wild pointer it did not get from a buffer, a stack overflow, a trap)
raises KernelFault(kind="crash"); the Python process lives on and the library stays usable.
(An access outside a buffer through the buffer's own pointer is stopped earlier, by the
bounds check: test_bounds_checked.py.) The message says what happened in
words that do not depend on the OS: a guard-page hit is SIGSEGV on Linux, SIGBUS on macOS."""
import platform
import re
import sys

import pytest
import torch

from torch_sparse_metal.emulator import KernelFault, compile_shader

SOURCE = r"""
#include <metal_stdlib>
using namespace metal;
kernel void read_through_null(device int* x [[buffer(0)]], device int* device const* pointers [[buffer(1)]],
                              uint i [[thread_position_in_grid]]) {
  x[i] = i == 3 ? *pointers[0] : 0;  // the host stores a null pointer there
}
// A helper that synchronises: a kernel that calls it runs as fibers, each thread on its own stack.
void on_a_fiber() { simdgroup_barrier(mem_flags::mem_none); }
kernel void overflow_fiber_stack(device int* x [[buffer(0)]], uint i [[thread_position_in_grid]]) {
  volatile int big[1 << 20];  // 4 MB on a fiber stack of 256 KB
  big[i] = 1;
  x[i] = big[i];
  on_a_fiber();
}
kernel void trap(device int* x [[buffer(0)]], uint i [[thread_position_in_grid]]) {
  if (i == 9) __builtin_trap();  // emulator-only: ud2 (SIGILL) on x86-64, brk (SIGTRAP) on AArch64
  x[i] = 1;
}
kernel void fill(device int* x [[buffer(0)]], uint i [[thread_position_in_grid]]) {
  x[i] = int(i);
}
"""


@pytest.fixture(scope="module")
def lib():
    return compile_shader(SOURCE)


MEMORY = "SIGSEGV|SIGBUS"  # which one depends on the OS


@pytest.mark.parametrize("kernel, make, cause, signals, thread", [
    ("read_through_null", lambda: [torch.zeros(100, dtype=torch.int32), torch.zeros(1, dtype=torch.int64)],
     "invalid memory access", MEMORY, "thread (3, 0, 0)"),
    ("overflow_fiber_stack", lambda: [torch.zeros(64, dtype=torch.int32)],
     "fiber stack overflow", MEMORY, "thread ("),
    ("trap", lambda: [torch.zeros(100, dtype=torch.int32)],
     "trap or illegal instruction", "SIGILL|SIGTRAP", "thread (9, 0, 0)"),
])
def test_fault_is_reported_not_fatal(lib, kernel, make, cause, signals, thread):
    for _ in range(2):  # and again: the worker that faulted is usable afterwards
        with pytest.raises(KernelFault) as info:
            args = make()
            getattr(lib, kernel)(*args, threads=args[0].numel(), group_size=32)
        message = str(info.value)
        assert info.value.kind == "crash"
        assert re.search(rf"{cause} \(({signals})\) at address 0x[0-9a-f]+ in {re.escape(thread)}", message)
        assert kernel in message
    out = torch.full((1000,), -1, dtype=torch.int32)
    lib.fill(out, threads=1000, group_size=64)
    assert torch.equal(out, torch.arange(1000, dtype=torch.int32))


def test_stack_overflow_message_names_the_setting(lib):
    with pytest.raises(KernelFault, match=r"TSM_EMU_STACK_KB sets the stack size, now 256 KB"):
        lib.overflow_fiber_stack(torch.zeros(64, dtype=torch.int32), threads=64, group_size=32)


MISALIGNED = r"""
#include <metal_stdlib>
using namespace metal;
kernel void misaligned_vectors(device const float* a [[buffer(0)]], device float4* out [[buffer(1)]],
                               uint i [[thread_position_in_grid]]) {
  device const float4* v = (device const float4*)(a + 1);  // 4 bytes past a 16-byte boundary
  out[i] = v[i] * 2.0f + v[i + 1];
}
"""


@pytest.mark.skipif(platform.machine() not in ("x86_64", "AMD64") or sys.platform != "linux",
                    reason="x86-64 Linux raises a general-protection fault for the aligned vector load; "
                           "an AArch64 host loads misaligned data")
@pytest.mark.parametrize("sanitize", [False, True])
def test_a_misaligned_vector_access_is_named(sanitize):
    # Undefined in Metal; on x86-64 the aligned load faults with no address, which the
    # message must not present as a mere wild pointer at 0x0.
    lib = compile_shader(MISALIGNED, sanitize=sanitize)
    with pytest.raises(KernelFault, match=r"misaligned or invalid memory access \(SIGSEGV\).*"
                                          r"not aligned to it, through a pointer cast") as info:
        lib.misaligned_vectors(torch.arange(80, dtype=torch.float32), torch.zeros(8, 4), threads=8)
    assert info.value.kind == "crash"
