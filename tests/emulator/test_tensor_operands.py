"""Metal 4's `metal::tensor` (tensor_inline views of device and threadgroup memory) as the
operands of `mpp::tensor_ops::matmul2d`, the form llama.cpp's ggml uses on GPUs with tensor
units (tsm_emu/tensor_ops.h): products against numpy through several SIMD-groups, dynamic K,
slices, edges, a tensor destination, the spread destination layout, and the faults and
compile errors of what is wrong or not emulated."""
import numpy as np
import pytest
import torch

from torch_sparse_metal.emulator import KernelFault, MetalCompileError, compile_shader

HEAD = r"""
#include <metal_stdlib>
#include <metal_tensor>
#include <MetalPerformancePrimitives/MetalPerformancePrimitives.h>
using namespace metal;
using namespace mpp::tensor_ops;
"""

SOURCE = HEAD + r"""
// C (M x N, row-major) = A (M x K) B^T (B is N x K, row-major): tiles of 64 x 32 by four
// SIMD-groups, A staged through threadgroup memory in steps of 32 along K, B read where it is;
// the last step's K is what is left, the tile's edges are cut by the operands' extents.
kernel void tiled(device const half* A [[buffer(0)]], device const half* B [[buffer(1)]],
                  device float* C [[buffer(2)]], constant int4& mnk [[buffer(3)]],
                  threadgroup half* sa [[threadgroup(0)]],
                  uint2 tg [[threadgroup_position_in_grid]], ushort tid [[thread_index_in_threadgroup]]) {
  const int M = mnk.x, N = mnk.y, K = mnk.z;
  const int r0 = tg.y * 64, c0 = tg.x * 32;
  matmul2d<matmul2d_descriptor(64, 32, static_cast<int>(dynamic_extent), false, true, false,
                               matmul2d_descriptor::mode::multiply_accumulate),
           execution_simdgroups<4>> op;
  auto whole_a = tensor(sa, dextents<int32_t, 2>(32, 64));
  auto whole_b = tensor(B, dextents<int32_t, 2>(K, N), array<int, 2>({1, K}));
  auto acc = op.get_destination_cooperative_tensor<decltype(whole_a), decltype(whole_b), float>();
  for (ushort i = 0; i < acc.get_capacity(); ++i) acc[i] = 0;
  for (int k0 = 0; k0 < K; k0 += 32) {
    for (int w = tid; w < 64 * 32; w += 128) {
      const int r = w / 32, k = w % 32;
      sa[w] = (r0 + r < M && k0 + k < K) ? A[(r0 + r) * K + k0 + k] : half(0);
    }
    threadgroup_barrier(mem_flags::mem_threadgroup);
    const int k_left = min(32, K - k0);
    auto a = tensor<threadgroup half, dextents<int32_t, 2>, tensor_inline>(
        sa, dextents<int32_t, 2>(k_left, 64), array<int, 2>({1, 32}));
    auto b = tensor(B + c0 * K + k0, dextents<int32_t, 2>(k_left, N - c0), array<int, 2>({1, K}));
    op.run(a, b, acc);
    threadgroup_barrier(mem_flags::mem_threadgroup);
  }
  auto c = tensor(C, dextents<int32_t, 2>(N, M), array<int, 2>({1, N}));
  acc.store(c.slice(c0, r0));
}

// D = op(A) op(B) (+ D) straight into a tensor, two SIMD-groups, static K; `cut` shortens the
// left operand's extents (rows past them, and columns past K - cut.y, read as zero).
template <int M, int N, int K, bool TL, bool TR, bool ACC>
kernel void direct(device const float* a [[buffer(0)]], device const float* b [[buffer(1)]],
                   device float* d [[buffer(2)]], constant int2& cut [[buffer(3)]]) {
  constexpr auto desc = matmul2d_descriptor(M, N, K, TL, TR, false,
      ACC ? matmul2d_descriptor::mode::multiply_accumulate : matmul2d_descriptor::mode::multiply);
  matmul2d<desc, execution_simdgroups<2>> op;
  const int rows = M - cut.x, cols = K - cut.y;
  auto ta = TL ? tensor(a, dextents<int, 2>(rows, cols), array<int, 2>({1, M}))
               : tensor(a, dextents<int, 2>(cols, rows), array<int, 2>({1, K}));
  auto tb = tensor(b, TR ? dextents<int, 2>(K, N) : dextents<int, 2>(N, K));
  auto td = tensor(d, dextents<int, 2>(N, M));
  op.run(ta, tb, td);
}
#define DIRECT(name, M, N, K, TL, TR, ACC) \
  template [[host_name(#name)]] kernel void direct<M, N, K, TL, TR, ACC>( \
      device const float*, device const float*, device float*, constant int2&);
DIRECT(direct_24x40x20, 24, 40, 20, false, false, false)
DIRECT(direct_24x40x20_tl_acc, 24, 40, 20, true, false, true)
DIRECT(direct_16x16x32_tr_acc, 16, 16, 32, false, true, true)
DIRECT(direct_33x7x5_tl_tr, 33, 7, 5, true, true, false)

// C = A B^T straight into C by tiles of 32 x 32: static-extent slices inside, slices of
// what is left at the edges (reads past them zero, writes past them dropped).
kernel void by_tiles(device const float* A [[buffer(0)]], device const float* B [[buffer(1)]],
                     device float* C [[buffer(2)]], constant uint4& mkn [[buffer(3)]],
                     uint2 tg [[threadgroup_position_in_grid]]) {
  const int M = mkn.x, K = mkn.y, N = mkn.z, m = tg.y * 32, n = tg.x * 32;
  using e2 = dextents<int32_t, 2>;
  tensor<device const float, e2, tensor_inline> a(A, e2(K, M)), b(B, e2(K, N));
  tensor<device float, e2, tensor_inline> c(C, e2(N, M));
  matmul2d<matmul2d_descriptor(32, 32, static_cast<int>(dynamic_extent), false, true),
           execution_simdgroups<4>> op;
  if (m + 32 <= M && n + 32 <= N) {
    auto ta = a.template slice<dynamic_extent, 32>(0, m);
    auto tb = b.template slice<dynamic_extent, 32>(0, n);
    auto tc = c.template slice<32, 32>(n, m);
    op.run(ta, tb, tc);
  } else {
    auto ta = a.slice(0, m);
    auto tb = b.slice(0, n);
    auto tc = c.slice(n, m);
    op.run(ta, tb, tc);
  }
}

// Where each of 128 threads' elements of a 24 x 40 destination are: (column, row, valid).
kernel void spread(device int* out [[buffer(0)]], ushort tid [[thread_index_in_threadgroup]]) {
  matmul2d<matmul2d_descriptor(24, 40, dynamic_extent), execution_simdgroups<4>> op;
  using t = tensor<device float, dextents<int, 2>, tensor_inline>;
  auto d = op.get_destination_cooperative_tensor<t, t, float>();
  for (ushort i = 0; i < d.get_capacity(); ++i) {
    auto at = d.get_multidimensional_index(i);
    device int* o = out + (tid * d.get_capacity() + i) * 3;
    o[0] = at[0];
    o[1] = at[1];
    o[2] = d.is_valid_element(i);
  }
}

// K read from operands whose K extents differ.
kernel void unequal_k(device const float* a [[buffer(0)]], device float* d [[buffer(1)]]) {
  matmul2d<matmul2d_descriptor(16, 16, dynamic_extent), execution_simdgroup> op;
  auto ta = tensor(a, dextents<int, 2>(8, 16));
  auto tb = tensor(a, dextents<int, 2>(16, 4));
  auto td = tensor(d, dextents<int, 2>(16, 16));
  op.run(ta, tb, td);
}

// A tensor that says it is longer than its buffer.
kernel void too_long(device const float* a [[buffer(0)]], device float* d [[buffer(1)]]) {
  matmul2d<matmul2d_descriptor(16, 16, 16), execution_simdgroup> op;
  auto ta = tensor(a, dextents<int, 2>(16, 16));
  auto td = tensor(d, dextents<int, 2>(16, 16));
  op.run(ta, ta, td);
}

kernel void slice_past_the_end(device float* d [[buffer(0)]]) {
  auto t = tensor(d, dextents<int, 2>(4, 4));
  auto s = t.slice(5, 0);
  (void)s;
}

// The tile is written and multiplied with no barrier between: a race on threadgroup memory.
kernel void no_barrier(device const float* a [[buffer(0)]], device float* d [[buffer(1)]],
                       ushort tid [[thread_index_in_threadgroup]]) {
  threadgroup float tile[16 * 16];
  for (int i = tid; i < 256; i += 64) tile[i] = a[i];
  matmul2d<matmul2d_descriptor(16, 16, 16), execution_simdgroups<2>> op;
  auto t = tensor(&tile[0], dextents<int, 2>(16, 16));
  auto td = tensor(d, dextents<int, 2>(16, 16));
  op.run(t, t, td);
}
"""


@pytest.fixture(scope="module")
def lib():
    return compile_shader(SOURCE, language_version="4.0")


def run_tiled(library, m, n, k, seed=0):
    rng = np.random.default_rng(seed)
    a = torch.from_numpy(rng.normal(size=(m, k)).astype(np.float16))
    b = torch.from_numpy(rng.normal(size=(n, k)).astype(np.float16))
    c = torch.full((m, n), 7.0)
    library.tiled(a, b, c, torch.tensor([m, n, k, 0], dtype=torch.int32), threadgroup_memory=[64 * 32 * 2],
                  threads=((n + 31) // 32 * 128, (m + 63) // 64), group_size=(128, 1))
    expected = a.double().numpy() @ b.double().numpy().T
    np.testing.assert_allclose(c.double().numpy(), expected, atol=1e-5 * k, rtol=0)


@pytest.mark.parametrize("m, n, k", [(64, 32, 32), (100, 70, 45), (130, 33, 96), (5, 3, 7)])
def test_a_tiled_product_through_four_simdgroups(lib, m, n, k):
    run_tiled(lib, m, n, k)


def test_the_tiled_product_sanitized():
    run_tiled(compile_shader(SOURCE, language_version="4.0", sanitize=True), 100, 70, 45, seed=1)


@pytest.mark.parametrize("name, cut", [("direct_24x40x20", (0, 0)), ("direct_24x40x20_tl_acc", (0, 0)),
                                       ("direct_16x16x32_tr_acc", (0, 0)), ("direct_33x7x5_tl_tr", (0, 0)),
                                       ("direct_24x40x20", (5, 3)), ("direct_24x40x20_tl_acc", (2, 7))])
def test_a_tensor_destination(lib, name, cut):
    m, n, k = (int(x) for x in name.split("_")[1].split("x"))
    tl, tr, accumulate = "_tl" in name, "_tr" in name, "acc" in name
    rng = np.random.default_rng(m * n + k)
    a = rng.normal(size=(k, m) if tl else (m, k)).astype(np.float32)
    b = rng.normal(size=(n, k) if tr else (k, n)).astype(np.float32)
    d = rng.normal(size=(m, n)).astype(np.float32)
    left = (a.T if tl else a).astype(np.float64)
    left[m - cut[0]:, :] = 0  # outside the left operand's extents
    left[:, k - cut[1]:] = 0
    expected = left @ (b.T if tr else b) + (d if accumulate else 0)
    out = torch.from_numpy(d.copy())
    getattr(lib, name)(torch.from_numpy(a), torch.from_numpy(b), out, torch.tensor(cut, dtype=torch.int32),
                       threads=64, group_size=64)
    np.testing.assert_allclose(out.double().numpy(), expected, atol=1e-5 * k, rtol=0)


@pytest.mark.parametrize("m, k, n", [(64, 40, 96), (50, 33, 70), (7, 5, 3)])
def test_static_and_dynamic_extent_slices(lib, m, k, n):
    rng = np.random.default_rng(m * k * n)
    a, b = rng.normal(size=(m, k)).astype(np.float32), rng.normal(size=(n, k)).astype(np.float32)
    c = torch.full((m, n), 7.0)
    lib.by_tiles(torch.from_numpy(a), torch.from_numpy(b), c, torch.tensor([m, k, n, 0], dtype=torch.int32),
                 threads=((n + 31) // 32 * 128, (m + 31) // 32), group_size=(128, 1))
    np.testing.assert_allclose(c.double().numpy(), a.astype(np.float64) @ b.T.astype(np.float64),
                               atol=1e-5 * k, rtol=0)


def test_the_spread_layout_covers_every_element_once(lib):
    capacity = (24 * 40 + 127) // 128
    out = torch.full((128 * capacity * 3,), -1, dtype=torch.int32)
    lib.spread(out, threads=128, group_size=128)
    places = out.reshape(128 * capacity, 3).numpy()
    valid = places[places[:, 2] == 1]
    assert len(valid) == 24 * 40
    assert {(int(c), int(r)) for c, r, _ in valid} == {(c, r) for c in range(40) for r in range(24)}
    assert set(places[:, 2]) == {0, 1}


def test_k_from_operands_that_disagree_is_a_fault(lib):
    with pytest.raises(KernelFault, match="K extents differ"):
        lib.unequal_k(torch.zeros(256), torch.zeros(256), threads=32, group_size=32)


def test_an_operand_past_its_buffer_is_out_of_bounds(lib):
    with pytest.raises(KernelFault) as info:
        lib.too_long(torch.zeros(200), torch.zeros(256), threads=32, group_size=32)
    assert info.value.kind == "out_of_bounds"


def test_a_slice_outside_the_tensor_is_a_fault(lib):
    with pytest.raises(KernelFault, match="slice"):
        lib.slice_past_the_end(torch.zeros(16), threads=1, group_size=1)


def test_the_scope_needs_whole_simdgroups(lib):
    args = [torch.zeros(64, 32, dtype=torch.float16), torch.zeros(32, 32, dtype=torch.float16), torch.zeros(64, 32),
            torch.tensor([64, 32, 32, 0], dtype=torch.int32)]
    with pytest.raises(KernelFault, match="multiple of 32 N"):
        lib.tiled(*args, threadgroup_memory=[64 * 32 * 2], threads=(96, 1), group_size=(96, 1))


def test_a_missing_barrier_before_the_product_is_a_race():
    library = compile_shader(SOURCE, language_version="4.0", sanitize=True)
    with pytest.raises(KernelFault) as info:
        library.no_barrier(torch.randn(256), torch.zeros(256), threads=64, group_size=64)
    assert info.value.kind == "threadgroup_race"


@pytest.mark.parametrize("body, says", [
    ("kernel void k(tensor<device half, dextents<int32_t, 2>> t [[buffer(0)]]) { (void)t; }",
     r"tensor_handle \(an MTLTensor bound by the host\)"),
    ("kernel void k(device float* p [[buffer(0)]]) {\n"
     "  matmul2d<matmul2d_descriptor(16, 16, 16), execution_simdgroups<4>> op;\n"
     "  auto l = op.get_left_input_cooperative_tensor<float, float, float>(); (void)l; }", "N > 1"),
    ("kernel void k(device float* p [[buffer(0)]]) {\n"
     "  matmul2d<matmul2d_descriptor(16, 16, 16), execution_thread> op; (void)op; }", "execution_thread"),
    ("kernel void k(device float* p [[buffer(0)]]) {\n"
     "  matmul2d<matmul2d_descriptor(16, 16, 16), execution_simdgroup> op;\n"
     "  auto l = op.get_left_input_cooperative_tensor<float, float, float>();\n"
     "  auto t = tensor(p, dextents<int, 2>(16, 16));\n"
     "  op.run(l, t, t); }", "both cooperative tensors or both"),
])
def test_what_is_not_emulated_is_a_compile_error_naming_it(body, says):
    with pytest.raises(MetalCompileError, match=says):
        compile_shader(HEAD + body, language_version="4.0")


def test_a_tensor_keeps_its_address_space():
    # A threadgroup tensor over device memory: no constructor takes the device pointer.
    with pytest.raises(MetalCompileError, match="no matching constructor .*tensor<threadgroup half"):
        compile_shader(HEAD + """
kernel void k(device half* p [[buffer(0)]]) {
  auto t = tensor<threadgroup half, dextents<int, 2>, tensor_inline>(p, dextents<int, 2>(4, 4));
  (void)t;
}""", language_version="4.0")


def test_tensors_are_metal_4():
    with pytest.raises(MetalCompileError, match="dextents|tensor"):
        compile_shader(HEAD.replace("using namespace mpp::tensor_ops;\n", "") + """
kernel void k(device float* p [[buffer(0)]]) {
  auto t = tensor(p, dextents<int, 2>(4, 4));
  (void)t;
}""", language_version="3.2")
