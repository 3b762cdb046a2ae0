// Scalar and vector types of the Metal Shading Language, for the emulator (C++17, g++).
//
// Everything lives in namespace metal (the classes for bfloat and the vectors, with their
// operators, in metal::tsm_detail::builtin: see there); kernels say `using namespace metal;`.
// Rules for every file of the emulated <metal_stdlib>:
//   * never include <cmath>, <math.h>, <cstdlib>, <stdlib.h>, <algorithm> or anything else
//     that declares global C math functions: with `using namespace metal;` at global scope
//     they would make unqualified calls such as abs(x) ambiguous. Use __builtin_* instead.
//   * the address-space words (device, constant, thread, threadgroup) are defined away as
//     macros after these headers: never use them as identifiers here.
//
// What is here:
//   scalars  uint ushort uchar ulong half (_Float16) bfloat size_t ptrdiff_t (double is kept
//            usable: kernels are instantiated for it in emulator builds)
//   vectors  vec<T, N> (N = 2, 3, 4) and the MSL names float4, half2, uint3, bool4, ...;
//            3-component vectors have the size and alignment of 4-component ones; packed_*
//            types (packed_float3 is 12 bytes). Members .x .y .z .w / .r .g .b .a, v[i],
//            every 2-, 3- and 4-component swizzle in both spellings (assignable when no
//            component repeats), MSL constructors and element-wise operators.
//   as_type<T>(x), numeric_limits<T>, the <metal_limits> macros (INT_MAX, HALF_MAX, ...),
//   and the half literal suffix (1.5h).
// Reserved names besides Metal's: metal::tsm_detail (internals), the TSM_* macros.
// Math functions and the math constants are in tsm_emu/math.h.
//
// Deliberate departures from Metal, all in the permissive direction unless noted:
//   * a proxy returned by a swizzle converts to vec<T, K> but has no members of its own, so
//     v.xy.x does not compile: write float2(v.xy).x or v.x.
//   * vector shifts use the shift count modulo the element width (as OpenCL specifies);
//     integer division by zero and INT_MIN / -1 follow tsm_emu/integer_division.h, as scalars do.
//   * bfloat is a class: bfloat op bfloat/integer -> bfloat, bfloat op half/float -> float,
//     bfloat op double -> double. Because it converts both ways, `c ? b : 0.0f` with a
//     bfloat b is ambiguous in C++: the translation casts the operand clang converts,
//     but not where the operands' types depend on a template parameter.
//   * integer vector +, -, * and unary - wrap around (defined), as on the GPU.
//   * (stricter) a constant expression reads a vector through .x .y .z .w and v[i] only:
//     not through .r .g .b .a or a swizzle, and vector operators are not constexpr.
#pragma once

#include <cstddef>
#include <cstdint>
#include <initializer_list>
#include <limits>
#include <type_traits>
#include <utility>

#include "tsm_emu/integer_division.h"

namespace metal {

// ---- scalar types ---------------------------------------------------------------------
// The same underlying types glibc's <sys/types.h> uses for its global uint/ushort/ulong, so
// both may be visible at once without ambiguity.
typedef unsigned int uint;
typedef unsigned short ushort;
typedef unsigned char uchar;
typedef unsigned long ulong;
typedef _Float16 half;
using size_t = decltype(sizeof(0));
// Metal's fixed-width integer names, the same types as <cstdint>'s global ones.
using int8_t = std::int8_t;
using uint8_t = std::uint8_t;
using int16_t = std::int16_t;
using uint16_t = std::uint16_t;
using int32_t = std::int32_t;
using uint32_t = std::uint32_t;
using int64_t = std::int64_t;
using uint64_t = std::uint64_t;
using intptr_t = std::intptr_t;
using uintptr_t = std::uintptr_t;
using ptrdiff_t = decltype(static_cast<int*>(nullptr) - static_cast<int*>(nullptr));

// The classes that stand for types built into Metal (bfloat, the vectors) live with their
// operators, and nothing else, in a namespace of their own. Metal's own have no associated
// namespace, so an unqualified call with such an argument inside a shader's namespace must
// not find metal::simd_max or metal::abs by argument-dependent lookup (PyTorch's c10 declares
// its own simd_max and calls it with a bfloat, which made the call ambiguous here).
namespace tsm_detail {
namespace builtin {
struct bfloat;
template <class T, int N>
struct vec;
template <class T, int N>
struct packed_vec;
}  // namespace builtin
}  // namespace tsm_detail
using tsm_detail::builtin::bfloat;
using tsm_detail::builtin::packed_vec;
using tsm_detail::builtin::vec;

namespace tsm_detail {

template <class T>
using bare = std::remove_cv_t<std::remove_reference_t<T>>;

template <class T>
struct is_bfloat : std::is_same<bare<T>, bfloat> {};
template <class T>
struct is_half : std::is_same<bare<T>, _Float16> {};

// Arithmetic scalars (including bool and the character types), half and bfloat.
template <class T>
struct is_scalar
    : std::integral_constant<bool, std::is_arithmetic<bare<T>>::value || is_half<T>::value ||
                                       is_bfloat<T>::value> {};
// float, double, half, bfloat (and long double, which MSL lacks; harmless).
template <class T>
struct is_fp : std::integral_constant<bool, std::is_floating_point<bare<T>>::value ||
                                                is_half<T>::value || is_bfloat<T>::value> {};
// Integers other than bool.
template <class T>
struct is_int : std::integral_constant<bool, std::is_integral<bare<T>>::value &&
                                                 !std::is_same<bare<T>, bool>::value> {};

// A class whose conversion to an arithmetic type is to bool alone: a call that takes a bool
// or a float picks the bool (an `operator float()` would pick the float; two conversions
// would be ambiguous, and so no match).
std::true_type as_bool_or_float(bool);
std::false_type as_bool_or_float(float);
template <class U, class = void>
struct converts_as_bool : std::false_type {};
template <class U>
struct converts_as_bool<U, std::enable_if_t<std::is_class<U>::value,
                                            std::void_t<decltype(as_bool_or_float(std::declval<U>()))>>>
    : decltype(as_bool_or_float(std::declval<U>())) {};

// float <-> bfloat bits, round to nearest even; NaN stays NaN (quiet, sign kept).
constexpr std::uint16_t float_to_bfloat_bits(float f) {
  std::uint32_t u = __builtin_bit_cast(std::uint32_t, f);
  if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<std::uint16_t>((u >> 16) | 0x0040u);
  u += 0x7fffu + ((u >> 16) & 1u);
  return static_cast<std::uint16_t>(u >> 16);
}
constexpr float bfloat_bits_to_float(std::uint16_t b) {
  return __builtin_bit_cast(float, static_cast<std::uint32_t>(b) << 16);
}

namespace builtin {
// bfloat16: 8 exponent bits, 7 mantissa bits. Converts implicitly to float; arithmetic is
// done in float and rounded back (round to nearest even).
struct bfloat {
  std::uint16_t bits_;

  bfloat() = default;
  template <class U, std::enable_if_t<std::is_integral<U>::value, int> = 0>
  constexpr bfloat(U v) : bits_(tsm_detail::float_to_bfloat_bits(static_cast<float>(v))) {}
  // From a floating-point type only explicitly, as in Metal: so `c ? b : f` of a bfloat and a
  // float has one conversion to find, the bfloat's to float (candle's `x > 0 ? x : mul * ...`).
  template <class U, std::enable_if_t<std::is_floating_point<U>::value || std::is_same<U, _Float16>::value,
                                      int> = 0>
  explicit constexpr bfloat(U v) : bits_(tsm_detail::float_to_bfloat_bits(static_cast<float>(v))) {}
  // An object of a class whose only conversion is `operator bool()` (MLX's masks:
  // `op.scale = mask[i]`, `T(mask)`) converts implicitly, as in Metal, where bfloat is
  // arithmetic and this is one user-defined conversion, here two. (Then `f(x)` of an
  // `f(bool)` and an `f(bfloat)` is ambiguous, where Metal picks `f(bool)`.)
  template <class U, std::enable_if_t<tsm_detail::converts_as_bool<U>::value, int> = 0>
  constexpr bfloat(U v) : bfloat(static_cast<bool>(v)) {}
  // Of a class that converts to another arithmetic type, `bfloat(x)` only: implicitly, an
  // `f(x)` of an `f(float)` and an `f(bfloat)` would be ambiguous, where Metal picks `f(float)`.
  template <class U, std::enable_if_t<std::is_class<U>::value && !std::is_same<U, bfloat>::value &&
                                          !tsm_detail::converts_as_bool<U>::value &&
                                          std::is_convertible<U, float>::value,
                                      int> = 0>
  explicit constexpr bfloat(U v) : bfloat(static_cast<float>(v)) {}
  constexpr operator float() const { return tsm_detail::bfloat_bits_to_float(bits_); }

  static constexpr bfloat from_bits(std::uint16_t b) {
    bfloat r{};
    r.bits_ = b;
    return r;
  }
};
}  // namespace builtin

// Result of `a op b` when at least one side is a bfloat and neither is a vector.
template <class A, class B>
struct bf_arith {
  using type = std::conditional_t<
      (is_bfloat<A>::value && (is_bfloat<B>::value || std::is_integral<B>::value)) ||
          (is_bfloat<B>::value && std::is_integral<A>::value),
      bfloat,
      std::conditional_t<std::is_same<A, double>::value || std::is_same<B, double>::value, double,
                         std::conditional_t<std::is_same<A, long double>::value ||
                                                std::is_same<B, long double>::value,
                                            long double, float>>>;
};
template <class A, class B,
          bool ok = (is_bfloat<A>::value || is_bfloat<B>::value) && is_scalar<A>::value &&
                    is_scalar<B>::value>
struct bf_bin {};
template <class A, class B>
struct bf_bin<A, B, true> {
  using type = typename bf_arith<bare<A>, bare<B>>::type;
  // the precision the operation is carried out in
  using calc = std::conditional_t<std::is_same<type, bfloat>::value, float, type>;
};
template <class A, class B>
using bf_bin_t = typename bf_bin<A, B>::type;
template <class A, class B>
using bf_calc_t = typename bf_bin<A, B>::calc;

namespace builtin {

#define TSM_BF_BINOP(op)                                                              \
  template <class A, class B>                                                         \
  constexpr tsm_detail::bf_bin_t<A, B> operator op(const A& a, const B& b) {          \
    using C = tsm_detail::bf_calc_t<A, B>;                                            \
    return tsm_detail::bf_bin_t<A, B>(static_cast<C>(a) op static_cast<C>(b));        \
  }
#define TSM_BF_CMPOP(op)                                                              \
  template <class A, class B>                                                         \
  constexpr std::enable_if_t<sizeof(tsm_detail::bf_bin_t<A, B>) != 0, bool>           \
  operator op(const A& a, const B& b) {                                               \
    using C = tsm_detail::bf_calc_t<A, B>;                                            \
    return static_cast<C>(a) op static_cast<C>(b);                                    \
  }
#define TSM_BF_ASSIGNOP(op)                                                           \
  template <class B, class = tsm_detail::bf_bin_t<bfloat, B>>                         \
  constexpr bfloat& operator op##=(bfloat& a, const B& b) {                           \
    using C = tsm_detail::bf_calc_t<bfloat, B>;                                       \
    a = bfloat(static_cast<C>(a) op static_cast<C>(b));                               \
    return a;                                                                         \
  }
TSM_BF_BINOP(+)
TSM_BF_BINOP(-)
TSM_BF_BINOP(*)
TSM_BF_BINOP(/)
TSM_BF_CMPOP(==)
TSM_BF_CMPOP(!=)
TSM_BF_CMPOP(<)
TSM_BF_CMPOP(>)
TSM_BF_CMPOP(<=)
TSM_BF_CMPOP(>=)
TSM_BF_ASSIGNOP(+)
TSM_BF_ASSIGNOP(-)
TSM_BF_ASSIGNOP(*)
TSM_BF_ASSIGNOP(/)
#undef TSM_BF_BINOP
#undef TSM_BF_CMPOP
#undef TSM_BF_ASSIGNOP

constexpr bfloat operator-(bfloat a) { return bfloat::from_bits(a.bits_ ^ 0x8000u); }
constexpr bfloat operator+(bfloat a) { return a; }
constexpr bfloat& operator++(bfloat& a) { return a = bfloat(float(a) + 1.0f); }
constexpr bfloat& operator--(bfloat& a) { return a = bfloat(float(a) - 1.0f); }
constexpr bfloat operator++(bfloat& a, int) { bfloat r = a; ++a; return r; }
constexpr bfloat operator--(bfloat& a, int) { bfloat r = a; --a; return r; }

}  // namespace builtin
}  // namespace tsm_detail

// Metal's half literal suffix: 1.5h. (Literal suffixes without '_' are reserved to the
// standard library in C++, hence the pragma.)
#pragma GCC diagnostic push
#if defined(__clang__)
#pragma clang diagnostic ignored "-Wuser-defined-literals"
#else
#pragma GCC diagnostic ignored "-Wliteral-suffix"
#endif
constexpr half operator""h(long double v) { return static_cast<half>(v); }
#pragma GCC diagnostic pop

// ---- vector types ---------------------------------------------------------------------
namespace tsm_detail {
namespace builtin {

// Reading proxy for a swizzle of K components (indices I0..I3, -1 when unused) of a vector
// whose storage holds S elements. It overlays that storage inside the vector's union.
// Assignable only when no component repeats. Copy-assignment from the same swizzle of
// another vector must assign components, not copy the whole storage: the deleted
// `const volatile&` copy-assignment suppresses the implicit ones so that the template
// below is chosen for every non-volatile source.
template <class T, int K, int S, int I0, int I1, int I2, int I3>
struct swz {
  T d_[S];

  static constexpr bool assignable =
      I0 != I1 && (K < 3 || (I2 != I0 && I2 != I1)) &&
      (K < 4 || (I3 != I0 && I3 != I1 && I3 != I2));

  operator vec<T, K>() const {
    vec<T, K> r{};  // zero padding lane: a float3 written to memory is deterministic
    const int idx[4] = {I0, I1, I2, I3};
    for (int i = 0; i < K; ++i) r.d_[i] = d_[idx[i]];
    return r;
  }

  swz& operator=(const volatile swz&) = delete;

  // Constrained on `assignable` only: a std::is_convertible<U, vec<T, K>> test here would
  // be evaluated (and cached) while the enclosing vector is instantiated, when vec<T, K>
  // may still be incomplete.
  template <class U, bool A = assignable, std::enable_if_t<A, int> = 0>
  swz& operator=(U&& u) {
    const vec<T, K> v = static_cast<U&&>(u);  // before writing: the source may alias us
    const int idx[4] = {I0, I1, I2, I3};
    for (int i = 0; i < K; ++i) d_[idx[i]] = v.d_[i];
    return *this;
  }
};

// Storage: a union of the named components, the element array and the swizzle proxies.
// S = number of stored elements (4 for a 3-vector, 3 for a packed 3-vector), A = alignment.
// Constructors make x, y, z, w the active member: a constant expression may read only that one
// (c10's `constexpr auto inf = numeric_limits<T>::infinity().x`), so there at_(i) names them;
// at run time it is d_[i] (g++ and clang define reading another member of a union).
template <class T, int N, int S, int A>
struct alignas(A) vstore {  // 8 and 16 components (MLX's nax fragments): no named ones
  T d_[S];
  vstore() = default;
  constexpr explicit vstore(int) : d_{} {}
  constexpr T& at_(int i) { return d_[i]; }
  constexpr const T& at_(int i) const { return d_[i]; }
};

#define TSM_VSTORE_AT(n, pick, ...)                                           \
  constexpr explicit vstore(int) : __VA_ARGS__ {                              \
    if (!__builtin_is_constant_evaluated())                                   \
      for (int i = n; i < S; ++i) d_[i] = T(); /* a 3-vector's fourth lane */ \
  }                                                                           \
  constexpr T& at_(int i) {                                                   \
    if (__builtin_is_constant_evaluated()) return pick;                       \
    return d_[i];                                                             \
  }                                                                           \
  constexpr const T& at_(int i) const {                                       \
    if (__builtin_is_constant_evaluated()) return pick;                       \
    return d_[i];                                                             \
  }

#define TSM_SWZ(K, i0, i1, i2, i3, n1, n2) swz<T, K, S, i0, i1, i2, i3> n1, n2;

template <class T, int S, int A>
struct alignas(A) vstore<T, 2, S, A> {
  union {
    struct { T x, y; };
    T d_[S];
    struct { T r, g; };
#define TSM_SWZ_DIM 2
#include "tsm_emu/swizzles.inc"
#undef TSM_SWZ_DIM
  };
  vstore() = default;
  TSM_VSTORE_AT(2, (i == 0 ? x : y), x(), y())
};

template <class T, int S, int A>
struct alignas(A) vstore<T, 3, S, A> {
  union {
    struct { T x, y, z; };
    T d_[S];
    struct { T r, g, b; };
#define TSM_SWZ_DIM 3
#include "tsm_emu/swizzles.inc"
#undef TSM_SWZ_DIM
  };
  vstore() = default;
  TSM_VSTORE_AT(3, (i == 0 ? x : i == 1 ? y : z), x(), y(), z())
};

template <class T, int S, int A>
struct alignas(A) vstore<T, 4, S, A> {
  union {
    struct { T x, y, z, w; };
    T d_[S];
    struct { T r, g, b, a; };
#define TSM_SWZ_DIM 4
#include "tsm_emu/swizzles.inc"
#undef TSM_SWZ_DIM
  };
  vstore() = default;
  TSM_VSTORE_AT(4, (i == 0 ? x : i == 1 ? y : i == 2 ? z : w), x(), y(), z(), w())
};

#undef TSM_SWZ
#undef TSM_VSTORE_AT

}  // namespace builtin
using builtin::swz;

// What a type looks like to the vector operators: vectors, packed vectors and swizzle
// proxies are "vector-like" with n components of type elem; anything else is a scalar.
template <class X>
struct vinfo {
  static constexpr bool vec_like = false;
  static constexpr int n = 1;
  using elem = X;
  using vec_type = X;
};
template <class T, int N>
struct vinfo<vec<T, N>> {
  static constexpr bool vec_like = true;
  static constexpr int n = N;
  using elem = T;
  using vec_type = vec<T, N>;
};
template <class T, int N>
struct vinfo<packed_vec<T, N>> : vinfo<vec<T, N>> {};
template <class T, int K, int S, int I0, int I1, int I2, int I3>
struct vinfo<swz<T, K, S, I0, I1, I2, I3>> : vinfo<vec<T, K>> {};

template <class X>
using vi = vinfo<bare<X>>;
template <class X>
struct is_vec_like : std::integral_constant<bool, vi<X>::vec_like> {};

// Number of components an argument contributes to a vector constructor (0: not allowed).
template <class X>
constexpr int ncomp() {
  return vi<X>::vec_like ? vi<X>::n : (is_scalar<X>::value ? 1 : 0);
}
template <class... X>
constexpr bool ctor_args_ok(int n) {
  const int c[] = {ncomp<X>()...};
  int total = 0;
  for (int v : c) {
    if (v == 0) return false;
    total += v;
  }
  return total == n;
}

// Component k++ of the vector store d takes x (or each of x's components).
template <class D, class X>
constexpr void put(D& d, int& k, const X& x) {
  using T = std::remove_reference_t<decltype(d.at_(0))>;
  if constexpr (vi<X>::vec_like) {
    const typename vi<X>::vec_type v = x;
    for (int i = 0; i < vi<X>::n; ++i) d.at_(k++) = static_cast<T>(v[i]);
  } else {
    d.at_(k++) = static_cast<T>(x);
  }
}

template <int N>
constexpr int storage_count() { return N == 3 ? 4 : N; }
template <class T, int N>
constexpr int vec_align() { return int(sizeof(T)) * storage_count<N>(); }

namespace builtin {
// Constructors shared by vec and packed_vec.
template <class T, int N, int S, int A>
struct vcore : vstore<T, N, S, A> {
  using value_type = T;
  static constexpr int size = N;

  vcore() = default;

  // Broadcast: implicit, as Metal converts scalars to vectors implicitly.
  template <class U, std::enable_if_t<is_scalar<U>::value, int> = 0>
  constexpr vcore(const U& s) : vstore<T, N, S, A>(0) {
    for (int i = 0; i < N; ++i) this->at_(i) = static_cast<T>(s);
  }

  // Brace initialisation names the leading components and zero-fills the rest, as Metal's
  // (clang's) vector initialiser lists do: float4 v = {1} is (1, 0, 0, 0), while float4(1)
  // broadcasts. Narrowing is an error in both.
  constexpr vcore(std::initializer_list<T> components) : vstore<T, N, S, A>(0) {
    int k = 0;
    for (const T& c : components)
      if (k < N) this->at_(k++) = c;
  }

  // Components and smaller vectors, concatenated: float4(a, b, c, d), float4(v2, z, w), ...
  template <class A0, class A1, class... As,
            std::enable_if_t<ctor_args_ok<A0, A1, As...>(N), int> = 0>
  constexpr vcore(const A0& a0, const A1& a1, const As&... as) : vstore<T, N, S, A>(0) {
    int k = 0;
    put(*this, k, a0);
    put(*this, k, a1);
    (put(*this, k, as), ...);
  }

  // Element-type conversion, explicit as in Metal: float4(int4), bool4(v.xyzw), ...
  template <class X, std::enable_if_t<vi<X>::vec_like && vi<X>::n == N &&
                                          !std::is_same<bare<X>, vec<T, N>>::value,
                                      int> = 0>
  constexpr explicit vcore(const X& src) : vstore<T, N, S, A>(0) {
    int k = 0;
    put(*this, k, src);
  }

  constexpr T& operator[](int i) { return this->at_(i); }
  constexpr const T& operator[](int i) const { return this->at_(i); }
};
}  // namespace builtin
using builtin::vcore;

// The right-hand side of `v = {a, b, c, d}`, constructed as `V(a, b, c, d)` (the check
// has already rejected a narrowing list, as Apple's compiler does).
template <class V>
struct braced {
  template <class... A>
  braced(const A&... components) : value(components...) {}
  V value;
};

namespace builtin {
// vec<T, N>: Metal's vector, size and alignment N * sizeof(T) (3-vectors like 4-vectors).
// Value-initialisation (float4(), float4{}) gives zeros; default-initialisation leaves the
// components indeterminate, as in Metal.
template <class T, int N>
struct vec : tsm_detail::vcore<T, N, tsm_detail::storage_count<N>(), tsm_detail::vec_align<T, N>()> {
  // (8 and 16: metal::vec<T, 8> is MLX's nax fragment, MSL 4.0; there are no typedefs for them)
  static_assert((N >= 2 && N <= 4) || N == 8 || N == 16, "vec<T, N>: N must be 2, 3, 4, 8 or 16");
  using core = tsm_detail::vcore<T, N, tsm_detail::storage_count<N>(), tsm_detail::vec_align<T, N>()>;
  using core::core;

  vec() = default;
  vec(const vec&) = default;
  // See swz: the template assigns element-wise; the class stays trivially copyable.
  vec& operator=(const volatile vec&) = delete;
  template <class U, std::enable_if_t<std::is_convertible<U&&, vec>::value, int> = 0>
  vec& operator=(U&& u) {
    const vec v = static_cast<U&&>(u);
    for (int i = 0; i < N; ++i) this->d_[i] = v.d_[i];
    return *this;
  }
  // v = {a, b, c, d} (ggml): a braced list deduces no U above.
  vec& operator=(const tsm_detail::braced<vec>& list) { return *this = list.value; }
};

// packed_vec<T, N>: N * sizeof(T) bytes, aligned like T (packed_float3 is 12 bytes).
template <class T, int N>
struct packed_vec : tsm_detail::vcore<T, N, N, int(alignof(T))> {
  using core = tsm_detail::vcore<T, N, N, int(alignof(T))>;
  using core::core;

  packed_vec() = default;
  packed_vec(const packed_vec&) = default;
  constexpr packed_vec(const vec<T, N>& v) : core(0) {
    for (int i = 0; i < N; ++i) (*this)[i] = v[i];
  }
  // packed_float3 p = v.xyz;  (one user-defined conversion, not swizzle -> vec -> packed)
  template <int S, int I0, int I1, int I2, int I3>
  packed_vec(const tsm_detail::swz<T, N, S, I0, I1, I2, I3>& s) : packed_vec(vec<T, N>(s)) {}
  operator vec<T, N>() const {
    vec<T, N> r{};
    for (int i = 0; i < N; ++i) r.d_[i] = this->d_[i];
    return r;
  }
  packed_vec& operator=(const volatile packed_vec&) = delete;
  template <class U, std::enable_if_t<std::is_convertible<U&&, vec<T, N>>::value, int> = 0>
  packed_vec& operator=(U&& u) {
    const vec<T, N> v = static_cast<U&&>(u);
    for (int i = 0; i < N; ++i) this->d_[i] = v.d_[i];
    return *this;
  }
};
}  // namespace builtin
}  // namespace tsm_detail

#define TSM_VEC_NAMES(T, name)                                                       \
  typedef vec<T, 2> name##2;                                                         \
  typedef vec<T, 3> name##3;                                                         \
  typedef vec<T, 4> name##4;                                                         \
  typedef packed_vec<T, 2> packed_##name##2;                                         \
  typedef packed_vec<T, 3> packed_##name##3;                                         \
  typedef packed_vec<T, 4> packed_##name##4;
TSM_VEC_NAMES(float, float)
TSM_VEC_NAMES(half, half)
TSM_VEC_NAMES(bfloat, bfloat)
TSM_VEC_NAMES(int, int)
TSM_VEC_NAMES(uint, uint)
TSM_VEC_NAMES(short, short)
TSM_VEC_NAMES(ushort, ushort)
TSM_VEC_NAMES(char, char)
TSM_VEC_NAMES(uchar, uchar)
TSM_VEC_NAMES(bool, bool)
TSM_VEC_NAMES(long, long)
TSM_VEC_NAMES(ulong, ulong)
TSM_VEC_NAMES(double, double)  // emulator only: Metal has no double
#undef TSM_VEC_NAMES

// ---- vector operators -----------------------------------------------------------------
// Free templates (found by argument-dependent lookup) taking vectors, packed vectors and
// swizzle proxies. Two vector operands must have the same element type and size (Metal
// has no implicit conversion between vector types); a scalar operand is converted to the
// element type and broadcast.
namespace tsm_detail {

template <class A, class B, bool AV = vi<A>::vec_like, bool BV = vi<B>::vec_like>
struct vbin {};
template <class A, class B>
struct vbin<A, B, true, true>
    : std::enable_if<std::is_same<typename vi<A>::vec_type, typename vi<B>::vec_type>::value,
                     typename vi<A>::vec_type> {};
template <class A, class B>
struct vbin<A, B, true, false> : std::enable_if<is_scalar<B>::value, typename vi<A>::vec_type> {};
template <class A, class B>
struct vbin<A, B, false, true> : std::enable_if<is_scalar<A>::value, typename vi<B>::vec_type> {};
template <class A, class B>
using vbin_t = typename vbin<A, B>::type;

// x as a V: a vector-like x converts (explicitly, so element types may differ); a scalar
// is converted to the element type and broadcast. V may itself be a scalar type.
template <class V, class X>
inline V to_vec(const X& x) {
  if constexpr (!vinfo<V>::vec_like) {
    return static_cast<V>(x);
  } else if constexpr (vi<X>::vec_like) {
    return V(x);
  } else {
    return V(static_cast<typename V::value_type>(x));
  }
}

// Integer +, -, * and negation wrap around (two's complement) as on the GPU: they are done
// in the unsigned version of the promoted type.
template <class T, bool = is_int<T>::value>
struct wrap {
  using type = T;
};
template <class T>
struct wrap<T, true> {
  using type = std::make_unsigned_t<decltype(+T())>;
};
template <class T>
using wrap_t = typename wrap<T>::type;

template <class V>
struct as_bool_vec;
template <class T, int N>
struct as_bool_vec<vec<T, N>> {
  using type = vec<bool, N>;
};

template <class T>
constexpr T shift_count(T c) {
  return static_cast<T>(c & static_cast<T>(sizeof(T) * 8 - 1));
}
// Left shift done on the unsigned type: defined for negative values, as on the GPU.
template <class T>
constexpr T shl(T a, T c) {
  using U = std::make_unsigned_t<T>;
  return static_cast<T>(static_cast<U>(static_cast<U>(a) << shift_count(c)));
}
template <class T>
constexpr T shr(T a, T c) {
  return static_cast<T>(a >> shift_count(c));
}

namespace builtin {

#define TSM_VEC_BINOP(op, expr)                                                      \
  template <class A, class B>                                                        \
  inline tsm_detail::vbin_t<A, B> operator op(const A& a_, const B& b_) {            \
    using V = tsm_detail::vbin_t<A, B>;                                              \
    using T = typename V::value_type;                                                \
    const V a = tsm_detail::to_vec<V>(a_), b = tsm_detail::to_vec<V>(b_);            \
    V r{};                                                                           \
    for (int i = 0; i < V::size; ++i) r.d_[i] = static_cast<T>(expr);               \
    return r;                                                                        \
  }
TSM_VEC_BINOP(+, tsm_detail::wrap_t<T>(a.d_[i]) + tsm_detail::wrap_t<T>(b.d_[i]))
TSM_VEC_BINOP(-, tsm_detail::wrap_t<T>(a.d_[i]) - tsm_detail::wrap_t<T>(b.d_[i]))
TSM_VEC_BINOP(*, tsm_detail::wrap_t<T>(a.d_[i]) * tsm_detail::wrap_t<T>(b.d_[i]))
TSM_VEC_BINOP(/, ::tsm_emu::div(a.d_[i], b.d_[i]))
TSM_VEC_BINOP(%, ::tsm_emu::rem(a.d_[i], b.d_[i]))
TSM_VEC_BINOP(&, a.d_[i] & b.d_[i])
TSM_VEC_BINOP(|, a.d_[i] | b.d_[i])
TSM_VEC_BINOP(^, a.d_[i] ^ b.d_[i])
TSM_VEC_BINOP(<<, tsm_detail::shl<T>(a.d_[i], b.d_[i]))
TSM_VEC_BINOP(>>, tsm_detail::shr<T>(a.d_[i], b.d_[i]))
#undef TSM_VEC_BINOP

// A shift's operands may differ in signedness, as scalars' may (naga's `int4 >> uint4`): the
// result has the left operand's type.
#define TSM_VEC_MIXED_SHIFT(op, f)                                                                    \
  template <class T, class U, int N,                                                                  \
            std::enable_if_t<!std::is_same<T, U>::value && std::is_integral<T>::value &&              \
                                 std::is_integral<U>::value && !std::is_same<T, bool>::value, int> = 0> \
  inline vec<T, N> operator op(const vec<T, N>& a, const vec<U, N>& b) {                              \
    vec<T, N> r{};                                                                                    \
    for (int i = 0; i < N; ++i) r.d_[i] = tsm_detail::f<T>(a.d_[i], static_cast<T>(b.d_[i]));        \
    return r;                                                                                         \
  }                                                                                                   \
  template <class T, class U, int N,                                                                  \
            std::enable_if_t<!std::is_same<T, U>::value && std::is_integral<T>::value &&              \
                                 std::is_integral<U>::value && !std::is_same<T, bool>::value, int> = 0> \
  inline vec<T, N>& operator op##=(vec<T, N>& a, const vec<U, N>& b) {                                \
    return a = a op b;                                                                                \
  }
TSM_VEC_MIXED_SHIFT(<<, shl)
TSM_VEC_MIXED_SHIFT(>>, shr)
#undef TSM_VEC_MIXED_SHIFT

#define TSM_VEC_BOOLOP(op)                                                           \
  template <class A, class B>                                                        \
  inline typename tsm_detail::as_bool_vec<tsm_detail::vbin_t<A, B>>::type            \
  operator op(const A& a_, const B& b_) {                                            \
    using V = tsm_detail::vbin_t<A, B>;                                              \
    const V a = tsm_detail::to_vec<V>(a_), b = tsm_detail::to_vec<V>(b_);            \
    typename tsm_detail::as_bool_vec<V>::type r{};                                   \
    for (int i = 0; i < V::size; ++i) r.d_[i] = a.d_[i] op b.d_[i];                  \
    return r;                                                                        \
  }
TSM_VEC_BOOLOP(==)
TSM_VEC_BOOLOP(!=)
TSM_VEC_BOOLOP(<)
TSM_VEC_BOOLOP(>)
TSM_VEC_BOOLOP(<=)
TSM_VEC_BOOLOP(>=)
TSM_VEC_BOOLOP(&&)
TSM_VEC_BOOLOP(||)
#undef TSM_VEC_BOOLOP

#define TSM_VEC_ASSIGNOP(op)                                                         \
  template <class A, class B, class = tsm_detail::vbin_t<A, B>,                      \
            std::enable_if_t<tsm_detail::is_vec_like<A>::value, int> = 0>            \
  inline A& operator op##=(A& a, const B& b) {                                       \
    a = a op b;                                                                      \
    return a;                                                                        \
  }
TSM_VEC_ASSIGNOP(+)
TSM_VEC_ASSIGNOP(-)
TSM_VEC_ASSIGNOP(*)
TSM_VEC_ASSIGNOP(/)
TSM_VEC_ASSIGNOP(%)
TSM_VEC_ASSIGNOP(&)
TSM_VEC_ASSIGNOP(|)
TSM_VEC_ASSIGNOP(^)
TSM_VEC_ASSIGNOP(<<)
TSM_VEC_ASSIGNOP(>>)
#undef TSM_VEC_ASSIGNOP

#define TSM_VEC_UNOP(op, R, expr)                                                    \
  template <class X, class V = typename tsm_detail::vi<X>::vec_type,                 \
            std::enable_if_t<tsm_detail::is_vec_like<X>::value, int> = 0>            \
  inline R operator op(const X& x_) {                                                \
    using T = typename V::value_type;                                                \
    (void)sizeof(T);                                                                 \
    const V x = x_;                                                                  \
    R r{};                                                                           \
    for (int i = 0; i < V::size; ++i) r.d_[i] = expr;                                \
    return r;                                                                        \
  }
TSM_VEC_UNOP(-, V, static_cast<T>(-tsm_detail::wrap_t<T>(x.d_[i])))
TSM_VEC_UNOP(+, V, x.d_[i])
TSM_VEC_UNOP(~, V, static_cast<T>(~x.d_[i]))
TSM_VEC_UNOP(!, typename tsm_detail::as_bool_vec<V>::type, !x.d_[i])
#undef TSM_VEC_UNOP

template <class X, std::enable_if_t<tsm_detail::is_vec_like<X>::value, int> = 0>
inline X& operator++(X& x) {
  x += 1;
  return x;
}
template <class X, std::enable_if_t<tsm_detail::is_vec_like<X>::value, int> = 0>
inline X& operator--(X& x) {
  x -= 1;
  return x;
}
template <class X, class V = typename tsm_detail::vi<X>::vec_type,
          std::enable_if_t<tsm_detail::is_vec_like<X>::value, int> = 0>
inline V operator++(X& x, int) {
  const V old = x;
  x += 1;
  return old;
}
template <class X, class V = typename tsm_detail::vi<X>::vec_type,
          std::enable_if_t<tsm_detail::is_vec_like<X>::value, int> = 0>
inline V operator--(X& x, int) {
  const V old = x;
  x -= 1;
  return old;
}

}  // namespace builtin
}  // namespace tsm_detail

// ---- <metal_type_traits> ----------------------------------------------------------------
// The std traits under Metal's names, with half and bfloat counted as floating point, and
// Metal's own (remove_addrspace: the emulator has one address space).
using std::add_const;
using std::add_const_t;
using std::bool_constant;
using std::conditional;
using std::conditional_t;
using std::decay;
using std::decay_t;
using std::declval;
using std::enable_if;
using std::enable_if_t;
using std::false_type;
using std::integral_constant;
using std::is_base_of;
using std::is_const;
using std::is_convertible;
using std::is_pointer;
using std::is_same;
using std::is_trivially_copyable;
using std::is_void;
using std::make_signed;
using std::make_signed_t;
using std::make_unsigned;
using std::make_unsigned_t;
using std::remove_const;
using std::remove_const_t;
using std::remove_cv;
using std::remove_cv_t;
using std::remove_pointer;
using std::remove_pointer_t;
using std::remove_reference;
using std::remove_reference_t;
using std::remove_volatile;
using std::remove_volatile_t;
using std::true_type;
// Internal traits of Apple's <metal_type_traits> (MLX's atomic.h uses _disjunction).
template <class... B>
using _disjunction = std::disjunction<B...>;
template <class... B>
using _conjunction = std::conjunction<B...>;
// <metal_uniform>: a value the same in every thread; here just the value.
template <class T>
struct uniform {
  T value_;
  uniform() = default;
  constexpr uniform(T value) : value_(value) {}
  constexpr operator T() const { return value_; }
};
template <class T>
constexpr uniform<T> make_uniform(T value) { return uniform<T>(value); }
template <class T>
struct remove_addrspace {
  using type = T;
};
template <class T>
using remove_addrspace_t = typename remove_addrspace<T>::type;
// Metal's traits classify a vector by its element type: is_floating_point_v<half2> holds, and
// is_scalar_v tells the two apart (PyTorch's c10 registers complex ops on float2 through
// is_floating_point_v and defines is_scalar_floating_point_v for the scalars alone).
template <class T>
using trait_scalar_t = typename tsm_detail::vinfo<std::remove_cv_t<T>>::elem;
template <class T>
struct is_floating_point : bool_constant<tsm_detail::is_fp<trait_scalar_t<T>>::value> {};
template <class T>
struct is_integral : std::is_integral<trait_scalar_t<T>> {};
template <class T>
struct is_arithmetic : bool_constant<is_floating_point<T>::value || is_integral<T>::value> {};
template <class T>
struct is_vector : bool_constant<tsm_detail::vi<T>::vec_like> {};
template <class T>
struct is_scalar : bool_constant<is_arithmetic<T>::value && !is_vector<T>::value> {};
// Apple's name for the types the SIMD-group functions take, which shaders use (candle's
// reduce.metal: `__is_valid_simdgroup_type<T>::value`): not bfloat (see the check's metal_stdlib).
template <class T>
struct __is_valid_simdgroup_type
    : bool_constant<tsm_detail::is_scalar<trait_scalar_t<T>>::value && !tsm_detail::is_bfloat<trait_scalar_t<T>>::value> {};
template <class T>
struct is_signed
    : bool_constant<std::is_signed<trait_scalar_t<T>>::value || is_floating_point<T>::value> {};
template <class T>
struct is_unsigned : std::is_unsigned<trait_scalar_t<T>> {};
template <class T>
struct vec_elements : integral_constant<int, tsm_detail::vi<T>::n> {};
template <class T>
struct make_scalar {
  using type = typename tsm_detail::vi<T>::elem;
};
template <class T>
using make_scalar_t = typename make_scalar<T>::type;
template <class T, class U>
constexpr bool is_same_v = is_same<T, U>::value;
template <class T>
constexpr bool is_floating_point_v = is_floating_point<T>::value;
template <class T>
constexpr bool is_integral_v = is_integral<T>::value;
template <class T>
constexpr bool is_arithmetic_v = is_arithmetic<T>::value;
template <class T>
constexpr bool is_scalar_v = is_scalar<T>::value;
template <class T>
constexpr bool is_signed_v = is_signed<T>::value;
template <class T>
constexpr bool is_unsigned_v = is_unsigned<T>::value;
template <class T>
constexpr bool is_vector_v = is_vector<T>::value;
template <class T>
constexpr bool is_pointer_v = is_pointer<T>::value;
template <class T>
constexpr bool is_const_v = is_const<T>::value;
template <class B, class D>
constexpr bool is_base_of_v = is_base_of<B, D>::value;
template <class F, class T>
constexpr bool is_convertible_v = is_convertible<F, T>::value;

// ---- as_type --------------------------------------------------------------------------
// Bit reinterpretation. A swizzle proxy is first turned into the vector it denotes.
template <class T, class U>
inline T as_type(const U& u) {
  using From = std::conditional_t<tsm_detail::vi<U>::vec_like &&
                                      !std::is_same<tsm_detail::bare<U>,
                                                    packed_vec<typename tsm_detail::vi<U>::elem,
                                                               tsm_detail::vi<U>::n>>::value,
                                  typename tsm_detail::vi<U>::vec_type, tsm_detail::bare<U>>;
  static_assert(sizeof(T) == sizeof(From), "as_type<T>(x): T and x must have the same size");
  const From from = u;
  T t;
  __builtin_memcpy(static_cast<void*>(&t), static_cast<const void*>(&from), sizeof(T));
  return t;
}

// ---- numeric_limits -------------------------------------------------------------------
// numeric_limits<T> derives from _numeric_limits_impl<T>, as Apple's does: shaders specialise
// the latter for their own types (candle's reduce.metal, `_numeric_limits_impl<indexed<T>>`).
template <class T>
struct _numeric_limits_impl : std::numeric_limits<T> {};
template <class T>
struct numeric_limits : _numeric_limits_impl<T> {};
template <class T>
struct numeric_limits<const T> : numeric_limits<T> {};
template <class T>
struct numeric_limits<volatile T> : numeric_limits<T> {};
template <class T>
struct numeric_limits<const volatile T> : numeric_limits<T> {};

template <>
struct _numeric_limits_impl<half> {
  static constexpr bool is_specialized = true;
  static constexpr bool is_signed = true;
  static constexpr bool is_integer = false;
  static constexpr bool is_exact = false;
  static constexpr bool has_infinity = true;
  static constexpr bool has_quiet_NaN = true;
  static constexpr int digits = 11;
  static constexpr int radix = 2;
  static constexpr half min() { return half(6.103515625e-05f); }      // 0x1p-14
  static constexpr half max() { return half(65504.0f); }
  static constexpr half lowest() { return half(-65504.0f); }
  static constexpr half epsilon() { return half(9.765625e-04f); }     // 0x1p-10
  static constexpr half denorm_min() { return half(5.9604644775390625e-08f); }  // 0x1p-24
  static constexpr half infinity() { return half(__builtin_huge_valf()); }
  static constexpr half quiet_NaN() { return half(__builtin_nanf("")); }
  static constexpr half signaling_NaN() { return half(__builtin_nanf("")); }
};

template <>
struct _numeric_limits_impl<bfloat> {
  static constexpr bool is_specialized = true;
  static constexpr bool is_signed = true;
  static constexpr bool is_integer = false;
  static constexpr bool is_exact = false;
  static constexpr bool has_infinity = true;
  static constexpr bool has_quiet_NaN = true;
  static constexpr int digits = 8;
  static constexpr int radix = 2;
  static constexpr bfloat min() { return bfloat::from_bits(0x0080); }     // 0x1p-126
  static constexpr bfloat max() { return bfloat::from_bits(0x7f7f); }     // 0x1.fep127
  static constexpr bfloat lowest() { return bfloat::from_bits(0xff7f); }
  static constexpr bfloat epsilon() { return bfloat::from_bits(0x3c00); } // 0x1p-7
  static constexpr bfloat denorm_min() { return bfloat::from_bits(0x0001); }
  static constexpr bfloat infinity() { return bfloat::from_bits(0x7f80); }
  static constexpr bfloat quiet_NaN() { return bfloat::from_bits(0x7fc0); }
  static constexpr bfloat signaling_NaN() { return bfloat::from_bits(0x7fc0); }
};

// A vector's limits are its element type's, each value broadcast (see the check's metal_stdlib).
template <class T, int N>
struct _numeric_limits_impl<vec<T, N>> {
  using S = numeric_limits<T>;
  static constexpr bool is_specialized = S::is_specialized;
  static constexpr bool is_signed = S::is_signed;
  static constexpr bool is_integer = S::is_integer;
  static constexpr bool is_exact = S::is_exact;
  static constexpr bool has_infinity = S::has_infinity;
  static constexpr bool has_quiet_NaN = S::has_quiet_NaN;
  static constexpr int digits = S::digits;
  static constexpr int radix = S::radix;
  static constexpr vec<T, N> min() { return vec<T, N>(S::min()); }
  static constexpr vec<T, N> max() { return vec<T, N>(S::max()); }
  static constexpr vec<T, N> lowest() { return vec<T, N>(S::lowest()); }
  static constexpr vec<T, N> epsilon() { return vec<T, N>(S::epsilon()); }
  static constexpr vec<T, N> infinity() { return vec<T, N>(S::infinity()); }
  static constexpr vec<T, N> quiet_NaN() { return vec<T, N>(S::quiet_NaN()); }
  static constexpr vec<T, N> signaling_NaN() { return vec<T, N>(S::signaling_NaN()); }
  static constexpr vec<T, N> denorm_min() { return vec<T, N>(S::denorm_min()); }
};

}  // namespace metal

namespace tsm_emu {
// A swizzle given to a function template (_cxx_forms.swizzle_arguments): its vector, as MSL's
// `v.xy` is an rvalue of the vector type; C++ would deduce the proxy that reads it.
template <class X>
typename metal::tsm_detail::vinfo<X>::vec_type swizzle_value(const X& x) {
  return x;
}
}  // namespace tsm_emu

namespace tsm_emu {
// An operand of `c ? x : y` in a template where one operand has a template parameter's type
// and the other an arithmetic type (the rewriter wraps both, each given the other's type):
// converted as Metal's usual arithmetic conversions convert the pair when one is a bfloat
// (g++ finds the class converting both ways) -- an integer beside a bfloat to bfloat, a
// bfloat beside a float to float -- and the operand itself, an lvalue as before, otherwise.
template <class Other, class X>
constexpr decltype(auto) conditional_operand(X&& x) {
  using Self = std::remove_cv_t<std::remove_reference_t<X>>;
  using O = std::remove_cv_t<Other>;
  if constexpr (std::is_same<O, metal::bfloat>::value && std::is_integral<Self>::value) {
    return metal::bfloat(x);
  } else if constexpr (std::is_same<Self, metal::bfloat>::value && std::is_floating_point<O>::value) {
    return O(x);
  } else {
    return std::forward<X>(x);
  }
}
}  // namespace tsm_emu

// ---- <metal_limits> macros ------------------------------------------------------------
// Spelled like GCC's <limits.h>/<float.h> where those define the same names, so including
// one of those later is harmless.
#ifndef CHAR_BIT
#define CHAR_BIT __CHAR_BIT__
#endif
#ifndef SCHAR_MAX
#define SCHAR_MAX __SCHAR_MAX__
#endif
#ifndef SCHAR_MIN
#define SCHAR_MIN (-SCHAR_MAX - 1)
#endif
#ifndef UCHAR_MAX
#define UCHAR_MAX (SCHAR_MAX * 2 + 1)
#endif
#ifndef CHAR_MAX
#define CHAR_MAX SCHAR_MAX
#endif
#ifndef CHAR_MIN
#define CHAR_MIN SCHAR_MIN
#endif
#ifndef SHRT_MAX
#define SHRT_MAX __SHRT_MAX__
#endif
#ifndef SHRT_MIN
#define SHRT_MIN (-SHRT_MAX - 1)
#endif
#ifndef USHRT_MAX
#define USHRT_MAX (SHRT_MAX * 2 + 1)
#endif
#ifndef INT_MAX
#define INT_MAX __INT_MAX__
#endif
#ifndef INT_MIN
#define INT_MIN (-INT_MAX - 1)
#endif
#ifndef UINT_MAX
#define UINT_MAX (INT_MAX * 2U + 1U)
#endif
#ifndef LONG_MAX
#define LONG_MAX __LONG_MAX__
#endif
#ifndef LONG_MIN
#define LONG_MIN (-LONG_MAX - 1L)
#endif
#ifndef ULONG_MAX
#define ULONG_MAX (LONG_MAX * 2UL + 1UL)
#endif

#ifndef FLT_DIG
#define FLT_DIG __FLT_DIG__
#endif
#ifndef FLT_MANT_DIG
#define FLT_MANT_DIG __FLT_MANT_DIG__
#endif
#ifndef FLT_MAX_10_EXP
#define FLT_MAX_10_EXP __FLT_MAX_10_EXP__
#endif
#ifndef FLT_MAX_EXP
#define FLT_MAX_EXP __FLT_MAX_EXP__
#endif
#ifndef FLT_MIN_10_EXP
#define FLT_MIN_10_EXP __FLT_MIN_10_EXP__
#endif
#ifndef FLT_MIN_EXP
#define FLT_MIN_EXP __FLT_MIN_EXP__
#endif
#ifndef FLT_RADIX
#define FLT_RADIX __FLT_RADIX__
#endif
#ifndef FLT_MAX
#define FLT_MAX __FLT_MAX__
#endif
#ifndef FLT_MIN
#define FLT_MIN __FLT_MIN__
#endif
#ifndef FLT_EPSILON
#define FLT_EPSILON __FLT_EPSILON__
#endif

#define HALF_DIG 3
#define HALF_MANT_DIG 11
#define HALF_MAX_10_EXP 4
#define HALF_MAX_EXP 16
#define HALF_MIN_10_EXP (-4)
#define HALF_MIN_EXP (-13)
#define HALF_RADIX 2
#define HALF_MAX (::metal::half(65504.0f))
#define HALF_MIN (::metal::half(6.103515625e-05f))
#define HALF_EPSILON (::metal::half(9.765625e-04f))

#define BFLOAT_DIG 2
#define BFLOAT_MANT_DIG 8
#define BFLOAT_MAX (::metal::bfloat::from_bits(0x7f7f))
#define BFLOAT_MIN (::metal::bfloat::from_bits(0x0080))
#define BFLOAT_EPSILON (::metal::bfloat::from_bits(0x3c00))
