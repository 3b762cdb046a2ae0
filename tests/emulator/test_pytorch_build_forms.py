"""Forms of PyTorch's MPS kernels that the check accepted but the emulator's C++ build
rejected (issue 15), in this project's own kernels: each builds, plain and sanitized, and
computes what NumPy does."""
import math
import numpy as np
import pytest
import torch

from torch_sparse_metal.emulator import compile_shader

HEAD = "#include <metal_stdlib>\nusing namespace metal;\n"

# Loads at a byte offset through a void pointer, overloaded on its address space (as
# PyTorch's c10/metal/indexing.h reads any dtype): called with typed pointers, which
# convert to `constant void*` or `device void*`, and from a kernel template with void
# pointers, through a helper whose pointer type is a template parameter.
VOID_OVERLOADS = HEAD + """
inline float load(constant void* p, long offset) {
  return *reinterpret_cast<constant float*>(static_cast<constant char*>(p) + offset);
}
inline float load(device void* p, long offset) {
  return 2.0f * *reinterpret_cast<device float*>(static_cast<device char*>(p) + offset);
}
template <typename T> inline T at(constant void* p, long offset) {
  return *reinterpret_cast<constant T*>(static_cast<constant char*>(p) + offset);
}
template <typename T> inline T at(device void* p, long offset) {
  return T(10) * *reinterpret_cast<device T*>(static_cast<device char*>(p) + offset);
}
template <typename T, typename P> inline T at_index(P p, long i) { return at<T>(p, i * long(sizeof(T))); }
kernel void typed(device float* out [[buffer(0)]], constant float* a [[buffer(1)]],
                  uint i [[thread_position_in_grid]]) {
  out[i] = load(a, i * 4) + load(out, i * 4);
}
template <typename T>
kernel void untyped(device void* out [[buffer(0)]], constant void* a [[buffer(1)]],
                    uint i [[thread_position_in_grid]]) {
  T sum = at<T>(a, i * sizeof(T)) + at_index<T>(out, i);
  *reinterpret_cast<device T*>(static_cast<device char*>(out) + i * sizeof(T)) = sum;
}
template [[host_name("untyped_float")]] kernel void untyped<float>(device void*, constant void*, uint);
template [[host_name("untyped_int")]] kernel void untyped<int>(device void*, constant void*, uint);
"""


@pytest.mark.parametrize("sanitize", [False, True])
def test_overloads_on_the_address_space_of_a_void_pointer(sanitize):
    lib = compile_shader(VOID_OVERLOADS, sanitize=sanitize)
    a = torch.arange(5, dtype=torch.float32)
    out = torch.full((5,), 0.5)
    lib.typed(out, a, threads=5)
    np.testing.assert_array_equal(out.numpy(), np.arange(5) + 1.0)  # constant: a; device: 2 * out
    for name, dtype in (("untyped_float", torch.float32), ("untyped_int", torch.int32)):
        a = torch.arange(4, dtype=dtype)
        out = torch.tensor([1, 2, 3, 4], dtype=dtype)
        getattr(lib, name)(out, a, threads=4)
        np.testing.assert_array_equal(out.numpy(), np.arange(4) + 10 * np.array([1, 2, 3, 4]))


def test_kernel_templates_sharing_a_name_are_instantiated_by_parameter_list():
    # PyTorch's two fused_sgd templates (with and without momentum), one host name each.
    lib = compile_shader(HEAD + """
template <typename T>
kernel void step(device T* w [[buffer(0)]], constant float& lr [[buffer(1)]],
                 uint i [[thread_position_in_grid]]) {
  w[i] -= T(lr);
}
template <typename T>
kernel void step(device T* w [[buffer(0)]], device T* v [[buffer(1)]], constant float& lr [[buffer(2)]],
                 constant float& momentum [[buffer(3)]], uint i [[thread_position_in_grid]]) {
  v[i] = T(momentum) * v[i] + T(1);
  w[i] -= T(lr) * v[i];
}
template [[host_name("step_float")]] kernel void step<float>(device float*, constant float&, uint);
template [[host_name("step_momentum_float")]] kernel void step<float>(
    device float*, device float*, constant float&, constant float&, uint);
""")
    w = torch.ones(3)
    lib.step_float(w, 0.25, threads=3)
    np.testing.assert_array_equal(w.numpy(), np.full(3, 0.75))
    w, v = torch.ones(3), torch.tensor([0.0, 1.0, 2.0])
    lib.step_momentum_float(w, v, 0.5, 0.5, threads=3)
    expected_v = 0.5 * np.array([0.0, 1.0, 2.0]) + 1
    np.testing.assert_array_equal(v.numpy(), expected_v)
    np.testing.assert_array_equal(w.numpy(), 1 - 0.5 * expected_v)


@pytest.mark.parametrize("sanitize", [False, True])
def test_a_conditional_of_a_bfloat_and_an_integer_is_a_bfloat(sanitize):
    # PyTorch's GridSampler3D clips a coordinate with `c ? size - 1 : coord`; the integer
    # operand converts to bfloat (the usual arithmetic conversions), as does a float one to
    # float in `c ? b : 0.5f`.
    lib = compile_shader(HEAD + """
kernel void clip(device bfloat* x [[buffer(0)]], device float* y [[buffer(1)]], constant long& n [[buffer(2)]],
                 uint i [[thread_position_in_grid]]) {
  bfloat v = x[i];
  x[i] = v > n - 1 ? n - 1 : v < 0 ? 0 : v;
  y[i] = v < 0 ? 0.5f : v;
}
""", sanitize=sanitize)
    values = np.array([-3.0, 0.5, 2.25, 7.0, 300.0], np.float32)
    x = torch.tensor(values, dtype=torch.bfloat16)
    y = torch.zeros(5)
    lib.clip(x, y, 5, threads=5)
    np.testing.assert_array_equal(x.float().numpy(), np.clip(values, 0, 4))
    np.testing.assert_array_equal(y.numpy(), np.where(values < 0, 0.5, values))


@pytest.mark.parametrize("sanitize", [False, True])
@pytest.mark.parametrize("simd", [False, True])
def test_a_threadgroup_array_passed_whole_deduces_a_pointer(sanitize, simd):
    # Sort.metal: merge_partition(tgv, tgv + n, ...) for `template <typename Ptr> int
    # merge_partition(Ptr A, Ptr B, ...)`. With no SIMD-group function the kernel runs as
    # barrier regions, where the array is a view of it (both are objects in the emulator).
    lib = compile_shader(HEAD + """
template <typename Ptr> inline float dot_halves(Ptr a, Ptr b, int n) {
  float s = 0;
  for (int j = 0; j < n; ++j) s += a[j] * b[j];
  return s;
}
template <typename T>
kernel void k(device const T* x [[buffer(0)]], device T* y [[buffer(1)]], uint i [[thread_index_in_threadgroup]]) {
  threadgroup T tile[8];
  tile[i] = x[i];
  threadgroup_barrier(mem_flags::mem_threadgroup);
  float s = dot_halves(tile, tile + 4, 4);
  y[i] = T(s) + T(SHIFT);
}
template [[host_name("k_float")]] kernel void k<float>(device const float*, device float*, uint);
""".replace("T(SHIFT)", "T(simd_sum(0.0f))" if simd else "T(0)"), sanitize=sanitize)
    x = torch.arange(8, dtype=torch.float32)
    y = torch.zeros(8)
    lib.k_float(x, y, threads=8, group_size=8)
    np.testing.assert_array_equal(y.numpy(), np.full(8, float(np.dot(np.arange(4), np.arange(4, 8)))))


@pytest.mark.parametrize("sanitize", [False, True])
def test_a_conditional_of_a_template_parameter_and_an_integer(sanitize):
    # GridSampler3D's clip_coordinates<T> (`coord < 0 ? 0 : coord > size - 1 ? size - 1 :
    # coord`) and HistogramKernel's `w >= 0 ? weight[i] : 1`, instantiated for bfloat (a
    # class in the emulator's C++), float and long.
    lib = compile_shader(HEAD + """
template <typename T> T clip(T coord, long size) { return coord < 0 ? 0 : coord > size - 1 ? size - 1 : coord; }
template <typename T>
kernel void k(device T* x [[buffer(0)]], device const T* w [[buffer(1)]], constant int& s [[buffer(2)]],
              uint i [[thread_position_in_grid]]) {
  T c = clip(x[i], 5);
  x[i] = c + ((s >= 0) ? w[i] : 1);
}
template [[host_name("k_bfloat")]] kernel void k<bfloat>(device bfloat*, device const bfloat*, constant int&, uint);
template [[host_name("k_float")]] kernel void k<float>(device float*, device const float*, constant int&, uint);
template [[host_name("k_long")]] kernel void k<long>(device long*, device const long*, constant int&, uint);
""", sanitize=sanitize)
    for name, dtype in (("k_bfloat", torch.bfloat16), ("k_float", torch.float32), ("k_long", torch.int64)):
        for s, added in ((1, np.array([10, 20, 30, 40])), (-1, np.ones(4))):
            x = torch.tensor([-2, 3, 9, 4], dtype=dtype)
            getattr(lib, name)(x, torch.tensor([10, 20, 30, 40], dtype=dtype), s, threads=4)
            np.testing.assert_array_equal(x.double().numpy(), np.clip([-2, 3, 9, 4], 0, 4) + added)


@pytest.mark.parametrize("sanitize", [False, True])
def test_a_conditional_of_a_template_parameter_and_a_float(sanitize):
    # UnaryKernel's angle_functor: `T(isnan(x) ? x : x < 0 ? M_PI_F : 0.0)`. Beside a float a
    # bfloat converts to float, as a half does; the result is rounded to T once, after.
    lib = compile_shader(HEAD + """
using namespace metal;
template <typename T> T angle(T x) { return T(isnan(x) ? x : x < 0 ? M_PI_F : 0.0); }
template <typename T> float widened(T x, bool keep) { auto r = keep ? x : 0.5f; return r * 3.0f; }
template <typename T>
kernel void k(device T* x [[buffer(0)]], device float* w [[buffer(1)]], uint i [[thread_position_in_grid]]) {
  w[i] = widened(x[i], i % 2 == 0);
  x[i] = angle(x[i]);
}
template [[host_name("k_bfloat")]] kernel void k<bfloat>(device bfloat*, device float*, uint);
template [[host_name("k_half")]] kernel void k<half>(device half*, device float*, uint);
template [[host_name("k_float")]] kernel void k<float>(device float*, device float*, uint);
""", sanitize=sanitize)
    for name, dtype in (("k_bfloat", torch.bfloat16), ("k_half", torch.float16), ("k_float", torch.float32)):
        values = torch.tensor([-1.5, 2.0, float("nan"), -0.25], dtype=dtype)
        x, w = values.clone(), torch.zeros(4)
        getattr(lib, name)(x, w, threads=4)
        pi = torch.tensor(math.pi, dtype=dtype).item()
        np.testing.assert_array_equal(x.float().numpy(), [pi, 0.0, np.nan, pi])
        np.testing.assert_array_equal(w.numpy(), [values[0].item() * 3, 1.5, np.nan, 1.5])


@pytest.mark.parametrize("sanitize", [False, True])
def test_a_program_scope_constant_bounds_arrays_passed_whole(sanitize):
    # LinearAlgebra.metal: `constant uint TILE_DIM = 16;` bounds threadgroup tiles that a
    # helper takes as `threadgroup T A_tile[TILE_DIM][TILE_DIM]`; c10's `all(a == b)` of half2.
    lib = compile_shader(HEAD + """
using namespace metal;
constant uint TILE = 4;
template <typename T>
inline T trace(threadgroup T tile[TILE][TILE], uint n) { T s = 0; for (uint k = 0; k < n; ++k) s += tile[k][k]; return s; }
kernel void k(device const float* x [[buffer(0)]], device float* out [[buffer(1)]],
              device const half2* h [[buffer(2)]], device bool* same [[buffer(3)]],
              uint2 l [[thread_position_in_threadgroup]], uint2 g [[thread_position_in_grid]]) {
  threadgroup float tile[TILE][TILE];
  tile[l.y][l.x] = x[l.y * TILE + l.x];
  threadgroup_barrier(mem_flags::mem_threadgroup);
  if (l.x == 0 && l.y == 0) out[0] = trace(tile, TILE);
  if (l.y == 0) same[l.x] = all(h[l.x] == h[l.x + 1]);
}""", sanitize=sanitize, language_version="3.2")
    x = torch.arange(16, dtype=torch.float32)
    out, same = torch.zeros(1), torch.zeros(4, dtype=torch.bool)
    h = torch.tensor([[1, 2], [1, 2], [1, 3], [0, 3], [0, 3]], dtype=torch.float16)
    lib.k(x, out, h, same, threads=(4, 4), group_size=(4, 4))
    assert out.item() == 0 + 5 + 10 + 15
    assert same.tolist() == [True, False, False, True]


NAMESPACED = HEAD + """
namespace at_ns {
enum class Epilogue : int { None = 0, Scale = 1 };
template <typename T, Epilogue E>
kernel void scale_sum(device T* y [[buffer(0)]], uint l [[thread_index_in_threadgroup]]) {
  threadgroup T shared[8];
  shared[l] = y[l];
  threadgroup_barrier(mem_flags::mem_threadgroup);
  T s = 0;
  for (uint k = 0; k < 8; ++k) s += shared[k];
  y[l] = E == Epilogue::Scale ? s * T(2) : s;
}
template [[host_name("scale_sum_float")]] kernel void scale_sum<float, Epilogue::Scale>(device float*, uint);
template [[host_name("sum_float")]] kernel void scale_sum<float, Epilogue::None>(device float*, uint);
}  // namespace at_ns
"""


@pytest.mark.parametrize("sanitize", [False, True])
def test_an_instantiation_in_a_namespace_names_its_arguments_there(sanitize):
    # Gemm.metal: `template [[host_name(...)]] kernel void gemm<..., GemmEpilogue::None>(...)`
    # inside `namespace at_gemm`, the argument unqualified.
    lib = compile_shader(NAMESPACED, sanitize=sanitize)
    for name, factor in (("scale_sum_float", 2), ("sum_float", 1)):
        y = torch.arange(8, dtype=torch.float32)
        getattr(lib, name)(y, threads=8, group_size=8)
        np.testing.assert_array_equal(y.numpy(), np.full(8, 28.0 * factor))


# A namespace of the shader's own declares functions that Metal's library also has, and calls
# them unqualified with bfloat and vector arguments (c10/metal/reduction_utils.h: its
# `simd_max(T)` called with a bfloat). Metal's bfloat and vectors are built-in types, with no
# namespace that argument-dependent lookup would search, so the calls find the shader's
# functions alone; the emulator's classes for those types must add nothing either.
OWN_NAMES = HEAD + """
namespace mine {
template <typename T> T simd_max(T v) { return T(::metal::simd_max(float(v)) + 1.0f); }
template <typename T> T abs(T v) { return -v; }
template <typename T> T dot(T a, T b) { return a * b; }
template <typename T> T reduce(T v, float2 w) {
  float2 m = abs(w);            // mine::abs: (-w.x, -w.y)
  float2 d = dot(w, w);         // mine::dot: element-wise
  return simd_max(v) + T(m.x + m.y + d.x + d.y);
}
}  // namespace mine
kernel void own_names(device bfloat* out [[buffer(0)]], device float2* w [[buffer(1)]],
                      uint i [[thread_position_in_grid]]) {
  out[i] = mine::reduce(out[i], w[0]);
}
"""


@pytest.mark.parametrize("sanitize", [False, True])
def test_a_shader_namespace_calls_its_own_functions_with_bfloat_and_vector_arguments(sanitize):
    lib = compile_shader(OWN_NAMES, sanitize=sanitize)
    values = torch.arange(32, dtype=torch.float32) - 40.0
    out = values.to(torch.bfloat16)
    w = torch.tensor([[1.0, -2.0]])
    lib.own_names(out, w, threads=32, group_size=32)
    # mine::simd_max: max -9, plus 1; mine::abs: (-1, 2); mine::dot: (1, 4)
    np.testing.assert_array_equal(out.float().numpy(), np.full(32, -8.0 + 1.0 + 5.0))
