"""MSL forms the rewriter must translate faithfully, with and without the sanitizer:
braceless loop bodies and collectives in loop conditions (SIMD semantics), prototypes and
default arguments of helpers that reach collectives, element addresses, reference
parameters, range-for and sizeof over threadgroup arrays."""
import numpy as np
import pytest
import torch

from torch_sparse_metal.emulator import compile_shader

SOURCE = r"""
#include <metal_stdlib>
using namespace metal;

float reduce_it(float v);                                  // a prototype, defined below
inline float scaled_sum(float x, float s = 2.0f) { return simd_sum(x) * s; }  // a default

kernel void braceless_loop(device float* o [[buffer(0)]], uint lane [[thread_index_in_simdgroup]]) {
  float acc = 0.0f;
  for (uint i = 0; i < 2; ++i)
    if (!(lane == 0 && i == 0)) acc += simd_sum(float(i + 1));
  o[lane] = acc;   // lane 0: 2 * 32; others: 1 * 31 + 2 * 32
}

kernel void collective_in_condition(device float* o [[buffer(0)]],
                                    uint lane [[thread_index_in_simdgroup]]) {
  float acc = 0.0f;
  uint i = 0;
  while (i < 3 && simd_sum(1u) == 32u) {
    if (lane != 0) acc += simd_sum(1.0f);
    ++i;
  }
  o[lane] = acc + 1000.0f * float(i);   // every lane runs 3 iterations
}

kernel void helpers(device float* o [[buffer(0)]], uint lane [[thread_index_in_simdgroup]]) {
  o[lane] = reduce_it(1.0f) + scaled_sum(1.0f);   // 32 + 64
}
float reduce_it(float v) { return simd_sum(v); }

inline device float* element(device float* p, uint j) { return &p[j]; }
inline void add_to(device float& x, float v) { x += v; }

kernel void addresses(device float* out [[buffer(0)]], uint i [[thread_position_in_grid]]) {
  device float* end = element(out, 32u);          // one past the end: a valid address
  device uint* bits = (device uint*)&out[i];       // a C-style cast of an element address
  add_to(out[i], float(end - out));                // an element bound to a reference parameter
  bits[0] = bits[0];
}

kernel void arrays(device float* out [[buffer(0)]], uint lid [[thread_position_in_threadgroup]]) {
  threadgroup float t[4][8];
  threadgroup float v[8];
  t[lid / 8][lid % 8] = float(lid);
  if (lid < 8) v[lid] = float(lid + 8);
  threadgroup_barrier(mem_flags::mem_threadgroup);
  if (lid == 0) {
    float total = 0.0f;
    for (threadgroup float& e : v) total += e;     // range-for over a threadgroup array
    out[0] = total;
    out[1] = float(sizeof(t) / sizeof(t[0]));      // rows
    out[2] = float(sizeof(t[0]) / sizeof(t[0][0]));  // columns
  }
}
"""


@pytest.fixture(scope="module", params=[False, True], ids=["plain", "sanitized"])
def lib(request):
    return compile_shader(SOURCE, sanitize=request.param)


def test_braceless_loop_bodies_keep_iterations_apart(lib):
    o = torch.zeros(32)
    lib.braceless_loop(o, threads=32, group_size=32)
    assert o[0].item() == 64.0 and (o[1:] == 31.0 + 64.0).all()


def test_a_collective_in_a_loop_condition_is_part_of_the_iteration(lib):
    o = torch.zeros(32)
    lib.collective_in_condition(o, threads=32, group_size=32)
    assert o[0].item() == 3000.0 and (o[1:] == 3000.0 + 3 * 31).all()


def test_prototypes_and_default_arguments_of_helpers(lib):
    o = torch.zeros(32)
    lib.helpers(o, threads=32, group_size=32)
    assert (o == 32.0 + 64.0).all()


def test_element_addresses_casts_and_reference_parameters(lib):
    out = torch.arange(32, dtype=torch.float32)
    lib.addresses(out, threads=32, group_size=32)
    np.testing.assert_array_equal(out.numpy(), np.arange(32) + 32.0)


def test_range_for_and_sizeof_over_threadgroup_arrays(lib):
    out = torch.zeros(3)
    lib.arrays(out, threads=32, group_size=32)
    assert out.tolist() == [float(sum(range(8, 16))), 4.0, 8.0]


def test_a_long_loop_is_not_a_hang():
    """A million distinct accesses by one thread between two barriers is work, not a spin."""
    lib = compile_shader(r"""
    #include <metal_stdlib>
    using namespace metal;
    kernel void long_sum(device const float* x [[buffer(0)]], device float* out [[buffer(1)]],
                         constant uint& n [[buffer(2)]]) {
      float s = 0.0f;
      for (uint i = 0; i < n; ++i) s += x[i];
      out[0] = s;
    }
    """, sanitize=True)
    n = (1 << 20) + 16
    out = torch.zeros(1)
    lib.long_sum(torch.ones(n), out, n, threads=1, group_size=1)
    assert out.item() == n


def test_parenthesised_program_scope_expression_without_collective_helpers():
    # With no helper reaching a collective, `(2 + 1);` at program scope was once taken for a
    # helper's prototype and given a call-site parameter.
    lib = compile_shader("""#include <metal_stdlib>
using namespace metal;
constant int K = (2 + 1);
typedef float (unary_t)(float);
kernel void k(device int * out [[buffer(0)]], uint i [[thread_position_in_grid]]) { out[i] = K; }
""")
    out = torch.zeros(2, dtype=torch.int32)
    lib.k(out, threads=2)
    assert out.tolist() == [3, 3]
