"""Without the sanitizer too, an access outside a kernel's buffers and threadgroup memory never
touches memory outside them: it raises KernelFault(kind="out_of_bounds") naming the thread,
the buffer and the element, and nothing beyond the buffer changes."""
import pytest
import torch

from torch_sparse_metal.emulator import KernelFault, compile_shader

SOURCE = r"""
#include <metal_stdlib>
using namespace metal;
kernel void grid_too_large(device float* y [[buffer(0)]], uint i [[thread_position_in_grid]]) {
  y[i] = 7.0f;
}
kernel void read_past_the_end(device const float* x [[buffer(0)]], device float* y [[buffer(1)]],
                              uint i [[thread_position_in_grid]]) {
  y[i] = x[i + 1];
}
kernel void index_minus_one(device float* y [[buffer(0)]], uint i [[thread_position_in_grid]]) {
  y[int(i) - 1] = 1.0f;  // a signed index: element -1 (with a uint, i - 1 wraps as on the GPU)
}
kernel void far_away(device float* y [[buffer(0)]], uint i [[thread_position_in_grid]]) {
  y[i + (i == 5 ? 400000000u : 0u)] = 1.0f;
}
kernel void pointer_arithmetic(device float* y [[buffer(0)]], uint i [[thread_position_in_grid]]) {
  device float* p = y + 10;
  p[i] = 2.0f;
}
inline void store(device float& slot, float v) { slot = v; }
kernel void through_a_reference(device float* y [[buffer(0)]], uint i [[thread_position_in_grid]]) {
  store(y[i + 12], 3.0f);
}
struct Pair { float a; float b; };
kernel void struct_field(device Pair* p [[buffer(0)]], uint i [[thread_position_in_grid]]) {
  p[i + 4].b = 1.0f;
}
kernel void vector_element(device float4* v [[buffer(0)]], uint i [[thread_position_in_grid]]) {
  v[i + 3].y = 1.0f;
}
kernel void atomic_add(device atomic_uint* c [[buffer(0)]], uint i [[thread_position_in_grid]]) {
  atomic_fetch_add_explicit(&c[i * 2], 1u, memory_order_relaxed);
}
kernel void threadgroup_array(device float* y [[buffer(0)]], uint lid [[thread_index_in_threadgroup]]) {
  threadgroup float t[8];
  t[lid] = 1.0f;
  threadgroup_barrier(mem_flags::mem_threadgroup);
  y[lid] = t[lid];
}
kernel void threadgroup_argument(device float* y [[buffer(0)]], threadgroup float* t [[threadgroup(0)]],
                                 uint lid [[thread_index_in_threadgroup]]) {
  t[lid + 4] = 1.0f;
  y[lid] = 0.0f;
}
"""


@pytest.fixture(scope="module", params=[False, True], ids=["plain", "sanitized"])
def lib(request):
    return compile_shader(SOURCE, sanitize=request.param)


def guarded(n, dtype=torch.float32, extra=64):
    """A buffer of n elements that is the front of a larger allocation: what follows it must
    stay as it was."""
    whole = torch.full((n + extra,), -3, dtype=dtype)
    return whole, whole[:n]


@pytest.mark.parametrize("kernel, elements, threads, says", [
    ("grid_too_large", 16, 64, "accesses [[buffer(0)]] `y` at element 16 (byte offset 64, 4 bytes) "
                               "but it holds 16 elements (64 bytes)"),
    ("index_minus_one", 16, 16, "at element -1 "),
    ("far_away", 16, 16, "at element 400000005 "),
    ("pointer_arithmetic", 16, 16, "at element 16 "),
    ("through_a_reference", 16, 16, "at element 16 "),
])
def test_writes_outside_a_buffer_fault_and_change_nothing_beyond_it(lib, kernel, elements, threads, says):
    whole, y = guarded(elements)
    with pytest.raises(KernelFault) as info:
        getattr(lib, kernel)(y, threads=threads, group_size=16)
    assert info.value.kind == "out_of_bounds"
    assert says in str(info.value) and kernel in str(info.value)
    assert "thread (" in str(info.value)
    assert torch.all(whole[elements:] == -3), "memory past the buffer changed"


def test_the_issues_example_leaves_the_heap_intact():
    lib = compile_shader("#include <metal_stdlib>\nusing namespace metal;\n"
                         "kernel void w(device float* y [[buffer(0)]], uint i [[thread_position_in_grid]]) "
                         "{ y[i] = 7.0f; }")
    for _ in range(50):
        with pytest.raises(KernelFault, match="out_of_bounds"):
            lib.w(torch.zeros(16), threads=64)
    blocks = [torch.randn(1000) for _ in range(200)]  # the allocator still works
    assert all(b.numel() == 1000 for b in blocks)


def test_reads_outside_a_buffer_fault(lib):
    x, y = torch.ones(8), torch.zeros(8)
    with pytest.raises(KernelFault, match=r"out_of_bounds: .* accesses \[\[buffer\(0\)\]\] `x` at element 8 "):
        lib.read_past_the_end(x, y, threads=8, group_size=8)


@pytest.mark.parametrize("kernel, make, threads, says", [
    ("struct_field", lambda: torch.zeros(8), 1, "accesses [[buffer(0)]] `p` at element 4 (byte offset 32, 8 bytes)"),
    ("vector_element", lambda: torch.zeros(12), 1, "accesses [[buffer(0)]] `v` at element 3 (byte offset 48, 16 bytes)"),
    ("atomic_add", lambda: torch.zeros(8, dtype=torch.int32), 8, "accesses [[buffer(0)]] `c` at element 8 "),
])
def test_fields_vectors_and_atomics_are_checked(lib, kernel, make, threads, says):
    buffer = make()
    with pytest.raises(KernelFault) as info:
        getattr(lib, kernel)(buffer, threads=threads, group_size=threads)
    assert info.value.kind == "out_of_bounds" and says in str(info.value)


def test_threadgroup_memory_is_checked(lib):
    with pytest.raises(KernelFault, match=r"threadgroup variable `t` at element 8 "):
        lib.threadgroup_array(torch.zeros(16), threads=16, group_size=16)
    with pytest.raises(KernelFault, match=r"\[\[threadgroup\(0\)\]\] `t` at element 8 "):
        lib.threadgroup_argument(torch.zeros(8), threads=8, group_size=8, threadgroup_memory=[32])


def test_in_bounds_accesses_still_work(lib):
    whole, y = guarded(16)
    lib.grid_too_large(y, threads=16, group_size=16)
    assert torch.all(y == 7) and torch.all(whole[16:] == -3)
