"""The emulator accepts the Metal that Apple's compiler accepts, and rejects what it rejects.

Every source here goes through compile_shader, so through the front-end check (clang's
C++ for OpenCL front end with Metal's address spaces and library) and, when accepted, the
emulator's own build. Rejected sources must fail with MetalCompileError naming the line
and the construct; accepted ones must compile and compute what Metal computes.
"""
import numpy as np
import pytest
import torch

from torch_sparse_metal.emulator import (LANGUAGE_VERSIONS, LAUNCHER_LANGUAGE_VERSIONS, MetalCompileError,
                                      compile_shader)

PRELUDE = "#include <metal_stdlib>\nusing namespace metal;\n"


def compile_at(body: str, version: str = "4.0", **kwargs):
    return compile_shader(PRELUDE + body, language_version=version, **kwargs)


# (id, source, what the error must say, the line it must name (counted from the body's
# first line, 1-based), language versions that reject it)
ALL = tuple(LANGUAGE_VERSIONS)
REJECTED = [
    # ---- address spaces ----------------------------------------------------------------
    ("device_ptr_to_thread_param", """
void bump(thread int* p) { *p += 1; }
kernel void k(device int* x [[buffer(0)]]) {
  bump(x);
}""", "cannot convert a device pointer to the thread address space", 4, ALL),
    ("device_ptr_to_unqualified_param", """
int first(const int* p) { return p[0]; }
kernel void k(device const int* x [[buffer(0)]], device int* y [[buffer(1)]]) {
  y[0] = first(x);
}""", "cannot convert a device pointer to the thread address space", 4, ALL),
    ("device_lvalue_to_thread_ref", """
void twice(thread float& v) { v *= 2.0f; }
kernel void k(device float* x [[buffer(0)]]) {
  twice(x[0]);
}""", "cannot convert a device object to the thread address space", 4, ALL),
    ("device_lvalue_to_const_ref", """
float sq(const thread float& v) { return v * v; }
kernel void k(device float* x [[buffer(0)]]) {
  x[1] = sq(x[0]);
}""", "cannot convert a device object to the thread address space", 4, ALL),
    ("threadgroup_lvalue_to_device_ref", """
void set(device float& v) { v = 1.0f; }
kernel void k(device float* x [[buffer(0)]], uint i [[thread_index_in_threadgroup]]) {
  threadgroup float t[8];
  set(t[i]);
  x[i] = t[i];
}""", "no matching function for call to 'set'", 5, ALL),
    ("constant_to_device_ptr", """
kernel void k(constant float* c [[buffer(0)]], device float* y [[buffer(1)]]) {
  device float* alias = c;
  y[0] = alias[0];
}""", "constant float", 3, ALL),
    ("threadgroup_array_to_device_ptr", """
kernel void k(device float* y [[buffer(0)]]) {
  threadgroup float t[4];
  device float* p = t;
  y[0] = p[0];
}""", "threadgroup float", 4, ALL),
    ("write_through_constant", """
kernel void k(constant int* c [[buffer(0)]]) {
  c[0] = 3;
}""", "read-only variable is not assignable", 3, ALL),
    ("thread_address_to_device_param", """
void store(device float* p, float v) { *p = v; }
kernel void k(device float* y [[buffer(0)]]) {
  float local = 2.0f;
  store(&local, 1.0f);
  y[0] = local;
}""", "no matching function for call to 'store'", 5, ALL),
    ("library_out_param_on_device", """
kernel void k(device float* x [[buffer(0)]], device float* y [[buffer(1)]]) {
  y[0] = fract(x[0]);
  y[1] = sincos(x[0], y[2]);
}""", "cannot convert a device object to the thread address space", 4, ALL),
    ("method_on_device_object", """
struct Counter { int n; int next() const { return n + 1; } };
kernel void k(device Counter* c [[buffer(0)]], device int* y [[buffer(1)]]) {
  y[0] = c[0].next();
}""", "cannot convert a device object to the thread address space", 4, ALL),
    ("local_pointer_from_device", """
kernel void k(device float* x [[buffer(0)]]) {
  float* p = x + 1;
  *p = 0.0f;
}""", "device float * -> thread float *", 3, ALL),
    ("struct_member_pointer_from_device", """
struct View { float* data; };
kernel void k(device float* x [[buffer(0)]]) {
  View v;
  v.data = x;
  v.data[0] = 1.0f;
}""", "cannot convert a device pointer to the thread address space", 5, ALL),
    ("return_device_as_thread", """
float* pick(device float* x) { return x; }
kernel void k(device float* x [[buffer(0)]]) {
  pick(x)[0] = 1.0f;
}""", "cannot convert a device pointer to the thread address space", 2, ALL),
    ("template_thread_pointer_with_device_argument", """
template <typename T> T load_one(thread const T* p) { return *p; }
kernel void k(device const float* x [[buffer(0)]], device float* y [[buffer(1)]]) {
  y[0] = load_one(x);
}""", "cannot convert a device pointer to the thread address space", 4, ALL),
    ("conversion_inside_an_explicit_instantiation", """
inline void put(thread float* p, float v) { *p = v; }
template <typename T>
[[kernel]] void fill(device T* out [[buffer(0)]], uint i [[thread_position_in_grid]]) {
  put(out + i, 1.0f);
}
template [[host_name("fill_f")]] [[kernel]] decltype(fill<float>) fill<float>;""",
     "cannot convert a device pointer to the thread address space", 5, ALL),
    ("cast_to_thread_pointer", """
kernel void k(device float* x [[buffer(0)]]) {
  thread float* p = (thread float*)x;
  p[0] = 1.0f;
}""", "", 3, ALL),
    # ---- types and C++ Metal does not have ---------------------------------------------------
    ("double", """
kernel void k(device float* y [[buffer(0)]]) {
  double d = 1.0;
  y[0] = float(d);
}""", "Metal has no double", 3, ALL),
    ("long_long", """
kernel void k(device long* y [[buffer(0)]]) {
  long long v = 5;
  y[0] = long(v);
}""", "long long", 3, ALL),
    ("goto", """
kernel void k(device int* y [[buffer(0)]]) {
  int i = 0;
again:
  if (++i < 3) goto again;
  y[0] = i;
}""", "goto", 5, ALL),
    ("exceptions", """
kernel void k(device int* y [[buffer(0)]]) {
  if (y[0] < 0) throw 1;
}""", "Metal has no exceptions", 3, ALL),
    ("new_and_delete", """
kernel void k(device int* y [[buffer(0)]]) {
  int* p = new int(3);
  y[0] = *p;
}""", "new", 3, ALL),
    ("virtual_function", """
struct Shape { virtual float area() const { return 0.0f; } };
kernel void k(device float* y [[buffer(0)]]) { Shape s; y[0] = s.area(); }""",
     "Metal has no virtual functions", 2, ALL),
    ("function_pointer", """
float twice(float x) { return 2.0f * x; }
kernel void k(device float* y [[buffer(0)]]) {
  float (*f)(float) = y[0] > 0.0f ? twice : twice;
  y[0] = f(y[0]);
}""", "Metal has no function pointers", 4, ALL),
    ("variable_length_array", """
kernel void k(device float* y [[buffer(0)]], constant uint& n [[buffer(1)]]) {
  float scratch[n];
  scratch[0] = 1.0f;
  y[0] = scratch[0];
}""", "Metal has no variable-length arrays", 3, ALL),
    ("thread_local", """
kernel void k(device int* y [[buffer(0)]]) {
  thread_local int hits = 0;
  y[0] = ++hits;
}""", "thread_local", 3, ALL),
    ("program_scope_variable_not_constant", """
float scale = 2.0f;
kernel void k(device float* y [[buffer(0)]]) { y[0] *= scale; }""",
     "program-scope variable must be declared in the constant address space", 2, ALL),
    ("recursion", """
uint steps(uint n) { return n <= 1 ? 0 : 1 + steps(n % 2 ? 3 * n + 1 : n / 2); }
kernel void k(device uint* y [[buffer(0)]]) { y[0] = steps(y[0]); }""",
     "Metal does not support recursion", 2, ALL),
    ("lambda", """
kernel void k(device float* y [[buffer(0)]]) {
  auto twice = [](float v) { return 2.0f * v; };
  y[0] = twice(y[0]);
}""", "has no lambda expressions", 3, ("3.0", "3.1", "3.2")),
    ("std_namespace", """
kernel void k(device float* y [[buffer(0)]]) {
  y[0] = std::max(y[0], 1.0f);
}""", "undeclared identifier 'std'", 3, ALL),
    ("printf", """
kernel void k(device float* y [[buffer(0)]]) {
  printf("%f", y[0]);
}""", "undeclared identifier 'printf'", 3, ALL),
    ("erf_is_not_in_the_library", """
kernel void k(device float* y [[buffer(0)]]) { y[0] = erf(y[0]); }""",
     "undeclared identifier 'erf'", 2, ALL),
    ("unqualified_kernel_pointer_parameter", """
kernel void k(float* y [[buffer(0)]]) { y[0] = 1.0f; }""",
     "must be declared in the device, constant or threadgroup address space", 2, ALL),
    ("threadgroup_variable_in_a_helper", """
float helper(float v) {
  threadgroup float t[32];
  t[0] = v;
  return t[0];
}
kernel void k(device float* y [[buffer(0)]]) { y[0] = helper(y[0]); }""",
     "threadgroup variables may be declared only in a kernel function's scope", 3, ALL),
    ("mixed_int_and_float_arguments", """
kernel void k(device float* y [[buffer(0)]]) { y[0] = max(y[0], 0); }""",
     "call to 'max' is ambiguous", 2, ALL),
    ("implicit_float_to_bfloat", """
kernel void k(device bfloat* y [[buffer(0)]], device const float* x [[buffer(1)]]) {
  y[0] = x[0] * 2.0f;
}""", "no implicit conversion from float to bfloat", 3, ("3.1", "3.2", "4.0")),
    ("bfloat_before_msl_3_1", """
kernel void k(device bfloat* y [[buffer(0)]]) { y[0] = bfloat(1.0f); }""",
     "unknown type name 'bfloat'", 2, ("3.0",)),
    # ---- barriers, atomics, SIMD-group and simdgroup_matrix functions --------------------------
    ("barrier_without_flags", """
kernel void k(device float* y [[buffer(0)]]) {
  threadgroup_barrier();
}""", "no matching function for call to 'threadgroup_barrier'", 3, ALL),
    ("atomic_float_min", """
kernel void k(device atomic_float* a [[buffer(0)]]) {
  atomic_fetch_min_explicit(a, 1.0f, memory_order_relaxed);
}""", "no matching function for call to 'atomic_fetch_min_explicit'", 3, ALL),
    ("atomic_float_bitwise_or", """
kernel void k(device atomic_float* a [[buffer(0)]]) {
  atomic_fetch_or_explicit(a, 1.0f, memory_order_relaxed);
}""", "no matching function for call to 'atomic_fetch_or_explicit'", 3, ALL),
    ("atomic_float_in_threadgroup_memory", """
kernel void k(device float* y [[buffer(0)]]) {
  threadgroup atomic_float total;
  atomic_fetch_add_explicit(&total, 1.0f, memory_order_relaxed);
}""", "no matching function for call to 'atomic_fetch_add_explicit'", 4, ALL),
    ("strong_compare_exchange", """
kernel void k(device atomic_uint* a [[buffer(0)]]) {
  uint expected = 0;
  atomic_compare_exchange_strong_explicit(a, &expected, 1u, memory_order_relaxed, memory_order_relaxed);
}""", "atomic_compare_exchange_strong_explicit", 4, ALL),
    ("atomic_long", """
kernel void k(device atomic_long* a [[buffer(0)]]) {
  atomic_fetch_add_explicit(a, 1l, memory_order_relaxed);
}""", "atomic_long", 2, ALL),
    ("ulong_atomic_that_returns_a_value", """
kernel void k(device atomic_ulong* a [[buffer(0)]], device ulong* y [[buffer(1)]]) {
  y[0] = atomic_fetch_max_explicit(a, 3ul, memory_order_relaxed);
}""", "no matching function for call to 'atomic_fetch_max_explicit'", 3, ALL),
    ("sequentially_consistent_atomic", """
kernel void k(device atomic_uint* a [[buffer(0)]]) {
  atomic_fetch_add_explicit(a, 1u, memory_order_seq_cst);
}""", "", 3, ALL),
    ("simd_shuffle_of_a_struct", """
struct Pair { float a, b; };
kernel void k(device Pair* p [[buffer(0)]], uint lane [[thread_index_in_simdgroup]]) {
  Pair mine = p[lane];
  p[lane] = simd_shuffle(mine, (lane + 1) % 32);
}""", "no matching function for call to 'simd_shuffle'", 5, ALL),
    ("vote_to_a_wider_integer", """
kernel void k(device ulong* y [[buffer(0)]], device const float* x [[buffer(1)]], uint lane [[thread_index_in_simdgroup]]) {
  y[lane] = ulong(quad_ballot(x[lane] > 0.0f));
}""", "quad_vote", 3, ALL),
    ("integer_simdgroup_matrix", """
kernel void k(device int* y [[buffer(0)]]) {
  simdgroup_matrix<int, 8, 8> m;
}""", "simdgroup_matrix element type must be float, half or", 3, ALL),
    ("simdgroup_load_from_thread_memory", """
kernel void k(device float* y [[buffer(0)]]) {
  float staged[64];
  simdgroup_float8x8 m;
  simdgroup_load(m, staged, 8);
  simdgroup_store(m, y, 8);
}""", "no matching function for call to 'simdgroup_load'", 5, ALL),
    ("vector_constructor_short_of_components", """
kernel void k(device uint4* y [[buffer(0)]], uint i [[thread_position_in_grid]]) {
  y[i] = uint4(i, uint2(0));
}""", "a vector constructor's arguments must give each of the vector's components", 3, ALL),
    ("vector_constructor_from_a_shorter_vector", """
kernel void k(device float4* y [[buffer(0)]]) {
  y[0] = float4(float2(1.0f));
}""", "a vector constructor's arguments must give each of the vector's components", 3, ALL),
]


@pytest.mark.parametrize("name, body, says, line, versions", REJECTED, ids=[r[0] for r in REJECTED])
def test_what_metal_rejects_is_a_compile_error_naming_the_line(name, body, says, line, versions):
    source_line = body.splitlines()[line - 1].strip()
    for version in LANGUAGE_VERSIONS:
        if version not in versions:
            continue
        with pytest.raises(MetalCompileError) as info:
            compile_at(body, version)
        message = str(info.value)
        assert says in message, message
        # PRELUDE is 2 lines, and the body starts with a newline.
        assert info.value.line == line + 2, message
        assert source_line in message


VERSIONED = [
    ("lambda", """
kernel void k(device float* y [[buffer(0)]]) {
  auto twice = [](float v) { return 2.0f * v; };
  y[0] = twice(y[0]);
}""", ("4.0",)),
    ("bfloat", """
kernel void k(device bfloat* y [[buffer(0)]]) { y[0] = bfloat(1.0f); }""", ("3.1", "3.2", "4.0")),
    ("sequentially_consistent_fence", """
kernel void k(device uint* y [[buffer(0)]]) {
  y[0] = 1;
  atomic_thread_fence(mem_flags::mem_device, memory_order_seq_cst, thread_scope_device);
}""", ("3.2", "4.0")),
]


@pytest.mark.parametrize("name, body, accepted_by", VERSIONED, ids=[v[0] for v in VERSIONED])
def test_what_a_language_version_allows(name, body, accepted_by):
    for version in LANGUAGE_VERSIONS:
        if version in accepted_by:
            compile_at(body, version)
        else:
            with pytest.raises(MetalCompileError):
                compile_at(body, version)


def test_metal_version_macro_follows_the_language_version():
    body = """
kernel void k(device uint* y [[buffer(0)]]) { y[0] = __METAL_VERSION__; }"""
    for version, number in LANGUAGE_VERSIONS.items():
        y = torch.zeros(1, dtype=torch.int32)
        compile_at(body, version).k(y, threads=1)
        assert int(y) == number


def test_unknown_language_version_is_a_clear_error():
    with pytest.raises(ValueError, match="language_version '2.4' .* 3.0, 3.1, 3.2, 4.0"):
        compile_at("kernel void k(device int* y [[buffer(0)]]) {}", "2.4")


def test_only_metal_headers_and_the_users_own_are_visible(tmp_path):
    with pytest.raises(MetalCompileError, match="algorithm"):
        compile_shader("#include <algorithm>\n" + PRELUDE + "kernel void k(device int* y [[buffer(0)]]) {}")
    (tmp_path / "mine.h").write_text("inline int seven() { return 7; }\n")
    lib = compile_shader('#include "mine.h"\n' + PRELUDE +
                         "kernel void k(device int* y [[buffer(0)]]) { y[0] = seven(); }",
                         include_dirs=[str(tmp_path)])
    y = torch.zeros(1, dtype=torch.int32)
    lib.k(y, threads=1)
    assert int(y) == 7


def test_host_compiler_macros_do_not_reach_shaders():
    body = """
kernel void k(device int* y [[buffer(0)]]) {
#if defined(__GNUC__) || defined(__x86_64__) || defined(__aarch64__) || defined(__linux__)
  y[0] = 1;
#else
  y[0] = 2;
#endif
#ifdef __METAL__
  y[1] = 3;
#endif
}"""
    y = torch.zeros(2, dtype=torch.int32)
    compile_at(body).k(y, threads=1)
    assert y.tolist() == [2, 3]


# ---- valid Metal that must compile and compute Metal's answer ------------------------------------

def test_overloads_on_address_space_call_the_overload_metal_chooses():
    body = """
inline float scaled(device const float* p) { return p[0]; }
inline float scaled(threadgroup const float* p) { return 10.0f * p[0]; }
inline float scaled(constant float* p) { return 100.0f * p[0]; }
inline float scaled(thread const float* p) { return 1000.0f * p[0]; }
struct Cell {
  float v;
  float get() const thread { return v; }
  float get() const device { return -v; }
  float get() const threadgroup { return 2.0f * v; }
};
kernel void k(device const float* a [[buffer(0)]], constant float* c [[buffer(1)]],
              device Cell* cells [[buffer(2)]], device float* out [[buffer(3)]],
              uint i [[thread_index_in_threadgroup]]) {
  threadgroup float t[4];
  threadgroup Cell tc[4];
  t[i] = a[i];
  tc[i] = cells[i];
  threadgroup_barrier(mem_flags::mem_threadgroup);
  float local = a[i];
  Cell mine = cells[i];
  out[i] = scaled(a + i) + scaled(t + i) + scaled(c + i) + scaled(&local);
  out[4 + i] = mine.get() + cells[i].get() + tc[i].get();
}"""
    a = torch.tensor([1.0, 2.0, 3.0, 4.0])
    c = torch.tensor([0.5, 0.25, 0.125, 0.0625])
    cells = torch.tensor([1.0, 2.0, 4.0, 8.0])
    for sanitize in (False, True):
        out = torch.zeros(8)
        compile_at(body, sanitize=sanitize).k(a, c, cells, out, threads=4, group_size=4)
        np.testing.assert_allclose(out[:4].numpy(), (a + 10 * a + 100 * c + 1000 * a).numpy())
        np.testing.assert_allclose(out[4:].numpy(), (cells - cells + 2 * cells).numpy())


def test_address_space_qualified_constructors_and_conversions_with_one_body():
    body = """
struct Fixed {
  int raw;
  Fixed(float v) thread : raw(int(v * 256.0f)) {}
  Fixed(float v) device : raw(int(v * 256.0f)) {}
  operator float() const thread { return float(raw) / 256.0f; }
  operator float() const device { return float(raw) / 256.0f; }
  operator float() const constant { return float(raw) / 256.0f; }
};
kernel void k(device Fixed* f [[buffer(0)]], constant Fixed& c [[buffer(1)]], device float* out [[buffer(2)]]) {
  Fixed local(1.5f);
  out[0] = local;
  out[1] = f[0];
  out[2] = c;
}"""
    f = torch.tensor([512], dtype=torch.int32)
    c = torch.tensor([64], dtype=torch.int32)
    out = torch.zeros(3)
    compile_at(body).k(f, c, out, threads=1)
    assert out.tolist() == [1.5, 2.0, 0.25]


def test_different_bodies_the_emulator_cannot_name_apart_are_reported():
    body = """
struct Odd {
  float v;
  operator float() const thread { return v; }
  operator float() const device { return -v; }
};
kernel void k(device Odd* o [[buffer(0)]], device float* out [[buffer(1)]]) { out[0] = o[0]; }"""
    with pytest.raises(MetalCompileError, match="operator float is overloaded on address space with different bodies"):
        compile_at(body)


def test_struct_copies_between_address_spaces_are_valid():
    body = """
struct Pair { float a; int b; };
kernel void k(device Pair* p [[buffer(0)]], constant Pair& c [[buffer(1)]], uint i [[thread_index_in_threadgroup]]) {
  threadgroup Pair t[2];
  Pair local = c;
  t[i] = local;
  threadgroup_barrier(mem_flags::mem_threadgroup);
  p[i] = t[1 - i];
  p[i].a += float(c.b);
}"""
    p = torch.zeros(4)
    c = torch.tensor([1.5, 0.0])
    c.view(torch.int32)[1] = 3
    compile_at(body).k(p, c, threads=2, group_size=2)
    assert p.view(-1, 2)[:, 0].tolist() == [4.5, 4.5]
    assert p.view(torch.int32).view(-1, 2)[:, 1].tolist() == [3, 3]


def test_vector_brace_initialisation_zero_fills_and_constructors_broadcast():
    body = """
kernel void k(device float4* out [[buffer(0)]]) {
  float4 listed = {7.0f};
  float4 braced{1.0f, 2.0f};
  out[0] = listed;
  out[1] = braced;
  out[2] = float4(3.0f);
  out[3] = float4(float2(1.0f, 2.0f), 3.0f, 4.0f);
}"""
    out = torch.zeros(4, 4)
    compile_at(body).k(out, threads=1)
    assert out.tolist() == [[7, 0, 0, 0], [1, 2, 0, 0], [3, 3, 3, 3], [1, 2, 3, 4]]


def test_bfloat_math_takes_the_float_overload():
    body = """
kernel void k(device const bfloat* x [[buffer(0)]], device float* f [[buffer(1)]], device bfloat* b [[buffer(2)]]) {
  f[0] = sqrt(x[0]);
  b[0] = bfloat(exp(x[1]));
}"""
    x = torch.tensor([2.0, 1.0], dtype=torch.bfloat16)
    f, b = torch.zeros(1), torch.zeros(1, dtype=torch.bfloat16)
    compile_at(body, "3.1").k(x, f, b, threads=1)
    assert f.item() == pytest.approx(2.0 ** 0.5, rel=1e-6)
    assert b.item() == torch.tensor(np.e, dtype=torch.bfloat16).item()


# ---- integer division: one answer on every architecture -------------------------------------

DIVISION = """
template <typename T>
[[kernel]] void divide(device const T* x [[buffer(0)]], device const T* y [[buffer(1)]],
                       device T* q [[buffer(2)]], device T* r [[buffer(3)]],
                       uint i [[thread_position_in_grid]]) {
  q[i] = x[i] / y[i];
  T rest = x[i];
  rest %= y[i];
  r[i] = rest;
}
template [[host_name("divide_int")]] [[kernel]] decltype(divide<int>) divide<int>;
template [[host_name("divide_uint")]] [[kernel]] decltype(divide<uint>) divide<uint>;
kernel void divide_int4(device const int4* x [[buffer(0)]], device const int4* y [[buffer(1)]],
                        device int4* q [[buffer(2)]], device int4* r [[buffer(3)]],
                        uint i [[thread_position_in_grid]]) {
  q[i] = x[i] / y[i];
  r[i] = x[i] % y[i];
}
kernel void constant_folded(device uint* y [[buffer(0)]]) {
  constexpr uint rows = 96 / 32;
  float scratch[rows * 7 % 5];
  scratch[0] = 1.0f;
  y[0] = rows + uint(scratch[0]);
}
"""
INT_MIN = -2**31
X = [7, -7, 7, -7, 7, INT_MIN, INT_MIN, 0]
Y = [2, 2, -2, -2, 0, -1, 1, 0]


def test_integer_division_is_the_same_on_every_architecture():
    """x / 0 = 0, x % 0 = x, INT_MIN / -1 = INT_MIN, INT_MIN % -1 = 0 (AArch64's answers),
    through scalars, templates, compound assignment and vectors."""
    lib = compile_at(DIVISION)
    x, y = torch.tensor(X, dtype=torch.int32), torch.tensor(Y, dtype=torch.int32)
    want_q = [3, -3, -3, 3, 0, INT_MIN, INT_MIN, 0]
    want_r = [1, -1, 1, -1, 7, 0, 0, 0]
    for kernel, threads in (("divide_int", 8), ("divide_int4", 2)):
        q, r = torch.zeros(8, dtype=torch.int32), torch.zeros(8, dtype=torch.int32)
        getattr(lib, kernel)(x, y, q, r, threads=threads)
        assert q.tolist() == want_q, kernel
        assert r.tolist() == want_r, kernel
    q, r = torch.zeros(8, dtype=torch.int32), torch.zeros(8, dtype=torch.int32)
    lib.divide_uint(x, y, q, r, threads=8)
    ux, uy = np.array(X, dtype=np.int64) % 2**32, np.array(Y, dtype=np.int64) % 2**32
    want = [(a // b, a % b) if b else (0, a) for a, b in zip(ux, uy)]
    assert (q.numpy().astype(np.int64) % 2**32).tolist() == [w[0] for w in want]
    assert (r.numpy().astype(np.int64) % 2**32).tolist() == [w[1] for w in want]
    out = torch.zeros(1, dtype=torch.int32)
    lib.constant_folded(out, threads=1)
    assert int(out) == 4


@pytest.mark.parametrize("kernel, threads, index, what", [
    ("divide_int", 8, 4, "integer division 7 / 0 by zero"),
    ("divide_int4", 2, 1, "integer division 7 / 0 by zero"),
])
def test_the_sanitizer_reports_integer_division_by_zero(kernel, threads, index, what):
    from torch_sparse_metal.emulator import KernelFault
    lib = compile_at(DIVISION, sanitize=True)
    x, y = torch.tensor(X, dtype=torch.int32), torch.tensor(Y, dtype=torch.int32)
    q, r = torch.zeros(8, dtype=torch.int32), torch.zeros(8, dtype=torch.int32)
    with pytest.raises(KernelFault) as info:
        getattr(lib, kernel)(x, y, q, r, threads=threads)
    assert info.value.kind == "integer_division"
    assert what in str(info.value) and f"thread ({index}, 0, 0)" in str(info.value)


def test_the_sanitizer_reports_int_min_divided_by_minus_one():
    from torch_sparse_metal.emulator import KernelFault
    lib = compile_at(DIVISION, sanitize=True)
    x = torch.tensor([INT_MIN], dtype=torch.int32)
    y = torch.tensor([-1], dtype=torch.int32)
    with pytest.raises(KernelFault, match="integer division -2147483648 / -1 overflows") as info:
        lib.divide_int(x, y, torch.zeros(1, dtype=torch.int32), torch.zeros(1, dtype=torch.int32), threads=1)
    assert info.value.kind == "integer_division"


# ---- the project's own kernels ----------------------------------------------------------------

def test_launcher_versions_are_known_versions():
    assert set(LAUNCHER_LANGUAGE_VERSIONS) <= set(LANGUAGE_VERSIONS)
