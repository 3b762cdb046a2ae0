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


TINT_ARRAY = """
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
"""
TINT_FORMS = """
#include <metal_stdlib>
using namespace metal;
""" + TINT_ARRAY + """
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


ATOMIC_HELPERS = """
#include <metal_stdlib>
using namespace metal;
struct Exchanged { int old; bool swapped; };
template <typename A>  // naga's helpers: one per address space, the atomic's type deduced
Exchanged exchange(device A* p, int expected, int desired) {
  bool swapped = atomic_compare_exchange_weak_explicit(p, &expected, desired, memory_order_relaxed,
                                                       memory_order_relaxed);
  return Exchanged{expected, swapped};
}
template <typename A>
Exchanged exchange(threadgroup A* p, int expected, int desired) {
  bool swapped = atomic_compare_exchange_weak_explicit(p, &expected, desired, memory_order_relaxed,
                                                       memory_order_relaxed);
  return Exchanged{expected, swapped};
}
struct Slots { atomic_int inner[4]; };
kernel void k(device Slots& slots [[buffer(0)]], device int* out [[buffer(1)]], constant uint& at [[buffer(2)]],
              uint i [[thread_position_in_grid]]) {
  threadgroup atomic_int shared[4];
  atomic_store_explicit(&shared[i], int(i), memory_order_relaxed);
  Exchanged d = exchange(&slots.inner[i * at], 7, 100 + int(i));  // the address of an element
  Exchanged t = exchange(&shared[i], 1, 50);
  out[i] = d.old * 1000 + int(d.swapped) * 100 + t.old * 10 + int(t.swapped);
}
"""


@pytest.mark.parametrize("sanitize", SANITIZE)
def test_template_pointer_parameters_take_element_addresses(sanitize):
    lib = compile_shader(ATOMIC_HELPERS, sanitize=sanitize)
    slots, out = torch.tensor([7, 3, 7, 9], dtype=torch.int32), torch.zeros(4, dtype=torch.int32)
    lib.k(slots, out, torch.tensor([1], dtype=torch.int32), threads=4, group_size=4)
    assert slots.tolist() == [100, 3, 102, 9]
    assert out.tolist() == [7100, 3000 + 11, 7100 + 20, 9000 + 30]
    # the helper's pointer is checked: an element past the buffer faults, naming it
    with pytest.raises(KernelFault) as fault:
        lib.k(slots, out, torch.tensor([2], dtype=torch.int32), threads=4, group_size=4)
    assert fault.value.kind == "out_of_bounds"


SCALARS_WITH_NARROW_VECTORS = """
#include <metal_stdlib>
using namespace metal;
kernel void k(device short2* s [[buffer(0)]], device ushort2* u [[buffer(1)]], device char4* c [[buffer(2)]],
              device int* flags [[buffer(3)]]) {
  short2 x = s[0];
  s[1] = x + 1;   // an int scalar converted to the vector's element type, then the operation
  s[2] = x * 2;
  bool2 z = x == 0 || x > 10;  // SPIRV-Cross's spvSMod of a short2
  ushort2 y = u[0];
  u[1] = y - 1u;
  c[1] = c[0] * 3;
  flags[0] = z.x; flags[1] = z.y; flags[2] = all(y == 0u);
}
"""


@pytest.mark.parametrize("sanitize", SANITIZE)
def test_scalars_of_greater_rank_than_a_vectors_elements(sanitize):
    lib = compile_shader(SCALARS_WITH_NARROW_VECTORS, sanitize=sanitize)
    s = torch.tensor([[30000, 0], [0, 0], [0, 0]], dtype=torch.int16)
    u = torch.tensor([[0, 0], [0, 0]], dtype=torch.int16)
    c = torch.tensor([[100, -2, 0, 1], [0, 0, 0, 0]], dtype=torch.int8)
    flags = torch.zeros(3, dtype=torch.int32)
    lib.k(s, u, c, flags, threads=1)
    x = np.array([30000, 0], dtype=np.int16)
    assert s[1].tolist() == (x + np.int16(1)).tolist() and s[2].tolist() == (x * np.int16(2)).tolist()
    assert u[1].tolist() == [-1, -1]  # 0 - 1 as ushort: 65535, read back as int16
    assert c[1].tolist() == (np.array([100, -2, 0, 1], dtype=np.int8) * np.int8(3)).tolist()
    assert flags.tolist() == [1, 1, 1]


VOLATILE_BLOCKS = """
#include <metal_stdlib>
using namespace metal;
struct SSBO { float4 value; int n; };
kernel void k(volatile device SSBO& __restrict b [[buffer(0)]], const volatile device SSBO& d [[buffer(1)]],
              volatile device float4* e [[buffer(2)]], volatile device int* f [[buffer(3)]],
              uint i [[thread_position_in_grid]]) {
  threadgroup float t[2];
  volatile threadgroup float& r = t[i];
  r = float(i) + 1;
  threadgroup_barrier(mem_flags::mem_threadgroup);
  if (i == 0) {  // SPIRV-Cross's coherent blocks: volatile structs and vectors, written whole
    b.value = float4(20.0) + t[1];
    b.n = d.n + 1;
    e[1] = e[0] * 2;
    f[1] = f[0] + 1;
  }
}
"""


@pytest.mark.parametrize("sanitize", SANITIZE)
def test_volatile_structs_and_vectors(sanitize):
    lib = compile_shader(VOLATILE_BLOCKS, sanitize=sanitize)
    b, d = torch.zeros(8), torch.zeros(8)
    d.view(torch.int32)[4] = 41
    e, f = torch.tensor([[1.0, 2, 3, 4], [0, 0, 0, 0]]), torch.tensor([5, 0], dtype=torch.int32)
    lib.k(b, d, e, f, threads=2, group_size=2)
    assert b[:4].tolist() == [22.0] * 4 and b.view(torch.int32)[4] == 42
    assert e[1].tolist() == [2.0, 4.0, 6.0, 8.0] and f.tolist() == [5, 6]


DESCRIPTOR_ARRAY = """
#include <metal_stdlib>
using namespace metal;
template <typename T> struct spvDescriptor { T value; };
template <typename T>
struct spvDescriptorArray {  // SPIRV-Cross's descriptor arrays: two constructors, one exact
  spvDescriptorArray(const device spvDescriptor<T>* ptr_) : ptr(&ptr_->value) {}
  spvDescriptorArray(const device void* ptr_) : spvDescriptorArray(static_cast<const device spvDescriptor<T>*>(ptr_)) {}
  const device T& operator[](size_t i) const { return ptr[i]; }
  const device T* ptr;
};
struct Rows { spvDescriptor<float4> rows[2]; };
kernel void k(device Rows& set [[buffer(0)]], device float4* out [[buffer(1)]], uint i [[thread_position_in_grid]]) {
  spvDescriptorArray<float4> rows {set.rows};  // the array decays to the exact constructor's pointer
  out[i] = rows[i] * 2.0f;
}
"""


@pytest.mark.parametrize("sanitize", SANITIZE)
def test_descriptor_array_constructors_take_the_decayed_array(sanitize):
    lib = compile_shader(DESCRIPTOR_ARRAY, sanitize=sanitize)
    rows, out = torch.arange(8.0), torch.zeros(2, 4)
    lib.k(rows, out, threads=2)
    assert out.flatten().tolist() == (torch.arange(8.0) * 2).tolist()


@pytest.mark.parametrize("declaration", [
    "struct Set { device float* data; int n; };\nkernel void k(constant Set& set [[buffer(0)]]) { set.data[0] = 1; }",
    "template <typename T> struct D { T value; };\nstruct Set { D<device float*> items[2]; };\n"
    "kernel void k(device Set* set [[buffer(0)]]) { set->items[0].value[0] = 1; }",
    "template <typename T> struct B { T value; int length; };\n"
    "kernel void k(device void* raw [[buffer(0)]]) { ((device B<device float*>*)raw)->value[0] = 1; }",
])
def test_data_in_buffers_that_holds_pointers_is_an_emulator_limit(declaration):
    # Metal's 8-byte pointers against the emulator's 32: refused, never read from the wrong bytes
    with pytest.raises(MetalCompileError, match=r"holds a pointer \(.*\): Metal stores a pointer in 8 bytes"):
        compile_shader("#include <metal_stdlib>\nusing namespace metal;\n" + declaration)


REFERENCE_CASTS = """
#include <metal_stdlib>
using namespace metal;
struct Sub { float4 f[2]; float4 f2[2]; };
kernel void k(device Sub* s [[buffer(0)]], uint i [[thread_position_in_grid]]) {
  (device float&)s[i].f[1] = 5.0f;  // SPIRV-Cross's std140 arrays: a vector's first components
  (device float2&)s[i].f2[0] = float2(1.0f, 2.0f);
  float x = (device float&)s[i].f[0];
  s[i].f2[1].w = x;
}
"""


@pytest.mark.parametrize("sanitize", SANITIZE)
def test_c_style_casts_to_references(sanitize):
    lib = compile_shader(REFERENCE_CASTS, sanitize=sanitize)
    s = torch.zeros(2, 16)
    s[:, 0] = torch.tensor([9.0, 8.0])
    lib.k(s, threads=2)
    want = torch.zeros(2, 16)
    want[:, 0], want[:, 15] = torch.tensor([9.0, 8.0]), torch.tensor([9.0, 8.0])
    want[:, 4], want[:, 8], want[:, 9] = 5.0, 1.0, 2.0
    assert torch.equal(s, want)


ARRAY_COPIES = """
#include <metal_stdlib>
using namespace metal;
template <typename T, uint N>  // SPIRV-Cross's array copies, by reference to arrays
inline void copy(thread T (&dst)[N], constant T (&src)[N]) { for (uint i = 0; i < N; i++) dst[i] = src[i]; }
template <typename T, uint N, uint M>
inline void copy(thread T (&dst)[N][M], constant T (&src)[N][M]) { for (uint i = 0; i < N; i++) copy(dst[i], src[i]); }
constant float table[2][2][2] = { { { 1.0, 2.0 }, { 3.0, 4.0 } }, { { 5.0, 6.0 }, { 7.0, 8.0 } } };
kernel void k(device float* o [[buffer(0)]], uint i [[thread_position_in_grid]]) {
  float c[2][2][2];
  copy(c, table);  // T is float[2] from both arrays, the constant one as the thread one
  o[i] = c[i / 4][(i / 2) % 2][i % 2];
}
"""


@pytest.mark.parametrize("sanitize", SANITIZE)
def test_references_to_constant_arrays_deduce_as_thread_ones(sanitize):
    lib = compile_shader(ARRAY_COPIES, sanitize=sanitize)
    out = torch.zeros(8)
    lib.k(out, threads=8)
    assert out.tolist() == [1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0, 8.0]


TEMPORARY_SUBSCRIPTS = """
#include <metal_stdlib>
using namespace metal;
""" + TINT_ARRAY + """
tint_array<float, 4> make_array(float x) {
  tint_array<float, 4> m = {};
  m[1] = x;
  return m;
}
kernel void k(device float* o [[buffer(0)]], uint i [[thread_position_in_grid]]) {
  o[i] = make_array(float(i) + 0.5f)[1u];  // a temporary is in thread: the thread overload
}
"""


@pytest.mark.parametrize("sanitize", SANITIZE)
def test_a_temporary_takes_the_thread_overload(sanitize):
    lib = compile_shader(TEMPORARY_SUBSCRIPTS, sanitize=sanitize)
    out = torch.zeros(3)
    lib.k(out, threads=3)
    assert out.tolist() == [0.5, 1.5, 2.5]


def test_a_temporary_without_a_thread_overload_is_rejected():
    with pytest.raises(MetalCompileError, match=r"no viable overloaded operator\[\]"):
        compile_shader("\n".join(line for line in TEMPORARY_SUBSCRIPTS.splitlines() if ") thread {" not in line
                                  and ") const thread {" not in line))


THREAD_ARRAY_OF_BUFFER_POINTERS = """
#include <metal_stdlib>
using namespace metal;
float second(device float* (&buffers)[2], uint i) { return buffers[1][i]; }  // SPIRV-Cross's
kernel void k(device float* a [[buffer(0)]], device float* b [[buffer(1)]], uint i [[thread_position_in_grid]]) {
  device float* buffers[] = { a, b };  // pointers held in thread memory: laid out by the emulator alone
  a[i] = second(buffers, i) * 2.0f;
}
"""


def test_pointers_held_in_thread_memory_are_not_refused():
    lib = compile_shader(THREAD_ARRAY_OF_BUFFER_POINTERS)
    a, b = torch.zeros(3), torch.tensor([1.0, 2.0, 3.0])
    lib.k(a, b, threads=3)
    assert a.tolist() == [2.0, 4.0, 6.0]


SWIZZLES_TO_TEMPLATES = """
#include <metal_stdlib>
using namespace metal;
template <typename T> T twice(T x) { return x + x; }
template <typename Tx, typename Ty>  // SPIRV-Cross's signed modulo: the result takes y's sign
Tx smod(Tx x, Ty y) {
  Tx r = x - y * (x / y);
  return select(Tx(r + y), r, r == 0 || (x >= 0) == (y >= 0));
}
kernel void k(device short4* o [[buffer(0)]], uint i [[thread_position_in_grid]]) {
  short4 v = o[2 * i];
  o[2 * i + 1] = short4(twice(v.xy), smod(v.xy, v.zw));  // T is short2, not the swizzle
}
"""


@pytest.mark.parametrize("sanitize", SANITIZE)
def test_swizzles_given_to_function_templates_are_vectors(sanitize):
    lib = compile_shader(SWIZZLES_TO_TEMPLATES, sanitize=sanitize)
    o = torch.tensor([[7, -7, 3, 3], [0] * 4, [5, 5, -3, 3], [0] * 4], dtype=torch.int16)
    lib.k(o, threads=2)
    x, y = o[[0, 2], :2].numpy(), o[[0, 2], 2:].numpy()
    r = x - y * np.trunc(x / y).astype(np.int16)
    want_mod = np.where((r == 0) | ((x >= 0) == (y >= 0)), r, r + y)
    assert o[[1, 3], :2].tolist() == (2 * x).tolist()
    assert o[[1, 3], 2:].tolist() == want_mod.tolist() == [[1, 2], [-1, 2]]


POINTEE_TEMPLATE_ARGUMENTS = """
#include <metal_stdlib>
using namespace metal;
template <typename T> struct Box;
template <typename T> struct Box<device T*> { int n; };  // SPIRV-Cross's spvBufferDescriptor form
kernel void k(device Box<device float*>* b [[buffer(0)]], uint i [[thread_position_in_grid]]) {
  b[i].n = int(i) + 5;  // the pointee names the same specialisation as the declaration
}
"""


@pytest.mark.parametrize("sanitize", SANITIZE)
def test_pointers_in_a_pointees_template_arguments(sanitize):
    lib = compile_shader(POINTEE_TEMPLATE_ARGUMENTS, sanitize=sanitize)
    boxes = torch.zeros(3, dtype=torch.int32)
    lib.k(boxes, threads=3)
    assert boxes.tolist() == [5, 6, 7]
