// <metal_pack>: normalised integers packed into a uint, component 0 in the low bits.
// float -> unorm: clamp to [0, 1], scale by 2^n - 1, round to nearest even; float -> snorm:
// clamp to [-1, 1], scale by 2^(n-1) - 1, round to nearest even. Back: divide by the scale
// (snorm clamps -2^(n-1) to -1). The half forms compute in float.
#pragma once

#include <cstdint>

#include "tsm_emu/types.h"

namespace metal {
namespace pack_detail {

template <int Bits, bool Signed>
inline uint32_t to_bits(float x) {
  constexpr float scale = Signed ? float((1 << (Bits - 1)) - 1) : float((1u << Bits) - 1u);
  const float lo = Signed ? -1.0f : 0.0f;
  float c = x != x ? 0.0f : (x < lo ? lo : (x > 1.0f ? 1.0f : x));
  const int32_t q = int32_t(__builtin_rintf(c * scale));
  return uint32_t(q) & ((1u << Bits) - 1u);
}
template <int Bits, bool Signed>
inline float from_bits(uint32_t bits) {
  constexpr float scale = Signed ? float((1 << (Bits - 1)) - 1) : float((1u << Bits) - 1u);
  if (!Signed) return float(bits) / scale;
  const int32_t v = int32_t(bits << (32 - Bits)) >> (32 - Bits);  // sign-extend
  const float f = float(v) / scale;
  return f < -1.0f ? -1.0f : f;
}
template <int Bits, bool Signed, int N, class V>
inline uint32_t pack(const V& v) {
  uint32_t out = 0;
  for (int i = 0; i < N; ++i) out |= to_bits<Bits, Signed>(float(v[i])) << (i * Bits);
  return out;
}
template <int Bits, bool Signed, class T, int N>
inline vec<T, N> unpack(uint32_t x) {
  vec<T, N> out;
  for (int i = 0; i < N; ++i) out[i] = T(from_bits<Bits, Signed>((x >> (i * Bits)) & ((1u << Bits) - 1u)));
  return out;
}

}  // namespace pack_detail

inline uint pack_float_to_unorm4x8(float4 x) { return pack_detail::pack<8, false, 4>(x); }
inline uint pack_float_to_snorm4x8(float4 x) { return pack_detail::pack<8, true, 4>(x); }
inline uint pack_half_to_unorm4x8(half4 x) { return pack_detail::pack<8, false, 4>(x); }
inline uint pack_half_to_snorm4x8(half4 x) { return pack_detail::pack<8, true, 4>(x); }
inline uint pack_float_to_unorm2x16(float2 x) { return pack_detail::pack<16, false, 2>(x); }
inline uint pack_float_to_snorm2x16(float2 x) { return pack_detail::pack<16, true, 2>(x); }
inline uint pack_half_to_unorm2x16(half2 x) { return pack_detail::pack<16, false, 2>(x); }
inline uint pack_half_to_snorm2x16(half2 x) { return pack_detail::pack<16, true, 2>(x); }
inline float4 unpack_unorm4x8_to_float(uint x) { return pack_detail::unpack<8, false, float, 4>(x); }
inline float4 unpack_snorm4x8_to_float(uint x) { return pack_detail::unpack<8, true, float, 4>(x); }
inline half4 unpack_unorm4x8_to_half(uint x) { return pack_detail::unpack<8, false, half, 4>(x); }
inline half4 unpack_snorm4x8_to_half(uint x) { return pack_detail::unpack<8, true, half, 4>(x); }
inline float2 unpack_unorm2x16_to_float(uint x) { return pack_detail::unpack<16, false, float, 2>(x); }
inline float2 unpack_snorm2x16_to_float(uint x) { return pack_detail::unpack<16, true, float, 2>(x); }
inline half2 unpack_unorm2x16_to_half(uint x) { return pack_detail::unpack<16, false, half, 2>(x); }
inline half2 unpack_snorm2x16_to_half(uint x) { return pack_detail::unpack<16, true, half, 2>(x); }

}  // namespace metal
