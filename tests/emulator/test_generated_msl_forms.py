"""Forms that shader translators generate (Tint, SPIRV-Cross, naga) and Apple's compiler
accepts, each in a kernel of our own that runs against values computed here: <simd/simd.h>,
copies from constant objects, translator array wrappers, qualifiers and attributes Metal
ignores for kernels, the fast and precise geometric functions, mixed-signedness shifts,
vertex and fragment functions beside the kernels."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from torch_sparse_metal.emulator import KernelFault, MetalCompileError, compile_shader

SANITIZE = [pytest.param(False, id="plain"), pytest.param(True, id="sanitized")]


@pytest.mark.parametrize("sanitize", SANITIZE)
def test_simd_header_names_the_metal_types(sanitize):
    lib = compile_shader("""
#include <metal_stdlib>
#include <simd/simd.h>
using namespace metal;
struct Uniforms { simd::float4x4 m; vector_float4 bias; simd_uint2 size; matrix_float2x2 n; };
kernel void k(constant Uniforms& u [[buffer(0)]], device simd_float4* out [[buffer(1)]],
              device simd::packed::float4* packed [[buffer(2)]], uint i [[thread_position_in_grid]]) {
  matrix_float4x4 m = u.m;
  simd::float4 v = m * float4(1, 2, 3, 4) + u.bias;
  simd_float1 s = float(u.size.x) + u.n[1][0];
  out[i] = v + s;
  packed[i] = simd_packed_float4(v);
}""", sanitize=sanitize)
    u = torch.zeros(28)  # float4x4 at 0, float4 at 64, uint2 at 80, float2x2 at 88, 112 bytes
    u[:16] = torch.arange(16.0)
    u[16:20] = 0.5
    u[20:21] = torch.tensor([3], dtype=torch.int32).view(torch.float32)
    u[22:26] = torch.tensor([1.0, 2.0, 10.0, 20.0])
    out, packed = torch.zeros(2, 4), torch.zeros(2, 4)
    lib.k(u, out, packed, threads=2)
    v = torch.arange(16.0).view(4, 4).T @ torch.tensor([1.0, 2, 3, 4]) + 0.5
    assert torch.equal(out[0], v + 13) and torch.equal(packed[1], v)


def test_the_simd_names_need_the_header():
    with pytest.raises(MetalCompileError, match="unknown type name 'vector_float4'"):
        compile_shader("#include <metal_stdlib>\nusing namespace metal;\n"
                       "kernel void k(device vector_float4* o [[buffer(0)]]) { o[0] = 1; }")


TINT_FORMS = """
#include <metal_stdlib>
using namespace metal;
template<typename T, size_t N>
struct tint_array {
  const constant T& operator[](size_t i) const constant { return elements[i]; }
  device T& operator[](size_t i) device { return elements[i]; }
  const device T& operator[](size_t i) const device { return elements[i]; }
  thread T& operator[](size_t i) thread { return elements[i]; }
  const thread T& operator[](size_t i) const thread { return elements[i]; }
  threadgroup T& operator[](size_t i) threadgroup { return elements[i]; }
  const threadgroup T& operator[](size_t i) const threadgroup { return elements[i]; }
  T elements[N];
};
struct a { int a; };  // a member named like its struct
struct tint_module_vars_struct {
  const constant tint_array<float2x2, 2>* u;
  device float* s;
  thread tint_array<float2x2, 2>* p;
};
kernel void f(const constant tint_array<float2x2, 2>* u [[buffer(0)]], device float* s [[buffer(1)]]) {
  thread tint_array<float2x2, 2> p = {};
  tint_module_vars_struct const v = tint_module_vars_struct{.u=u, .s=s, .p=(&p)};
  (*v.p)[1] = (*v.u)[0];         // a matrix copied from the constant address space
  (*v.p)[0][1] = (*v.u)[1][0].yx;
  a const x = a{7};
  float4 picked = select(float4(1.0f), float4(2.0f), x.a == 7);  // vectors chosen by one bool
  (*v.s) = (*v.p)[1][1].y + (*v.p)[0][1].x + picked.w + transpose((*v.p)[1])[0].y + float(x.a);
}
"""


@pytest.mark.parametrize("sanitize", SANITIZE)
def test_tint_forms(sanitize):
    lib = compile_shader(TINT_FORMS, sanitize=sanitize)
    u = torch.arange(1.0, 9.0)  # two float2x2: [[1, 2], [3, 4]], [[5, 6], [7, 8]] by column
    s = torch.zeros(1)
    lib.f(u, s, threads=1)
    # p[1] = u[0]; p[0][1] = u[1][0].yx = (6, 5); select(...) = 2; transpose(p[1])[0].y = p[1][1][0] = 3
    assert s.item() == 4 + 6 + 2 + 3 + 7


SPIRV_CROSS_FORMS = """
#include <metal_stdlib>
#include <simd/simd.h>
using namespace metal;
template<typename T, size_t Num>
struct spvUnsafeArray {
  T elements[Num ? Num : 1];
  thread T& operator [] (size_t pos) thread { return elements[pos]; }
  constexpr const thread T& operator [] (size_t pos) const thread { return elements[pos]; }
  device T& operator [] (size_t pos) device { return elements[pos]; }
  constexpr const device T& operator [] (size_t pos) const device { return elements[pos]; }
  constexpr const constant T& operator [] (size_t pos) const constant { return elements[pos]; }
};
template<typename T> inline T spvSubgroupShuffle(T value, ushort lane) { return simd_shuffle(value, lane); }
template<> inline bool spvSubgroupShuffle(bool value, ushort lane) { return !!simd_shuffle((ushort)value, lane); }
struct Data { float a; float b; };
struct Pair {  // as SPIRV-Cross's spvStorageMatrix: constructors, and assignment from a braced list
  float2 columns[2];
  Pair() thread = default;
  Pair(float2x2 m) thread : columns{m[0], m[1]} {}
  thread Pair& operator=(initializer_list<float2> cols) thread {
    size_t i = 0;
    for (auto& c : cols) columns[i++] = c;
    return *this;
  }
};
constant spvUnsafeArray<spvUnsafeArray<float, 2>, 2> table =
    spvUnsafeArray<spvUnsafeArray<float, 2>, 2>({ spvUnsafeArray<float, 2>({ 1.0, 2.0 }), spvUnsafeArray<float, 2>({ 3.0, 4.0 }) });
kernel void main0(coherent device float* __restrict__ out [[buffer(0), user(fake0)]],
                  device const float* in [[buffer(1)]],
                  uint3 spvDispatchBase [[grid_origin]], uint3 size [[grid_size]],
                  uint3 gid [[thread_position_in_grid]]) {
  spvUnsafeArray<Data, 2> d = spvUnsafeArray<Data, 2>({ Data{ 1.0, 2.0 }, Data{ 3.0, 5.0 } });
  device const float2* pairs = reinterpret_cast<device const float2*>(in);
  uint i = gid.x + spvDispatchBase.x;
  Pair p;
  p = { float2(10.0), float2(20.0) };
  out[i] = d[i].b + table[i][1] + pairs[i].y + float(size.x) + p.columns[i].x +
           float(spvSubgroupShuffle(i == 0, ushort(0))) + spvSubgroupShuffle(float(i), ushort(1));
}
"""


@pytest.mark.parametrize("sanitize", SANITIZE)
def test_spirv_cross_forms(sanitize):
    lib = compile_shader(SPIRV_CROSS_FORMS, sanitize=sanitize)
    out, data = torch.zeros(2), torch.arange(4.0)
    lib.main0(out, data, threads=2)
    assert out.tolist() == [2 + 2 + 1 + 2 + 10 + 1 + 1, 5 + 4 + 3 + 2 + 20 + 1 + 1]


NAGA_FORMS = """
#include <metal_stdlib>
#include <simd/simd.h>
using metal::uint;
struct Bits { metal::int4 v; metal::uint4 s; };
struct VertexOutput { metal::float4 position [[position]]; float varying [[user(loc0), center_perspective]]; };
vertex VertexOutput vertex_main(uint vid [[vertex_id]]) {  // beside the kernel, never run here
  return VertexOutput { metal::float4(float(vid)), 1.0 };
}
fragment metal::float4 fragment_main(VertexOutput in [[stage_in]]) {
  return metal::float4(in.varying);
}
kernel void main_(device Bits& bits [[user(fake0)]], device metal::float3* dirs [[user(fake0)]],
                  uint i [[thread_position_in_grid]]) {
  if (i == 0) {
    bits.v = (bits.v >> bits.s) + (bits.v << metal::uint4(1u));
    bits.v >>= metal::uint4(1u);
  }
  dirs[i] = metal::fast::normalize(dirs[i]) + metal::precise::normalize(dirs[i]) * metal::fast::length(dirs[i]);
}
"""


@pytest.mark.parametrize("sanitize", SANITIZE)
def test_naga_forms(sanitize):
    lib = compile_shader(NAGA_FORMS, sanitize=sanitize)
    bits = torch.tensor([-64, 64, -7, 1, 1, 2, 3, 4], dtype=torch.int32)
    dirs = torch.tensor([[3.0, 4.0, 0.0, 0.0], [0.0, 0.0, 2.0, 0.0]])
    lib.main_(bits, dirs, threads=2)
    v, s = np.array([-64, 64, -7, 1], dtype=np.int32), np.array([1, 2, 3, 4], dtype=np.int32)
    assert bits[:4].tolist() == (((v >> s) + (v << 1)) >> 1).tolist()  # arithmetic shifts of int
    np.testing.assert_allclose(dirs[:, :3].numpy(), [[0.6 * 6, 0.8 * 6, 0], [0, 0, 3]], rtol=1e-6)


def test_a_file_named_like_assembly_compiles(tmp_path: Path):
    # The check for inline assembly reads code, not the file names in line markers.
    (tmp_path / "bitcast_sar.asm.h").write_text("inline int three() { return 3; }\n")
    lib = compile_shader('#include <metal_stdlib>\n#include "bitcast_sar.asm.h"\nusing namespace metal;\n'
                         "kernel void k(device int* o [[buffer(0)]]) { o[0] = three(); }\n",
                         include_dirs=[str(tmp_path)])
    out = torch.zeros(1, dtype=torch.int32)
    lib.k(out, threads=1)
    assert out.item() == 3


DEVICE_ADDRESSES = """
#include <metal_stdlib>
using namespace metal;
struct SSBO { float a; float3 b; };
kernel void k(device SSBO* s [[buffer(0)]], device uint2* addr [[buffer(1)]], device uchar* bytes [[buffer(2)]]) {
  ulong base = as_type<ulong>(addr[0]);  // SPIRV-Cross's buffer device addresses
  (reinterpret_cast<device SSBO*>(base))->a = 5.0f;
  device SSBO* t = (device SSBO*)(base + 32);
  t->b.y = 7.0f;
  device half* h = reinterpret_cast<device half*>(bytes);
  h[1] = half(2.0);
}
"""


@pytest.mark.parametrize("sanitize", SANITIZE)
def test_pointers_from_device_addresses(sanitize):
    lib = compile_shader(DEVICE_ADDRESSES, sanitize=sanitize)
    s, raw = torch.zeros(2, 8), torch.zeros(4, dtype=torch.uint8)
    address = torch.tensor([s.data_ptr()], dtype=torch.int64).view(torch.int32)
    lib.k(s, address, raw, threads=1)
    assert s[0, 0] == 5 and s[1, 5] == 7 and raw.view(torch.float16)[1] == 2
    outside = torch.tensor([s.data_ptr() + 4096 * 1024], dtype=torch.int64).view(torch.int32)
    with pytest.raises(KernelFault) as fault:  # an address in no buffer
        lib.k(s, outside, raw, threads=1)
    assert fault.value.kind == "out_of_bounds"
