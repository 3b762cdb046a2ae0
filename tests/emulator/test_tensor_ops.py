"""Metal 4's mpp::tensor_ops::matmul2d on cooperative tensors (tsm_emu/tensor_ops.h): products
against numpy for shapes, transposes, modes and element types; the emulated layout and its
queries; the SIMD-group rule, bounds and what is not emulated as errors that say so."""
import numpy as np
import pytest
import torch

from torch_sparse_metal.emulator import KernelFault, MetalCompileError, compile_shader

HEAD = r"""
#include <metal_stdlib>
#include <MetalPerformancePrimitives/MetalPerformancePrimitives.h>
using namespace metal;
using namespace mpp::tensor_ops;
"""

# D = op(A) op(B) (+ C) of one SIMD-group, each element loaded and stored where
# get_multidimensional_index says it is: code that holds for any layout.
SOURCE = HEAD + r"""
template <int M, int N, int K, bool TL, bool TR, bool ACC, typename T, typename U>
kernel void product(device const T* a [[buffer(0)]], device const T* b [[buffer(1)]],
                    device U* c [[buffer(2)]]) {
  constexpr auto desc = matmul2d_descriptor(M, N, K, TL, TR, false,
      ACC ? matmul2d_descriptor::mode::multiply_accumulate : matmul2d_descriptor::mode::multiply);
  matmul2d<desc, execution_simdgroup> op;
  auto left = op.template get_left_input_cooperative_tensor<T, T, U>();
  auto right = op.template get_right_input_cooperative_tensor<T, T, U>();
  auto dest = op.template get_destination_cooperative_tensor<decltype(left), decltype(right), U>();
  constexpr int a_cols = TL ? M : K, b_cols = TR ? K : N;
  for (ushort i = 0; i < left.get_capacity(); ++i) {
    auto at = left.get_multidimensional_index(i);
    left[i] = a[at[1] * a_cols + at[0]];
  }
  for (ushort i = 0; i < right.get_capacity(); ++i) {
    auto at = right.get_multidimensional_index(i);
    right[i] = b[at[1] * b_cols + at[0]];
  }
  for (ushort i = 0; i < dest.get_capacity(); ++i) {
    auto at = dest.get_multidimensional_index(i);
    if (dest.is_valid_element(i)) dest[i] = ACC ? c[at[1] * N + at[0]] : U(77);  // multiply ignores it
  }
  op.run(left, right, dest);
  for (ushort i = 0; i < dest.get_capacity(); ++i) {
    auto at = dest.get_multidimensional_index(i);
    if (dest.is_valid_element(i)) c[at[1] * N + at[0]] = dest[i];
  }
}
#define PRODUCT(name, M, N, K, TL, TR, ACC, T, U) \
  template [[host_name(#name)]] kernel void product<M, N, K, TL, TR, ACC, T, U>( \
      device const T*, device const T*, device U*);
PRODUCT(half_16x32x16, 16, 32, 16, false, false, true, half, float)
PRODUCT(float_32x16x32_tl, 32, 16, 32, true, false, true, float, float)
PRODUCT(bfloat_16x16x32_tr, 16, 16, 32, false, true, false, bfloat, float)
PRODUCT(half_32x32x16_tl_tr_to_half, 32, 32, 16, true, true, true, half, half)
PRODUCT(char_16x16x16_to_int, 16, 16, 16, false, false, true, char, int)

// Where each lane's elements of a 16 x 32 destination are: (column, row) per element.
kernel void layout(device int* out [[buffer(0)]], ushort lane [[thread_index_in_simdgroup]]) {
  constexpr auto desc = matmul2d_descriptor(16, 32, 16);
  matmul2d<desc, execution_simdgroup> op;
  using op_t = matmul2d<desc, execution_simdgroup>;
  auto dest = op.get_destination_cooperative_tensor<op_t::cooperative_tensor_left_input_t<half, half, float>,
                                                    op_t::cooperative_tensor_right_input_t<half, half, float>,
                                                    float>();
  for (ushort i = 0; i < dest.get_capacity(); ++i) {
    auto at = dest.get_multidimensional_index(i);
    out[(lane * dest.get_capacity() + i) * 2] = at[0];
    out[(lane * dest.get_capacity() + i) * 2 + 1] = at[1];
  }
  out[32 * 16 * 2 + lane] = __metal_get_thread_index_in_simdgroup(ushort());
}

kernel void past_the_end(device float* out [[buffer(0)]]) {
  constexpr auto desc = matmul2d_descriptor(16, 16, 16);
  matmul2d<desc, execution_simdgroup> op;
  auto left = op.get_left_input_cooperative_tensor<half, half, float>();
  left[left.get_capacity()] = half(1);
  out[0] = left[0];
}
"""

CASES = {  # name: M, N, K, transposed left, transposed right, accumulate, numpy input type, torch output type
    "half_16x32x16": (16, 32, 16, False, False, True, np.float16, torch.float32),
    "float_32x16x32_tl": (32, 16, 32, True, False, True, np.float32, torch.float32),
    "bfloat_16x16x32_tr": (16, 16, 32, False, True, False, "bfloat16", torch.float32),
    "half_32x32x16_tl_tr_to_half": (32, 32, 16, True, True, True, np.float16, torch.float16),
    "char_16x16x16_to_int": (16, 16, 16, False, False, True, np.int8, torch.int32),
}


@pytest.fixture(scope="module")
def lib():
    return compile_shader(SOURCE, language_version="4.0")


def mlx_place(lane: int, i: int, cols: int):
    """(row, column) of element i of ``lane`` in an operand of ``cols`` columns, as MLX's
    nax fragments lay out 16x16 fragments (steel/gemm/nax.h), fragments in row-major order."""
    q, f, h, j = lane // 4, i // 8, (i // 4) % 2, i % 4
    r0, c0 = (q & 4) | ((lane // 2) % 4), ((q & 2) | (lane % 2)) * 4
    fr, fc = divmod(f, cols // 16)
    return fr * 16 + r0 + 8 * h, fc * 16 + c0 + j


@pytest.mark.parametrize("name", sorted(CASES))
def test_products_against_numpy(lib, name):
    m, n, k, tl, tr, accumulate, dtype, out_dtype = CASES[name]
    rng = np.random.default_rng(len(name))
    a_shape, b_shape = ((k, m) if tl else (m, k)), ((n, k) if tr else (k, n))
    if dtype == np.int8:
        a, b = (torch.from_numpy(rng.integers(-128, 128, s).astype(np.int8)) for s in (a_shape, b_shape))
        c = torch.from_numpy(rng.integers(-1000, 1000, (m, n)).astype(np.int32))
    else:
        torch_type = torch.bfloat16 if dtype == "bfloat16" else torch.from_numpy(np.zeros(1, dtype)).dtype
        a, b = (torch.from_numpy(rng.normal(size=s).astype(np.float32)).to(torch_type) for s in (a_shape, b_shape))
        c = torch.from_numpy(rng.normal(size=(m, n)).astype(np.float32)).to(out_dtype)
    a64, b64 = a.double().numpy(), b.double().numpy()
    expected = (a64.T if tl else a64) @ (b64.T if tr else b64) + (c.double().numpy() if accumulate else 0)
    getattr(lib, name)(a, b, c, threads=32, group_size=32)
    if dtype == np.int8:
        np.testing.assert_array_equal(c.numpy(), expected.astype(np.int32))
    else:  # products accumulated in float, one rounding into the output type
        tolerance = 2e-3 * np.abs(expected).max() if out_dtype == torch.float16 else 1e-5 * k
        np.testing.assert_allclose(c.double().numpy(), expected, atol=tolerance, rtol=0)


def test_the_layout_is_mlxs_and_covers_every_element_once(lib):
    out = torch.zeros(32 * 16 * 2 + 32, dtype=torch.int32)
    lib.layout(out, threads=32, group_size=32)
    places = out[:32 * 16 * 2].reshape(32, 16, 2).numpy()
    expected = [[mlx_place(lane, i, 32)[::-1] for i in range(16)] for lane in range(32)]
    np.testing.assert_array_equal(places, np.array(expected))  # (column, row), as Metal orders extents
    covered = {(int(col), int(row)) for col, row in places.reshape(-1, 2)}
    assert covered == {(col, row) for col in range(32) for row in range(16)}
    np.testing.assert_array_equal(out[32 * 16 * 2:].numpy(), np.arange(32))


def test_run_needs_the_whole_simdgroup(lib):
    args = [torch.zeros(16, 16, dtype=torch.float16), torch.zeros(16, 32, dtype=torch.float16), torch.zeros(16, 32)]
    with pytest.raises(KernelFault, match="all 32 lanes") as info:
        lib.half_16x32x16(*args, threads=16, group_size=16)
    assert info.value.kind == "inactive_lane"


def test_an_element_past_the_capacity_is_out_of_bounds(lib):
    with pytest.raises(KernelFault, match="cooperative_tensor") as info:
        lib.past_the_end(torch.zeros(1), threads=32, group_size=32)
    assert info.value.kind == "out_of_bounds"


def test_a_kernel_with_a_barrier_and_a_tensor_operation_runs_as_fibers(tmp_path):
    from torch_sparse_metal.emulator import _compiler
    source = HEAD + r"""
kernel void staged(device const half* a [[buffer(0)]], device float* c [[buffer(1)]],
                   ushort lane [[thread_index_in_simdgroup]]) {
  threadgroup half tile[16 * 16];
  for (ushort i = lane; i < 256; i += 32) tile[i] = a[i];
  threadgroup_barrier(mem_flags::mem_threadgroup);
  constexpr auto desc = matmul2d_descriptor(16, 16, 16);
  matmul2d<desc, execution_simdgroup> op;
  auto left = op.get_left_input_cooperative_tensor<half, half, float>();
  auto right = op.get_right_input_cooperative_tensor<half, half, float>();
  auto dest = op.get_destination_cooperative_tensor<decltype(left), decltype(right), float>();
  for (ushort i = 0; i < left.get_capacity(); ++i) {
    auto at = left.get_multidimensional_index(i);
    left[i] = tile[at[1] * 16 + at[0]];
    right[i] = tile[at[0] * 16 + at[1]];
  }
  op.run(left, right, dest);
  for (ushort i = 0; i < dest.get_capacity(); ++i) {
    auto at = dest.get_multidimensional_index(i);
    c[at[1] * 16 + at[0]] = dest[i];
  }
}
"""
    path = tmp_path / "staged.metal"
    path.write_text(source)
    assert _compiler.generated_cxx(path, language_version="4.0").grouped == set()
    a = torch.randn(16, 16).half()
    c = torch.zeros(16, 16)
    compile_shader(source, language_version="4.0").staged(a, c, threads=32, group_size=32)
    torch.testing.assert_close(c, a.float() @ a.float().T, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("what, says", [
    ("matmul2d<matmul2d_descriptor(16, 16, 8), execution_simdgroup> op;\n"
     "  auto l = op.get_left_input_cooperative_tensor<half, half, float>(); (void)l;", "multiples of 16"),
])
def test_what_is_not_emulated_is_a_compile_error_naming_it(what, says):
    with pytest.raises(MetalCompileError, match=says):
        compile_shader(HEAD + "kernel void k(device float* out [[buffer(0)]]) {\n"
                       "  constexpr auto desc = matmul2d_descriptor(16, 16, 16);\n  " + what + "\n}",
                       language_version="4.0")


def test_tensor_operations_are_metal_4():
    with pytest.raises(MetalCompileError, match="mpp"):
        compile_shader(HEAD.replace("using namespace mpp::tensor_ops;\n", "") + """
kernel void k(device float* out [[buffer(0)]]) {
  constexpr auto desc = mpp::tensor_ops::matmul2d_descriptor(16, 16, 16);
  (void)desc;
}""", language_version="3.2")


def test_a_tensor_operation_made_from_template_arguments_in_a_helper():
    # MLX's nax fragments: the descriptor depends on the helper's template arguments, so
    # clang leaves `op.run(...)` unresolved; the kernel that reaches it still synchronises.
    lib = compile_shader(HEAD + r"""
template <typename T, bool transposed>
struct Fragment {
  static void product(thread vec<T, 8>& d, thread const vec<T, 8>& a, thread const vec<T, 8>& b) {
    constexpr auto desc = matmul2d_descriptor(16, 16, 16, transposed, false, true,
                                              matmul2d_descriptor::mode::multiply);
    matmul2d<desc, execution_simdgroup> op;
    auto x = op.template get_left_input_cooperative_tensor<T, T, T>();
    auto y = op.template get_right_input_cooperative_tensor<T, T, T>();
    auto z = op.template get_destination_cooperative_tensor<remove_addrspace_t<decltype(x)>,
                                                            remove_addrspace_t<decltype(y)>, T>();
    for (short i = 0; i < 8; i++) { x[i] = a[i]; y[i] = b[i]; }
    op.run(x, y, z);
    for (short i = 0; i < 8; i++) d[i] = z[i];
  }
};
kernel void k(device const float* a [[buffer(0)]], device float* d [[buffer(1)]],
              ushort lane [[thread_index_in_simdgroup]]) {
  vec<float, 8> x, y, z;
  for (short i = 0; i < 8; i++) { x[i] = a[lane * 8 + i]; y[i] = i == 0 ? 1.0f : 0.0f; }
  Fragment<float, false>::product(z, x, y);
  for (short i = 0; i < 8; i++) d[lane * 8 + i] = z[i];
}""", language_version="4.0")
    a = torch.randn(32 * 8)
    d = torch.zeros(32 * 8)
    lib.k(a, d, threads=32, group_size=32)
    # The fragments are A and B in the emulated layout: the same product in numpy, read back so.
    A, Bm = np.zeros((16, 16)), np.zeros((16, 16))
    for lane in range(32):
        for i in range(8):
            r, c = mlx_place(lane, i, 16)
            A[r, c] = a[lane * 8 + i]
            Bm[r, c] = 1.0 if i == 0 else 0.0
    D = A @ Bm
    expected = [[D[mlx_place(lane, i, 16)] for i in range(8)] for lane in range(32)]
    np.testing.assert_allclose(d.numpy().reshape(32, 8), np.array(expected), rtol=1e-6, atol=1e-6)
