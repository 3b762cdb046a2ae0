"""Parts of Metal's library and language that public Metal code (MLX, llama.cpp/ggml,
PyTorch's MPS kernels) uses, written here as this project's own kernels: each runs on
the emulator and is compared with NumPy."""
import numpy as np
import pytest
import torch

from torch_sparse_metal.emulator import compile_shader

HEAD = "#include <metal_stdlib>\nusing namespace metal;\n"


def test_pack_and_unpack_match_the_normalised_integer_rules():
    lib = compile_shader(HEAD + """
kernel void pack(device const float4* x [[buffer(0)]], device uint* out [[buffer(1)]],
                 device float4* back [[buffer(2)]], uint i [[thread_position_in_grid]]) {
  out[4 * i + 0] = pack_float_to_unorm4x8(x[i]);
  out[4 * i + 1] = pack_float_to_snorm4x8(x[i]);
  out[4 * i + 2] = pack_float_to_unorm2x16(x[i].xy);
  out[4 * i + 3] = pack_half_to_snorm2x16(half2(x[i].zw));
  back[2 * i] = unpack_snorm4x8_to_float(out[4 * i + 1]);
  back[2 * i + 1] = float4(unpack_unorm2x16_to_float(out[4 * i + 2]), float2(unpack_snorm2x16_to_half(out[4 * i + 3])));
}""")
    x = np.array([[0.0, 0.5, 1.0, 2.0], [-1.5, -0.25, 0.25, 0.999], [0.1, 0.2, -0.3, 0.4]], np.float32)
    out = torch.zeros(12, dtype=torch.int32)
    back = torch.zeros(6, 4)
    lib.pack(torch.from_numpy(x), out, back, threads=3)
    words = out.numpy().view(np.uint32).reshape(3, 4)

    def packed(values, bits, signed):
        scale = 2 ** (bits - 1) - 1 if signed else 2 ** bits - 1
        q = np.rint(np.clip(values, -1 if signed else 0, 1) * scale).astype(np.int64) & (2 ** bits - 1)
        return sum(int(v) << (k * bits) for k, v in enumerate(q))

    for row, w in zip(x, words):
        assert w[0] == packed(row, 8, False)
        assert w[1] == packed(row, 8, True)
        assert w[2] == packed(row[:2], 16, False)
        assert w[3] == packed(row[2:].astype(np.float16).astype(np.float32), 16, True)
    snorm8 = np.rint(np.clip(x, -1, 1) * 127) / 127
    np.testing.assert_allclose(back.numpy()[0::2], snorm8, rtol=0, atol=1e-6)
    np.testing.assert_allclose(back.numpy()[1::2, :2], np.rint(np.clip(x[:, :2], 0, 1) * 65535) / 65535, atol=1e-6)


def test_matrices_multiply_like_numpy():
    lib = compile_shader(HEAD + """
kernel void mat(device const float4* cols [[buffer(0)]], device float* out [[buffer(1)]]) {
  float4x4 m(cols[0], cols[1], cols[2], cols[3]);
  float4 v = cols[4];
  float4 mv = m * v, vm = v * m;
  float4x4 mm = m * transpose(m) + float4x4(2.0f);
  float3x2 r(1.0f, 2.0f, 3.0f, 4.0f, 5.0f, 6.0f);  // 3 columns of 2
  for (int k = 0; k < 4; ++k) { out[k] = mv[k]; out[4 + k] = vm[k]; out[8 + k] = mm[1][k]; }
  out[12] = determinant(m);
  out[13] = r[2][1];
  out[14] = (r * float3(1.0f, 0.0f, 1.0f)).y;
}""")
    rng = np.random.default_rng(0)
    cols = rng.standard_normal((5, 4)).astype(np.float32)
    out = torch.zeros(15)
    lib.mat(torch.from_numpy(cols), out, threads=1)
    m = cols[:4].T.astype(np.float64)  # column c of the Metal matrix is cols[c]
    v = cols[4].astype(np.float64)
    o = out.numpy()
    np.testing.assert_allclose(o[0:4], m @ v, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(o[4:8], v @ m, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(o[8:12], (m @ m.T + 2 * np.eye(4))[:, 1], rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(o[12], np.linalg.det(m), rtol=1e-4)
    assert o[13] == 6.0 and o[14] == 2.0 + 6.0


def test_metal_array_is_an_aggregate_with_size():
    lib = compile_shader(HEAD + """
#include <metal_array>
struct Shape { metal::array<int, 3> dims; };
kernel void arr(constant Shape& s [[buffer(0)]], device int* out [[buffer(1)]]) {
  metal::array<int, 4> a = {1, 2, 3, 4};
  int total = 0;
  for (size_t i = 0; i < a.size(); ++i) total += a[i] * s.dims[i % s.dims.size()];
  out[0] = total;
  out[1] = int(a.size());
}""")
    out = torch.zeros(2, dtype=torch.int32)
    lib.arr(torch.tensor([10, 20, 30], dtype=torch.int32), out, threads=1)
    assert out.tolist() == [1 * 10 + 2 * 20 + 3 * 30 + 4 * 10, 4]


def test_quad_shuffle_and_fill_stay_inside_the_quad():
    lib = compile_shader(HEAD + """
kernel void q(device float* up [[buffer(0)]], device float* down [[buffer(1)]],
              device float* rot [[buffer(2)]], uint i [[thread_position_in_grid]]) {
  float v = float(i), fill = 100.0f + float(i);
  up[i] = quad_shuffle_and_fill_up(v, fill, ushort(1));
  down[i] = quad_shuffle_and_fill_down(v, fill, ushort(1), ushort(2));
  rot[i] = simd_shuffle_rotate_down(v, ushort(3));
}""")
    up, down, rot = torch.zeros(32), torch.zeros(32), torch.zeros(32)
    lib.q(up, down, rot, threads=32, group_size=32)
    lane = np.arange(32)
    base = lane & ~3
    i = lane - base
    want_up = np.where(i >= 1, lane - 1, 100 + base + (i + 3) % 4)
    window = base + (i // 2) * 2
    j = i % 2
    want_down = np.where(j + 1 < 2, lane + 1, 100 + window + (j + 1) % 2)
    assert up.numpy().tolist() == want_up.tolist()
    assert down.numpy().tolist() == want_down.tolist()
    assert rot.numpy().tolist() == ((lane + 3) % 32).tolist()


def test_attribute_spellings_of_public_code():
    lib = compile_shader(HEAD + """
template <typename T>
[[kernel, max_total_threads_per_threadgroup(64)]] void scale(
    device const T* x, device T* y, constant T& a,
    ushort lane [[thread_index_in_simdgroup]], ushort sg [[simdgroup_index_in_threadgroup]],
    uint i [[thread_position_in_grid]]) {
  y[i] = x[i] * a + T(lane) * T(0) + T(sg) * T(0);
}
template [[host_name("scale_f32")]] [[kernel]] decltype(scale<float>) scale<float>;
template [[host_name("scale_f16")]] [[kernel]] decltype(scale<half>) scale<half>;
// ggml's form: the function type named once by a typedef (the signature is T's alone).
template <typename T>
kernel void fill(device char* out [[buffer(0)]], uint i [[thread_position_in_grid]]) {
  ((device T*) out)[i] = T(i);
}
typedef decltype(fill<float>) fill_t;
template [[host_name("fill_f32")]] kernel fill_t fill<float>;
template [[host_name("fill_i32")]] kernel fill_t fill<int>;
""")
    x = torch.arange(64.0)
    y = torch.zeros(64)
    lib.scale_f32(x, y, 2.0, threads=64, group_size=64)
    assert torch.equal(y, 2 * x)
    yh = torch.zeros(64, dtype=torch.float16)
    lib.scale_f16(x.half(), yh, 0.5, threads=64, group_size=64)
    assert torch.equal(yh, (x * 0.5).half())
    f, n = torch.zeros(4), torch.zeros(4, dtype=torch.int32)
    lib.fill_f32(f, threads=4)
    lib.fill_i32(n, threads=4)
    assert f.tolist() == [0.0, 1.0, 2.0, 3.0] and n.tolist() == [0, 1, 2, 3]


def test_volatile_and_coherent_device_pointers():
    lib = compile_shader(HEAD + """
kernel void copy(volatile coherent(device) device uint* a [[buffer(0)]],
                 volatile device const float* b [[buffer(1)]],
                 device float* out [[buffer(2)]], uint i [[thread_position_in_grid]]) {
  a[i] = a[i] + 1;
  out[i] = b[i] * 2.0f;
  atomic_thread_fence(mem_flags::mem_device, memory_order_seq_cst, thread_scope_device);
}""", language_version="3.2")
    a = torch.arange(4, dtype=torch.int32)
    out = torch.zeros(4)
    lib.copy(a, torch.ones(4), out, threads=4)
    assert a.tolist() == [1, 2, 3, 4] and out.tolist() == [2.0] * 4


def test_types_without_using_namespace_and_logging():
    lib = compile_shader("""
#include <metal_stdlib>
#include <metal_logging>
struct block { half2 d; uint8_t qs[4]; };
constant metal::os_log logger("tsm", "test");
kernel void dequant(device const block* b [[buffer(0)]], device float* out [[buffer(1)]],
                    uint i [[thread_position_in_grid]]) {
  logger.log_debug("block %u", i);
  out[i] = float(b[0].d.x) * b[0].qs[i] + float(b[0].d.y);
}""", language_version="3.2")
    raw = np.zeros(1, dtype=[("d", np.float16, 2), ("qs", np.uint8, 4)])
    raw["d"] = [0.5, 1.0]
    raw["qs"] = [1, 2, 3, 4]
    out = torch.zeros(4)
    lib.dequant(np.frombuffer(raw.tobytes(), np.uint8).copy(), out, threads=4)
    assert out.tolist() == [1.5, 2.0, 2.5, 3.0]


def test_braced_vector_arguments_uniform_and_apple_builtins():
    lib = compile_shader(HEAD + """
#pragma METAL internals : enable
template <typename T>
constexpr constant bool is_wide = _disjunction<is_same<T, float>, is_same<T, int>>::value;
template <typename I>
I linear(uint3 p, constant const int* strides) { return p.x * strides[0] + p.y * strides[1] + p.z * strides[2]; }
kernel void k(constant const int* strides [[buffer(0)]], device float* out [[buffer(1)]],
              uint3 p [[thread_position_in_grid]]) {
  const uniform<int> n = make_uniform(strides[0]);
  long at = linear<long>({p.x, p.y, 0}, strides);
  out[at] = __metal_fabs(-float(at), __METAL_PRECISE_MATH__) + (is_wide<float> ? 0.0f : 1000.0f) + float(n) * 0.0f;
}""")
    out = torch.zeros(12)
    lib.k(torch.tensor([1, 4, 100], dtype=torch.int32), out, threads=(4, 3, 1), group_size=(4, 3, 1))
    assert out.tolist() == [float(i) for i in range(12)]


def test_threadgroup_initialiser_is_accepted_and_memory_starts_uninitialised():
    src = HEAD + """
kernel void k(device float* out [[buffer(0)]], uint l [[thread_position_in_threadgroup]]) {
  threadgroup float t[4] = {0};
  out[l] = t[l];
}"""
    from torch_sparse_metal.emulator import KernelFault
    with pytest.raises(KernelFault) as fault:
        compile_shader(src, sanitize=True).k(torch.zeros(4), threads=4, group_size=4)
    assert fault.value.kind == "uninitialized_read"
