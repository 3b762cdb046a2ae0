"""Forms of candle's Metal kernels (huggingface/candle, candle-metal-kernels/src/metal_src)
that the check once rejected or the emulator could not build, in kernels of our own, each
run against a reference; and the rules next to them that still hold."""
import numpy as np
import pytest
import torch

from torch_sparse_metal.emulator import KernelFault, MetalCompileError, compile_shader

HEAD = "#include <metal_stdlib>\nusing namespace metal;\n"

# reduce.metal: a struct with a `threadgroup` default constructor beside the plain one, the
# constructors spelled with the template's arguments; its numeric_limits through Apple's
# `_numeric_limits_impl`; `__is_valid_simdgroup_type`; bfloat behind `__HAVE_BFLOAT__`.
REDUCE_FORMS = HEAD + """
template <typename T>
struct indexed {
  uint i;
  T val;
  constexpr indexed<T>() = default;
  constexpr indexed<T>() threadgroup = default;
};
template <typename T>
struct _numeric_limits_impl<indexed<T>> {
  static constexpr indexed<T> lowest() { return indexed<T>{0, numeric_limits<T>::lowest()}; }
};
#if defined(__HAVE_BFLOAT__)
bfloat simd_shuffle_down(bfloat v, ushort delta) { return bfloat(simd_shuffle_down(float(v), delta)); }
#endif
template <typename T>
indexed<T> simd_shuffle_down(indexed<T> v, ushort delta) {
  return indexed<T>{simd_shuffle_down(v.i, delta), simd_shuffle_down(v.val, delta)};
}
template <typename T>
indexed<T> larger(indexed<T> a, indexed<T> b) { return b.val > a.val ? b : a; }
template <typename T>
kernel void argmax(device const T* x [[buffer(0)]], device uint* out [[buffer(1)]],
                   device int* flags [[buffer(2)]], uint l [[thread_index_in_threadgroup]]) {
  threadgroup indexed<T> shared[32];
  indexed<T> v = numeric_limits<indexed<T>>::lowest();
  v = larger(v, indexed<T>{l, x[l]});
  for (ushort d = 16; d > 0; d /= 2) v = larger(v, simd_shuffle_down(v, d));
  shared[l] = v;
  threadgroup_barrier(mem_flags::mem_threadgroup);
  if (l == 0) {
    out[0] = shared[0].i;
    flags[0] = int(__is_valid_simdgroup_type<T>::value) | int(__is_valid_simdgroup_type<float4>::value) << 1;
#if defined(__HAVE_BFLOAT__)
    flags[0] |= 4;
#endif
  }
}
template [[host_name("argmax_float")]] kernel void argmax<float>(device const float*, device uint*, device int*, uint);
#if defined(__HAVE_BFLOAT__)
template [[host_name("argmax_bfloat")]] kernel void argmax<bfloat>(device const bfloat*, device uint*, device int*, uint);
#endif
"""


@pytest.mark.parametrize("sanitize", [False, True])
def test_an_argmax_over_a_struct_with_a_threadgroup_constructor(sanitize):
    lib = compile_shader(REDUCE_FORMS, language_version="3.2", sanitize=sanitize)
    # (bfloat is no SIMD-group type: Apple's headers of MSL 3.1 declare no simd_* of it)
    for name, dtype, flags_set in (("argmax_float", torch.float32, 7), ("argmax_bfloat", torch.bfloat16, 6)):
        x = torch.tensor(np.random.default_rng(3).permutation(32) - 40.0, dtype=dtype)
        out, flags = torch.zeros(1, dtype=torch.int32), torch.zeros(1, dtype=torch.int32)
        getattr(lib, name)(x, out, flags, threads=32, group_size=32)
        assert out.item() == int(torch.argmax(x))
        assert flags.item() == flags_set


def test_simd_group_functions_take_no_bfloat():
    # Apple's MSL 3.1 headers declare none (candle: "Metal does not have simd_shuffle_down
    # for bfloat16"); where later ones do, pipelines are reported to fail to build.
    with pytest.raises(MetalCompileError, match="simd_shuffle_down"):
        compile_shader(HEAD + """
kernel void k(device bfloat* y [[buffer(0)]], uint i [[thread_position_in_grid]]) {
  y[i] = simd_shuffle_down(y[i], 1);
}""", language_version="3.2")


def test_have_bfloat_is_defined_from_msl_3_1():
    lib = compile_shader(REDUCE_FORMS, language_version="3.0")
    assert sorted(lib.kernel_names) == ["argmax_float"]


# gemv.metal: MLX's decltype instantiation with casts among the template arguments.
@pytest.mark.parametrize("sanitize", [False, True])
def test_decltype_instantiations_with_casts_among_template_arguments(sanitize):
    lib = compile_shader(HEAD + """
template <typename T, int scale, bool negate>
kernel void scaled(device T* y [[buffer(0)]], uint i [[thread_position_in_grid]]) {
  y[i] = negate ? -y[i] * T(scale) : y[i] * T(scale);
}
#define instantiate(name, T, s, n) \\
  template [[host_name(name)]] [[kernel]] decltype(scaled<T, s, (bool)n>) scaled<T, s, (bool)n>;
instantiate("scaled_3", float, 3, 0)
instantiate("scaled_neg_2", float, 2, 1)
""", sanitize=sanitize)
    y = torch.arange(4, dtype=torch.float32)
    lib.scaled_3(y, threads=4)
    lib.scaled_neg_2(y, threads=4)
    np.testing.assert_array_equal(y.numpy(), -6 * np.arange(4))


# mlx_gemm.metal: a parameter that exists when a bool computed from function constants holds.
GATHER = HEAD + """
constant bool do_gather [[function_constant(300)]];
constant bool use_bias [[function_constant(100)]];
constant bool gather_bias = do_gather && use_bias;
kernel void k(device float* y [[buffer(0)]],
              const device float* bias [[buffer(1), function_constant(use_bias)]],
              const constant uint* bias_index [[buffer(2), function_constant(gather_bias)]],
              uint i [[thread_position_in_grid]]) {
  float b = 0;
  if (use_bias) b = bias[gather_bias ? bias_index[i] : i];
  y[i] += b;
}
"""


@pytest.mark.parametrize("gather,bias", [(True, True), (False, True), (True, False)])
def test_a_parameter_behind_a_bool_computed_from_function_constants(gather, bias):
    lib = compile_shader(GATHER, function_constants={"do_gather": gather, "use_bias": bias})
    y = torch.zeros(3)
    b = torch.tensor([10.0, 20.0, 30.0])
    index = torch.tensor([2, 0, 1], dtype=torch.int32)
    args = [y] + [b] * bias + [index] * (gather and bias)  # absent buffers are not passed
    lib.k(*args, threads=3)
    want = (b[index.long()] if gather else b) if bias else torch.zeros(3)
    np.testing.assert_array_equal(y.numpy(), want.numpy())


# reduce.metal: the kernel reaches its barriers only through an object's operator(), a
# functor it declares (`block_reducer<...> reducer; reducer(value)`), never by name.
@pytest.mark.parametrize("sanitize", [False, True])
def test_barriers_reached_through_a_functor_object(sanitize):
    lib = compile_shader(HEAD + """
template <typename T, uint N>
struct block_sum {
  threadgroup T* shared;
  uint tid;
  T operator()(T v) {
    shared[tid] = v;
    threadgroup_barrier(mem_flags::mem_threadgroup);
    for (uint s = N / 2; s > 0; s /= 2) {
      if (tid < s) shared[tid] += shared[tid + s];
      threadgroup_barrier(mem_flags::mem_threadgroup);
    }
    return shared[0];
  }
};
template <typename T, uint N>
T reduce_block(threadgroup T* shared, uint tid, T v) {
  block_sum<T, N> reducer{shared, tid};
  return reducer(v);
}
template <typename T>
kernel void k(device const T* x [[buffer(0)]], device T* out [[buffer(1)]],
              uint tid [[thread_index_in_threadgroup]], uint g [[threadgroup_position_in_grid]]) {
  threadgroup T shared[64];
  T total = reduce_block<T, 64>(shared, tid, x[g * 64 + tid]);
  if (tid == 0) out[g] = total;
}
template [[host_name("k")]] kernel void k<float>(device const float*, device float*, uint, uint);
""", sanitize=sanitize)
    x = torch.arange(128, dtype=torch.float32)
    out = torch.zeros(2)
    lib.k(x, out, threads=128, group_size=64)
    np.testing.assert_array_equal(out.numpy(), [x[:64].sum().item(), x[64:].sum().item()])


REFERENCE_TO_A_THREADGROUP_SCALAR = HEAD + """
struct MD { float m; float d; };
void publish(threadgroup MD& total, float v, uint tid, uint writer) { if (tid == writer) { total.m = v; total.d = 1.0f; } }
void publish_all(threadgroup MD& total, float v) { total.m = v; }
kernel void k(device float* y [[buffer(0)]], constant uint& racy [[buffer(1)]],
              uint tid [[thread_index_in_threadgroup]]) {
  threadgroup MD total;
  if (racy) publish_all(total, y[tid]); else publish(total, y[tid], tid, 2);
  threadgroup_barrier(mem_flags::mem_threadgroup);
  y[tid] = total.m + total.d;
}
"""


def test_binding_a_threadgroup_scalar_to_a_reference_is_no_access():
    # softmax: `threadgroup MD<T>& md_total` written by one thread, read by all after a
    # barrier. The sanitizer saw each thread read the variable where it was passed.
    lib = compile_shader(REFERENCE_TO_A_THREADGROUP_SCALAR, sanitize=True)
    y = torch.arange(4, dtype=torch.float32)
    lib.k(y, 0, threads=4, group_size=4)
    np.testing.assert_array_equal(y.numpy(), np.full(4, 3.0))
    with pytest.raises(KernelFault, match="threadgroup_race"):  # every thread writes it: a race
        lib.k(torch.arange(4, dtype=torch.float32), 1, threads=4, group_size=4)
