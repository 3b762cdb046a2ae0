"""The sanitized build accepts the pointer syntax MSL kernels use, and still checks it."""
import numpy as np
import pytest
import torch

from torch_sparse_metal.emulator import KernelFault, compile_shader
from torch_sparse_metal.emulator._access_rewrite import checked_members, marked_stores
from torch_sparse_metal.emulator._rewrite import _checked_pointers


@pytest.mark.parametrize("msl, cxx", [
    ("device float* p", "::tsm_emu::ptr<float> p"),
    ("device const float* p", "::tsm_emu::ptr<const float> p"),
    ("const device float* p", "::tsm_emu::ptr<const float> p"),
    ("device float4 const* p", "::tsm_emu::ptr<const float4> p"),
    ("volatile device atomic_uint* p", "::tsm_emu::ptr<volatile atomic_uint> p"),
    ("device atomic<T>* p", "::tsm_emu::ptr<atomic<T>> p"),
    ("device vec<float, 4>* p", "::tsm_emu::ptr<vec<float, 4>> p"),
    ("threadgroup unsigned int* p", "::tsm_emu::ptr<unsigned int> p"),
    ("constant metal::float2* p", "::tsm_emu::ptr<const metal::float2> p"),
    ("(device uint*)(x)", "(::tsm_emu::ptr<uint>)(x)"),
    ("reinterpret_cast<device const uint*>(x)", "::tsm_emu::ptr_cast<const uint>(x)"),
    ("constant Params& p", "constant Params& p"),  # references stay: checked when bound
    ("thread float* p", "thread float* p"),        # private memory is not checked
])
def test_pointer_rewrite(msl, cxx):
    assert _checked_pointers(msl) == cxx


def _member(address: str, *fields: str) -> str:
    steps = ", ".join(f"{'[&]' if '[' in f else '[]'}(auto& tsm_m_) -> decltype(auto) {{ return (tsm_m_.{f}); }}"
                      for f in fields)
    return f"::tsm_emu::member_of({address}, {steps})"


@pytest.mark.parametrize("msl, cxx", [
    ("y = p[i].a;", f"y = {_member('::tsm_emu::element_address(p, i)', 'a')};"),
    ("y = t[i][j].a.b[k];", f"y = {_member('::tsm_emu::element_address(t[i], j)', 'a', 'b[k]')};"),
    ("y = p->a;", f"y = {_member('p', 'a')};"),
    ("y = (p + 1)->a;", f"y = {_member('(p + 1)', 'a')};"),
    ("y = (*r).a;", f"y = {_member('r', 'a')};"),
    ("y = m.ref().a;", f"y = {_member('m.pointer()', 'a')};"),
    ("y = v[i].xy;", f"y = {_member('::tsm_emu::element_address(v, i)', 'xy')};"),
    ("y = p[i]\n  .a;\nz;", f"y = {_member('::tsm_emu::element_address(p, i)', 'a')}\n;\nz;"),
    ("p[q[i].a].b = 1;", "::tsm_emu::stored(" + _member(
        "::tsm_emu::element_address(p, " + _member("::tsm_emu::element_address(q, i)", "a") + ")", "b")
     + ") = 1;"),
    # not data members, not evaluated, or not a member access at all: unchanged
    ("a[i].thread_elements()[0] = 1;", "::tsm_emu::stored(a[i].thread_elements()[0]) = 1;"),
    ("n = sizeof(p[0].a);", "n = sizeof(p[0].a);"),
    ("y = f(*p).a;", "y = f(*p).a;"),
    ("y = this->a;", "y = this->a;"),
    ("auto f(int x) -> float;", "auto f(int x) -> float;"),
    ("auto g = [](int x) -> float { return x; };", "auto g = [](int x) -> float { return x; };"),
])
def test_member_access_rewrite(msl, cxx):
    assert marked_stores(checked_members(msl)) == cxx


@pytest.mark.parametrize("msl, cxx", [
    ("t[i] = v;", "::tsm_emu::stored(t[i]) = v;"),
    ("t[i][j] += v;", "::tsm_emu::updated(t[i][j]) += v;"),
    ("*p = v; *(p + 1) <<= 2;", "::tsm_emu::stored(*p) = v; ::tsm_emu::updated(*(p + 1)) <<= 2;"),
    ("(*r) = v;", "::tsm_emu::stored((*r)) = v;"),
    ("m.ref() = v;", "::tsm_emu::stored(m.ref()) = v;"),
    ("t[i]++; --t[j];", "::tsm_emu::updated(t[i])++; --::tsm_emu::updated(t[j]);"),
    ("if (c) t[i] = v;", "if (c) ::tsm_emu::stored(t[i]) = v;"),
    # a name ending in a digit is no number: all of it is the target (barrier regions'
    # renamed variables end in one)
    ("c__tsm2.thread_elements()[i] = v; x = 1.f;", "::tsm_emu::stored(c__tsm2.thread_elements()[i]) = v; x = 1.f;"),
    # plain variables, declarations, comparisons, template defaults: unchanged
    ("x = t[i]; x += 1; i++; --i;", "x = t[i]; x += 1; i++; --i;"),
    ("float a[4] = {0}; device float* p = x; float *q = &y;", "float a[4] = {0}; device float* p = x; float *q = &y;"),
    ("b = t[i] == v || t[i] != w || t[i] <= v || t[i] >= w;", "b = t[i] == v || t[i] != w || t[i] <= v || t[i] >= w;"),
    ("template <class T, class = void> struct S;", "template <class T, class = void> struct S;"),
    ("y = a * b[i];", "y = a * b[i];"),
    # elements of local arrays are registers: unmarked in their block, marked elsewhere
    ("{ float acc[4][4], b[4]; acc[i][j] += b[j]; b[0] = 1; } { b[0] = 1; }",
     "{ float acc[4][4], b[4]; acc[i][j] += b[j]; b[0] = 1; } { ::tsm_emu::stored(b[0]) = 1; }"),
    ("{ threadgroup float t[4]; t[i] = 1; }", "{ threadgroup float t[4]; ::tsm_emu::stored(t[i]) = 1; }"),
])
def test_assignment_target_rewrite(msl, cxx):
    assert marked_stores(msl) == cxx


VOLATILE_SOURCE = r"""
#include <metal_stdlib>
using namespace metal;
kernel void volatile_pointers(device int* a [[buffer(0)]], device int* out [[buffer(1)]],
                              volatile device atomic_uint* count [[buffer(2)]],
                              uint lid [[thread_position_in_threadgroup]]) {
  volatile device int* p = a;
  device volatile int* q = a;
  threadgroup int s[32];
  volatile threadgroup int* t = s;
  p[lid] = p[lid] + 1;
  q[lid] += 2;
  t[lid] = *(q + lid);
  atomic_fetch_add_explicit(count, 1u, memory_order_relaxed);
  threadgroup_barrier(mem_flags::mem_threadgroup);
  out[lid] = t[31 - lid];
}

kernel void volatile_race(device int* a [[buffer(0)]], uint lid [[thread_position_in_threadgroup]]) {
  volatile device int* p = a;
  p[0] = int(lid);
}
"""


@pytest.mark.parametrize("sanitize", [False, True], ids=["plain", "sanitized"])
def test_volatile_pointers_compile_and_run_in_both_builds(sanitize):
    lib = compile_shader(VOLATILE_SOURCE, sanitize=sanitize)
    a, out, count = torch.arange(32, dtype=torch.int32), torch.zeros(32, dtype=torch.int32), torch.zeros(1, dtype=torch.int32)
    lib.volatile_pointers(a, out, count, threads=32, group_size=32)
    np.testing.assert_array_equal(a.numpy(), np.arange(32) + 3)
    np.testing.assert_array_equal(out.numpy(), np.arange(31, -1, -1) + 3)
    assert count.item() == 32


def test_accesses_through_volatile_pointers_are_checked():
    lib = compile_shader(VOLATILE_SOURCE, sanitize=True)
    with pytest.raises(KernelFault) as info:
        lib.volatile_race(torch.zeros(1, dtype=torch.int32), threads=4, group_size=4)
    assert info.value.kind == "device_race" and "`a` element 0" in str(info.value)
    with pytest.raises(KernelFault) as info:
        lib.volatile_pointers(torch.zeros(31, dtype=torch.int32), torch.zeros(32, dtype=torch.int32),
                              torch.zeros(1, dtype=torch.int32), threads=32, group_size=32)
    assert info.value.kind == "out_of_bounds" and "element 31" in str(info.value)


SOURCE = r"""
#include <metal_stdlib>
using namespace metal;
struct Pair { float a; float b; };

inline float first(device const float* p, uint i) { return p[i]; }

kernel void forms(device const float* x [[buffer(0)]], device float4* v [[buffer(1)]],
                  device Pair* pairs [[buffer(2)]], device float* out [[buffer(3)]],
                  constant uint& n [[buffer(4)]], uint i [[thread_position_in_grid]]) {
  device const uint* bits = reinterpret_cast<device const uint*>(x);
  device const float* shifted = x + 1;
  v[i].xy = float2(x[i], first(x, i));                 // swizzle write through the checked ref
  device Pair* p = pairs + i;
  p->b = p->a + 1.0f;                                  // -> on a checked pointer
  out[i] = (i + 1 < n ? shifted[i] : 0.0f) + float(bits[i] == as_type<uint>(x[i]));
}

kernel void via_address(device float* out [[buffer(0)]], uint i [[thread_position_in_grid]]) {
  device float* q = &out[0];                           // a raw address gets its region back
  q[i + 1] = 1.0f;                                     // one past the end for the last thread
}
"""


def test_forms_run_clean_and_right():
    lib = compile_shader(SOURCE, sanitize=True)
    n = 40
    x = torch.randn(n)
    v = torch.zeros(n, 4)
    pairs = torch.stack([torch.arange(n, dtype=torch.float32), torch.zeros(n)], dim=1).contiguous()
    out = torch.zeros(n)
    lib.forms(x, v, pairs, out, n, threads=n, group_size=16)
    np.testing.assert_array_equal(v[:, 0].numpy(), x.numpy())
    np.testing.assert_array_equal(v[:, 1].numpy(), x.numpy())
    np.testing.assert_array_equal(pairs[:, 1].numpy(), np.arange(n) + 1.0)
    expected = np.append(x.numpy()[1:], 0.0) + 1.0
    np.testing.assert_allclose(out.numpy(), expected, rtol=1e-6)


def test_pointer_from_an_address_keeps_its_bounds():
    lib = compile_shader(SOURCE, sanitize=True)
    with pytest.raises(KernelFault) as info:
        lib.via_address(torch.zeros(8), threads=8, group_size=8)
    assert info.value.kind == "out_of_bounds"
    assert "element 8" in str(info.value) and "`out`" in str(info.value)


DEDUCTION_SOURCE = r"""
#include <metal_stdlib>
using namespace metal;
// `const T*` parameters deduce T from non-const pointers, as in MSL: in the sanitized build
// ptr<float> converts to ptr<const T> through its base class.
template <typename T>
T block_sum(threadgroup const T* p, uint n) { T s = 0; for (uint i = 0; i < n; ++i) s += p[i]; return s; }
template <typename T>
T device_sum(device const T* p, uint n) { T s = 0; for (uint i = 0; i < n; ++i) s += p[i]; return s; }

kernel void sums(device const float* x [[buffer(0)]], device float* out [[buffer(1)]],
                 uint lid [[thread_position_in_threadgroup]]) {
  threadgroup float t[32];
  t[lid] = x[lid];
  threadgroup_barrier(mem_flags::mem_threadgroup);
  if (lid == 0) {
    out[0] = block_sum(t + 0, 32u);
    out[1] = device_sum(x, 32u);
    out[2] = device_sum(out, 2u);
  }
}
"""


@pytest.mark.parametrize("sanitize", [False, True])
def test_const_pointer_parameters_deduce_from_non_const_arguments(sanitize):
    lib = compile_shader(DEDUCTION_SOURCE, sanitize=sanitize)
    out = torch.zeros(3)
    lib.sums(torch.arange(32, dtype=torch.float32), out, threads=32, group_size=32)
    np.testing.assert_array_equal(out.numpy(), [496.0, 496.0, 992.0])


ARRAY_DECAY_SOURCE = r"""
#include <metal_stdlib>
using namespace metal;
template <typename T>
T first_plus_last(threadgroup T* p, uint n) { return p[0] + p[n - 1]; }
template <typename T>
T row_sum(threadgroup T* row) { return row[0] + row[3]; }

#ifdef __METAL_EMULATOR__  // double: the emulator's own extension
kernel void decay(device const double* x [[buffer(0)]], device double* out [[buffer(1)]],
                  uint lid [[thread_position_in_threadgroup]]) {
  threadgroup double t[8];
  threadgroup double m[2][4];
  t[lid] = x[lid];
  m[lid / 4][lid % 4] = x[lid];
  threadgroup_barrier(mem_flags::mem_threadgroup);
  if (lid == 0) {
    out[0] = first_plus_last(t, 8u);   // array-to-pointer decay deduces T
    out[1] = row_sum(m[1]);            // a row of a 2-D array decays too
  }
}
#endif
"""


@pytest.mark.parametrize("sanitize", [False, True])
def test_threadgroup_arrays_decay_into_template_parameters(sanitize):
    lib = compile_shader(ARRAY_DECAY_SOURCE, sanitize=sanitize)
    out = torch.zeros(2, dtype=torch.float64)
    lib.decay(torch.arange(8, dtype=torch.float64), out, threads=8, group_size=8)
    np.testing.assert_array_equal(out.numpy(), [0.0 + 7.0, 4.0 + 7.0])


REVIEW_SOURCE = r"""
#include <metal_stdlib>
using namespace metal;

// Taking an element's address is pointer arithmetic, not an access: no race with the
// other threads' writes before the barrier, and one past the end is a valid address.
kernel void addresses(device float* out [[buffer(0)]], device const int* ends [[buffer(1)]],
                      uint lid [[thread_position_in_threadgroup]]) {
  threadgroup float t[32];
  t[lid] = float(lid);
  threadgroup float* p = &t[0];
  device float* end = &out[ends[0]];
  threadgroup_barrier(mem_flags::mem_threadgroup);
  out[lid] = p[lid ^ 1u] + float(end - out);
}

// Accesses through a local reference are checked at each use, not only where it binds.
kernel void local_reference_race(device float* out [[buffer(0)]],
                                 uint lid [[thread_position_in_threadgroup]]) {
  device float& first = out[0];
  threadgroup_barrier(mem_flags::mem_device);
  first = float(lid);
}

// Threadgroup memory written only by atomics is initialized.
kernel void atomic_init(device uint* out [[buffer(0)]], uint lid [[thread_position_in_threadgroup]]) {
  threadgroup atomic_uint counts[4];
  if (lid < 4) atomic_store_explicit(&counts[lid], 0u, memory_order_relaxed);
  threadgroup_barrier(mem_flags::mem_threadgroup);
  atomic_fetch_add_explicit(&counts[lid % 4], 1u, memory_order_relaxed);
  threadgroup_barrier(mem_flags::mem_threadgroup);
  if (lid < 4) out[lid] = atomic_load_explicit(&counts[lid], memory_order_relaxed);
}

// Thread 0 waits for thread 1: no forward progress is promised between threads.
kernel void spin_wait(device atomic_uint* flag [[buffer(0)]], uint lid [[thread_position_in_threadgroup]]) {
  if (lid == 0) {
    while (atomic_load_explicit(flag, memory_order_relaxed) == 0u) {}
  } else {
    atomic_store_explicit(flag, 1u, memory_order_relaxed);
  }
}
"""


@pytest.fixture(scope="module")
def review_lib():
    return compile_shader(REVIEW_SOURCE, sanitize=True)


def test_taking_an_address_is_not_an_access(review_lib):
    out = torch.zeros(32)
    review_lib.addresses(out, torch.tensor([32], dtype=torch.int32), threads=32, group_size=32)
    np.testing.assert_array_equal(out.numpy(), (np.arange(32) ^ 1) + 32.0)


def test_uses_of_a_local_reference_are_checked(review_lib):
    with pytest.raises(KernelFault) as info:
        review_lib.local_reference_race(torch.full((1,), -1.0), threads=4, group_size=4)
    assert info.value.kind == "device_race" and "`out` element 0" in str(info.value)


def test_atomic_stores_initialize_threadgroup_memory(review_lib):
    out = torch.zeros(4, dtype=torch.int32)
    review_lib.atomic_init(out, threads=64, group_size=64)
    assert out.tolist() == [16, 16, 16, 16]


def test_a_spin_wait_is_reported_not_hung(review_lib):
    with pytest.raises(KernelFault) as info:
        review_lib.spin_wait(torch.zeros(1, dtype=torch.int32), threads=2, group_size=2)
    assert info.value.kind == "hang" and "forward progress" in str(info.value)


def test_more_than_31_buffers_is_a_launch_error():
    from torch_sparse_metal.emulator import LaunchError
    lib = compile_shader(REVIEW_SOURCE)
    with pytest.raises(LaunchError, match="at most 31"):
        lib.atomic_init(*[torch.zeros(1)] * 32, threads=1)
    with pytest.raises(LaunchError, match="at most 31"):
        lib.atomic_init(torch.zeros(4, dtype=torch.int32), threads=1, threadgroup_memory=[16] * 32)
