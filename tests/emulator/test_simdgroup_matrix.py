"""simdgroup_matrix<T, 8, 8>: Apple's lane layout, loads/stores (strided, offset,
transposed), multiply(-accumulate) against numpy, diagonal constructor, uniformity rule."""
from fractions import Fraction

import numpy as np
import pytest
import torch

from torch_sparse_metal.emulator import KernelFault, compile_shader, record

SOURCE = r"""
#include <metal_stdlib>
using namespace metal;

// Which element each lane owns, via thread_elements(): lane l writes l into its two slots.
kernel void layout(device float* out [[buffer(0)]], uint lane [[thread_index_in_simdgroup]]) {
  simdgroup_float8x8 m = make_filled_simdgroup_matrix<float, 8, 8>(0.0f);
  m.thread_elements()[0] = float(lane);
  m.thread_elements()[1] = float(lane) + 0.5f;
  simdgroup_store(m, out, 8);
}

// C (M x N) = A (M x K) @ B (K x N) [+ C]; one SIMD-group per 8x8 tile of C.
kernel void matmul(device const float* A [[buffer(0)]], device const float* B [[buffer(1)]],
                   device float* C [[buffer(2)]], constant uint& N [[buffer(3)]],
                   constant uint& K [[buffer(4)]], constant uint& accumulate [[buffer(5)]],
                   constant uint& b_transposed [[buffer(6)]],
                   uint2 tile [[threadgroup_position_in_grid]]) {
  simdgroup_float8x8 acc;
  if (accumulate) simdgroup_load(acc, C, N, ulong2(tile.x * 8, tile.y * 8));
  else acc = simdgroup_float8x8(0.0f);
  for (uint k = 0; k < K; k += 8) {
    simdgroup_float8x8 a, b;
    simdgroup_load(a, A, K, ulong2(k, tile.y * 8));
    if (b_transposed) simdgroup_load(b, B, K, ulong2(k, tile.x * 8), true);
    else simdgroup_load(b, B + k * N + tile.x * 8, N);
    simdgroup_multiply_accumulate(acc, a, b, acc);
  }
  simdgroup_store(acc, C, N, ulong2(tile.x * 8, tile.y * 8));
}

kernel void diagonal_times(device const float* B [[buffer(0)]], device float* C [[buffer(1)]]) {
  simdgroup_float8x8 d = simdgroup_float8x8(3.0f), b, c;
  simdgroup_load(b, B, 8);
  simdgroup_multiply(c, d, b);
  simdgroup_store(c, C, 8);
}

kernel void half_matrix(device const half* A [[buffer(0)]], device const half* B [[buffer(1)]],
                        device float* C [[buffer(2)]]) {
  simdgroup_half8x8 a, b;
  simdgroup_float8x8 c;
  simdgroup_load(a, A, 8);
  simdgroup_load(b, B, 8);
  simdgroup_half8x8 p;
  simdgroup_multiply(p, a, b);
  for (uint i = 0; i < 2; ++i) c.thread_elements()[i] = float(p.thread_elements()[i]);
  simdgroup_store(c, C, 8);
}
"""


@pytest.fixture(scope="module", params=[False, True], ids=["plain", "sanitized"])
def lib(request):
    return compile_shader(SOURCE, sanitize=request.param)


def test_lane_layout_is_apples(lib):
    out = torch.full((8, 8), -1.0)
    lib.layout(out, threads=32, group_size=32)
    expected = np.full((8, 8), -1.0)
    for lane in range(32):
        q = lane // 4
        row, col = (q & 4) + (lane // 2) % 4, (q & 2) * 2 + (lane % 2) * 2
        expected[row, col], expected[row, col + 1] = lane, lane + 0.5
    np.testing.assert_array_equal(out.numpy(), expected)  # every element owned exactly once


@pytest.mark.parametrize("M, N, K", [(8, 8, 8), (16, 24, 32), (24, 8, 40)])
@pytest.mark.parametrize("accumulate", [0, 1])
@pytest.mark.parametrize("b_transposed", [0, 1])
def test_matmul_against_numpy(lib, M, N, K, accumulate, b_transposed):
    g = torch.Generator().manual_seed(M * N * K)
    A, B, C0 = torch.randn(M, K, generator=g), torch.randn(K, N, generator=g), torch.randn(M, N, generator=g)
    C = C0.clone()
    b_arg = B.t().contiguous() if b_transposed else B
    lib.matmul(A, b_arg, C, N, K, accumulate, b_transposed, threads=(N // 8 * 32, M // 8), group_size=(32, 1))
    expected = A.double().numpy() @ B.double().numpy() + (C0.double().numpy() if accumulate else 0)
    np.testing.assert_allclose(C.numpy(), expected, rtol=1e-5, atol=1e-5)


def _round_float32(exact: Fraction) -> np.float32:
    """`exact` rounded once to float32, to nearest, ties to even."""
    r = np.float32(float(exact))  # within an ulp of the answer (two roundings)
    near = [np.nextafter(r, np.float32(-np.inf)), r, np.nextafter(r, np.float32(np.inf))]
    return min(near, key=lambda v: (abs(Fraction(float(v)) - exact), int(np.array(v).view(np.int32)) & 1))


def _fused_steps(A: np.ndarray, B: np.ndarray, C: np.ndarray, rounded) -> np.ndarray:
    """C + A @ B as Metal's simdgroup products make it: each element a chain of fused steps
    in k order, each computed exactly (Fractions) and rounded once by ``rounded``."""
    out = C.copy()
    for i in range(A.shape[0]):
        for j in range(B.shape[1]):
            for k in range(A.shape[1]):
                out[i, j] = rounded(Fraction(float(A[i, k])) * Fraction(float(B[k, j])) + Fraction(float(out[i, j])))
    return out


def test_products_accumulate_in_k_order_one_rounding_per_step(lib):
    # The emulator computes a SIMD-group's product once for its 32 lanes, vectorised across
    # a row of the result: each element must still be Metal's chain of fused steps, k = 0..K-1.
    M, N, K = 16, 24, 32
    g = torch.Generator().manual_seed(7)
    A, B, C = torch.randn(M, K, generator=g), torch.randn(K, N, generator=g), torch.randn(M, N, generator=g)
    expected = _fused_steps(A.numpy(), B.numpy(), C.numpy(), _round_float32)
    lib.matmul(A, B, C, N, K, 1, 0, threads=(N // 8 * 32, M // 8), group_size=(32, 1))
    np.testing.assert_array_equal(C.numpy().view(np.int32), expected.view(np.int32))


def test_diagonal_constructor(lib):
    B = torch.randn(8, 8)
    C = torch.zeros(8, 8)
    lib.diagonal_times(B, C, threads=32, group_size=32)
    np.testing.assert_allclose(C.numpy(), 3 * B.numpy(), rtol=1e-6)


def test_half_matrices_round_to_half(lib):
    A, B = torch.randn(8, 8).half(), torch.randn(8, 8).half()
    C = torch.zeros(8, 8)
    lib.half_matrix(A, B, C, threads=32, group_size=32)
    expected = (A.float() @ B.float()).half().float()  # float accumulation, one rounding to half
    torch.testing.assert_close(C, expected, rtol=2e-3, atol=2e-3)


def test_partial_simdgroup_is_refused(lib):
    with pytest.raises(KernelFault, match="all 32 lanes") as info:
        lib.diagonal_times(torch.randn(8, 8), torch.zeros(8, 8), threads=16, group_size=16)
    assert info.value.kind == "inactive_lane"


def test_counters_of_one_product():
    lib = compile_shader(SOURCE, sanitize=True)
    M, N, K = 16, 24, 32
    with record() as launches:
        lib.matmul(torch.randn(M, K), torch.randn(K, N), torch.zeros(M, N), N, K, 0, 0,
                   threads=(N // 8 * 32, M // 8), group_size=(32, 1))
    c = launches[0].counters
    assert c["fmas"] == M * N * K
    tiles, steps = (M // 8) * (N // 8), K // 8
    assert c["device_bytes_read"] == tiles * steps * 2 * 64 * 4  # one 8x8 of A and of B per step
    assert c["device_bytes_written"] == M * N * 4


DOUBLE_SOURCE = r"""
#include <metal_stdlib>
using namespace metal;
// Emulator only (Metal has no double): lets float64 gradcheck run through simdgroup kernels.
#ifdef __METAL_EMULATOR__
kernel void double_product(device const double* A [[buffer(0)]], device const double* B [[buffer(1)]],
                           device double* C [[buffer(2)]]) {
  simdgroup_matrix<double, 8, 8> a, b, c;
  simdgroup_load(a, A, 8);
  simdgroup_load(b, B, 8);
  simdgroup_multiply(c, a, b);
  simdgroup_store(c, C, 8);
}
#endif
"""


def test_double_matrices_on_the_emulator():
    lib = compile_shader(DOUBLE_SOURCE)
    A, B = torch.randn(8, 8, dtype=torch.float64), torch.randn(8, 8, dtype=torch.float64)
    C = torch.zeros(8, 8, dtype=torch.float64)
    lib.double_product(A, B, C, threads=32, group_size=32)
    # float() of a Fraction rounds it once to double, to nearest, ties to even.
    expected = _fused_steps(A.numpy(), B.numpy(), np.zeros((8, 8)), float)
    np.testing.assert_array_equal(C.numpy(), expected)


# `a * b` of two simdgroup matrices (MLX's Winograd conv: `(G * g) * Gt`): the product
# simdgroup_multiply stores, a SIMD-group function the translation turns into a call.
PRODUCTS = r"""
#include <metal_stdlib>
using namespace metal;

template <typename T>
simdgroup_matrix<T, 8, 8> sandwich(simdgroup_matrix<T, 8, 8> a, simdgroup_matrix<T, 8, 8> b) {
  return (a * b) * a;
}
simdgroup_half8x8 squared(thread const simdgroup_half8x8& a) { return a * a; }

// In the kernel's body (barrier regions, unless TSM_EMU_REGIONS=0).
kernel void operator_product(device const float* A [[buffer(0)]], device const float* B [[buffer(1)]],
                             device float* C [[buffer(2)]], uint sg [[simdgroup_index_in_threadgroup]]) {
  simdgroup_float8x8 a, b;
  simdgroup_load(a, A + sg * 64, 8);
  simdgroup_load(b, B, 8);
  simdgroup_float8x8 c = a * b;
  simdgroup_store(c, C + sg * 64, 8);
}

kernel void function_product(device const float* A [[buffer(0)]], device const float* B [[buffer(1)]],
                             device float* C [[buffer(2)]], uint sg [[simdgroup_index_in_threadgroup]]) {
  simdgroup_float8x8 a, b, c;
  simdgroup_load(a, A + sg * 64, 8);
  simdgroup_load(b, B, 8);
  simdgroup_multiply(c, a, b);
  simdgroup_store(c, C + sg * 64, 8);
}

// Through helpers (fibers): a template's nested products, and half matrices.
kernel void operator_helpers(device const float* A [[buffer(0)]], device const float* B [[buffer(1)]],
                             device float* C [[buffer(2)]], device half* H [[buffer(3)]],
                             uint sg [[simdgroup_index_in_threadgroup]]) {
  simdgroup_float8x8 a, b;
  simdgroup_half8x8 h;
  simdgroup_load(a, A + sg * 64, 8);
  simdgroup_load(b, B, 8);
  simdgroup_load(h, H + sg * 64, 8);
  simdgroup_store(sandwich(a, b), C + sg * 64, 8);
  simdgroup_store(squared(h), H + sg * 64, 8);
}

kernel void function_helpers(device const float* A [[buffer(0)]], device const float* B [[buffer(1)]],
                             device float* C [[buffer(2)]], device half* H [[buffer(3)]],
                             uint sg [[simdgroup_index_in_threadgroup]]) {
  simdgroup_float8x8 a, b, ab, c;
  simdgroup_half8x8 h, hh;
  simdgroup_load(a, A + sg * 64, 8);
  simdgroup_load(b, B, 8);
  simdgroup_load(h, H + sg * 64, 8);
  simdgroup_multiply(ab, a, b);
  simdgroup_multiply(c, ab, a);
  simdgroup_multiply(hh, h, h);
  simdgroup_store(c, C + sg * 64, 8);
  simdgroup_store(hh, H + sg * 64, 8);
}
"""


def product_launches(lib, kind: str):
    """(C, H, counters) of the `operator_*` or `function_*` kernels on the same inputs."""
    g = torch.Generator().manual_seed(5)
    A, B, H = torch.randn(128, generator=g), torch.randn(64, generator=g), torch.randn(128, generator=g).half()
    C1, C2, H2 = torch.zeros(128), torch.zeros(128), H.clone()
    with record() as launches:
        lib[f"{kind}_product"](A, B, C1, threads=64, group_size=64)
        lib[f"{kind}_helpers"](A, B, C2, H2, threads=64, group_size=64)
    return (C1, C2, H2), [x.counters for x in launches], (A, B, H)


@pytest.mark.parametrize("regions", ["1", "0"], ids=["regions", "fibers"])
@pytest.mark.parametrize("sanitize", [False, True], ids=["plain", "sanitized"])
def test_a_times_b_is_simdgroup_multiply_bit_for_bit(monkeypatch, regions, sanitize):
    monkeypatch.setenv("TSM_EMU_REGIONS", regions)
    lib = compile_shader(PRODUCTS, sanitize=sanitize)
    by_operator, operator_counters, (A, B, H) = product_launches(lib, "operator")
    by_function, function_counters, _ = product_launches(lib, "function")
    for x, y in zip(by_operator, by_function):
        assert torch.equal(x.view(torch.uint8), y.view(torch.uint8))
    assert operator_counters == function_counters  # sanitized: the same FMAs, bytes, ...
    if sanitize:
        assert operator_counters[0]["fmas"] == 2 * 512 and operator_counters[1]["fmas"] == 2 * 3 * 512
    a, b = A.view(2, 8, 8).double().numpy(), B.view(8, 8).double().numpy()
    np.testing.assert_allclose(by_operator[0].view(2, 8, 8).numpy(), a @ b, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(by_operator[1].view(2, 8, 8).numpy(), a @ b @ a, rtol=1e-4, atol=1e-4)
    h = H.view(2, 8, 8).float()
    torch.testing.assert_close(by_operator[2].view(2, 8, 8).float(), (h @ h).half().float(), rtol=2e-3, atol=2e-3)


def test_products_in_a_kernel_body_run_as_regions_and_through_helpers_as_fibers(tmp_path):
    from torch_sparse_metal.emulator import _compiler
    path = tmp_path / "shader.metal"
    path.write_text(PRODUCTS)
    generated = _compiler.generated_cxx(path)
    assert generated.grouped == {"operator_product", "function_product", "function_helpers"}
    # The helpers' products are sites of their own, the kernel's calls of them frames.
    assert "::tsm_emu::CallFrame tsm_emu_call_frame_(caller_site_)" in generated.text
    assert generated.text.count("__tsm_simdgroup_product(") >= 4


def test_a_product_needs_all_lanes():
    lib = compile_shader(PRODUCTS)
    with pytest.raises(KernelFault, match="all 32 lanes") as info:
        lib.operator_product(torch.randn(64), torch.randn(64), torch.zeros(64), threads=16, group_size=16)
    assert info.value.kind == "inactive_lane"


def test_products_of_matrices_of_two_element_types_are_refused():
    from torch_sparse_metal.emulator import MetalCompileError
    with pytest.raises(MetalCompileError, match="invalid operands to binary expression"):
        compile_shader(r"""
#include <metal_stdlib>
using namespace metal;
kernel void k(device float* out [[buffer(0)]]) {
  simdgroup_float8x8 a = simdgroup_float8x8(1.0f);
  simdgroup_half8x8 b = simdgroup_half8x8(1.0h);
  simdgroup_store(a * b, out, 8);
}""")


def test_a_product_of_template_parameters_is_an_error_that_says_so():
    # `M a; a * b` with M a template parameter: nothing before instantiation says the
    # operands are matrices, so the translation leaves the operator, which the emulator
    # refuses (Metal takes it).
    from torch_sparse_metal.emulator import MetalCompileError
    with pytest.raises(MetalCompileError, match="name them as simdgroup_matrix<T, 8, 8>"):
        compile_shader(r"""
#include <metal_stdlib>
using namespace metal;
template <typename M> M product(M a, M b) { return a * b; }
kernel void k(device float* out [[buffer(0)]]) {
  simdgroup_float8x8 a = simdgroup_float8x8(1.0f);
  simdgroup_store(product(a, a), out, 8);
}""")


def test_a_dependent_call_with_a_matrix_and_a_product_of_scalars_is_no_product(tmp_path):
    # In a template, `Scale<T>::first(m, s * s)` is an unresolved call whose arguments are a
    # matrix and an unresolved `*` of scalars: no SIMD-group function, so the kernel runs
    # its threads as a plain loop (not as barrier regions), and right.
    from torch_sparse_metal.emulator import _compiler
    source = r"""
#include <metal_stdlib>
using namespace metal;
template <typename T> struct Scale {
  static T first(simdgroup_matrix<T, 8, 8> m, T s) { return m.thread_elements()[0] * s; }
};
template <typename T>
kernel void k(device T* out [[buffer(0)]], uint i [[thread_position_in_grid]]) {
  simdgroup_matrix<T, 8, 8> m = make_filled_simdgroup_matrix<T, 8, 8>(T(2));
  T s = T(i);
  out[i] = Scale<T>::first(m, s * s);
}
template [[host_name("k_float")]] kernel void k<float>(device float*, uint);
"""
    path = tmp_path / "shader.metal"
    path.write_text(source)
    assert _compiler.generated_cxx(path).grouped == set()
    out = torch.zeros(5)
    compile_shader(source).k_float(out, threads=5)
    np.testing.assert_array_equal(out.numpy(), 2 * np.arange(5.0) ** 2)
