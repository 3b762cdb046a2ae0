"""Forms of public Metal code (ggml's dequantisers, MLX's steel tiles) that the check once
rejected or the emulator could not build, in this project's own kernels: each is accepted
and computes what NumPy does, and the rule each relaxation sits next to still holds."""
import warnings

import numpy as np
import pytest
import torch

from torch_sparse_metal.emulator import KernelFault, MetalCompileError, _compiler, _frontend, compile_shader

HEAD = "#include <metal_stdlib>\nusing namespace metal;\n"


def test_functions_as_template_arguments_select_the_dequantiser():
    # ggml: `template <void (*deq)(device const block *, short, thread float4 &)>`, with
    # a function template and a plain function as arguments, and a typedef'd kernel type.
    lib = compile_shader(HEAD + """
struct block { half scale; uchar q[4]; };
void deq_plain(device const block * b, short il, thread float4 & out) {
  out = float4(b->q[0], b->q[1], b->q[2], b->q[3]) * (float) b->scale + (float) il;
}
template <typename T4>
void deq_centred(device const block * b, short il, thread T4 & out) {
  out = (T4) ((float4(b->q[0], b->q[1], b->q[2], b->q[3]) - 8.0) * (float) b->scale);
}
template <void (*deq)(device const block *, short, thread float4 &)>
kernel void dequantise(device const block * blocks [[buffer(0)]], device float4 * out [[buffer(1)]],
                       uint i [[thread_position_in_grid]]) {
  float4 v;
  deq(blocks + i, 0, v);
  out[i] = v;
}
typedef decltype(dequantise<deq_plain>) dequantise_t;
template [[host_name("plain")]] kernel dequantise_t dequantise<deq_plain>;
template [[host_name("centred")]] kernel dequantise_t dequantise<deq_centred>;
""")
    rng = np.random.default_rng(1)
    n = 6
    raw = np.zeros((n, 6), np.uint8)  # half scale, then four bytes
    scales = rng.uniform(0.1, 2.0, n).astype(np.float16)
    raw[:, :2] = scales.view(np.uint8).reshape(n, 2)
    raw[:, 2:] = rng.integers(0, 16, (n, 4))
    blocks = torch.from_numpy(raw.reshape(-1).copy())
    for name, expected in (("plain", raw[:, 2:] * scales[:, None].astype(np.float32)),
                           ("centred", (raw[:, 2:] - 8.0) * scales[:, None].astype(np.float32))):
        out = torch.zeros(n, 4)
        getattr(lib, name)(blocks, out, threads=n)
        np.testing.assert_allclose(out.numpy(), expected, rtol=1e-6)


FUNCTIONS = HEAD + """float twice(float x) { return 2.0f * x; }
float thrice(float x) { return 3.0f * x; }
template <typename F> void swap_in(thread F& f) { f = thrice; }
kernel void k(device float* y [[buffer(0)]]) {
  """
ONE_FUNCTION = ["float (*f)(float) = twice;\n  y[0] = f(y[0]);", "auto f = &twice;\n  y[0] = f(y[0]);"]


@pytest.mark.parametrize("body", ONE_FUNCTION)
def test_a_local_naming_a_function_is_no_function_pointer_in_msl_4_only(body):
    # MLX's nax GEMMs (MSL 4.0): `auto do_gemm = gemm_loop<...>; Ctile = do_gemm(...)`.
    with pytest.raises(MetalCompileError, match=r"Metal has no function pointers \(`f`\)"):
        compile_shader(FUNCTIONS + body + "\n}", language_version="3.2")
    y = torch.tensor([1.5])
    compile_shader(FUNCTIONS + body + "\n}", language_version="4.0").k(y, threads=1)
    assert y.item() == 3.0


@pytest.mark.parametrize("version", ["3.2", "4.0"])
@pytest.mark.parametrize("body", [
    "}\nfloat apply(float (*f)(float), float x) { f = thrice; return f(x);",  # a parameter assigned
    "float (*f)(float) = twice;\n  f = thrice;\n  y[0] = f(y[0]);",  # assigned
    "float (*f)(float) = y[0] > 0 ? twice : thrice;\n  y[0] = f(y[0]);",  # chosen at run time
    "auto f = twice;\n  auto g = &f;\n  y[0] = (*g)(y[0]);",  # its address taken
    "auto f = twice;\n  auto& g = f;\n  g = thrice;\n  y[0] = f(y[0]);",  # a reference bound to it
    "auto f = twice;\n  swap_in(f);\n  y[0] = f(y[0]);",  # an argument for a reference parameter
])
def test_function_pointers_outside_template_arguments_are_rejected(body, version):
    with pytest.raises(MetalCompileError, match=r"Metal has no function pointers \(`f`\)"):
        compile_shader(FUNCTIONS + body + "\n}", language_version=version)


def test_vector_and_matrix_casts_convert_and_literals_are_float():
    # ggml: `(float4) h4`, `(half4x4) m`, `s2_t(h2)` with s2_t a template parameter,
    # `0.5*x` of a float4 in a template, a float scalar times a half vector.
    lib = compile_shader(HEAD + """
template <typename T4, typename F2>
kernel void casts(device const half4 * h [[buffer(0)]], device float4 * out [[buffer(1)]],
                uint i [[thread_position_in_grid]]) {
  T4 x = (T4) h[i];
  float4x4 m(x, 2.0 * x, x + 1, x - 1);
  half4x4 mh = (half4x4) m;
  F2 pair = F2(h[i].xy);
  float slope = 0.5f;
  half4 scaled = slope * h[i];
  out[4 * i + 0] = 0.5*x;
  out[4 * i + 1] = float4(mh[1]);
  out[4 * i + 2] = float4(pair, (float2) scaled.zw);
  out[4 * i + 3] = float4(i % 4 == 0 ? 1.0 : 1e1 * i);
}
typedef decltype(casts<float4, float2>) casts_t;
template [[host_name("casts")]] kernel casts_t casts<float4, float2>;
""")
    h = np.array([[1, 2, 3, 4], [-0.5, 0.25, 8, -16], [3.5, 0, 1, 2]], np.float16)
    out = torch.zeros(12, 4)
    lib.casts(torch.from_numpy(h.view(np.int16).copy()), out, threads=3)
    x = h.astype(np.float32)
    got = out.numpy().reshape(3, 4, 4)
    np.testing.assert_array_equal(got[:, 0], 0.5 * x)
    np.testing.assert_array_equal(got[:, 1], (2 * x).astype(np.float16).astype(np.float32))
    np.testing.assert_array_equal(got[:, 2, :2], x[:, :2])
    np.testing.assert_array_equal(got[:, 2, 2:], (np.float16(0.5) * h[:, 2:]).astype(np.float32))
    np.testing.assert_array_equal(got[:, 3], np.array([1, 10, 20])[:, None] * np.ones(4))


def test_a_vector_of_another_length_is_still_no_cast():
    with pytest.raises(MetalCompileError, match="different size"):
        compile_shader(HEAD + """
kernel void k(device const half4* h [[buffer(0)]], device float3* y [[buffer(1)]]) {
  y[0] = (float3) h[0];
}""")


def test_thread_member_functions_return_references_to_members():
    # MLX's steel tiles: `thread T& frag_at(short i) thread { return frags[i]; }`, a const
    # overload, `c ? threadgroup value : constant value` of one class, and an array bound
    # that divides in a typedef'd anonymous struct.
    lib = compile_shader(HEAD + """
struct pair_t {
  float a, b;
  constexpr pair_t(float a, float b) thread : a(a), b(b) {}
  constexpr pair_t() threadgroup : a(0), b(0) {}
  template <typename U> constexpr pair_t(U x) thread : a(x), b(0) {}
  template <typename U> constexpr pair_t(U x) threadgroup : a(x), b(0) {}
  template <typename U> constexpr pair_t(U x) constant : a(x), b(0) {}
};
constant pair_t fallback = pair_t(7.0f, 8.0f);
typedef struct { float v[16 / 8 / 2]; } one_t;
template <short N>
struct tile {
  float4 frags[N];
  thread float4& frag_at(short i) thread { return frags[i]; }
  const thread float4& frag_at(short i) const thread { return frags[i]; }
};
kernel void k(device float4* y [[buffer(0)]], uint i [[thread_index_in_threadgroup]]) {
  threadgroup pair_t shared[2];
  tile<2> t;
  t.frag_at(0) = float4(1.0f);
  t.frag_at(1) = t.frag_at(0) * 3.0f;
  t.frag_at(1)[2] = sizeof(one_t);
  shared[i] = pair_t(float(i), 0.0f);
  threadgroup_barrier(mem_flags::mem_threadgroup);
  pair_t p = i == 0 ? shared[i] : fallback;
  y[i] = t.frag_at(1) + p.a;
}""")
    y = torch.zeros(2, 4)
    lib.k(y, threads=2, group_size=2)
    np.testing.assert_array_equal(y.numpy(), [[3, 3, 4, 3], [10, 10, 11, 10]])


def test_a_device_pointer_still_does_not_become_a_thread_pointer_in_a_member_function():
    with pytest.raises(MetalCompileError, match="cannot convert a device pointer to the thread address space"):
        compile_shader(HEAD + """
struct acc { float s; void add(thread const float* p) thread { s += *p; } };
kernel void k(device float* y [[buffer(0)]]) { acc a{0.0f}; a.add(y); y[0] = a.s; }""")


def test_a_macro_in_a_loop_count_pragma_is_a_hint_the_check_does_not_need():
    lib = compile_shader(HEAD + """
#define MIN(x, y) ((x) < (y) ? (x) : (y))
kernel void k(device float* y [[buffer(0)]]) {
  float s = 0.0f;
  #pragma unroll (MIN(4, 8))
  for (int j = 0; j < 8; ++j) s += j;
  y[0] = s;
}""")
    y = torch.zeros(1)
    lib.k(y, threads=1)
    assert y.item() == 28


def test_explicit_specialisations_of_a_function_template_are_called_by_template_argument():
    # ggml's `template <uint32_t t> bool tri(int, int);` and its `template <> bool tri<3>(...)`.
    lib = compile_shader(HEAD + """
template <uint32_t kind> bool keep(const int i, const int r);
template <> bool keep<3>(const int i, const int r) { return i < r; }
template <> bool keep<2>(const int i, const int r) { return i <= r; }
template <uint32_t kind>
kernel void tri(device float* y [[buffer(0)]], uint2 p [[thread_position_in_grid]]) {
  y[p.y * 3 + p.x] = keep<kind>(p.x, p.y) ? 1.0f : 0.0f;
}
typedef decltype(tri<3>) tri_t;
template [[host_name("lower")]] kernel tri_t tri<3>;
template [[host_name("lower_diag")]] kernel tri_t tri<2>;
""")
    for name, expected in (("lower", np.tril(np.ones((3, 3)), -1)), ("lower_diag", np.tril(np.ones((3, 3))))):
        y = torch.zeros(9)
        getattr(lib, name)(y, threads=(3, 3))
        np.testing.assert_array_equal(y.numpy().reshape(3, 3), expected)


# ---- third pass: what MLX's reduce, scan, sort, conv, fft, gemv and steel kernels and
# PyTorch's Eye.metal need of the check -----------------------------------------------------

def test_vector_constructors_are_constant_expressions_and_initialise_directly():
    # PyTorch's `constexpr float2 eye_one() { return float2(1.0, 0.0); }`; MLX's
    # `const int2 offsets(0, row);` (a vector initialised directly).
    lib = compile_shader(HEAD + """
constexpr float2 unit_x() { return float2(1.0, 0.0); }
constant constexpr float4 corners = float4(1, 2, 3, 4);
kernel void k(device float4* out [[buffer(0)]], uint i [[thread_position_in_grid]]) {
  constexpr float2 u = unit_x();
  const int2 offsets(3, i);
  float4 splat(0.5f);
  out[i] = float4(u, float2(offsets)) + corners + splat;
}""")
    out = torch.zeros(3, 4)
    lib.k(out, threads=3)
    expected = np.array([[1.0, 0.0, 3.0, i] for i in range(3)]) + [1, 2, 3, 4] + 0.5
    np.testing.assert_array_equal(out.numpy(), expected)


def test_a_vector_constructor_from_a_runtime_value_is_still_no_constant_expression():
    with pytest.raises(MetalCompileError, match="must be initialized by a constant expression"):
        compile_shader(HEAD + """
kernel void k(device float2* out [[buffer(0)]], uint i [[thread_position_in_grid]]) {
  constexpr float2 w(1.0f, float(i));
  out[i] = w;
}""")


CONSTANT_OBJECTS = HEAD + """
struct cplx {
  float re, im;
  constexpr cplx(float a, float b) thread : re(a), im(b) {}
  constexpr cplx() thread : re(0), im(0) {}
  constexpr cplx() threadgroup : re(0), im(0) {}
  template <typename U> constexpr cplx(U x) thread : re(x), im(0) {}
  template <typename U> constexpr cplx(U x) device : re(x), im(0) {}
  template <typename U> constexpr cplx(U x) constant : re(x), im(0) {}
  constexpr cplx(float2 v) constant : re(v.x), im(v.y) {}
  constexpr operator float2() const constant { return float2(re, im); }
};
template <typename T> struct Limit { static constexpr constant T big = T(1e30f); };
template <> struct Limit<cplx> {
  static constexpr constant cplx big = cplx(numeric_limits<float>::infinity(), -1.0f);
};
template <typename T> struct Smallest { static constexpr constant T init = Limit<T>::big; };
constant constexpr cplx origin(0.5f, 0.25f);
"""


def test_thread_constructors_and_copies_initialise_constant_objects():
    # MLX's complex_t: `static constexpr constant T init = Limits<T>::max;` and the
    # `Limits<complex_t<T>>` specialisation that builds it with a `thread` constructor.
    lib = compile_shader(CONSTANT_OBJECTS + """
kernel void k(device float2* out [[buffer(0)]], device cplx* z [[buffer(1)]],
              device const uint* n [[buffer(2)]], uint i [[thread_position_in_grid]]) {
  cplx c = Smallest<cplx>::init;
  out[i] = float2(min(c.re, float(i)), c.im) + float2(origin.re, origin.im);
  z[i] = Smallest<cplx>::init;
  if (i == 2) {
    z[i] = n[i];
  }
}""")
    out, z = torch.zeros(3, 2), torch.zeros(3, 2)
    lib.k(out, z, torch.tensor([0, 0, 7], dtype=torch.int32), threads=3)
    np.testing.assert_array_equal(out.numpy(), [[0.5, -0.75], [1.5, -0.75], [2.5, -0.75]])
    np.testing.assert_array_equal(z.numpy(), [[np.inf, -1.0], [np.inf, -1.0], [7.0, 0.0]])


def test_a_constant_object_still_needs_a_constructor_for_its_arguments():
    with pytest.raises(MetalCompileError, match="no matching constructor"):
        compile_shader(CONSTANT_OBJECTS + """
constant constexpr cplx too_many(1.0f, 2.0f, 3.0f);
kernel void k(device float* out [[buffer(0)]]) { out[0] = too_many.re; }""")


def test_constexpr_members_redeclared_outside_and_function_constants_through_a_macro():
    # MLX's conv: `constant constexpr const float W<6, 3, 8>::wt_transform[8][8];` of an
    # explicit specialisation; fft: `STEEL_CONST bool inv_ [[function_constant(0)]];` with
    # STEEL_CONST `static constant constexpr const`.
    source = HEAD + """
#define TILE_CONST static constant constexpr const
TILE_CONST bool flip_ [[function_constant(0)]];
TILE_CONST int reps_ [[function_constant(1)]];
template <int M> struct Taps {};
template <> struct Taps<2> { static constexpr constant float w[2][2] = {{1, 2}, {3, 4}}; };
constant constexpr const float Taps<2>::w[2][2];
kernel void k(device float* out [[buffer(0)]], uint i [[thread_position_in_grid]]) {
  out[i] = Taps<2>::w[i / 2][i % 2] * (flip_ ? -1.0f : 1.0f) * reps_;
}"""
    lib = compile_shader(source, function_constants={"flip_": True, "reps_": 3})
    out = torch.zeros(4)
    lib.k(out, threads=4)
    np.testing.assert_array_equal(out.numpy(), [-3, -6, -9, -12])
    constants = {"flip_": True, "reps_": 3}
    with pytest.raises(MetalCompileError, match="must be initialized"):
        compile_shader(source.replace("kernel void", "constant float lonely;\nkernel void"),
                       function_constants=constants)
    # A member of an implicit instantiation is redeclared only after `template <>`.
    implicit = source.replace("template <int M> struct Taps {};\ntemplate <> struct Taps<2> {",
                              "template <int M> struct Taps {")
    with pytest.raises(MetalCompileError, match="requires 'template<>'"):
        compile_shader(implicit, function_constants=constants)


def check_only(tmp_path, source: str, version: str = "4.0") -> None:
    """The front-end check of ``source``, without the emulator's build."""
    path = tmp_path / "shader.metal"
    path.write_text(source)
    views = _compiler._views(path, [], path.name, version)
    _frontend.check(views.metal, language_version=version, origin=path.name, main_file=str(path))


def test_a_threadgroup_array_sized_by_a_comparison_over_two_lines(tmp_path):
    # MLX's gemv: `threadgroup T tgp_memory\n [k::tgp_mem_size == 0 ? 1 : k::tgp_mem_size];`
    # (the `==` is no initialiser), and the array passed as `size == 0 ? nullptr : tgp_memory`.
    source = HEAD + """
template <int N> struct Shape { static constant constexpr const int size = N; };
void fill(threadgroup float* t, uint i) { if (t) t[i] = float(i); }
template <int N>
kernel void reverse(device float* out [[buffer(0)]], uint i [[thread_index_in_threadgroup]]) {
  using shape = Shape<N>;
  threadgroup float tile
      [shape::size == 0 ? 1 : shape::size];
  fill(shape::size == 0 ? nullptr : tile, i);
  threadgroup_barrier(mem_flags::mem_threadgroup);
  out[i] = tile[N - 1 - i];
}
template [[host_name("reverse8")]] kernel void reverse<8>(device float*, uint);
"""
    out = torch.zeros(8)
    compile_shader(source).reverse8(out, threads=8, group_size=8)
    np.testing.assert_array_equal(out.numpy(), np.arange(8)[::-1])
    with pytest.raises(MetalCompileError, match="no variable-length arrays"):
        check_only(tmp_path, source.replace("[shape::size == 0 ?", "[i == 0 ?"))


STEEL_FORMS = HEAD + """
template <int v> struct Int { static constexpr constant int value = v; constexpr operator int() const thread { return v; } };
template <typename T, int N>
struct Tile {
  T vals[N];
  thread T& at(short i) thread { return vals[i]; }
};
template <typename T, int N>
void tile_add(thread Tile<T, N>& d, thread Tile<T, N>& a) {
  for (short i = 0; i < N; ++i) d.at(i) += a.at(i);
}
template <typename T>
void thread_swap(thread T& a, thread T& b) { T w = a; a = b; b = w; }
template <typename T, int N>
struct Block {
  Tile<T, N> acc;
  void accumulate(thread Tile<T, N>& x) thread { tile_add(acc, x); tile_add(x, acc); }
};
template <typename P, typename S>
void gather(thread float* dst, P src, S step) {
  for (short i = 0; i < 4; ++i) { dst[i] = src[0]; src += step; }
}
"""


def test_steel_forms_deduce_from_members_and_locals_alike():
    # MLX's steel: `tile_matmad(Ctile, Atile, ...)` with thread MMATile<T, M, N>& parameters
    # (a member through `this`, and locals), thread_swap of locals, `src += str_y` with
    # str_y an Int<1>.
    lib = compile_shader(STEEL_FORMS + """
kernel void k(device float* out [[buffer(0)]], device const float* in [[buffer(1)]]) {
  Block<float, 2> b;
  b.acc.at(0) = 1.0f; b.acc.at(1) = 2.0f;
  Tile<float, 2> x;
  x.at(0) = 10.0f; x.at(1) = 20.0f;
  b.accumulate(x);
  float p = x.at(0), q = x.at(1);
  thread_swap(p, q);
  float g[4];
  gather(g, in + 1, Int<2>{});
  out[0] = p; out[1] = q;
  for (int i = 0; i < 4; ++i) out[2 + i] = g[i];
}""")
    out = torch.zeros(6)
    lib.k(out, torch.arange(16, dtype=torch.float32), threads=1)
    np.testing.assert_array_equal(out.numpy(), [42, 21, 1, 3, 5, 7])


def test_simdgroup_matrix_products_and_function_pointer_aliases(tmp_path):
    # MLX's Winograd conv: `(G * g) * Gt` of simdgroup matrices passes the check (it runs:
    # test_simdgroup_matrix.py); fft: `using RadixFunc = void (*)(...)` as the type of a
    # template parameter, which also runs.
    scale = HEAD + """
template <typename T> using Scale = T (*)(T);
template <typename T> T twice(T x) { return 2 * x; }
template <typename T, Scale<T> f> T apply(T x) { return f(x); }
"""
    check_only(tmp_path, scale + """
kernel void k(device float* out [[buffer(0)]], uint lane [[thread_index_in_simdgroup]]) {
  simdgroup_float8x8 a = make_filled_simdgroup_matrix<float, 8, 8>(1.0f);
  simdgroup_float8x8 c = make_filled_simdgroup_matrix<float, 8, 8>(0.5f);
  simdgroup_float8x8 ac = (a * c) * a;
  out[lane] = ac.thread_elements()[0];
}""")
    out = torch.zeros(1)
    compile_shader(scale + """
kernel void k(device float* out [[buffer(0)]]) { out[0] = apply<float, twice<float>>(3.0f); }""").k(out, threads=1)
    assert out.item() == 6.0
    with pytest.raises(MetalCompileError, match=r"Metal has no function pointers \(`f`\)"):
        check_only(tmp_path, scale + """
kernel void k(device float* out [[buffer(0)]]) {
  Scale<float> f = twice<float>;
  out[0] = f(1.0f);
}""", version="3.2")


def test_a_device_object_is_still_no_thread_reference_to_a_class_template():
    with pytest.raises(MetalCompileError, match="cannot convert a device object to the thread address space"):
        compile_shader(STEEL_FORMS + """
kernel void k(device Tile<float, 2>* tiles [[buffer(0)]]) {
  Tile<float, 2> x;
  tile_add(tiles[0], x);
}""")


def test_bool_vectors_named_by_typedefs_and_deduction_through_vec():
    # MLX's steel attention: `typedef metal::vec<T, 2> frag_type;` in a tile instantiated
    # with T = bool (its masks), and `thread dtype_frag_t<Atype>& A` with
    # `template <typename U> using dtype_frag_t = metal::vec<U, 2>;`, which deduces Atype.
    lib = compile_shader(HEAD + """
template <typename T>
struct Frag {
  typedef metal::vec<T, 2> frag_type;
  template <typename U> using dtype_frag_t = metal::vec<U, 2>;
  template <typename U>
  static float dot(thread dtype_frag_t<U>& a, thread frag_type& b) { return float(a.x) * float(b.x) + float(a.y) * float(b.y); }
};
kernel void k(device float* out [[buffer(0)]], device const float* in [[buffer(1)]],
              uint i [[thread_position_in_grid]]) {
  Frag<bool>::frag_type keep;
  keep[0] = in[2 * i] > 0.5f;
  keep[1] = in[2 * i + 1] > 0.5f;
  Frag<float>::frag_type x = float2(in[2 * i], in[2 * i + 1]);
  metal::vec<bool, 2> both = keep;
  half2 w = half2(2.0h, 3.0h);
  out[i] = Frag<float>::dot(w, x) + (keep[0] ? 10.0f : 0.0f) + (both[1] ? 100.0f : 0.0f);
}""")
    values = torch.tensor([0.25, 1.0, 2.0, 0.0])
    out = torch.zeros(2)
    lib.k(out, values, threads=2)
    np.testing.assert_array_equal(out.numpy(), [0.5 + 3.0 + 100, 4.0 + 10])


def test_array_designators_initialise_as_in_c():
    # ggml: `float sumf[r1ptg] = { [ 0 ... r1ptg - 1 ] = 0.0f };` with a template parameter
    # for the size; C's single designators, elements that follow one, a division in an
    # index, a value evaluated once, and the elements nothing names left zero.
    lib = compile_shader(HEAD + """
template <int N>
kernel void designators(device float * out [[buffer(0)]], device atomic_int * calls [[buffer(1)]],
                        uint i [[thread_position_in_grid]]) {
  float filled[N] = { [ 0 ... N - 1 ] = 1.5f };
  float mixed[8] = { 7.0f, [2] = 2.0f, 3.0f, [N/2 + 2 ... 6] = -1.0f, [5] = float(i) };
  int once[N] = { [0 ... N-1] = atomic_fetch_add_explicit(calls, 1, memory_order_relaxed) + 1 };
  for (int j = 0; j < N; ++j) {
    out[i * (N + 8 + N) + j] = filled[j];
    out[i * (N + 8 + N) + N + 8 + j] = once[j] > 0 ? 1.0f : 0.0f;
  }
  for (int j = 0; j < 8; ++j) {
    out[i * (N + 8 + N) + N + j] = mixed[j];
  }
}
typedef decltype(designators<4>) designators_t;
template [[host_name("designators4")]] kernel designators_t designators<4>;
""")
    threads, n = 3, 4
    out = torch.zeros(threads * (2 * n + 8))
    calls = torch.zeros(1, dtype=torch.int32)
    lib.designators4(out, calls, threads=threads)
    rows = out.numpy().reshape(threads, -1)
    for i, row in enumerate(rows):
        np.testing.assert_array_equal(row[:n], np.full(n, 1.5, np.float32))
        np.testing.assert_array_equal(row[n:n + 8], [7, 0, 2, 3, -1, i, -1, 0])
        np.testing.assert_array_equal(row[n + 8:], np.ones(n))
    assert calls.item() == threads  # the range's value is evaluated once per thread, not per element


def test_designated_array_kept_across_a_barrier():
    # Barrier regions move such a declaration into a per-thread slot; the kernel runs as
    # fibers instead (no warning: nothing failed), with the array as initialised.
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a failed barrier-region build falls back with a warning
        lib = compile_shader(HEAD + """
kernel void across(device float * out [[buffer(0)]], uint i [[thread_position_in_grid]],
                   uint l [[thread_position_in_threadgroup]]) {
  threadgroup float shared[4];
  float own[3] = { [0 ... 2] = float(i) };
  shared[l] = own[1];
  threadgroup_barrier(mem_flags::mem_threadgroup);
  out[i] = shared[(l + 1) % 4] + own[2];
}
""")
    out = torch.zeros(8)
    lib.across(out, threads=8, group_size=4)
    i = np.arange(8)
    np.testing.assert_array_equal(out.numpy(), (i // 4) * 4 + (i + 1) % 4 + i)


def test_void_pointers_carry_their_buffer():
    # ggml: `device const void * src0` parameters, read through casts to `device const char *`
    # and then the element type; a typed pointer passed for a `device void *` parameter.
    lib = compile_shader(HEAD + """
struct args_t { int row_bytes; int rows; };
void store(device void * dst, int i, float v) { ((device float *) dst)[i] = v; }
kernel void scale_rows(constant args_t & args, device const void * src, device void * dst,
                       device float * last, uint i [[thread_position_in_grid]]) {
  device const float * row = (device const float *) ((device const char *) src + i * args.row_bytes);
  device const void * end = (device const char *) src + args.rows * args.row_bytes;
  store(dst, i, row[0] * 2.0f + (src == end ? 1.0f : 0.0f));
  store(last, i, row[args.row_bytes / 4 - 1]);
}
""")
    x = torch.arange(12, dtype=torch.float32)
    args = torch.tensor([16, 3], dtype=torch.int32)
    out, last = torch.zeros(3), torch.zeros(3)
    lib.scale_rows(args, x, out, last, threads=3)
    np.testing.assert_array_equal(out.numpy(), [0, 8, 16])
    np.testing.assert_array_equal(last.numpy(), [3, 7, 11])
    # The cast pointer keeps the buffer's bounds: a row past it is out of bounds.
    with pytest.raises(KernelFault, match="out_of_bounds"):
        lib.scale_rows(torch.tensor([20, 3], dtype=torch.int32), x, out, last, threads=3)


def test_threadgroup_array_sizes_with_divisions():
    # `threadgroup T tile[A / 32 * B];`: a division inside a threadgroup array's size (once
    # mangled by the emulator's edits), and sizeof of every declarator of a declaration, not
    # only the first.
    lib = compile_shader(HEAD + """
constant constexpr int A = 64;
constant constexpr int B = 3;
template <int W>
kernel void tiles(device float * out [[buffer(0)]], uint l [[thread_position_in_threadgroup]]) {
  threadgroup float tile[A / 32 * B];
  threadgroup float wide[W / 2 * B + A % 5], other[A / W];
  tile[l] = l;
  wide[l] = 2 * l;
  other[l % (A / W)] = 0;
  threadgroup_barrier(mem_flags::mem_threadgroup);
  out[l] = tile[5 - l] + wide[(l + 1) % 6] + sizeof(tile) / 4 * 100 + sizeof(wide) / 4 * 1000
           + sizeof(other) / 4 * 10000;
}
typedef decltype(tiles<8>) tiles_t;
template [[host_name("tiles8")]] kernel tiles_t tiles<8>;
""")
    out = torch.zeros(6)
    lib.tiles8(out, threads=6, group_size=6)
    l = np.arange(6)
    np.testing.assert_array_equal(out.numpy(), (5 - l) + 2 * ((l + 1) % 6) + 600 + 16000 + 80000)


def test_function_template_argument_with_unnamed_device_reference():
    # ggml's quantisers: `template <..., void (*quantize)(device const float *, device block_q &)>`,
    # the reference parameter unnamed in the function type and named in the function.
    lib = compile_shader(HEAD + """
struct block { float scale; char q[4]; };
void quantize(device const float * src, device block & dst) {
  float amax = 0.0f;
  for (int j = 0; j < 4; ++j) amax = max(amax, fabs(src[j]));
  dst.scale = amax / 127.0f;
  for (int j = 0; j < 4; ++j) dst.q[j] = char(rint(src[j] / (amax > 0.0f ? dst.scale : 1.0f)));
}
void round_down(device const float *, device block &);
template <typename block_q, void (*quantize_func)(device const float *, device block_q &)>
kernel void quantize_rows(device const float * src [[buffer(0)]], device block_q * dst [[buffer(1)]],
                          uint i [[thread_position_in_grid]]) {
  quantize_func(src + 4 * i, dst[i]);
}
typedef decltype(quantize_rows<block, quantize>) quantize_rows_t;
template [[host_name("quantize_rows")]] kernel quantize_rows_t quantize_rows<block, quantize>;
""")
    rng = np.random.default_rng(3)
    x = rng.normal(size=(5, 4)).astype(np.float32)
    raw = torch.zeros(5 * 8, dtype=torch.uint8)
    lib.quantize_rows(torch.from_numpy(x.reshape(-1)), raw, threads=5)
    blocks = raw.numpy().reshape(5, 8)
    scales = blocks[:, :4].copy().view(np.float32)[:, 0]
    amax = np.abs(x).max(axis=1)
    np.testing.assert_allclose(scales, amax / 127.0, rtol=1e-6)
    np.testing.assert_array_equal(blocks[:, 4:].view(np.int8), np.rint(x / scales[:, None]).astype(np.int8))


PROGRAM_CONSTANTS = HEAD + """
constexpr constant static float levels[8] = { -1.0f, -0.6f, -0.3f, -0.1f, 0.1f, 0.3f, 0.6f, 1.0f };
namespace tables { struct range_t { float lo, hi; }; constant range_t range = { -2.0f, 2.0f }; }
// ggml's best_index_int8: a search through a `constant float *` into a program-scope table.
static inline int nearest(int n, constant float * table, float x) {
  if (x <= table[0]) return 0;
  if (x >= table[n - 1]) return n - 1;
  int lo = 0, hi = n - 1;
  while (hi - lo > 1) { int mid = (lo + hi) / 2; if (x < table[mid]) hi = mid; else lo = mid; }
  return x - table[lo] < table[hi] - x ? lo : hi;
}
kernel void quantise(device const float * x [[buffer(0)]], device int * index [[buffer(1)]],
                     constant int & n [[buffer(2)]], uint i [[thread_position_in_grid]]) {
  constant tables::range_t * r = &tables::range;
  index[i] = nearest(n, levels, clamp(x[i], r->lo, r->hi));
}
"""


def test_program_scope_constant_tables_through_constant_pointers():
    lib = compile_shader(PROGRAM_CONSTANTS)
    levels = np.array([-1.0, -0.6, -0.3, -0.1, 0.1, 0.3, 0.6, 1.0], np.float32)
    x = np.random.default_rng(4).uniform(-1.5, 1.5, 64).astype(np.float32)
    index = torch.zeros(64, dtype=torch.int32)
    lib.quantise(torch.from_numpy(x), index, torch.tensor([8], dtype=torch.int32), threads=64)
    np.testing.assert_array_equal(index.numpy(), np.abs(x[:, None] - levels[None, :]).argmin(axis=1))
    # The table's bounds hold: a count past its end is reported, naming it.
    with pytest.raises(KernelFault, match=r"out_of_bounds: .* accesses constant `levels` at element 8"):
        lib.quantise(torch.from_numpy(x), index, torch.tensor([9], dtype=torch.int32), threads=64)


def test_instantiation_without_attributes_binds_as_the_template():
    # PyTorch's Repeat.metal: `template [[host_name("n")]] kernel void f<int32_t>(constant
    # int32_t*, constant int64_t*, device int32_t*, uint);` repeats the parameter list
    # without its attributes: the bindings are the template's.
    lib = compile_shader(HEAD + """
template <typename T>
kernel void spread(constant T * counts [[buffer(0)]], constant long * ends [[buffer(1)]],
                   device T * out [[buffer(2)]], uint tid [[thread_position_in_grid]]) {
  for (long j = ends[tid] - counts[tid]; j < ends[tid]; ++j) out[j] = T(tid);
}
template [[host_name("spread_int")]] kernel void spread<int>(constant int *, constant long *, device int *, uint);
""")
    counts = torch.tensor([2, 0, 3, 1], dtype=torch.int32)
    ends = torch.cumsum(counts, 0).to(torch.int64)
    out = torch.full((6,), -1, dtype=torch.int32)
    lib.spread_int(counts, ends, out, threads=4)
    assert out.tolist() == [0, 0, 2, 2, 2, 3]


def test_helper_with_a_simd_group_function_passed_as_a_template_argument():
    # ggml's mul_mv_id: `template <kernel_mul_mv2_disp_t disp_fn> void mmv_fn(...)` with a
    # helper that calls simd_sum as the argument, while kernels call that helper directly.
    lib = compile_shader(HEAD + """
typedef void (row_sum_t)(device const float * x, device float * out, ushort lane);
template <int N>
void row_sum(device const float * x, device float * out, ushort lane) {
  float s = simd_sum(x[lane] * N);
  if (lane == 0) out[0] = s;
}
template <row_sum_t f>
void through(device const float * x, device float * out, ushort lane) { f(x, out, lane); }
kernel void sums(device const float * x [[buffer(0)]], device float * out [[buffer(1)]],
                 ushort lane [[thread_index_in_simdgroup]]) {
  through<row_sum<2>>(x, out, lane);
  row_sum<3>(x, out + 1, lane);
}
""")
    x = torch.arange(32, dtype=torch.float32)
    out = torch.zeros(2)
    lib.sums(x, out, threads=32, group_size=32)
    assert out.tolist() == [2 * 496.0, 3 * 496.0]


def test_member_specialisation_and_array_parameters():
    # MLX: an explicit specialisation of a member template inside its class (binary_ops.h's
    # FloorDivide), and `constant const int64_t strides[2]` parameters (utils.h's elem_to_loc_2).
    lib = compile_shader(HEAD + """
struct Halve {
  template <typename T>
  T operator()(T x) thread { return x / 2; }
  template <>
  float operator()(float x) thread { return x * 0.25f; }
};
template <typename IdxT>
IdxT location(uint2 elem, constant const int64_t strides[2]) {
  return elem.x * IdxT(strides[1]) + elem.y * IdxT(strides[0]);
}
kernel void strided(device const float * x [[buffer(0)]], device float * out [[buffer(1)]],
                    device int * halves [[buffer(2)]], constant const int64_t strides[2] [[buffer(3)]],
                    uint2 index [[thread_position_in_grid]], uint2 grid [[threads_per_grid]]) {
  out[index.x + grid.x * index.y] = Halve()(x[location<int64_t>(index, strides)]);
  halves[index.x + grid.x * index.y] = Halve()(int(index.x + grid.x * index.y));
}
""")
    x = torch.arange(12, dtype=torch.float32).reshape(3, 4)
    out, halves = torch.zeros(4, 3), torch.zeros(12, dtype=torch.int32)
    lib.strided(x, out, halves, torch.tensor([1, 4], dtype=torch.int64), threads=(3, 4), group_size=(3, 4))
    np.testing.assert_array_equal(out.numpy(), x.numpy().T * 0.25)  # the float specialisation
    np.testing.assert_array_equal(halves.numpy(), np.arange(12) // 2)  # the template


def test_braced_list_assigned_to_a_vector():
    # ggml's iq4_nl mat-vec: `qf1 = {shmem_f32[q8[0]], ..., shmem_f32[q8[3]]};`, components
    # read through checked pointers; `q = {}` gives zeros.
    lib = compile_shader(HEAD + """
kernel void gather4(device const float * x [[buffer(0)]], device const uchar * idx [[buffer(1)]],
                    device float4 * out [[buffer(2)]], threadgroup float * table [[threadgroup(0)]],
                    uint i [[thread_position_in_grid]]) {
  table[i] = x[i];
  threadgroup_barrier(mem_flags::mem_threadgroup);
  float4 q = float4(-1.0f);
  q = {table[idx[4 * i]], table[idx[4 * i + 1]], table[idx[4 * i + 2]], float(i)};
  out[i] = q;
  if (i == 0) { q = {}; out[4] = q; }
}
""")
    x = torch.tensor([10.0, 20.0, 30.0, 40.0])
    idx = torch.tensor([3, 2, 1, 0, 0, 0, 1, 1, 2, 3, 0, 0, 1, 1, 1, 1], dtype=torch.uint8)
    out = torch.full((5, 4), 7.0)
    lib.gather4(x, idx, out, threads=4, group_size=4, threadgroup_memory=[16])
    expected = x.numpy()[idx.numpy().reshape(4, 4)[:, :3]]
    np.testing.assert_array_equal(out.numpy()[:4, :3], expected)
    np.testing.assert_array_equal(out.numpy()[:4, 3], [0, 1, 2, 3])
    np.testing.assert_array_equal(out.numpy()[4], [0, 0, 0, 0])


# ---- fourth pass: what the emulator lacked to build MLX's gemv, quantized, conv and steel files


def test_pointer_traits_specialised_per_address_space_and_qualified_members():
    # MLX's steel type_traits: `pointer_element<device T*>`, `<threadgroup T*>`, ... (one
    # checked pointer type in the emulator); `void mma(...) thread {` calling a helper that
    # reaches a SIMD-group function; `constant int&` helper parameters given a kernel's
    # `const constant int&`; `const device auto* p = ...`; a `constant` reference to a class
    # template's specialisation followed by its attribute (`Params<2>& p [[buffer(2)]]`).
    lib = compile_shader(HEAD + """
template <typename T> struct pointer_element {};
template <typename T> struct pointer_element<thread T*> { using type = remove_cv_t<T>; };
template <typename T> struct pointer_element<device T*> { using type = remove_cv_t<T>; };
template <typename T> struct pointer_element<constant T*> { using type = remove_cv_t<T>; };
template <typename T> struct pointer_element<threadgroup T*> { using type = remove_cv_t<T>; };
template <typename P> using element_t = typename pointer_element<remove_cv_t<P>>::type;
template <int N> struct Params { int stride[N]; };
template <typename T> T lane_sum(T x) { return simd_sum(x); }
struct Summer {
  float total;
  void add(float x) thread { total += lane_sum(x); }
};
float scaled(float x, constant int& factor) { return x * factor; }
kernel void k(device const float* in [[buffer(0)]], device float* out [[buffer(1)]],
              const constant Params<2>& params [[buffer(2)]], const constant int& factor [[buffer(3)]],
              uint lane [[thread_index_in_simdgroup]]) {
  const device auto* row = in + params.stride[1];
  element_t<device const float*> x = row[lane];
  Summer s{0.0f};
  s.add(x);
  out[lane] = scaled(s.total, factor);
}""")
    data = torch.arange(64, dtype=torch.float32)
    params = torch.tensor([0, 32], dtype=torch.int32)
    out = torch.zeros(32)
    lib.k(data, out, params, torch.tensor([2], dtype=torch.int32), threads=32, group_size=32)
    np.testing.assert_array_equal(out.numpy(), np.full(32, 2.0 * np.arange(32, 64).sum()))


def test_address_space_specialisations_with_different_bodies_are_refused():
    with pytest.raises(MetalCompileError, match="with different bodies"):
        compile_shader(HEAD + """
template <typename T> struct size_of {};
template <typename T> struct size_of<device T*> { static constant constexpr int value = 1; };
template <typename T> struct size_of<threadgroup T*> { static constant constexpr int value = 2; };
kernel void k(device float* out [[buffer(0)]]) { out[0] = size_of<device float*>::value; }""")


def test_instantiations_that_name_no_template_arguments_select_by_parameters():
    # MLX's conv: `template [[host_name("...")]] [[kernel]] void naive_unfold_Nd(const device
    # float* in [[buffer(0)]], const constant Params<1>* p [[buffer(2)]], ...);`, T and N
    # deduced from the parameter list.
    lib = compile_shader(HEAD + """
template <int N> struct Params { int scale[N]; };
template <typename T, int N>
[[kernel]] void scale(const device T* in [[buffer(0)]], device T* out [[buffer(1)]],
                      const constant Params<N>* p [[buffer(2)]], uint i [[thread_position_in_grid]]) {
  out[i] = in[i] * T(p->scale[N - 1]);
}
template [[host_name("scale_f1")]] [[kernel]] void scale(const device float* in [[buffer(0)]],
    device float* out [[buffer(1)]], const constant Params<1>* p [[buffer(2)]], uint i [[thread_position_in_grid]]);
template [[host_name("scale_i2")]] [[kernel]] void scale(const device int* in [[buffer(0)]],
    device int* out [[buffer(1)]], const constant Params<2>* p [[buffer(2)]], uint i [[thread_position_in_grid]]);
""")
    out = torch.zeros(4)
    lib.scale_f1(torch.arange(4, dtype=torch.float32), out, torch.tensor([3], dtype=torch.int32), threads=4)
    np.testing.assert_array_equal(out.numpy(), [0, 3, 6, 9])
    out = torch.zeros(4, dtype=torch.int32)
    lib.scale_i2(torch.arange(4, dtype=torch.int32), out, torch.tensor([3, 5], dtype=torch.int32), threads=4)
    np.testing.assert_array_equal(out.numpy(), [0, 5, 10, 15])


def test_bfloat_from_a_class_that_converts_to_bool():
    # MLX's gemv_masked: `out_scale = T(mask_out);` with T = bfloat and a mask type whose
    # only conversion is `operator bool()`.
    lib = compile_shader(HEAD + """
struct Mask {
  char on;
  constexpr operator bool() thread { return on != 0; }
};
kernel void k(device const char* on [[buffer(0)]], device float* out [[buffer(1)]],
              uint i [[thread_position_in_grid]]) {
  Mask m{on[i]};
  out[i] = float(bfloat(m)) * 3.0f + float(half(m));
}""")
    out = torch.zeros(3)
    lib.k(torch.tensor([1, 0, 7], dtype=torch.int8), out, threads=3)
    np.testing.assert_array_equal(out.numpy(), [4, 0, 4])


def test_a_class_that_converts_to_bool_converts_to_bfloat_implicitly():
    # MLX's steel_gemm_masked: `op.scale = mask[i];` with a bfloat `scale` and a mask type
    # whose only conversions are `operator bool()` (one per address space); the same
    # conversion initialises, passes and returns a bfloat. A class that converts to float
    # still picks `f(float)` over `f(bfloat)`, as in Metal.
    lib = compile_shader(HEAD + """
struct Mask {
  char on;
  constexpr operator bool() thread { return on != 0; }
  constexpr operator bool() const device { return on != 0; }
};
struct Scale { float s; constexpr operator float() thread { return s; } };
template <typename T> struct ScaleOp { T scale; };
bfloat passed(bfloat b) { return b; }
bfloat returned(Mask m) { return m; }
float picked(float x) { return 1.0f + x; }
float picked(bfloat x) { return 100.0f + float(x); }
kernel void k(device const Mask* masks [[buffer(0)]], device float* out [[buffer(1)]],
              uint i [[thread_position_in_grid]]) {
  ScaleOp<bfloat> op;
  op.scale = masks[i];
  Mask m = masks[i];
  bfloat initialised = m;
  Scale s{2.5f};
  out[4 * i] = float(op.scale) + 2.0f * float(initialised);
  out[4 * i + 1] = float(passed(m)) + 2.0f * float(returned(m));
  out[4 * i + 2] = picked(s);
  out[4 * i + 3] = float(bfloat(s));
}""")
    out = torch.zeros(3, 4)
    lib.k(torch.tensor([1, 0, 7], dtype=torch.int8), out, threads=3)
    np.testing.assert_array_equal(out.numpy(), [[3, 3, 3.5, 2.5], [0, 0, 3.5, 2.5], [3, 3, 3.5, 2.5]])


def test_a_class_that_converts_to_bool_is_no_float_for_bfloat_overloads(tmp_path):
    # Metal: `f(mask)` of an `f(float)` and an `f(bfloat)` is ambiguous (both convert the
    # bool), which the check says.
    with pytest.raises(MetalCompileError, match="ambiguous"):
        check_only(tmp_path, HEAD + """
struct Mask { char on; constexpr operator bool() thread { return on != 0; } };
float picked(float x) { return x; }
float picked(bfloat x) { return float(x); }
kernel void k(device float* out [[buffer(0)]]) {
  Mask m{1};
  out[0] = picked(m);
}""")


def test_a_simd_group_function_reached_through_a_dependent_type_runs_as_fibers():
    # MLX's gemv and sort: the kernel calls `gemv_kernel::run(...)` with `gemv_kernel` an
    # alias of a class template's specialisation (sort's member is named like its kernel,
    # `sort_kernel::block_sort`); the members reduce with simd_sum, or across a barrier.
    lib = compile_shader(HEAD + """
template <typename T> struct Reduce {
  static void run(device T* out, uint lane) { out[lane] = simd_sum(out[lane]); }
  static void block_sum(device T* out, threadgroup T* t, uint i) {
    t[i] = out[i];
    threadgroup_barrier(mem_flags::mem_threadgroup);
    out[i] = t[0] + t[1] + t[2] + t[3];
  }
};
template <typename T>
kernel void k(device T* out [[buffer(0)]], uint lane [[thread_index_in_simdgroup]]) {
  using reduce = Reduce<T>;
  reduce::run(out, lane);
}
template <typename T>
kernel void block_sum(device T* out [[buffer(0)]], uint i [[thread_index_in_threadgroup]]) {
  threadgroup T t[4];
  Reduce<T>::block_sum(out, t, i);
}
template [[host_name("sum_f")]] kernel void k<float>(device float*, uint);
template [[host_name("block_sum_f")]] [[kernel]] decltype(block_sum<float>) block_sum<float>;
""")
    out = torch.arange(32, dtype=torch.float32)
    lib.sum_f(out, threads=32, group_size=32)
    np.testing.assert_array_equal(out.numpy(), np.full(32, 496.0))
    out = torch.arange(4, dtype=torch.float32)
    lib.block_sum_f(out, threads=4, group_size=4)
    np.testing.assert_array_equal(out.numpy(), np.full(4, 6.0))


BOOL_FRAGMENTS = HEAD + """
// MLX's nax attention: fragments of an alias template over vec, instantiated with bool masks.
template <typename T> struct Frag {
  template <typename U> using frag_t = typename metal::vec<U, 8>;
  template <typename U, typename P>
  static void load(thread frag_t<U>& dst, P src) {
    for (short i = 0; i < 8; i++) dst[i] = static_cast<U>(src[i]);
  }
};
template <typename M>
kernel void masked(device const M* mask [[buffer(0)]], device float* out [[buffer(1)]]) {
  typename Frag<M>::template frag_t<M> m;
  Frag<M>::load(m, mask);
  for (short i = 0; i < 8; i++) out[i] = m[i] ? 1.0f : 0.0f;
  BODY
}
template [[host_name("masked_bool")]] kernel void masked<bool>(device const bool*, device float*);
template [[host_name("masked_float")]] kernel void masked<float>(device const float*, device float*);
"""


def test_a_vector_of_bool_through_an_alias_template_is_checked_through_other_instantiations(tmp_path):
    lib = compile_shader(BOOL_FRAGMENTS.replace("BODY", ""), language_version="4.0")
    bits = torch.tensor([1, 0, 0, 1, 1, 0, 1, 0], dtype=torch.bool)
    for name, mask in (("masked_bool", bits), ("masked_float", bits.float())):
        out = torch.zeros(8)
        getattr(lib, name)(mask, out, threads=1)
        np.testing.assert_array_equal(out.numpy(), bits.float().numpy())
    # The template's errors still show, through its float instantiation.
    with pytest.raises(MetalCompileError, match="cannot convert a device"):
        check_only(tmp_path, BOOL_FRAGMENTS.replace("BODY", "thread float& r = out[0]; r = 1.0f;"))
