"""Arrays outside threadgroup memory -- thread-private locals in kernels and helpers,
multi-dimensional ones, arrays of vectors and structs, array members, `thread T (&)[N]`
parameters, metal::array -- are bounds-checked at each subscript, in the plain and the
sanitized build: an index outside the array raises KernelFault("out_of_bounds") naming the
array, the element, its length and the source line, before anything is touched. Valid
kernels using the same forms run as before, as barrier regions too."""
import re

import pytest

from torch_sparse_metal.emulator import compile_shader

from _one_value_kernels import fault, line_of, run
from _schedules import both_ways, grouped

SOURCE = r"""#include <metal_stdlib>
using namespace metal;
struct Acc { float v[3]; int n; };
constant float TABLE[3] = {1.0f, 2.0f, 3.0f};
template <int N> float total(thread const float (&a)[N]) {
  float s = 0.0f;
  for (int i = 0; i < N; ++i) s += a[i];
  return s;
}
float at(thread const float* p, int k) { return p[k]; }
float helper_local(int k) {
  float h[2] = {5.0f, 6.0f};
  return h[k];
}
// MLX's layer_norm_single_row: each thread reads N_READS elements of the row from r on; a
// thread whose r is past the row's end clears the tail from `axis_size - r`, negative there.
kernel void layer_norm_like(device float* out [[buffer(0)]], constant uint& axis_size [[buffer(1)]],
                            uint lid [[thread_position_in_threadgroup]]) {
  constexpr int N_READS = 4;
  float thread_x[N_READS] = {};
  const uint r = lid * N_READS;
  if (r + N_READS <= axis_size) {
    for (int i = 0; i < N_READS; i++) thread_x[i] = float(r + i);
  } else {
    for (int i = int(axis_size) - int(r); i < N_READS; i++) thread_x[i] = 0.0f;
  }
  out[lid] = thread_x[0] + thread_x[N_READS - 1];
}
kernel void index_n(device float* out [[buffer(0)]], constant int& extra [[buffer(1)]],
                    uint i [[thread_position_in_grid]]) {
  int x[4] = {1, 2, 3, 4};
  out[i] = float(x[int(i) + extra]);
}
kernel void two_d(device float* out [[buffer(0)]], constant int& extra [[buffer(1)]],
                  uint i [[thread_position_in_grid]]) {
  float4 m[2][3] = {};
  m[1][2] = float4(float(i));
  out[i] = m[1][2 + extra].w;
}
kernel void forms(device float* out [[buffer(0)]], constant int& which [[buffer(1)]],
                  uint i [[thread_position_in_grid]]) {
  Acc a = {{1.0f, 2.0f, 3.0f}, 3};
  float2 v[2] = {float2(1.0f, 2.0f), float2(3.0f, 4.0f)};
  metal::array<float, 3> m = {7.0f, 8.0f, 9.0f};
  Acc many[2] = {};
  many[1].v[2] = 10.0f;
  float r = total(a.v) + at(a.v, 2) + v[1].y + m[2] + many[1].v[2] + float(sizeof(v) + sizeof(a.v))
            + helper_local(1) + TABLE[1];
  if (which == 1) r += a.v[a.n];
  if (which == 2) r += v[2].x;
  if (which == 3) r += m[m.size()];
  if (which == 4) r += many[-1].v[0];
  if (which == 5) r += helper_local(2);
  if (which == 6) r += TABLE[which - 3];
  out[i] = r;
}
// A thread array kept across barriers (a barrier region's per-thread slot).
kernel void across_barriers(device float* out [[buffer(0)]], constant int& extra [[buffer(1)]],
                            uint lid [[thread_position_in_threadgroup]]) {
  threadgroup float t[8];
  float hist[3] = {0.0f, 0.0f, 0.0f};
  for (int k = 0; k < 3; ++k) {
    t[lid] = float(lid + k);
    threadgroup_barrier(mem_flags::mem_threadgroup);
    hist[(k + int(lid)) % 3] += t[(lid + 1) % 8];
    threadgroup_barrier(mem_flags::mem_threadgroup);
  }
  out[lid] = hist[0] + 2.0f * hist[1] + 4.0f * hist[extra + 2];
}
// MLX's form: the length a template parameter, the array kept across a barrier, its end's
// address taken (one past the end is an address, not an access).
template <typename T, int N_READS>
kernel void templated(device T* out [[buffer(0)]], constant int& extra [[buffer(1)]],
                      uint lid [[thread_position_in_threadgroup]]) {
  threadgroup T t[8];
  T x[2][N_READS];
  for (int i = 0; i < N_READS; ++i) { x[0][i] = T(i); x[1][i] = T(lid); }
  t[lid] = x[1][N_READS - 1];
  threadgroup_barrier(mem_flags::mem_threadgroup);
  T s = t[(lid + 1) % 8];
  for (thread T* p = &x[0][0]; p != &x[0][N_READS]; ++p) s += *p;
  out[lid] = s + x[extra / 8][N_READS - 1 + extra % 8];
}
template [[host_name("templated_f4")]] kernel void templated<float, 4>(device float*, constant int&, uint);
"""
LINES = SOURCE.splitlines()


@pytest.fixture(scope="module", params=[False, True], ids=["plain", "sanitized"])
def lib(request):
    return compile_shader(SOURCE, sanitize=request.param)


def test_layer_norm_like_negative_index_faults_at_the_access(lib):
    assert run(lib, "layer_norm_like", 16).tolist() == [3.0, 11.0, 19.0, 27.0]
    message = fault(lib, "layer_norm_like", 10)  # thread 3 starts at 12: index 10 - 12 = -2
    assert re.search(r"thread \(3, 0, 0\) .*accesses array `thread_x` at element -2 but it holds 4 "
                     rf"elements \(shader\.metal:{line_of(LINES, 'i < N_READS; i++) thread_x[i] = 0.0f')}\)$", message)


def test_index_n_and_minus_one(lib):
    assert run(lib, "index_n", 0).tolist() == [1.0, 2.0, 3.0, 4.0]
    assert "accesses array `x` at element 4 but it holds 4 elements" in fault(lib, "index_n", 1)
    assert "thread (0, 0, 0)" in fault(lib, "index_n", -1)
    assert "accesses array `x` at element -1 " in fault(lib, "index_n", -1)


def test_each_dimension_of_a_two_dimensional_array_is_checked(lib):
    assert run(lib, "two_d", 0).tolist() == [0.0, 1.0, 2.0, 3.0]
    message = fault(lib, "two_d", 1)
    assert f"accesses array `m[1]` at element 3 but it holds 3 elements (shader.metal:{line_of(LINES, 'm[1][2 + extra]')})" \
        in message


def test_valid_forms_run_and_each_bad_index_names_its_array(lib):
    # total 6 + at 3 + v[1].y 4 + m[2] 9 + many 10 + sizeof 16 + 12 + helper 6 + TABLE 2
    assert run(lib, "forms", 0).tolist() == [68.0] * 4
    expected = {1: ("a.v", 3, 3), 2: ("v", 2, 2), 3: ("metal::array", 3, 3), 4: ("many", -1, 2),
                5: ("h", 2, 2), 6: ("TABLE", 3, 3)}
    for which, (name, index, length) in expected.items():
        message = fault(lib, "forms", which)
        assert f"accesses array `{name}` at element {index} but it holds {length} elements" in message, message


def test_arrays_across_barriers_are_checked_as_barrier_regions_and_as_fibers(lib, monkeypatch, tmp_path):
    assert "across_barriers" in grouped(SOURCE, tmp_path)
    results = [(run(build, "across_barriers", 0, 8, 8).tolist(), fault(build, "across_barriers", 1, 8, 8))
               for build in both_ways(SOURCE, monkeypatch, lib.sanitize)]
    assert results[0] == results[1]
    values, message = results[0]
    assert values[0] == 1.0 + 2.0 * 2.0 + 4.0 * 3.0  # thread 0: hist[k] += k + 1
    assert "accesses array `hist` at element 3 but it holds 3 elements" in message


def test_a_length_from_a_template_parameter_is_checked_as_barrier_regions_and_as_fibers(lib, monkeypatch, tmp_path):
    assert "templated" in grouped(SOURCE, tmp_path)
    results = [(run(build, "templated_f4", 0, 8, 8).tolist(), fault(build, "templated_f4", 1, 8, 8),
                fault(build, "templated_f4", 16, 8, 8)) for build in both_ways(SOURCE, monkeypatch, lib.sanitize)]
    assert results[0] == results[1]
    values, past_the_row, past_the_rows = results[0]
    assert values == [float((lid + 1) % 8 + 6 + 3) for lid in range(8)]
    assert "accesses array `x[extra / 8]` at element 4 but it holds 4 elements" in past_the_row
    assert "accesses array `x` at element 2 but it holds 2 elements" in past_the_rows
