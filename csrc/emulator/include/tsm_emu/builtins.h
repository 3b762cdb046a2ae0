// Apple's compiler built-ins behind its <metal_math> (__metal_fabs(x, fast), ...), which
// public code calls directly (MLX's bfloat overloads), and the fast-math flags it passes
// them. The emulator computes every function precisely, whatever the flag says.
#pragma once

#include "tsm_emu/math.h"

#define __METAL_FAST_MATH__ true
#define __METAL_PRECISE_MATH__ false
#define __METAL_MAYBE_FAST_MATH__ false  // the emulator compiles without fast math

#define TSM_MATH_BUILTIN1(name, fn) \
  template <class T> inline T __metal_##name(T x, bool) { return T(metal::fn(x)); }
#define TSM_MATH_BUILTIN2(name) \
  template <class T> inline T __metal_##name(T x, T y, bool) { return T(metal::name(x, y)); }
#define TSM_MATH_BUILTIN3(name) \
  template <class T> inline T __metal_##name(T x, T y, T z, bool) { return T(metal::name(x, y, z)); }
TSM_MATH_BUILTIN1(fabs, fabs) TSM_MATH_BUILTIN1(acos, acos) TSM_MATH_BUILTIN1(acosh, acosh)
TSM_MATH_BUILTIN1(asin, asin) TSM_MATH_BUILTIN1(asinh, asinh) TSM_MATH_BUILTIN1(atan, atan)
TSM_MATH_BUILTIN1(atanh, atanh) TSM_MATH_BUILTIN1(ceil, ceil) TSM_MATH_BUILTIN1(cos, cos)
TSM_MATH_BUILTIN1(cosh, cosh) TSM_MATH_BUILTIN1(cospi, cospi) TSM_MATH_BUILTIN1(exp, exp)
TSM_MATH_BUILTIN1(exp10, exp10) TSM_MATH_BUILTIN1(exp2, exp2) TSM_MATH_BUILTIN1(floor, floor)
TSM_MATH_BUILTIN1(fract, fract) TSM_MATH_BUILTIN1(log, log) TSM_MATH_BUILTIN1(log10, log10)
TSM_MATH_BUILTIN1(log2, log2) TSM_MATH_BUILTIN1(rint, rint) TSM_MATH_BUILTIN1(round, round)
TSM_MATH_BUILTIN1(rsqrt, rsqrt) TSM_MATH_BUILTIN1(sin, sin) TSM_MATH_BUILTIN1(sinh, sinh)
TSM_MATH_BUILTIN1(sinpi, sinpi) TSM_MATH_BUILTIN1(sqrt, sqrt) TSM_MATH_BUILTIN1(tan, tan)
TSM_MATH_BUILTIN1(tanh, tanh) TSM_MATH_BUILTIN1(tanpi, tanpi) TSM_MATH_BUILTIN1(trunc, trunc)
TSM_MATH_BUILTIN2(atan2) TSM_MATH_BUILTIN2(divide) TSM_MATH_BUILTIN2(fmax) TSM_MATH_BUILTIN2(fmin)
TSM_MATH_BUILTIN2(fmod) TSM_MATH_BUILTIN2(pow) TSM_MATH_BUILTIN2(powr)
TSM_MATH_BUILTIN3(fmax3) TSM_MATH_BUILTIN3(fmin3) TSM_MATH_BUILTIN3(fmedian3)
#undef TSM_MATH_BUILTIN1
#undef TSM_MATH_BUILTIN2
#undef TSM_MATH_BUILTIN3
template <class T> inline T __metal_fma(T x, T y, T z) { return T(metal::fma(x, y, z)); }
template <class T> inline T __metal_nextafter(T x, T y) { return T(metal::nextafter(x, y)); }
template <class T> inline T __metal_frexp(T x, int* exponent) { return T(metal::frexp(x, *exponent)); }
template <class T> inline T __metal_ldexp(T x, int k, bool) { return T(metal::ldexp(x, k)); }
