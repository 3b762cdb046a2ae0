"""Forms of PyTorch's MPS kernels (aten/src/ATen/native/mps/kernels, c10/metal) that Apple's
compiler builds, in kernels of our own, each run against a reference; and what stays wrong."""

import numpy as np
import pytest
import torch

from torch_sparse_metal.emulator import MetalCompileError, compile_shader

HEAD = "#include <metal_stdlib>\n"


def test_scoped_enumerations():
    # c10/metal/common.h: `enum class ScalarType : int8_t { ... }`.
    lib = compile_shader(HEAD + """
enum class Op : int { add = 0, mul = 1 };
enum struct Scale { one, two };
inline float apply(Op op, float a, float b) { return op == Op::add ? a + b : a * b; }
kernel void k(device float* y [[buffer(0)]], constant int& which [[buffer(1)]],
              uint i [[thread_position_in_grid]]) {
  y[i] = apply(static_cast<Op>(which), y[i], 3.0f) * (Scale::two == Scale::two ? 2.0f : 1.0f);
}""")
    y = torch.arange(4, dtype=torch.float32)
    lib.k(y, torch.tensor([1], dtype=torch.int32), threads=4)
    np.testing.assert_array_equal(y.numpy(), np.arange(4) * 3.0 * 2.0)


def test_language_operators_and_types_without_using_namespace_metal():
    # c10/metal headers: bfloat and as_type<T>(x) in their own namespace, no using-directive.
    lib = compile_shader(HEAD + """
namespace mine {
inline uint bits(float x) { return as_type<uint>(x); }
inline float widen(bfloat x) { return float(x) * 2.0f; }
}
kernel void k(device uint* out [[buffer(0)]], device const float* a [[buffer(1)]],
              device const bfloat* b [[buffer(2)]], device float* w [[buffer(3)]],
              uint i [[thread_position_in_grid]]) {
  out[i] = mine::bits(a[i]);
  w[i] = mine::widen(b[i]);
}""", language_version="3.1")
    a = torch.tensor([1.0, -2.5, 0.0])
    out = torch.zeros(3, dtype=torch.int32)
    b = torch.tensor([0.5, 3.0, -1.0], dtype=torch.bfloat16)
    w = torch.zeros(3)
    lib.k(out, a, b, w, threads=3)
    np.testing.assert_array_equal(out.numpy().view(np.uint32), a.numpy().view(np.uint32))
    np.testing.assert_array_equal(w.numpy(), [1.0, 6.0, -2.0])


def test_make_signed_and_precise_sincos():
    # Im2Col: make_signed_t; c10/metal/random.h: precise::sincos.
    lib = compile_shader(HEAD + """
using namespace metal;
kernel void k(device int* s [[buffer(0)]], device float2* sc [[buffer(1)]],
              uint i [[thread_position_in_grid]]) {
  make_signed_t<uint> v = make_signed_t<uint>(i) - 2;
  s[i] = v;
  float c;
  float sn = precise::sincos(float(i), c);
  sc[i] = float2(sn, c);
}""")
    s = torch.zeros(4, dtype=torch.int32)
    sc = torch.zeros(4, 2)
    lib.k(s, sc, threads=4)
    np.testing.assert_array_equal(s.numpy(), np.arange(4) - 2)
    np.testing.assert_allclose(sc.numpy(), np.stack([np.sin(np.arange(4)), np.cos(np.arange(4))], 1), atol=1e-6)


def test_vectors_built_through_a_template_parameter():
    # c10/metal/utils.h: `return T(a, b);` with T = float2; a class T keeps its constructor.
    lib = compile_shader(HEAD + """
using namespace metal;
struct Pair { float x, y; Pair(float a, float b) : x(a), y(b + 1.0f) {} };
template <typename T> inline T make2(float a, float b) { return T(a, b); }
kernel void k(device float2* v [[buffer(0)]], device float* p [[buffer(1)]],
              uint i [[thread_position_in_grid]]) {
  v[i] = make2<float2>(float(i), 2.0f * i);
  Pair q = make2<Pair>(float(i), 0.5f);
  p[i] = q.x + q.y;
}""")
    v = torch.zeros(3, 2)
    p = torch.zeros(3)
    lib.k(v, p, threads=3)
    np.testing.assert_array_equal(v.numpy(), np.stack([np.arange(3), 2 * np.arange(3)], 1))
    np.testing.assert_array_equal(p.numpy(), np.arange(3) + 1.5)


def test_a_kernel_instantiated_by_a_qualified_name_with_spaces():
    # c10/metal/indexing.h's REGISTER_*_OP macros: `kernel void ::c10::metal::f<T>(...)`.
    lib = compile_shader(HEAD + """
namespace ns {
template <typename T>
kernel void fill(device T* o [[buffer(0)]], uint i [[thread_position_in_grid]]) { o[i] = T(3 * i); }
}
template [[host_name("fill_float")]] kernel void :: ns :: fill<float>(device float*, uint);
""")
    o = torch.zeros(4)
    lib.fill_float(o, threads=4)
    np.testing.assert_array_equal(o.numpy(), 3 * np.arange(4))


FUNCTION_ARGUMENTS = HEAD + """
using namespace metal;
inline float add(float a, float b) { return a + b; }
inline float larger(float a, float b) { return max(a, b); }
template <typename T> inline T combine(T a, T b, T (*op)(T, T)) { return op(a, b); }
template <typename T> inline T forward(T a, T b, T (*op)(T, T)) { return combine(a, b, op); }
"""


@pytest.mark.parametrize("version", ["3.1", "3.2", "4.0"])
def test_a_function_passed_by_name_to_a_pointer_parameter(version):
    # c10/metal/atomic.h: atomic_binary_op_helper(data, offset, value, T (*op)(T, T)),
    # called with a function's name, directly and through a forwarding helper.
    lib = compile_shader(FUNCTION_ARGUMENTS + """
kernel void k(device float* y [[buffer(0)]], device const float* x [[buffer(1)]],
              uint i [[thread_position_in_grid]]) {
  y[i] = combine(y[i], x[i], add) + forward(y[i], x[i], larger);
}""", language_version=version)
    y = torch.tensor([1.0, 5.0, -2.0])
    x = torch.tensor([3.0, 2.0, -4.0])
    expected = (y + x) + torch.maximum(y, x)
    lib.k(y, x, threads=3)
    torch.testing.assert_close(y, expected)


@pytest.mark.parametrize("body, says", [
    ("y[i] = combine(y[i], x[i], y[i] > 0 ? add : larger);", "argument for `op` must name a function"),
    ("float (*chosen)(float, float) = y[i] > 0 ? add : larger;\n  y[i] = combine(y[i], x[i], chosen);",
     r"no function pointers \(`chosen`\)"),
])
def test_a_function_chosen_at_run_time_is_still_rejected(body, says):
    with pytest.raises(MetalCompileError, match=says):
        compile_shader(FUNCTION_ARGUMENTS + """
kernel void k(device float* y [[buffer(0)]], device const float* x [[buffer(1)]],
              uint i [[thread_position_in_grid]]) {
  """ + body + "\n}", language_version="3.2")


def test_function_pointer_parameters_are_rejected_before_msl_3_1():
    with pytest.raises(MetalCompileError, match=r"no function pointers \(`op`\)"):
        compile_shader(FUNCTION_ARGUMENTS + """
kernel void k(device float* y [[buffer(0)]], uint i [[thread_position_in_grid]]) {
  y[i] = combine(y[i], 1.0f, add);
}""", language_version="3.0")


def test_explicit_conversions_between_half_and_bfloat():
    # c10/metal/utils.h cast_to: static_cast<T>(from) with T = half and from a bfloat (and
    # back); Metal converts explicitly, clang's __bf16 does not: the check goes through float.
    lib = compile_shader(HEAD + """
using namespace metal;
template <typename T, typename U> inline T cast_to(const U from) { return static_cast<T>(from); }
kernel void k(device const bfloat* b [[buffer(0)]], device half* h [[buffer(1)]],
              device bfloat* back [[buffer(2)]], uint i [[thread_position_in_grid]]) {
  h[3 * i] = cast_to<half>(b[i]);
  h[3 * i + 1] = half(b[i]);
  h[3 * i + 2] = static_cast<half>(b[i]);
  back[i] = cast_to<bfloat>(h[3 * i]) + bfloat(h[3 * i + 1]);
}""", language_version="3.1")
    b = torch.tensor([1.5, -3.25, 1000.0, 0.0078125], dtype=torch.bfloat16)
    h = torch.zeros(12, dtype=torch.float16)
    back = torch.zeros(4, dtype=torch.bfloat16)
    lib.k(b, h, back, threads=4)
    want = b.float().half()
    np.testing.assert_array_equal(h.reshape(4, 3).numpy(), np.stack([want.numpy()] * 3, 1))
    torch.testing.assert_close(back, (2 * want.float()).bfloat16(), rtol=0, atol=0)


def test_a_users_template_wins_over_the_bfloat_math_overloads():
    # c10/metal/utils.h: `template <typename T> T max(T, T)` specialised for bfloat, called
    # with `using namespace metal;` and `using namespace c10::metal;`: an exact match of a
    # template, as Apple's library has no bfloat max.
    lib = compile_shader(HEAD + """
using namespace metal;
namespace mine {
template <typename T> T max(T a, T b) { return a > b ? a : b; }
template <> inline bfloat max(bfloat a, bfloat b) { return bfloat(float(a) > float(b) ? a : b) + bfloat(1.0f); }
}
using namespace mine;
kernel void k(device bfloat* y [[buffer(0)]], device const bfloat* x [[buffer(1)]],
              uint i [[thread_position_in_grid]]) {
  y[i] = max(y[i], x[i]);
}""", language_version="3.1")
    y = torch.tensor([1.0, 5.0], dtype=torch.bfloat16)
    x = torch.tensor([2.0, 3.0], dtype=torch.bfloat16)
    lib.k(y, x, threads=2)
    np.testing.assert_array_equal(y.float().numpy(), [3.0, 6.0])


def test_an_array_parameter_is_a_pointer():
    # c10/metal/indexing.h: pos_from_thread_index(idx, thread T pos[max_ndim], ...), given
    # &pos[0] of a metal::array.
    lib = compile_shader(HEAD + """
using namespace metal;
template <typename T> inline void digits(T x, thread T out[4]) {
  for (int d = 0; d < 4; ++d) { out[d] = x % 10; x /= 10; }
}
kernel void k(device int* y [[buffer(0)]], uint i [[thread_position_in_grid]]) {
  metal::array<int, 4> pos;
  digits<int>(int(i) * 1234, &pos[0]);
  y[i] = pos[0] + 10 * pos[3];
}""")
    y = torch.zeros(3, dtype=torch.int32)
    lib.k(y, threads=3)
    want = [(n % 10) + 10 * ((n // 1000) % 10) for n in (0, 1234, 2468)]
    np.testing.assert_array_equal(y.numpy(), want)


def test_a_device_pointers_address_as_an_integer():
    # c10/metal/atomic.h atomic_add_helper: `reinterpret_cast<ulong>(data) % alignof(...)`.
    lib = compile_shader(HEAD + """
using namespace metal;
kernel void k(device const half* h [[buffer(0)]], device uint* out [[buffer(1)]],
              uint i [[thread_position_in_grid]]) {
  device const half* p = h + i;
  out[i] = uint(reinterpret_cast<ulong>(p) - reinterpret_cast<ulong>(h));
}""")
    out = torch.zeros(4, dtype=torch.int32)
    lib.k(torch.zeros(4, dtype=torch.float16), out, threads=4)
    np.testing.assert_array_equal(out.numpy(), 2 * np.arange(4))


def test_library_scalar_functions_are_overloads_not_templates():
    # Metal's pow, min, max on scalars are per-type overloads: a user's template that matches
    # exactly where they need a conversion wins (c10's pow<T, U> for pow(float, int), Gamma),
    # and they win where both match exactly (min(uint, uint) over c10's integral min).
    lib = compile_shader(HEAD + """
using namespace metal;
namespace mine {
template <typename T, typename U> inline float pow(T a, U b) { return ::metal::pow(float(a), float(b)) + 1000.0f; }
template <typename T, typename U> enable_if_t<is_integral_v<T> && is_integral_v<U>, T> min(T a, U b) {
  return ::metal::min(a, static_cast<T>(b)) + 100;
}
}
using namespace mine;
kernel void k(device float* o [[buffer(0)]], device uint* u [[buffer(1)]], uint i [[thread_position_in_grid]]) {
  float z = 2.0f;
  int n = int(i);
  o[i] = pow(z, n) + 10000.0f * pow(z, 2.0f);
  u[i] = min(i, 5u) + 10 * min(int(i), 7l);
}""")
    o = torch.zeros(3)
    u = torch.zeros(3, dtype=torch.int32)
    lib.k(o, u, threads=3)
    np.testing.assert_array_equal(o.numpy(), 2.0 ** np.arange(3) + 1000 + 40000)
    np.testing.assert_array_equal(u.numpy(), np.arange(3) + 10 * (np.arange(3) + 100))


def test_void_before_kernel_and_a_call_among_template_arguments():
    # SpecialOps.metal writes `void kernel i0(...)`; GroupedMM.metal instantiates
    # `grouped_mm_rows<T, BM, ..., grouped_mm_simdgroups(BM) / 2, 2>(...)`.
    lib = compile_shader(HEAD + """
using namespace metal;
constexpr int lanes(int n) { return n * 2; }
void kernel twice(device float* y [[buffer(0)]], uint i [[thread_position_in_grid]]) { y[i] *= 2; }
template <typename T, int N>
kernel void add(device T* y [[buffer(0)]], uint i [[thread_position_in_grid]]) { y[i] += T(N); }
template [[host_name("add_float")]] kernel void add<float, lanes(3) / 2>(device float*, uint);
""")
    y = torch.arange(4, dtype=torch.float32)
    lib.twice(y, threads=4)
    lib.add_float(y, threads=4)
    np.testing.assert_array_equal(y.numpy(), 2 * np.arange(4) + 3)


# A class with a conversion operator, read from device memory in one arm of `?:` and made
# in the other (ScaledMM.metal: `c ? args.a[i] : float8_e4m3fn(0.0f)`).
BYTE_CODE = HEAD + """
using namespace metal;
struct code {
  uchar x;
  code() = default;
  code(float v) : x(uchar(v * 2)) {}
  operator float() const { return float(x) / 2; }
};
struct other {
  uchar x;
  other(float v) : x(uchar(v)) {}
  operator float() const { return float(x); }
};
kernel void k(device const code* a [[buffer(0)]], device float* y [[buffer(1)]],
              uint i [[thread_position_in_grid]]) {
  const auto v = i < 3 ? a[i] : code(7.5f);
  y[i] = float(v);
}
"""


def test_a_conditional_copies_a_device_object_of_the_other_arms_class():
    lib = compile_shader(BYTE_CODE)
    y = torch.zeros(5)
    lib.k(torch.tensor([2, 5, 9, 1, 1], dtype=torch.uint8), y, threads=5)
    np.testing.assert_array_equal(y.numpy(), [1.0, 2.5, 4.5, 7.5, 7.5])


def test_a_conditional_of_two_classes_still_calls_a_method_on_a_device_object():
    # Both arms convert to float: `operator float` (a thread member) is called on a device
    # object, which Metal rejects.
    with pytest.raises(MetalCompileError, match="cannot convert a device object to the thread address space"):
        compile_shader(BYTE_CODE.replace("code(7.5f);", "other(7.5f);"))


ARRAY_DEDUCTION = HEAD + """
using namespace metal;
template <typename A> inline void fill(A v[4], A init) { for (int j = 0; j < 4; ++j) v[j] = init + A(j); }
template <typename A> inline A weigh(A x, const A w[], long n) { return x * w[n]; }
template <typename A> struct acc { using type = A; };
template <typename A> inline A weigh_by_alias(A x) {
  using acc_t = typename acc<A>::type;  // igamma.h: ratevl(static_cast<accscalar_t>(x), num, ...)
  const acc_t w[2] = {2., 0.5};
  return weigh(static_cast<acc_t>(x), w, 1);
}
kernel void k(device float* y [[buffer(0)]], uint i [[thread_position_in_grid]]) {
  float v[4];
  fill(v, float(i));
  const float w[2] = {2.0f, 0.5f};
  y[i] = weigh(v[3], w, 1) + weigh_by_alias(v[0]);
}
"""


def test_an_array_parameter_deduces_from_a_local_array_as_from_a_value():
    # ScanKernel.metal: load_safe(acc_t values[N_READS], ..., acc_t init) given a local
    # array and a value, and c10/metal/igamma.h's ratevl(T x, const T num[], ...) the value
    # first: a local is in thread, Metal's default address space.
    lib = compile_shader(ARRAY_DEDUCTION)
    y = torch.zeros(3)
    lib.k(y, threads=3)
    np.testing.assert_array_equal(y.numpy(), (np.arange(3) + 3) * 0.5 + np.arange(3) * 0.5)


def test_an_array_parameter_does_not_deduce_from_a_device_pointer_and_a_value():
    # There A is `device float` from one argument and `float` from the other.
    with pytest.raises(MetalCompileError, match="no matching function for call to 'fill'"):
        compile_shader(ARRAY_DEDUCTION.replace("fill(v, float(i));", "fill(y, float(i));"))


def test_a_function_pointer_template_parameter_returning_a_vector():
    # Quantized.metal: template <typename T, float2 (*get_scale_zero_func)(constant T*, uint2)>.
    lib = compile_shader(HEAD + """
using namespace metal;
inline float2 pair_at(constant float* p, uint2 i) { return float2(p[i.x], p[i.y]); }
template <typename T, float2 (*get)(constant T*, uint2)>
kernel void k(constant T* a [[buffer(0)]], device float* y [[buffer(1)]], uint i [[thread_position_in_grid]]) {
  float2 v = get(a, uint2(i, i + 1));
  y[i] = v.x - 2 * v.y;
}
template [[host_name("k_float")]] kernel void k<float, pair_at>(constant float*, device float*, uint);
""")
    a = torch.arange(5, dtype=torch.float32) ** 2
    y = torch.zeros(4)
    lib.k_float(a, y, threads=4)
    np.testing.assert_array_equal(y.numpy(), a[:4].numpy() - 2 * a[1:].numpy())


STATIC_MEMBER_OPS = HEAD + """
using namespace metal;
struct Ops {
  template <typename T> static T prod(T a, T b) { return a * b; }
  template <typename T> static T amax(T a, T b) { return max(a, b); }
};
template <typename T, T (*Op)(T, T)>
kernel void k(device T* y [[buffer(0)]], device const T* x [[buffer(1)]], uint i [[thread_position_in_grid]]) {
  y[i] = Op(y[i], x[i]);
}
template [[host_name("k_prod_float")]] kernel void k<float, Ops::prod<float>>(device float*, device const float*, uint);
template [[host_name("k_amax_int")]] kernel void k<int, Ops::amax<int>>(device int*, device const int*, uint);
"""


def test_a_static_member_function_as_a_function_pointer_template_argument():
    # ScatterGather.metal: scatter_reduce<T, IT, ScatterReduceOp::prod<T>>.
    lib = compile_shader(STATIC_MEMBER_OPS)
    y, x = torch.arange(4, dtype=torch.float32), torch.full((4,), 3.0)
    lib.k_prod_float(y, x, threads=4)
    np.testing.assert_array_equal(y.numpy(), 3 * np.arange(4))
    y, x = torch.tensor([1, 5, 2, 7], dtype=torch.int32), torch.full((4,), 3, dtype=torch.int32)
    lib.k_amax_int(y, x, threads=4)
    np.testing.assert_array_equal(y.numpy(), [3, 5, 3, 7])


def test_a_static_member_function_of_another_type_is_rejected():
    # The check takes such parameters as `auto`; the build still matches the types.
    with pytest.raises(MetalCompileError, match="amax<float>"):
        compile_shader(STATIC_MEMBER_OPS.replace("k<int, Ops::amax<int>>", "k<int, Ops::amax<float>>"))


@pytest.mark.parametrize("sanitize", [False, True])
def test_metal_arrays_data_and_copies_from_constant_memory(sanitize):
    # GridSampler.metal and Pooling.metal: params.sizes.data() of a constant struct's
    # metal::array; UpSample.metal copies one into a thread array.
    lib = compile_shader(HEAD + """
using namespace metal;
struct P { array<int, 4> sizes; };
kernel void k(constant P& p [[buffer(0)]], device int* out [[buffer(1)]], uint i [[thread_position_in_grid]]) {
  constant int* s = p.sizes.data();
  array<int, 4> local = p.sizes;
  thread int* l = local.data();
  out[i] = s[i % 4] + 10 * l[(i + 1) % 4];
}""", sanitize=sanitize)
    out = torch.zeros(4, dtype=torch.int32)
    lib.k(torch.tensor([1, 2, 3, 4], dtype=torch.int32), out, threads=4)
    np.testing.assert_array_equal(out.numpy(), [21, 32, 43, 14])


TRAITS = HEAD + """
using namespace metal;
template <typename T> constexpr constant bool scalar_fp = is_floating_point_v<T> && is_scalar_v<T>;
struct twice {  // BinaryKernel/UnaryKernel: float2 holds a complex number
  template <typename T, enable_if_t<scalar_fp<T>, bool> = true> T operator()(T x) { return x * 2; }
  template <typename T, enable_if_t<is_floating_point_v<T> && is_vector_v<T>, bool> = true>
  T operator()(T x) { return T(x.x - x.y, x.x + x.y); }
  template <typename T, enable_if_t<is_integral_v<T> && is_scalar_v<T>, bool> = true>
  float operator()(T x) { return float(x) + 0.5f; }
};
kernel void k(device float* s [[buffer(0)]], device float2* c [[buffer(1)]],
              device float* n [[buffer(2)]], device int* flags [[buffer(3)]],
              uint i [[thread_position_in_grid]]) {
  twice f;
  s[i] = f(s[i]);
  c[i] = f(c[i]);
  n[i] = f(int(i));
  if (i == 0) flags[0] = int(is_floating_point_v<half4>) | int(is_integral_v<uint2>) << 1 |
             int(is_arithmetic_v<const float3>) << 2 | int(is_scalar_v<float2>) << 3 |
             int(is_signed_v<int4>) << 4 | int(is_unsigned_v<int4>) << 5 |
             int(is_unsigned_v<ushort2>) << 6 | int(is_floating_point_v<int2>) << 7 |
             int(is_integral_v<float2>) << 8 | int(is_scalar_v<const float>) << 9;
}"""


@pytest.mark.parametrize("sanitize", [False, True])
def test_type_traits_classify_a_vector_by_its_element(sanitize):
    # c10/metal/utils.h defines is_scalar_floating_point_v = is_floating_point_v && is_scalar_v:
    # Metal's is_floating_point_v holds for half2, and UnaryKernel's exp_functor relies on it.
    lib = compile_shader(TRAITS, sanitize=sanitize)
    s = torch.tensor([1.5, -2.0, 0.25])
    c = torch.tensor([[1.0, 2.0], [3.0, -1.0], [0.0, 4.0]])
    n = torch.zeros(3)
    flags = torch.zeros(1, dtype=torch.int32)
    lib.k(s, c, n, flags, threads=3)
    np.testing.assert_array_equal(s.numpy(), [3.0, -4.0, 0.5])
    np.testing.assert_array_equal(c.numpy(), [[-1.0, 3.0], [4.0, 2.0], [-4.0, 4.0]])
    np.testing.assert_array_equal(n.numpy(), [0.5, 1.5, 2.5])
    expected = 1 | 1 << 1 | 1 << 2 | 0 << 3 | 1 << 4 | 0 << 5 | 1 << 6 | 0 << 7 | 0 << 8 | 1 << 9
    assert int(flags) == expected


@pytest.mark.parametrize("sanitize", [False, True])
def test_a_kernel_prototype_gives_the_kernel_its_host_name(sanitize):
    # Indexing.metal: `[[host_name("f")]] kernel void f(device bool*, ...);` after f's
    # definition. A prototype is not a second kernel; the name it gives is the kernel's.
    lib = compile_shader(HEAD + """
[[host_name("early")]] kernel void e(device int*, constant int&, uint);
kernel void e(device int* y [[buffer(0)]], constant int& a [[buffer(1)]],
              uint i [[thread_position_in_grid]]) { y[i] = a + int(i); }
kernel void f(device int* y [[buffer(0)]], constant int& a [[buffer(1)]],
              uint i [[thread_position_in_grid]]) { y[i] = a * int(i); }
[[host_name("f_named")]]
kernel void f(device int*, constant int&, uint);""", sanitize=sanitize)
    assert sorted(lib.kernel_names) == ["early", "f_named"]
    y = torch.zeros(4, dtype=torch.int32)
    three = torch.tensor([3], dtype=torch.int32)
    lib.f_named(y, three, threads=4)
    np.testing.assert_array_equal(y.numpy(), [0, 3, 6, 9])
    lib.early(y, three, threads=4)
    np.testing.assert_array_equal(y.numpy(), [3, 4, 5, 6])


STATIC_CAST_VECTORS = HEAD + """
using namespace metal;
struct cmul {
  float2 operator()(float2 a, float2 b) { return float2(a.x * b.x - a.y * b.y, a.x * b.y + a.y * b.x); }
};
template <typename F, typename T>
kernel void k(device T* out [[buffer(0)]], constant T* a [[buffer(1)]],
              device int2* rounded [[buffer(2)]], uint i [[thread_position_in_grid]]) {
  F f;
  using res_t = T;
  out[i] = static_cast<res_t>(f(static_cast<float2>(a[i]), float2(2.0f, 0.5f)));
  rounded[i] = static_cast<int2>(static_cast<float2>(a[i]) * 1.5f);
}
template [[host_name("k_half2")]] kernel void k<cmul, half2>(device half2*, constant half2*, device int2*, uint);
template [[host_name("k_float2")]] kernel void k<cmul, float2>(device float2*, constant float2*, device int2*, uint);
"""


@pytest.mark.parametrize("sanitize", [False, True])
@pytest.mark.parametrize("name,dtype", [("k_half2", torch.float16), ("k_float2", torch.float32)])
def test_static_cast_between_vectors_converts_each_element(sanitize, name, dtype):
    # c10/metal/special_math.h `static_cast<float2>(inp)` of a half2, and indexing.h's
    # `static_cast<res_t>(f(a, b))` of a local alias: Metal converts element by element.
    lib = compile_shader(STATIC_CAST_VECTORS, sanitize=sanitize)
    a = torch.tensor([[1.0, 2.0], [0.5, -1.0], [-3.0, 0.25]], dtype=dtype)
    out = torch.zeros_like(a)
    rounded = torch.zeros(3, 2, dtype=torch.int32)
    getattr(lib, name)(out, a, rounded, threads=3)
    z = a.double().numpy() @ np.array([1, 1j]) * (2 + 0.5j)
    np.testing.assert_allclose(out.double().numpy(), np.stack([z.real, z.imag], 1), rtol=1e-3)
    np.testing.assert_array_equal(rounded.numpy(), np.trunc(a.float().numpy() * 1.5))


def test_static_cast_between_vectors_of_different_lengths_is_rejected():
    with pytest.raises(MetalCompileError, match="static_cast"):
        compile_shader(HEAD + """
kernel void k(device float* y [[buffer(0)]], uint i [[thread_position_in_grid]]) {
  float4 v = static_cast<float4>(float2(1.0f, 2.0f));
  y[i] = v.x;
}""")


FUNCTION_POINTER_PARAMETERS = HEAD + """
using namespace metal;
struct Ops {
  template <typename T> static T amax(T a, T b) { return a < b ? b : a; }
  static float plus(float a, float b) { return a + b; }
};
inline float twice_sum(float a, float b) { return 2 * (a + b); }
template <typename T>
inline void combine(device T* y, T v, T (*op)(T, T)) { *y = op(*y, v); }
template <typename T, T (*Op)(T, T)>
kernel void k(device T* y [[buffer(0)]], device const T* x [[buffer(1)]], uint i [[thread_position_in_grid]]) {
  combine(y + i, x[i], Op);  // c10/metal/atomic.h's atomic_binary_op(..., ReduceOp)
}
template [[host_name("k_amax")]] kernel void k<float, Ops::amax<float>>(device float*, device const float*, uint);
template [[host_name("k_free")]] kernel void k<float, twice_sum>(device float*, device const float*, uint);
#if __METAL_VERSION__ >= 310
template [[host_name("k_amax_bfloat")]] kernel void k<bfloat, Ops::amax<bfloat>>(device bfloat*, device const bfloat*, uint);
#endif
kernel void plain(device float* y [[buffer(0)]], uint i [[thread_position_in_grid]]) {
  combine(y + i, 1.5f, &Ops::plus);
}
"""


@pytest.mark.parametrize("sanitize", [False, True])
def test_a_function_pointer_template_argument_passed_on_to_a_function_pointer_parameter(sanitize):
    # Indexing.metal's index_reduce<T, IT, IndexReduceOp::amax<T>> passes its ReduceOp to
    # c10/metal/atomic.h's `T (*op)(T, T)`: what the function is, is known where it is called.
    lib = compile_shader(FUNCTION_POINTER_PARAMETERS, language_version="3.2", sanitize=sanitize)
    x = torch.tensor([3.0, -1.0, 2.0])
    y = torch.tensor([1.0, 0.0, 5.0])
    lib.k_amax(y, x, threads=3)
    np.testing.assert_array_equal(y.numpy(), [3.0, 0.0, 5.0])
    lib.k_free(y, x, threads=3)
    np.testing.assert_array_equal(y.numpy(), [12.0, -2.0, 14.0])
    lib.plain(y, threads=3)
    np.testing.assert_array_equal(y.numpy(), [13.5, -0.5, 15.5])
    y = torch.tensor([1.0, 0.0, 5.0], dtype=torch.bfloat16)
    lib.k_amax_bfloat(y, x.bfloat16(), threads=3)
    np.testing.assert_array_equal(y.float().numpy(), [3.0, 0.0, 5.0])


def test_a_static_member_function_of_another_type_for_a_function_pointer_parameter_is_rejected():
    with pytest.raises(MetalCompileError):
        compile_shader(FUNCTION_POINTER_PARAMETERS.replace("static float plus(float a, float b)",
                                                           "static int plus(int a, int b)"), language_version="3.2")


def test_a_function_pointer_parameter_still_needs_metal_3_1():
    with pytest.raises(MetalCompileError, match="function pointer"):
        compile_shader(FUNCTION_POINTER_PARAMETERS, language_version="3.0")
