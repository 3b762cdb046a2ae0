"""A `thread T*` pointer taken from a thread-private array -- its decay, `&x[i]`, `x + i`,
the array passed to a `thread T*` parameter -- carries the array's bounds, in the plain and
the sanitized build: an access through it outside the array raises
KernelFault("out_of_bounds") naming the subscript, the element, the array's length and the
source line, before anything is touched. Pointers with no array behind them (a scalar's
address, a cast) are not checked; valid kernels run as before, as barrier regions too."""
import re

import pytest
import torch

from torch_sparse_metal.emulator import compile_shader

import _one_value_kernels
from _one_value_kernels import line_of, run
from _schedules import both_ways, grouped

SOURCE = r"""#include <metal_stdlib>
using namespace metal;
float at(thread const float* p, int k) { return p[k]; }
// `T` is deduced from the pointer: the parameter stays a raw pointer (not checked).
template <typename T> T first(thread T* p, int k) { return p[k]; }
void fill(thread float* p, int n, float v) { for (int i = 0; i < n; ++i) p[i] = v; }
struct Tile {
  float v[4];
  thread float* elems() thread { return reinterpret_cast<thread float*>(v); }
};
kernel void forms(device float* out [[buffer(0)]], constant int& which [[buffer(1)]],
                  uint i [[thread_position_in_grid]]) {
  float x[4] = {1.0f, 2.0f, 3.0f, 4.0f};
  float y[2][3] = {};
  thread float* p = x;
  thread float* q = &x[1];
  thread const float* c = p + 1;
  thread float* d = x + 2;
  thread float* row = y[1];
  float scalar = 5.0f;
  thread float* s = &scalar;
  Tile t = {};
  fill(t.v, 4, 1.0f);
  float r = t.elems()[3] + p[3] + q[2] + c[0] + d[1] + at(x, 3) + first(x, 1) + *s + row[2];
  for (thread float* w = &x[0]; w != &x[4]; ++w) r += *w;
  if (which == 1) r += p[4];
  if (which == 2) r += q[-2];
  if (which == 3) r += at(x, 4);
  if (which == 4) fill(x, 5, 0.0f);
  if (which == 5) r += *(p + 4);
  if (which == 6) r += row[3];
  if (which == 7) r += d[2];
  if (which == 8) r += (x - 1)[0];
  out[i] = r;
}
// A pointer into a thread array kept across barriers (a barrier region's per-thread slot).
kernel void across_barriers(device float* out [[buffer(0)]], constant int& extra [[buffer(1)]],
                            uint lid [[thread_position_in_threadgroup]]) {
  threadgroup float t[8];
  float hist[3] = {0.0f, 0.0f, 0.0f};
  thread float* h = hist + 1;
  for (int k = 0; k < 3; ++k) {
    t[lid] = float(lid + k);
    threadgroup_barrier(mem_flags::mem_threadgroup);
    h[(k + int(lid)) % 2] += t[(lid + 1) % 8];
    threadgroup_barrier(mem_flags::mem_threadgroup);
  }
  out[lid] = hist[0] + 2.0f * hist[1] + 4.0f * h[extra + 1];
}
"""
LINES = SOURCE.splitlines()


def fault(lib, kernel, value, threads=4, group=4) -> str:
    """Every fault here is the first thread's, before any store."""
    return _one_value_kernels.fault(lib, kernel, value, threads, group, nothing_stored=True)


@pytest.fixture(scope="module", params=[False, True], ids=["plain", "sanitized"])
def lib(request):
    return compile_shader(SOURCE, sanitize=request.param)


def test_valid_forms_run(lib):
    # elems 1 + p[3] 4 + q[2] 4 + c[0] 2 + d[1] 4 + at 4 + first 2 + scalar 5 + row 0 + the loop 10
    assert run(lib, "forms", 0).tolist() == [36.0] * 4


@pytest.mark.parametrize("which, subscript, element, length, needle", [
    (1, "p[4]", 4, 4, "r += p[4]"),
    (2, "q[-2]", -1, 4, "r += q[-2]"),
    (3, "p[k]", 4, 4, "return p[k]"),  # the array passed to a `thread const float*` parameter
    (4, "p[i]", 4, 4, "p[i] = v"),
    (6, "row[3]", 3, 3, "r += row[3]"),  # a row of a two-dimensional array: the row's bounds
    (7, "d[2]", 4, 4, "r += d[2]"),  # d = x + 2
    (8, "(x - 1)[0]", -1, 4, "(x - 1)[0]"),
])
def test_an_access_outside_the_array_faults_naming_the_subscript(lib, which, subscript, element, length, needle):
    message = fault(lib, "forms", which)
    assert re.search(rf"thread \(0, 0, 0\) .*accesses `{re.escape(subscript)}`, element {element} of a thread "
                     rf"array that holds {length} elements \(shader\.metal:{line_of(LINES, needle)}\)$", message), message


def test_a_dereference_outside_the_array_faults_without_a_subscript(lib):
    assert fault(lib, "forms", 5).endswith(
        "accesses element 4 of a thread array that holds 4 elements, through a `thread` pointer")


def test_pointers_across_barriers_as_barrier_regions_and_as_fibers(lib, monkeypatch, tmp_path):
    assert "across_barriers" in grouped(SOURCE, tmp_path)
    results = [(run(build, "across_barriers", 0, 8, 8).tolist(), fault(build, "across_barriers", 1, 8, 8))
               for build in both_ways(SOURCE, monkeypatch, lib.sanitize)]
    assert results[0] == results[1]
    values, message = results[0]
    # thread 0: h[k % 2] += k + 1, so hist[1] = 1 + 3, hist[2] = h[1] = 2
    assert values[0] == 2.0 * 4.0 + 4.0 * 2.0
    assert "accesses `h[extra + 1]`, element 3 of a thread array that holds 3 elements" in message


DEVICE_ARRAYS = r"""#include <metal_stdlib>
using namespace metal;
struct block { half d; uint8_t qs[16]; };
constant float TABLE[4] = {1.0f, 2.0f, 3.0f, 4.0f};
float first(constant float* t) { return t[0]; }
// ggml's form: an array member of a buffer's element, offset and cast to another pointee type.
kernel void members(device const block* x [[buffer(0)]], device float* out [[buffer(1)]],
                    uint i [[thread_position_in_grid]]) {
  device const uint16_t* q = (device const uint16_t*)(x[i].qs + 2);
  device const uint16_t* r = (device const uint16_t*)&x[i].qs[4];
  out[i] = float(q[0]) + float(r[0]) + float(x[i].qs[6]) + first(&TABLE[1]) + first(TABLE + 2);
}
"""


@pytest.mark.parametrize("sanitize", [False, True], ids=["plain", "sanitized"])
def test_arrays_in_buffers_and_constants_stay_checked_pointers(sanitize):
    lib = compile_shader(DEVICE_ARRAYS, sanitize=sanitize)
    x = torch.zeros(2, 18, dtype=torch.uint8)  # half d, then qs[16] from byte 2
    x[:, 4], x[:, 6], x[:, 8] = 1, 2, 3
    out = torch.zeros(2)
    lib.members(x, out, threads=2, group_size=2)
    assert out.tolist() == [1.0 + 2.0 + 3.0 + 2.0 + 3.0] * 2


@pytest.mark.parametrize("sanitize", [False, True])
def test_a_thread_pointer_variable_passed_to_a_template_pointer_parameter(sanitize):
    # `thread T* p` deduces A of a template's `A* q` and `const thread A* q`, as in Metal,
    # also beside a value the call deduces A from (clang's OpenCL mode deduces
    # `__private float` from the one and `float` from the other; both are Metal's thread).
    lib = compile_shader(r"""#include <metal_stdlib>
using namespace metal;
template <typename A> inline void fill(A* q, A v, int n) { for (int j = 0; j < n; ++j) q[j] = v + A(j); }
template <typename A> inline A total(const thread A* q, int n) { A s = 0; for (int j = 0; j < n; ++j) s += q[j]; return s; }
kernel void k(device float* y [[buffer(0)]], uint i [[thread_position_in_grid]]) {
  float local[4];
  thread float* p = local;
  fill(p, float(i), 4);
  y[i] = total(p + 1, 3);
}""", sanitize=sanitize)
    y = torch.zeros(3)
    lib.k(y, threads=3)
    assert y.tolist() == [3 * i + 6 for i in range(3)]
