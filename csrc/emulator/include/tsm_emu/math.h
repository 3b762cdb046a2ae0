// Math functions and constants of the Metal Shading Language, for the emulator.
//
// Every function is a template over its argument types, so scalars, vectors, packed
// vectors and swizzles all work element-wise, and a C library function of the same name and
// exact signature that happens to be visible wins overload resolution harmlessly instead of
// making the call ambiguous. No C math header is included (see types.h): the work is done by
// compiler builtins, which become libm calls where they are not inlined.
//
// Argument rules (Metal's, somewhat relaxed):
//   * vectors in one call must have the same element type and size; scalars are converted to
//     that element type and broadcast (clamp(float4, 0.0f, 1.0f)).
//   * scalars alone combine like C++ arithmetic (max(float, int) -> float, half and float ->
//     float, bfloat and an integer -> bfloat), except that mixing signed and unsigned
//     integers is rejected: min(int, uint) is ambiguous in Metal and silently wrong in C++.
//   * floating-point functions reject integer-only arguments (sqrt(4) is ambiguous in Metal).
//   * half and bfloat compute in float and round back; float computes in float (some in
//     double, then rounds); double (emulator only) computes in double.
//   * fast:: and precise:: hold the single-precision functions (float scalars and
//     vectors), which the emulator computes precisely. min/max/clamp on floats have
//     fmin/fmax semantics (a NaN operand is ignored).
//
// Not provided: functions Metal lacks (erf, expm1, log1p, remainder, hypot, ...), matrices,
// and the OpenCL spellings of the integer functions (Metal spells them absdiff, addsat,
// subsat, mulhi, madhi, madsat, not abs_diff, add_sat, ...).
#pragma once

#include "tsm_emu/runtime.h"
#include "tsm_emu/types.h"

namespace metal {
namespace tsm_detail {

// ---- result types ---------------------------------------------------------------------
template <class A, class B, bool both_int = is_int<A>::value && is_int<B>::value>
struct scal2 {
  using type = decltype(A() + B());
};
template <class A, class B>
struct scal2<A, B, true> {
  using type = std::conditional_t<std::is_signed<A>::value == std::is_signed<B>::value,
                                  decltype(A() + B()), void>;
};
template <class A>
struct scal2<A, A, false> {
  using type = A;
};
template <class A>
struct scal2<A, A, true> {
  using type = A;
};
template <>
struct scal2<bfloat, bfloat, false> {
  using type = bfloat;
};
template <class B>
struct scal2<bfloat, B, false> {
  using type = typename bf_arith<bfloat, B>::type;
};
template <class A>
struct scal2<A, bfloat, false> {
  using type = typename bf_arith<A, bfloat>::type;
};

template <class A, class B, bool AV = vinfo<A>::vec_like, bool BV = vinfo<B>::vec_like,
          class = void>
struct cmn2 {};
template <class A, class B>
struct cmn2<A, B, true, true,
            std::enable_if_t<std::is_same<typename vinfo<A>::vec_type,
                                          typename vinfo<B>::vec_type>::value>> {
  using type = typename vinfo<A>::vec_type;
};
template <class A, class B>
struct cmn2<A, B, true, false, std::enable_if_t<is_scalar<B>::value>> {
  using type = typename vinfo<A>::vec_type;
};
template <class A, class B>
struct cmn2<A, B, false, true, std::enable_if_t<is_scalar<A>::value>> {
  using type = typename vinfo<B>::vec_type;
};
template <class A, class B>
struct cmn2<A, B, false, false,
            std::enable_if_t<is_scalar<A>::value && is_scalar<B>::value &&
                             !std::is_void<typename scal2<A, B>::type>::value>> {
  using type = typename scal2<A, B>::type;
};

template <class V, class... X>
struct cmn_fold {};
template <class... X>
struct cmn {};
template <class A>
struct cmn<A> : std::enable_if<vinfo<A>::vec_like || is_scalar<A>::value,
                               typename vinfo<A>::vec_type> {};
template <class A, class B, class... R>
struct cmn<A, B, R...> : cmn_fold<void, A, B, R...> {};
template <class A, class B, class... R>
struct cmn_fold<std::void_t<typename cmn2<A, B>::type>, A, B, R...>
    : cmn<typename cmn2<A, B>::type, R...> {};

// The type every argument is converted to, and the result of most functions. A compiler
// error "no type named 'type' in struct metal::tsm_detail::cmn<...>" means the arguments
// have no common Metal type: vectors of different types or sizes, a non-numeric argument,
// or signed mixed with unsigned integers (min(uint, int) is ambiguous in Metal: cast one).
template <class... X>
using cmn_t = typename cmn<bare<X>...>::type;
template <class R>
using elem_t = typename vinfo<R>::elem;

template <class R>
using if_fp = std::enable_if_t<is_fp<elem_t<R>>::value, R>;
template <class R>
using if_int = std::enable_if_t<is_int<elem_t<R>>::value, R>;
template <class R>
using if_num = std::enable_if_t<is_fp<elem_t<R>>::value || is_int<elem_t<R>>::value, R>;

// Metal's library has no bfloat overloads: a bfloat argument converts to float (its one
// implicit conversion), so the function computes and returns float (vectors likewise).
template <class R>
struct bf_to_float {
  using type = R;
};
template <>
struct bf_to_float<bfloat> {
  using type = float;
};
template <int N>
struct bf_to_float<vec<bfloat, N>> {
  using type = vec<float, N>;
};
template <class R>
using bf_to_float_t = typename bf_to_float<R>::type;

template <class... X>
using fp_t = if_fp<bf_to_float_t<cmn_t<X...>>>;
template <class... X>
using int_t = if_int<cmn_t<X...>>;
template <class... X>
using num_t = if_num<bf_to_float_t<cmn_t<X...>>>;
// Both arguments Metal scalars of a type its library declares functions for (not bfloat):
// Metal's two-argument functions on scalars are overloads, not templates, so a user's
// template that matches exactly where they need a conversion wins (PyTorch's
// `c10::metal::pow<T, U>(T, U)` for `pow(float, int)`), and they win over a user's template
// where both match exactly (`min(uint, uint)`). The emulator's templates step aside there for
// its own per-type overloads.
template <class T>
struct is_library_scalar
    : std::integral_constant<bool, (std::is_arithmetic<bare<T>>::value || std::is_same<bare<T>, _Float16>::value) &&
                                       !std::is_same<bare<T>, bool>::value> {};
template <class X, class Y>
using if_not_scalars = std::enable_if_t<!(is_library_scalar<X>::value && is_library_scalar<Y>::value), int>;

// R with its element type replaced by E.
template <class R, class E>
struct rebind {
  using type = E;
};
template <class T, int N, class E>
struct rebind<vec<T, N>, E> {
  using type = vec<E, N>;
};
template <class R, class E>
using rebind_t = typename rebind<R, E>::type;

// The precision a floating-point element is computed in.
template <class E>
using calc_t = std::conditional_t<std::is_same<E, double>::value || std::is_same<E, long double>::value,
                                  double, float>;

// ---- element-wise application ---------------------------------------------------------
// Converts every argument to R (vector or scalar) and applies f lane by lane; Out is R or
// R with another element type.
template <class Out, class R, class F, class... A, std::size_t... J>
inline Out apply_impl(F f, std::index_sequence<J...>, const A&... a) {
  if constexpr (vinfo<R>::vec_like) {
    const R c[] = {to_vec<R>(a)...};
    Out r{};
    for (int i = 0; i < R::size; ++i) r.d_[i] = f(c[J].d_[i]...);
    return r;
  } else {
    return f(static_cast<R>(a)...);
  }
}
template <class Out, class R, class F, class... A>
inline Out apply(F f, const A&... a) {
  return apply_impl<Out, R>(f, std::index_sequence_for<A...>{}, a...);
}

// ---- scalar kernels -------------------------------------------------------------------
constexpr double kPi = 3.14159265358979323846264338327950288;

inline float h_fmin(float x, float y) { return __builtin_fminf(x, y); }
inline double h_fmin(double x, double y) { return __builtin_fmin(x, y); }
inline float h_fmax(float x, float y) { return __builtin_fmaxf(x, y); }
inline double h_fmax(double x, double y) { return __builtin_fmax(x, y); }

template <class C>
inline C h_fract(C x) {
  if (__builtin_isnan(x)) return x;
  if (__builtin_isinf(x)) return __builtin_copysign(C(0), x);
  const C one_minus_ulp = sizeof(C) == 4 ? C(0x1.fffffep-1f) : C(0x1.fffffffffffffp-1);
  const C f = x - __builtin_floor(x);
  return f < one_minus_ulp ? f : one_minus_ulp;
}
// sin(pi x), cos(pi x) with exact zeros at the integers / half-integers.
inline double h_sinpi(double x) {
  if (__builtin_isinf(x) || __builtin_isnan(x)) return __builtin_nan("");
  const double r = __builtin_fmod(x, 2.0);  // exact
  if (r == __builtin_trunc(r)) return __builtin_copysign(0.0, x);
  return __builtin_sin(kPi * r);
}
inline double h_cospi(double x) {
  if (__builtin_isinf(x) || __builtin_isnan(x)) return __builtin_nan("");
  const double r = __builtin_fabs(__builtin_fmod(x, 2.0));
  if (r == 0.5 || r == 1.5) return 0.0;
  return __builtin_cos(kPi * r);
}
inline double h_tanpi(double x) {
  if (__builtin_isinf(x) || __builtin_isnan(x)) return __builtin_nan("");
  const double r = __builtin_fmod(x, 1.0);  // tan has period pi
  if (r == 0.0) return __builtin_copysign(0.0, x);
  if (__builtin_fabs(r) == 0.5) return __builtin_copysign(__builtin_inf(), r);
  return __builtin_tan(kPi * r);
}
template <class C>
inline C h_sign(C x) {
  if (__builtin_isnan(x)) return C(0);
  if (x > C(0)) return C(1);
  if (x < C(0)) return C(-1);
  return x;  // keeps the sign of zero
}
template <class C>
inline C h_clampf(C x, C lo, C hi) {
  return h_fmin(h_fmax(x, lo), hi);
}
template <class C>
inline C h_smoothstep(C e0, C e1, C x) {
  const C t = h_clampf((x - e0) / (e1 - e0), C(0), C(1));
  return t * t * (C(3) - C(2) * t);
}
template <class C>
inline C h_median3(C x, C y, C z) {
  return h_fmax(h_fmin(x, y), h_fmin(h_fmax(x, y), z));
}

// Integer helpers on the element type T.
template <class T>
constexpr int width() { return int(sizeof(T)) * 8; }
template <class T>
using wide_t = std::conditional_t<std::is_signed<T>::value, __int128, unsigned __int128>;
template <class T>
using uns_t = std::make_unsigned_t<T>;

template <class T>
inline T k_clz(T x) {
  const auto u = static_cast<uns_t<T>>(x);
  if (u == 0) return static_cast<T>(width<T>());
  if (sizeof(T) == 8) return static_cast<T>(__builtin_clzll(static_cast<unsigned long long>(u)));
  return static_cast<T>(__builtin_clz(static_cast<unsigned>(u)) - (32 - width<T>()));
}
template <class T>
inline T k_ctz(T x) {
  const auto u = static_cast<uns_t<T>>(x);
  if (u == 0) return static_cast<T>(width<T>());
  return static_cast<T>(__builtin_ctzll(static_cast<unsigned long long>(u)));
}
template <class T>
inline T k_popcount(T x) {
  return static_cast<T>(__builtin_popcountll(static_cast<unsigned long long>(static_cast<uns_t<T>>(x))));
}
template <class T>
inline T k_reverse_bits(T x) {
  auto u = static_cast<uns_t<T>>(x);
  uns_t<T> r = 0;
  for (int i = 0; i < width<T>(); ++i) {
    r = static_cast<uns_t<T>>((r << 1) | (u & 1u));
    u = static_cast<uns_t<T>>(u >> 1);
  }
  return static_cast<T>(r);
}
template <class T>
inline T k_rotate(T v, T i) {
  const auto u = static_cast<uns_t<T>>(v);
  const int s = int(static_cast<uns_t<T>>(i) % uns_t<T>(width<T>()));
  if (s == 0) return v;
  return static_cast<T>(static_cast<uns_t<T>>((u << s) | (u >> (width<T>() - s))));
}
template <class T, class V>
inline T k_sat(V v) {
  const V lo = V(std::numeric_limits<T>::min()), hi = V(std::numeric_limits<T>::max());
  return static_cast<T>(v < lo ? lo : (v > hi ? hi : v));
}
template <class T>
inline T k_mulhi(T x, T y) {
  return static_cast<T>((wide_t<T>(x) * wide_t<T>(y)) >> width<T>());
}
template <class T>
inline T k_iabs(T x) {
  if constexpr (std::is_signed<T>::value) {
    return x < 0 ? static_cast<T>(uns_t<T>(0) - static_cast<uns_t<T>>(x)) : x;
  } else {
    return x;
  }
}
template <class T>
inline T k_extract_bits(T x, uint offset, uint bits) {
  if (bits == 0) return T(0);
  const auto u = static_cast<uns_t<T>>(x);
  const int W = width<T>();
  // move field to the top, then shift down (arithmetic for signed: sign-extends)
  const auto top = static_cast<uns_t<T>>(u << (W - int(offset) - int(bits)));
  return static_cast<T>(static_cast<T>(top) >> (W - int(bits)));
}
template <class T>
inline T k_insert_bits(T base, T ins, uint offset, uint bits) {
  if (bits == 0) return base;
  const int W = width<T>();
  const auto ones = static_cast<uns_t<T>>(~uns_t<T>(0));
  const auto mask = static_cast<uns_t<T>>(static_cast<uns_t<T>>(ones >> (W - int(bits))) << offset);
  const auto b = static_cast<uns_t<T>>(base), i = static_cast<uns_t<T>>(static_cast<uns_t<T>>(ins) << offset);
  return static_cast<T>(static_cast<uns_t<T>>((b & ~mask) | (i & mask)));
}

// Element-wise min/max: fmin/fmax for floating point, plain for integers.
template <class E>
inline E e_min(E x, E y) {
  if constexpr (is_fp<E>::value) {
    return static_cast<E>(h_fmin(calc_t<E>(x), calc_t<E>(y)));
  } else {
    return y < x ? y : x;
  }
}
template <class E>
inline E e_max(E x, E y) {
  if constexpr (is_fp<E>::value) {
    return static_cast<E>(h_fmax(calc_t<E>(x), calc_t<E>(y)));
  } else {
    return x < y ? y : x;
  }
}

}  // namespace tsm_detail

// ---- floating-point functions ---------------------------------------------------------
// TSM_FP<n>(name, float expression, double expression) over arguments x, y, z.
#define TSM_FP_LAMBDA1(name) [](auto x_) { using E = decltype(x_); return static_cast<E>(tsm_detail::k_##name(tsm_detail::calc_t<E>(x_))); }
#define TSM_FP1(name, fexpr, dexpr)                                                           \
  namespace tsm_detail {                                                                      \
  inline float k_##name(float x) { return fexpr; }                                            \
  inline double k_##name(double x) { return dexpr; }                                          \
  }                                                                                           \
  template <class X, class R = tsm_detail::fp_t<X>>                                           \
  inline R name(const X& x) {                                                                 \
    return tsm_detail::apply<R, R>(TSM_FP_LAMBDA1(name), x);                                  \
  }
#define TSM_FP2(name, fexpr, dexpr)                                                           \
  namespace tsm_detail {                                                                      \
  inline float k_##name(float x, float y) { return fexpr; }                                   \
  inline double k_##name(double x, double y) { return dexpr; }                                \
  }                                                                                           \
  namespace tsm_detail {                                                                      \
  template <class X, class Y, class R = fp_t<X, Y>>                                           \
  inline R any_##name(const X& x, const Y& y) {                                               \
    return apply<R, R>(                                                                       \
        [](auto x_, auto y_) {                                                                \
          using E = decltype(x_);                                                             \
          using C = calc_t<E>;                                                                \
          return static_cast<E>(k_##name(C(x_), C(y_)));                                      \
        },                                                                                    \
        x, y);                                                                                \
  }                                                                                           \
  }                                                                                           \
  template <class X, class Y, class R = tsm_detail::fp_t<X, Y>, tsm_detail::if_not_scalars<X, Y> = 0> \
  inline R name(const X& x, const Y& y) {                                                     \
    return tsm_detail::any_##name(x, y);                                                      \
  }                                                                                           \
  inline float name(float x, float y) { return tsm_detail::any_##name(x, y); }                \
  inline _Float16 name(_Float16 x, _Float16 y) { return tsm_detail::any_##name(x, y); }       \
  inline double name(double x, double y) { return tsm_detail::any_##name(x, y); }
#define TSM_FP3(name, fexpr, dexpr)                                                           \
  namespace tsm_detail {                                                                      \
  inline float k_##name(float x, float y, float z) { return fexpr; }                          \
  inline double k_##name(double x, double y, double z) { return dexpr; }                      \
  }                                                                                           \
  template <class X, class Y, class Z, class R = tsm_detail::fp_t<X, Y, Z>>                   \
  inline R name(const X& x, const Y& y, const Z& z) {                                         \
    return tsm_detail::apply<R, R>(                                                           \
        [](auto x_, auto y_, auto z_) {                                                       \
          using E = decltype(x_);                                                             \
          using C = tsm_detail::calc_t<E>;                                                    \
          return static_cast<E>(tsm_detail::k_##name(C(x_), C(y_), C(z_)));                   \
        },                                                                                    \
        x, y, z);                                                                             \
  }

TSM_FP1(sqrt, __builtin_sqrtf(x), __builtin_sqrt(x))
TSM_FP1(rsqrt, float(1.0 / __builtin_sqrt(double(x))), 1.0 / __builtin_sqrt(x))
TSM_FP1(cbrt, __builtin_cbrtf(x), __builtin_cbrt(x))
TSM_FP1(exp, __builtin_expf(x), __builtin_exp(x))
TSM_FP1(exp2, __builtin_exp2f(x), __builtin_exp2(x))
TSM_FP1(exp10, float(__builtin_pow(10.0, double(x))), __builtin_pow(10.0, x))
TSM_FP1(log, __builtin_logf(x), __builtin_log(x))
TSM_FP1(log2, __builtin_log2f(x), __builtin_log2(x))
TSM_FP1(log10, __builtin_log10f(x), __builtin_log10(x))
TSM_FP1(sin, __builtin_sinf(x), __builtin_sin(x))
TSM_FP1(cos, __builtin_cosf(x), __builtin_cos(x))
TSM_FP1(tan, __builtin_tanf(x), __builtin_tan(x))
TSM_FP1(asin, __builtin_asinf(x), __builtin_asin(x))
TSM_FP1(acos, __builtin_acosf(x), __builtin_acos(x))
TSM_FP1(atan, __builtin_atanf(x), __builtin_atan(x))
TSM_FP1(sinh, __builtin_sinhf(x), __builtin_sinh(x))
TSM_FP1(cosh, __builtin_coshf(x), __builtin_cosh(x))
TSM_FP1(tanh, __builtin_tanhf(x), __builtin_tanh(x))
TSM_FP1(asinh, __builtin_asinhf(x), __builtin_asinh(x))
TSM_FP1(acosh, __builtin_acoshf(x), __builtin_acosh(x))
TSM_FP1(atanh, __builtin_atanhf(x), __builtin_atanh(x))
TSM_FP1(sinpi, float(h_sinpi(double(x))), h_sinpi(x))
TSM_FP1(cospi, float(h_cospi(double(x))), h_cospi(x))
TSM_FP1(tanpi, float(h_tanpi(double(x))), h_tanpi(x))
TSM_FP1(asinpi, float(__builtin_asin(double(x)) / kPi), __builtin_asin(x) / kPi)
TSM_FP1(acospi, float(__builtin_acos(double(x)) / kPi), __builtin_acos(x) / kPi)
TSM_FP1(atanpi, float(__builtin_atan(double(x)) / kPi), __builtin_atan(x) / kPi)
TSM_FP1(floor, __builtin_floorf(x), __builtin_floor(x))
TSM_FP1(ceil, __builtin_ceilf(x), __builtin_ceil(x))
TSM_FP1(round, __builtin_roundf(x), __builtin_round(x))  // halfway cases away from zero
TSM_FP1(rint, __builtin_rintf(x), __builtin_rint(x))     // halfway cases to even
TSM_FP1(trunc, __builtin_truncf(x), __builtin_trunc(x))
TSM_FP1(fract, h_fract(x), h_fract(x))
TSM_FP1(fabs, __builtin_fabsf(x), __builtin_fabs(x))
TSM_FP1(logb, __builtin_logbf(x), __builtin_logb(x))
TSM_FP1(sign, h_sign(x), h_sign(x))
TSM_FP1(saturate, h_clampf(x, 0.0f, 1.0f), h_clampf(x, 0.0, 1.0))

TSM_FP2(pow, __builtin_powf(x, y), __builtin_pow(x, y))
TSM_FP2(powr, x < 0.0f ? __builtin_nanf("") : __builtin_powf(x, y),
        x < 0.0 ? __builtin_nan("") : __builtin_pow(x, y))
TSM_FP2(atan2, __builtin_atan2f(x, y), __builtin_atan2(x, y))
TSM_FP2(atan2pi, float(__builtin_atan2(double(x), double(y)) / kPi), __builtin_atan2(x, y) / kPi)
TSM_FP2(fmod, __builtin_fmodf(x, y), __builtin_fmod(x, y))
TSM_FP2(fdim, __builtin_fdimf(x, y), __builtin_fdim(x, y))
TSM_FP2(copysign, __builtin_copysignf(x, y), __builtin_copysign(x, y))
TSM_FP2(nextafter, __builtin_nextafterf(x, y), __builtin_nextafter(x, y))
TSM_FP2(fmin, h_fmin(x, y), h_fmin(x, y))
TSM_FP2(fmax, h_fmax(x, y), h_fmax(x, y))
TSM_FP2(divide, x / y, x / y)
TSM_FP2(step, y < x ? 0.0f : 1.0f, y < x ? 0.0 : 1.0)  // step(edge, x)

// Instrumented builds count explicit multiply-adds (runtime.h: counted_fmas).
#define TSM_COUNT_FMA() ::tsm_emu::counted_fmas(1)
namespace tsm_detail {
inline float counted_fma(float x, float y, float z) { return TSM_COUNT_FMA(), __builtin_fmaf(x, y, z); }
inline double counted_fma(double x, double y, double z) { return TSM_COUNT_FMA(), __builtin_fma(x, y, z); }
}  // namespace tsm_detail
TSM_FP3(fma, counted_fma(x, y, z), counted_fma(x, y, z))
TSM_FP3(mad, counted_fma(x, y, z), counted_fma(x, y, z))
TSM_FP3(mix, x + (y - x) * z, x + (y - x) * z)
TSM_FP3(smoothstep, h_smoothstep(x, y, z), h_smoothstep(x, y, z))
TSM_FP3(fmin3, h_fmin(h_fmin(x, y), z), h_fmin(h_fmin(x, y), z))
TSM_FP3(fmax3, h_fmax(h_fmax(x, y), z), h_fmax(h_fmax(x, y), z))
TSM_FP3(fmedian3, h_median3(x, y, z), h_median3(x, y, z))

#undef TSM_FP_LAMBDA1
#undef TSM_FP1
#undef TSM_FP2
#undef TSM_FP3

// sincos(x, cosval): returns sin(x), stores cos(x).
template <class X, class R = tsm_detail::fp_t<X>>
inline R sincos(const X& x, R& cosval) {
  cosval = cos(x);
  return sin(x);
}
// modf(x, intval): returns the fractional part, stores the integral part (both with x's sign).
template <class X, class R = tsm_detail::fp_t<X>>
inline R modf(const X& x, R& intval) {
  intval = trunc(x);
  return tsm_detail::apply<R, R>(
      [](auto v) {
        using E = decltype(v);
        using C = tsm_detail::calc_t<E>;
        const C c = C(v);
        return static_cast<E>(__builtin_isinf(c) ? __builtin_copysign(C(0), c) : c - __builtin_trunc(c));
      },
      x);
}
// frexp(x, exponent): mantissa in [0.5, 1), exponent as int / intN.
template <class X, class R = tsm_detail::fp_t<X>>
inline R frexp(const X& x, tsm_detail::rebind_t<R, int>& exponent) {
  const R v = x;
  R m{};
  if constexpr (tsm_detail::vinfo<R>::vec_like) {
    for (int i = 0; i < R::size; ++i) {
      using E = typename R::value_type;
      m.d_[i] = static_cast<E>(__builtin_frexp(double(v.d_[i]), &exponent.d_[i]));
    }
  } else {
    m = static_cast<R>(__builtin_frexp(double(v), &exponent));
  }
  return m;
}
// ldexp(x, k) = x * 2^k; k is int or intN.
template <class X, class K, class R = tsm_detail::fp_t<X>,
          std::enable_if_t<std::is_same<tsm_detail::elem_t<tsm_detail::cmn_t<K>>, int>::value, int> = 0>
inline R ldexp(const X& x, const K& k) {
  const tsm_detail::rebind_t<R, int> kk = tsm_detail::to_vec<tsm_detail::rebind_t<R, int>>(k);
  const R v = x;
  R r{};
  if constexpr (tsm_detail::vinfo<R>::vec_like) {
    for (int i = 0; i < R::size; ++i)
      r.d_[i] = static_cast<typename R::value_type>(__builtin_ldexp(double(v.d_[i]), kk.d_[i]));
  } else {
    r = static_cast<R>(__builtin_ldexp(double(v), kk));
  }
  return r;
}
template <class X, class R = tsm_detail::fp_t<X>>
inline tsm_detail::rebind_t<R, int> ilogb(const X& x) {
  return tsm_detail::apply<tsm_detail::rebind_t<R, int>, R>(
      [](auto v) { return __builtin_ilogb(double(v)); }, x);
}

// ---- predicates (bool / boolN) --------------------------------------------------------
#define TSM_PRED1(name, expr)                                                                 \
  template <class X, class R = tsm_detail::fp_t<X>>                                           \
  inline tsm_detail::rebind_t<R, bool> name(const X& x) {                                     \
    return tsm_detail::apply<tsm_detail::rebind_t<R, bool>, R>(                               \
        [](auto v) -> bool { const auto c = tsm_detail::calc_t<decltype(v)>(v); return expr; }, x); \
  }
#define TSM_PRED2(name, expr)                                                                 \
  template <class X, class Y, class R = tsm_detail::fp_t<X, Y>>                               \
  inline tsm_detail::rebind_t<R, bool> name(const X& x, const Y& y) {                         \
    return tsm_detail::apply<tsm_detail::rebind_t<R, bool>, R>(                               \
        [](auto v, auto w) -> bool {                                                          \
          const auto a = tsm_detail::calc_t<decltype(v)>(v);                                  \
          const auto b = tsm_detail::calc_t<decltype(v)>(w);                                  \
          return expr;                                                                        \
        },                                                                                    \
        x, y);                                                                                \
  }
TSM_PRED1(isnan, __builtin_isnan(c))
TSM_PRED1(isinf, __builtin_isinf(c))
TSM_PRED1(isfinite, __builtin_isfinite(c))
TSM_PRED1(isnormal, __builtin_isnormal(c))
TSM_PRED1(signbit, __builtin_signbit(c))
TSM_PRED2(isordered, !__builtin_isunordered(a, b))
TSM_PRED2(isunordered, __builtin_isunordered(a, b))
TSM_PRED2(isequal, a == b)
TSM_PRED2(isnotequal, a != b)
TSM_PRED2(isgreater, a > b)
TSM_PRED2(isgreaterequal, a >= b)
TSM_PRED2(isless, a < b)
TSM_PRED2(islessequal, a <= b)
TSM_PRED2(islessgreater, a < b || a > b)
#undef TSM_PRED1
#undef TSM_PRED2

// ---- functions on integers and floats -------------------------------------------------
template <class X, class R = tsm_detail::num_t<X>>
inline R abs(const X& x) {
  return tsm_detail::apply<R, R>(
      [](auto v) {
        using E = decltype(v);
        if constexpr (tsm_detail::is_fp<E>::value) {
          return static_cast<E>(__builtin_fabs(tsm_detail::calc_t<E>(v)));
        } else {
          return tsm_detail::k_iabs(v);
        }
      },
      x);
}
namespace tsm_detail {
template <class X, class Y, class R = num_t<X, Y>>
inline R any_min(const X& x, const Y& y) {
  return apply<R, R>([](auto a, auto b) { return e_min(a, b); }, x, y);
}
template <class X, class Y, class R = num_t<X, Y>>
inline R any_max(const X& x, const Y& y) {
  return apply<R, R>([](auto a, auto b) { return e_max(a, b); }, x, y);
}
}  // namespace tsm_detail
template <class X, class Y, class R = tsm_detail::num_t<X, Y>, tsm_detail::if_not_scalars<X, Y> = 0>
inline R min(const X& x, const Y& y) {
  return tsm_detail::any_min(x, y);
}
template <class X, class Y, class R = tsm_detail::num_t<X, Y>, tsm_detail::if_not_scalars<X, Y> = 0>
inline R max(const X& x, const Y& y) {
  return tsm_detail::any_max(x, y);
}
// Metal's scalar overloads (see is_library_scalar).
#define TSM_MINMAX(T)                                                     \
  inline T min(T x, T y) { return tsm_detail::any_min(x, y); }           \
  inline T max(T x, T y) { return tsm_detail::any_max(x, y); }
TSM_MINMAX(char) TSM_MINMAX(signed char) TSM_MINMAX(unsigned char) TSM_MINMAX(short) TSM_MINMAX(unsigned short)
TSM_MINMAX(int) TSM_MINMAX(unsigned int) TSM_MINMAX(long) TSM_MINMAX(unsigned long) TSM_MINMAX(_Float16)
TSM_MINMAX(float) TSM_MINMAX(double)
#undef TSM_MINMAX
// clamp(x, lo, hi) = min(max(x, lo), hi); undefined in Metal when lo > hi.
template <class X, class L, class H, class R = tsm_detail::num_t<X, L, H>>
inline R clamp(const X& x, const L& lo, const H& hi) {
  return tsm_detail::apply<R, R>(
      [](auto a, auto l, auto h) { return tsm_detail::e_min(tsm_detail::e_max(a, l), h); }, x, lo, hi);
}
template <class X, class Y, class Z, class R = tsm_detail::num_t<X, Y, Z>>
inline R min3(const X& x, const Y& y, const Z& z) {
  return tsm_detail::apply<R, R>(
      [](auto a, auto b, auto c) { return tsm_detail::e_min(tsm_detail::e_min(a, b), c); }, x, y, z);
}
template <class X, class Y, class Z, class R = tsm_detail::num_t<X, Y, Z>>
inline R max3(const X& x, const Y& y, const Z& z) {
  return tsm_detail::apply<R, R>(
      [](auto a, auto b, auto c) { return tsm_detail::e_max(tsm_detail::e_max(a, b), c); }, x, y, z);
}
template <class X, class Y, class Z, class R = tsm_detail::num_t<X, Y, Z>>
inline R median3(const X& x, const Y& y, const Z& z) {
  return tsm_detail::apply<R, R>(
      [](auto a, auto b, auto c) {
        using tsm_detail::e_max;
        using tsm_detail::e_min;
        return e_max(e_min(a, b), e_min(e_max(a, b), c));
      },
      x, y, z);
}

// ---- integer functions ----------------------------------------------------------------
#define TSM_INT1(name, expr)                                                                  \
  template <class X, class R = tsm_detail::int_t<X>>                                          \
  inline R name(const X& x) {                                                                 \
    return tsm_detail::apply<R, R>([](auto v) { return expr; }, x);                           \
  }
#define TSM_INT2(name, expr)                                                                  \
  template <class X, class Y, class R = tsm_detail::int_t<X, Y>>                              \
  inline R name(const X& x, const Y& y) {                                                     \
    return tsm_detail::apply<R, R>(                                                           \
        [](auto a, auto b) {                                                                  \
          using E = decltype(a);                                                              \
          using W = tsm_detail::wide_t<E>; /* 128 bits, signedness of E */                   \
          using S = __int128;              /* holds any sum/difference of two 64-bit values */ \
          (void)sizeof(W);                                                                    \
          (void)sizeof(S);                                                                    \
          return static_cast<E>(expr);                                                        \
        },                                                                                    \
        x, y);                                                                                \
  }
#define TSM_INT3(name, expr)                                                                  \
  template <class X, class Y, class Z, class R = tsm_detail::int_t<X, Y, Z>>                  \
  inline R name(const X& x, const Y& y, const Z& z) {                                         \
    return tsm_detail::apply<R, R>(                                                           \
        [](auto a, auto b, auto c) {                                                          \
          using E = decltype(a);                                                              \
          using W = tsm_detail::wide_t<E>; /* 128 bits, signedness of E */                   \
          using S = __int128;              /* holds any sum/difference of two 64-bit values */ \
          (void)sizeof(W);                                                                    \
          (void)sizeof(S);                                                                    \
          return static_cast<E>(expr);                                                        \
        },                                                                                    \
        x, y, z);                                                                             \
  }
TSM_INT1(clz, tsm_detail::k_clz(v))
TSM_INT1(ctz, tsm_detail::k_ctz(v))
TSM_INT1(popcount, tsm_detail::k_popcount(v))
TSM_INT1(reverse_bits, tsm_detail::k_reverse_bits(v))
TSM_INT2(addsat, tsm_detail::k_sat<E>(S(a) + S(b)))
TSM_INT2(subsat, tsm_detail::k_sat<E>(S(a) - S(b)))
TSM_INT2(hadd, (S(a) + S(b)) >> 1)
TSM_INT2(rhadd, (S(a) + S(b) + 1) >> 1)
TSM_INT2(mulhi, tsm_detail::k_mulhi(a, b))
TSM_INT2(rotate, tsm_detail::k_rotate(a, b))
TSM_INT2(mul24, static_cast<tsm_detail::uns_t<E>>(a) * static_cast<tsm_detail::uns_t<E>>(b))
TSM_INT3(madhi, static_cast<tsm_detail::uns_t<E>>(tsm_detail::k_mulhi(a, b)) + static_cast<tsm_detail::uns_t<E>>(c))
TSM_INT3(madsat, tsm_detail::k_sat<E>(W(a) * W(b) + W(c)))
TSM_INT3(mad24, static_cast<tsm_detail::uns_t<E>>(a) * static_cast<tsm_detail::uns_t<E>>(b) +
                    static_cast<tsm_detail::uns_t<E>>(c))
#undef TSM_INT1
#undef TSM_INT2
#undef TSM_INT3

// absdiff(x, y) = |x - y| without overflow, as the unsigned type.
template <class X, class Y, class R = tsm_detail::int_t<X, Y>>
inline tsm_detail::rebind_t<R, std::make_unsigned_t<tsm_detail::elem_t<R>>> absdiff(const X& x, const Y& y) {
  using U = std::make_unsigned_t<tsm_detail::elem_t<R>>;
  return tsm_detail::apply<tsm_detail::rebind_t<R, U>, R>(
      [](auto a, auto b) { return static_cast<U>(a < b ? static_cast<U>(b) - static_cast<U>(a)
                                                       : static_cast<U>(a) - static_cast<U>(b)); },
      x, y);
}
// extract_bits(x, offset, bits): bits [offset, offset + bits) of x in the low bits,
// sign-extended for signed types; 0 when bits == 0.
template <class X, class R = tsm_detail::int_t<X>>
inline R extract_bits(const X& x, uint offset, uint bits) {
  return tsm_detail::apply<R, R>(
      [offset, bits](auto v) { return tsm_detail::k_extract_bits(v, offset, bits); }, x);
}
// insert_bits(base, insert, offset, bits): base with bits [offset, offset + bits) replaced
// by the low bits of insert.
template <class X, class Y, class R = tsm_detail::int_t<X, Y>>
inline R insert_bits(const X& base, const Y& insert, uint offset, uint bits) {
  return tsm_detail::apply<R, R>(
      [offset, bits](auto b, auto i) { return tsm_detail::k_insert_bits(b, i, offset, bits); },
      base, insert);
}

// ---- relational -----------------------------------------------------------------------
// select(a, b, c): c ? b : a, per component; c is bool or a bool vector of the same size
// (for scalars, anything that converts to bool: ggml's select(1, -1, bits & mask)).
template <class A, class B, class C, class R = tsm_detail::cmn_t<A, B>,
          std::enable_if_t<std::is_same<tsm_detail::bare<C>, bool>::value ||
                               (!tsm_detail::vinfo<R>::vec_like && tsm_detail::is_scalar<C>::value) ||
                               std::is_same<typename tsm_detail::vi<C>::vec_type,
                                            tsm_detail::rebind_t<R, bool>>::value,
                           int> = 0>
inline R select(const A& a, const B& b, const C& c) {
  using M = tsm_detail::rebind_t<R, bool>;
  const R va = a, vb = b;
  const M m = tsm_detail::to_vec<M>(c);
  if constexpr (tsm_detail::vinfo<R>::vec_like) {
    R r{};
    for (int i = 0; i < R::size; ++i) r.d_[i] = m.d_[i] ? vb.d_[i] : va.d_[i];
    return r;
  } else {
    return m ? vb : va;
  }
}
// all / any over a bool vector (or any vector: non-zero counts as true) or a scalar.
template <class X, std::enable_if_t<tsm_detail::is_vec_like<X>::value || tsm_detail::is_scalar<X>::value, int> = 0>
inline bool all(const X& x) {
  const typename tsm_detail::vi<X>::vec_type v = x;
  if constexpr (tsm_detail::vi<X>::vec_like) {
    for (int i = 0; i < tsm_detail::vi<X>::n; ++i)
      if (!v.d_[i]) return false;
    return true;
  } else {
    return bool(v);
  }
}
template <class X, std::enable_if_t<tsm_detail::is_vec_like<X>::value || tsm_detail::is_scalar<X>::value, int> = 0>
inline bool any(const X& x) {
  const typename tsm_detail::vi<X>::vec_type v = x;
  if constexpr (tsm_detail::vi<X>::vec_like) {
    for (int i = 0; i < tsm_detail::vi<X>::n; ++i)
      if (v.d_[i]) return true;
    return false;
  } else {
    return bool(v);
  }
}

// ---- geometric ------------------------------------------------------------------------
// Computed in float (double for double vectors) and rounded once at the end.
template <class X, class Y, class R = tsm_detail::fp_t<X, Y>,
          std::enable_if_t<tsm_detail::vinfo<R>::vec_like, int> = 0>
inline tsm_detail::elem_t<R> dot(const X& x, const Y& y) {
  using E = tsm_detail::elem_t<R>;
  using C = tsm_detail::calc_t<E>;
  const R a = x, b = y;
  C s = 0;
  for (int i = 0; i < R::size; ++i) s += C(a.d_[i]) * C(b.d_[i]);
  return static_cast<E>(s);
}
template <class X, class Y, class R = tsm_detail::fp_t<X, Y>,
          std::enable_if_t<tsm_detail::vinfo<R>::vec_like && tsm_detail::vinfo<R>::n == 3, int> = 0>
inline R cross(const X& x, const Y& y) {
  using E = tsm_detail::elem_t<R>;
  using C = tsm_detail::calc_t<E>;
  const R a = x, b = y;
  return R(static_cast<E>(C(a.d_[1]) * C(b.d_[2]) - C(a.d_[2]) * C(b.d_[1])),
           static_cast<E>(C(a.d_[2]) * C(b.d_[0]) - C(a.d_[0]) * C(b.d_[2])),
           static_cast<E>(C(a.d_[0]) * C(b.d_[1]) - C(a.d_[1]) * C(b.d_[0])));
}
template <class X, class R = tsm_detail::fp_t<X>, std::enable_if_t<tsm_detail::vinfo<R>::vec_like, int> = 0>
inline tsm_detail::elem_t<R> length_squared(const X& x) {
  return dot(x, x);
}
template <class X, class R = tsm_detail::fp_t<X>, std::enable_if_t<tsm_detail::vinfo<R>::vec_like, int> = 0>
inline tsm_detail::elem_t<R> length(const X& x) {
  using E = tsm_detail::elem_t<R>;
  using C = tsm_detail::calc_t<E>;
  const R a = x;
  C s = 0;
  for (int i = 0; i < R::size; ++i) s += C(a.d_[i]) * C(a.d_[i]);
  return static_cast<E>(tsm_detail::k_sqrt(s));
}
template <class X, class Y, class R = tsm_detail::fp_t<X, Y>,
          std::enable_if_t<tsm_detail::vinfo<R>::vec_like, int> = 0>
inline tsm_detail::elem_t<R> distance(const X& x, const Y& y) {
  return length(R(x) - R(y));
}
template <class X, class Y, class R = tsm_detail::fp_t<X, Y>,
          std::enable_if_t<tsm_detail::vinfo<R>::vec_like, int> = 0>
inline tsm_detail::elem_t<R> distance_squared(const X& x, const Y& y) {
  const R d = R(x) - R(y);
  return dot(d, d);
}
template <class X, class R = tsm_detail::fp_t<X>, std::enable_if_t<tsm_detail::vinfo<R>::vec_like, int> = 0>
inline R normalize(const X& x) {
  using E = tsm_detail::elem_t<R>;
  using C = tsm_detail::calc_t<E>;
  const R a = x;
  C s = 0;
  for (int i = 0; i < R::size; ++i) s += C(a.d_[i]) * C(a.d_[i]);
  const C inv = C(1) / tsm_detail::k_sqrt(s);
  R r{};
  for (int i = 0; i < R::size; ++i) r.d_[i] = static_cast<E>(C(a.d_[i]) * inv);
  return r;
}
// reflect(i, n) = i - 2 dot(n, i) n   (n normalized)
template <class X, class Y, class R = tsm_detail::fp_t<X, Y>,
          std::enable_if_t<tsm_detail::vinfo<R>::vec_like, int> = 0>
inline R reflect(const X& i, const Y& n) {
  const R a = i, b = n;
  return a - b * (tsm_detail::elem_t<R>(2) * dot(b, a));
}
// faceforward(n, i, nref) = dot(nref, i) < 0 ? n : -n
template <class X, class Y, class Z, class R = tsm_detail::fp_t<X, Y, Z>,
          std::enable_if_t<tsm_detail::vinfo<R>::vec_like, int> = 0>
inline R faceforward(const X& n, const Y& i, const Z& nref) {
  const R nn = n;
  return dot(R(nref), R(i)) < tsm_detail::elem_t<R>(0) ? nn : -nn;
}
// refract(i, n, eta): i and n normalized.
template <class X, class Y, class E, class R = tsm_detail::fp_t<X, Y>,
          std::enable_if_t<tsm_detail::vinfo<R>::vec_like && tsm_detail::is_scalar<E>::value, int> = 0>
inline R refract(const X& i, const Y& n, const E& eta) {
  using T = tsm_detail::elem_t<R>;
  using C = tsm_detail::calc_t<T>;
  const R a = i, b = n;
  const C e = C(eta), d = C(dot(b, a));
  const C k = C(1) - e * e * (C(1) - d * d);
  if (k < C(0)) return R(T(0));
  R r{};
  const C s = e * d + tsm_detail::k_sqrt(k);
  for (int j = 0; j < R::size; ++j) r.d_[j] = static_cast<T>(e * C(a.d_[j]) - s * C(b.d_[j]));
  return r;
}

// ---- fast:: and precise:: -------------------------------------------------------------
// Both are computed precisely. They exist for single precision alone, as in Metal: a scalar
// argument of another type (half, bfloat, int) converts to float and the result is a float
// (the front end's check rejects a half vector). The scalar version is a template, which takes
// such an argument exactly, over the vector overloads, which would splat it.
#define TSM_SINGLE(name, n)                                                                   \
  template <TSM_SCALARS_##n>                                                                 \
  inline float name(TSM_SCALAR_PARAMS_##n) { return metal::name(TSM_FLOAT_ARGS_##n); }        \
  inline float2 name(TSM_PARAMS_##n(float2)) { return metal::name(TSM_ARGS_##n); }           \
  inline float3 name(TSM_PARAMS_##n(float3)) { return metal::name(TSM_ARGS_##n); }           \
  inline float4 name(TSM_PARAMS_##n(float4)) { return metal::name(TSM_ARGS_##n); }
#define TSM_SCALAR(X) class X, std::enable_if_t<tsm_detail::is_scalar<X>::value, int> = 0
#define TSM_SCALARS_1 TSM_SCALAR(X)
#define TSM_SCALARS_2 TSM_SCALAR(X), TSM_SCALAR(Y)
#define TSM_SCALARS_3 TSM_SCALAR(X), TSM_SCALAR(Y), TSM_SCALAR(Z)
#define TSM_SCALAR_PARAMS_1 X x
#define TSM_SCALAR_PARAMS_2 X x, Y y
#define TSM_SCALAR_PARAMS_3 X x, Y y, Z z
#define TSM_FLOAT_ARGS_1 float(x)
#define TSM_FLOAT_ARGS_2 float(x), float(y)
#define TSM_FLOAT_ARGS_3 float(x), float(y), float(z)
#define TSM_PARAMS_1(T) T x
#define TSM_PARAMS_2(T) T x, T y
#define TSM_PARAMS_3(T) T x, T y, T z
#define TSM_ARGS_1 x
#define TSM_ARGS_2 x, y
#define TSM_ARGS_3 x, y, z
#define TSM_SINGLE_NAMES                                                                      \
  TSM_SINGLE(acos, 1) TSM_SINGLE(acosh, 1) TSM_SINGLE(asin, 1) TSM_SINGLE(asinh, 1)           \
  TSM_SINGLE(atan, 1) TSM_SINGLE(atanh, 1) TSM_SINGLE(cos, 1) TSM_SINGLE(cosh, 1)             \
  TSM_SINGLE(cospi, 1) TSM_SINGLE(exp, 1) TSM_SINGLE(exp10, 1) TSM_SINGLE(exp2, 1)            \
  TSM_SINGLE(log, 1) TSM_SINGLE(log10, 1) TSM_SINGLE(log2, 1) TSM_SINGLE(rsqrt, 1)            \
  TSM_SINGLE(sin, 1) TSM_SINGLE(sinh, 1) TSM_SINGLE(sinpi, 1) TSM_SINGLE(sqrt, 1)             \
  TSM_SINGLE(tan, 1) TSM_SINGLE(tanh, 1) TSM_SINGLE(tanpi, 1) TSM_SINGLE(fabs, 1)             \
  TSM_SINGLE(abs, 1) TSM_SINGLE(floor, 1) TSM_SINGLE(ceil, 1) TSM_SINGLE(round, 1)            \
  TSM_SINGLE(trunc, 1) TSM_SINGLE(rint, 1) TSM_SINGLE(fract, 1) TSM_SINGLE(atan2, 2)          \
  TSM_SINGLE(pow, 2) TSM_SINGLE(powr, 2) TSM_SINGLE(divide, 2) TSM_SINGLE(fmax, 2)            \
  TSM_SINGLE(fmin, 2) TSM_SINGLE(max, 2) TSM_SINGLE(min, 2) TSM_SINGLE(fma, 3)                \
  TSM_SINGLE(clamp, 3) TSM_SINGLE(mix, 3)                                                     \
  using metal::sincos;
namespace fast {
TSM_SINGLE_NAMES
using metal::distance;
using metal::length;
using metal::normalize;
}  // namespace fast
namespace precise {
TSM_SINGLE_NAMES
using metal::distance;
using metal::length;
using metal::normalize;
}  // namespace precise
#undef TSM_SINGLE_NAMES
#undef TSM_ARGS_3
#undef TSM_ARGS_2
#undef TSM_ARGS_1
#undef TSM_PARAMS_3
#undef TSM_PARAMS_2
#undef TSM_PARAMS_1
#undef TSM_FLOAT_ARGS_3
#undef TSM_FLOAT_ARGS_2
#undef TSM_FLOAT_ARGS_1
#undef TSM_SCALAR_PARAMS_3
#undef TSM_SCALAR_PARAMS_2
#undef TSM_SCALAR_PARAMS_1
#undef TSM_SCALARS_3
#undef TSM_SCALARS_2
#undef TSM_SCALARS_1
#undef TSM_SCALAR
#undef TSM_SINGLE

}  // namespace metal

// ---- math constants (<metal_math>) ----------------------------------------------------
// Spelled exactly as glibc's <math.h> where it defines the same names.
#ifndef MAXFLOAT
#define MAXFLOAT 3.40282347e+38F
#endif
#ifndef HUGE_VALF
#define HUGE_VALF (__builtin_huge_valf ())
#endif
#ifndef INFINITY
#define INFINITY (__builtin_inff ())
#endif
#ifndef NAN
#define NAN (__builtin_nanf (""))
#endif
#define MAXHALF (::metal::half(65504.0f))
#define HUGE_VALH (::metal::half(__builtin_huge_valf()))

#define M_E_F 2.71828182845904523536028747135266250f
#define M_LOG2E_F 1.44269504088896340735992468100189214f
#define M_LOG10E_F 0.434294481903251827651128918916605082f
#define M_LN2_F 0.693147180559945309417232121458176568f
#define M_LN10_F 2.30258509299404568401799145468436421f
#define M_PI_F 3.14159265358979323846264338327950288f
#define M_PI_2_F 1.57079632679489661923132169163975144f
#define M_PI_4_F 0.785398163397448309615660845819875721f
#define M_1_PI_F 0.318309886183790671537767526745028724f
#define M_2_PI_F 0.636619772367581343075535053490057448f
#define M_2_SQRTPI_F 1.12837916709551257389615890312154517f
#define M_SQRT2_F 1.41421356237309504880168872420969808f
#define M_SQRT1_2_F 0.707106781186547524400844362104849039f

#define M_E_H (::metal::half(M_E_F))
#define M_LOG2E_H (::metal::half(M_LOG2E_F))
#define M_LOG10E_H (::metal::half(M_LOG10E_F))
#define M_LN2_H (::metal::half(M_LN2_F))
#define M_LN10_H (::metal::half(M_LN10_F))
#define M_PI_H (::metal::half(M_PI_F))
#define M_PI_2_H (::metal::half(M_PI_2_F))
#define M_PI_4_H (::metal::half(M_PI_4_F))
#define M_1_PI_H (::metal::half(M_1_PI_F))
#define M_2_PI_H (::metal::half(M_2_PI_F))
#define M_2_SQRTPI_H (::metal::half(M_2_SQRTPI_F))
#define M_SQRT2_H (::metal::half(M_SQRT2_F))
#define M_SQRT1_2_H (::metal::half(M_SQRT1_2_F))
