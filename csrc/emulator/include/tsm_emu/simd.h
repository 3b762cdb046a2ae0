// SIMD-group and quad-group functions over the active lanes of the caller's SIMD-group.
//
// Each call is a collective: the lane deposits its value and suspends until every live
// lane of its SIMD-group is waiting somewhere; the lanes waiting at this call site are the
// active lanes (a lane in another branch, or one that returned, is inactive). Reading an
// inactive lane through a shuffle is unspecified in Metal; it yields a poison value here,
// and a KernelFault of kind inactive_lane in a sanitized dispatch.
#pragma once

#include <type_traits>

#include "tsm_emu/runtime.h"

namespace metal {

namespace simd_detail {

template <class T>
inline T lane_value(const tsm_emu::SimdExchange& x, unsigned lane) {
  T v;
  __builtin_memcpy(static_cast<void*>(&v), x.values[lane], sizeof(T));
  return v;
}

inline bool active(const tsm_emu::SimdExchange& x, unsigned lane) {
  return lane < 32 && ((x.active >> lane) & 1);
}

template <class T>
inline T poison() {
  T v;
  __builtin_memset(static_cast<void*>(&v), 0xFF, sizeof(T));  // NaN for floats, -1 for ints
  return v;
}

// The value of `lane` as seen by the caller, within a window of `width` lanes (32 for SIMD
// functions, 4 for quad functions) that starts at the caller's window base.
template <class T>
inline T read(const tsm_emu::SimdExchange& x, unsigned lane) {
  if (active(x, lane)) return lane_value<T>(x, lane);
  if (!x.pending) tsm_emu::inactive_lane_read(lane);  // a fault in sanitized dispatches
  return poison<T>();
}

template <class T, class Op>
inline T reduce(const tsm_emu::SimdExchange& x, unsigned begin, unsigned end, Op op) {
  // Handing over (its result is discarded): no scan of 32 lanes of which one is there (a
  // sixth of sparse_linear_backward_batch_lanes' time run lanes at once).
  if (x.pending) return lane_value<T>(x, x.lane);
  bool have = false;
  T acc{};
  for (unsigned l = begin; l < end; ++l) {
    if (!active(x, l)) continue;
    T v = lane_value<T>(x, l);
    acc = have ? op(acc, v) : v;
    have = true;
  }
  return acc;
}

// A reduction over the whole SIMD-group is the same for every lane (the same lanes' values,
// in lane order): the first lane to read the exchange computes it into the exchange's memo,
// the others copy it. Each lane computing it alone waited on 32 dependent additions
// (perf: a fifth of sparse_linear_backward's samples in simd_sum).
template <class T, class Op>
inline T reduce_all(const tsm_emu::SimdExchange& x, Op op) {
  if (x.pending) return reduce<T>(x, 0, 32, op);  // (its result is discarded: see reduce)
  return tsm_emu::memoised<T>(x, [&](T& r) { r = reduce<T>(x, 0, 32, op); });
}

template <class T>
TSM_EMU_COLLECTIVE tsm_emu::SimdExchange exchange(const T& v, ::tsm_emu::Site site) {
  static_assert(sizeof(T) <= tsm_emu::kSimdValueBytes, "SIMD-group functions take values of at most 64 bytes");
  return tsm_emu::simd_exchange(&v, sizeof(T), site);
}

struct Sum { template <class T> T operator()(T a, T b) const { return a + b; } };
struct Product { template <class T> T operator()(T a, T b) const { return a * b; } };
// (min and max of bfloats are floats, as Metal's library has none: back to T, exactly)
struct Min { template <class T> T operator()(T a, T b) const { return T(min(a, b)); } };
struct Max { template <class T> T operator()(T a, T b) const { return T(max(a, b)); } };
struct And { template <class T> T operator()(T a, T b) const { return a & b; } };
struct Or { template <class T> T operator()(T a, T b) const { return a | b; } };
struct Xor { template <class T> T operator()(T a, T b) const { return a ^ b; } };

template <class T, class Op>
inline T prefix(const T& v, ::tsm_emu::Site site, bool inclusive, T identity, Op op) {
  auto x = exchange(v, site);
  T acc = identity;
  for (unsigned l = 0; l < x.lane; ++l)
    if (active(x, l)) acc = op(acc, lane_value<T>(x, l));
  return inclusive ? op(acc, lane_value<T>(x, x.lane)) : acc;
}

}  // namespace simd_detail

// The functions below take their value by const reference (Metal's take it by value; a
// caller cannot tell): a float4 passed by value arrives in two registers, which the callee
// stores to take the value's address and the exchange reloads as one 16-byte load, a
// store-to-load forward that fails (the shuffle matmul was 7% slower).
#define TSM_SIMD_REDUCTION(name, op, base, width)                                \
  template <class T>                                                             \
  TSM_EMU_COLLECTIVE T name(const T& v, ::tsm_emu::Site site_ = TSM_EMU_SITE_HERE) {                        \
    auto x = simd_detail::exchange(v, site_);         \
    if (width == 32) return simd_detail::reduce_all<T>(x, simd_detail::op{});   \
    unsigned b = base;                                                           \
    return simd_detail::reduce<T>(x, b, b + width, simd_detail::op{});           \
  }
TSM_SIMD_REDUCTION(simd_sum, Sum, 0, 32)
TSM_SIMD_REDUCTION(simd_product, Product, 0, 32)
TSM_SIMD_REDUCTION(simd_min, Min, 0, 32)
TSM_SIMD_REDUCTION(simd_max, Max, 0, 32)
TSM_SIMD_REDUCTION(simd_and, And, 0, 32)
TSM_SIMD_REDUCTION(simd_or, Or, 0, 32)
TSM_SIMD_REDUCTION(simd_xor, Xor, 0, 32)
TSM_SIMD_REDUCTION(quad_sum, Sum, x.lane & ~3u, 4)
TSM_SIMD_REDUCTION(quad_product, Product, x.lane & ~3u, 4)
TSM_SIMD_REDUCTION(quad_min, Min, x.lane & ~3u, 4)
TSM_SIMD_REDUCTION(quad_max, Max, x.lane & ~3u, 4)
TSM_SIMD_REDUCTION(quad_and, And, x.lane & ~3u, 4)
TSM_SIMD_REDUCTION(quad_or, Or, x.lane & ~3u, 4)
TSM_SIMD_REDUCTION(quad_xor, Xor, x.lane & ~3u, 4)
#undef TSM_SIMD_REDUCTION

template <class T>
inline T simd_prefix_inclusive_sum(const T& v, ::tsm_emu::Site site_ = TSM_EMU_SITE_HERE) {
  return simd_detail::prefix(v, site_, true, T(0), simd_detail::Sum{});
}
template <class T>
inline T simd_prefix_exclusive_sum(const T& v, ::tsm_emu::Site site_ = TSM_EMU_SITE_HERE) {
  return simd_detail::prefix(v, site_, false, T(0), simd_detail::Sum{});
}
template <class T>
inline T simd_prefix_inclusive_product(const T& v, ::tsm_emu::Site site_ = TSM_EMU_SITE_HERE) {
  return simd_detail::prefix(v, site_, true, T(1), simd_detail::Product{});
}
template <class T>
inline T simd_prefix_exclusive_product(const T& v, ::tsm_emu::Site site_ = TSM_EMU_SITE_HERE) {
  return simd_detail::prefix(v, site_, false, T(1), simd_detail::Product{});
}

// Shuffles: `src(lane)` names the lane to read; `keep` says the caller keeps its own value.
#define TSM_SHUFFLE(name, width, src_expr, keep_expr)                            \
  template <class T, class I>                                                    \
  TSM_EMU_COLLECTIVE T name(const T& v, I arg, ::tsm_emu::Site site_ = TSM_EMU_SITE_HERE) {                      \
    auto x = simd_detail::exchange(v, site_);         \
    const unsigned lane = x.lane, base = lane & ~(width - 1u);                  \
    const unsigned d = tsm_emu::own_operand(x, unsigned(arg), 0);                \
    (void)base;                                                                  \
    if (keep_expr) return simd_detail::lane_value<T>(x, lane);                   \
    return simd_detail::read<T>(x, src_expr);                                    \
  }
TSM_SHUFFLE(simd_shuffle, 32u, d, false)
TSM_SHUFFLE(simd_broadcast, 32u, d, false)
TSM_SHUFFLE(simd_shuffle_up, 32u, lane - d, d > lane)
TSM_SHUFFLE(simd_shuffle_down, 32u, lane + d, lane + d >= 32u)
TSM_SHUFFLE(simd_shuffle_rotate_up, 32u, (lane - d) & 31u, false)
TSM_SHUFFLE(simd_shuffle_rotate_down, 32u, (lane + d) & 31u, false)
TSM_SHUFFLE(simd_shuffle_xor, 32u, lane ^ (d & 31u), false)
TSM_SHUFFLE(quad_shuffle, 4u, base + (d & 3u), false)
TSM_SHUFFLE(quad_broadcast, 4u, base + (d & 3u), false)
TSM_SHUFFLE(quad_shuffle_up, 4u, lane - d, d > (lane - base))
TSM_SHUFFLE(quad_shuffle_down, 4u, lane + d, (lane - base) + d >= 4u)
TSM_SHUFFLE(quad_shuffle_rotate_up, 4u, base + ((lane - base - d) & 3u), false)
TSM_SHUFFLE(quad_shuffle_rotate_down, 4u, base + ((lane - base + d) & 3u), false)
TSM_SHUFFLE(quad_shuffle_xor, 4u, base + ((lane - base) ^ (d & 3u)), false)
#undef TSM_SHUFFLE

template <class T>
TSM_EMU_COLLECTIVE T simd_broadcast_first(const T& v, ::tsm_emu::Site site_ = TSM_EMU_SITE_HERE) {
  auto x = simd_detail::exchange(v, site_);
  return simd_detail::read<T>(x, unsigned(__builtin_ctzll(x.active)));
}

// Metal's simd_vote: a lane mask with convenience queries.
struct simd_vote {
  using vote_t = unsigned long;
  vote_t bits = 0;
  constexpr explicit simd_vote(vote_t v = 0) : bits(v) {}
  // Any integer width, so `ulong(vote)` and `uint(vote)` both work.
  template <class U, class = std::enable_if_t<std::is_integral<U>::value>>
  explicit constexpr operator U() const { return U(bits); }
  constexpr bool all() const { return bits == 0xFFFFFFFFul; }
  constexpr bool any() const { return bits != 0; }
};

inline simd_vote simd_ballot(bool p, ::tsm_emu::Site site_ = TSM_EMU_SITE_HERE) {
  auto x = simd_detail::exchange(p, site_);
  unsigned long bits = 0;
  for (unsigned l = 0; l < 32; ++l)
    if (simd_detail::active(x, l) && simd_detail::lane_value<bool>(x, l)) bits |= 1ul << l;
  return simd_vote(bits);
}
inline simd_vote simd_active_threads_mask(::tsm_emu::Site site_ = TSM_EMU_SITE_HERE) {
  auto x = simd_detail::exchange(true, site_);
  return simd_vote((unsigned long)x.active);
}
inline bool simd_all(bool p, ::tsm_emu::Site site_ = TSM_EMU_SITE_HERE) {
  auto x = simd_detail::exchange(p, site_);
  for (unsigned l = 0; l < 32; ++l)
    if (simd_detail::active(x, l) && !simd_detail::lane_value<bool>(x, l)) return false;
  return true;
}
inline bool simd_any(bool p, ::tsm_emu::Site site_ = TSM_EMU_SITE_HERE) {
  auto x = simd_detail::exchange(p, site_);
  for (unsigned l = 0; l < 32; ++l)
    if (simd_detail::active(x, l) && simd_detail::lane_value<bool>(x, l)) return true;
  return false;
}
inline bool simd_is_first(::tsm_emu::Site site_ = TSM_EMU_SITE_HERE) {
  auto x = simd_detail::exchange(true, site_);
  return unsigned(__builtin_ctzll(x.active)) == x.lane;
}

// Quad-group votes and scans: the same collectives over the caller's group of 4 lanes.
struct quad_vote {
  using vote_t = unsigned short;
  vote_t bits = 0;
  constexpr explicit quad_vote(vote_t v = 0) : bits(v) {}
  template <class U, class = std::enable_if_t<std::is_integral<U>::value>>
  explicit constexpr operator U() const { return U(bits); }
  constexpr bool all() const { return bits == 0xF; }
  constexpr bool any() const { return bits != 0; }
};

namespace simd_detail {
inline unsigned quad_bits(const tsm_emu::SimdExchange& x, bool want_values) {
  const unsigned base = x.lane & ~3u;
  unsigned bits = 0;
  for (unsigned l = 0; l < 4; ++l)
    if (active(x, base + l) && (!want_values || lane_value<bool>(x, base + l))) bits |= 1u << l;
  return bits;
}
template <class T, class Op>
inline T quad_prefix(const T& v, ::tsm_emu::Site site, bool inclusive, T identity, Op op) {
  auto x = exchange(v, site);
  T acc = identity;
  for (unsigned l = x.lane & ~3u; l < x.lane; ++l)
    if (active(x, l)) acc = op(acc, lane_value<T>(x, l));
  return inclusive ? op(acc, lane_value<T>(x, x.lane)) : acc;
}
}  // namespace simd_detail

inline quad_vote quad_ballot(bool p, ::tsm_emu::Site site_ = TSM_EMU_SITE_HERE) {
  auto x = simd_detail::exchange(p, site_);
  return quad_vote((unsigned short)simd_detail::quad_bits(x, true));
}
inline quad_vote quad_active_threads_mask(::tsm_emu::Site site_ = TSM_EMU_SITE_HERE) {
  auto x = simd_detail::exchange(true, site_);
  return quad_vote((unsigned short)simd_detail::quad_bits(x, false));
}
inline bool quad_all(bool p, ::tsm_emu::Site site_ = TSM_EMU_SITE_HERE) {
  auto x = simd_detail::exchange(p, site_);
  return simd_detail::quad_bits(x, true) == simd_detail::quad_bits(x, false);
}
inline bool quad_any(bool p, ::tsm_emu::Site site_ = TSM_EMU_SITE_HERE) {
  auto x = simd_detail::exchange(p, site_);
  return simd_detail::quad_bits(x, true) != 0;
}
inline bool quad_is_first(::tsm_emu::Site site_ = TSM_EMU_SITE_HERE) {
  auto x = simd_detail::exchange(true, site_);
  return unsigned(__builtin_ctz(simd_detail::quad_bits(x, false))) == (x.lane & 3u);
}
template <class T>
inline T quad_broadcast_first(const T& v, ::tsm_emu::Site site_ = TSM_EMU_SITE_HERE) {
  auto x = simd_detail::exchange(v, site_);
  return simd_detail::read<T>(x, (x.lane & ~3u) + unsigned(__builtin_ctz(simd_detail::quad_bits(x, false))));
}
template <class T>
inline T quad_prefix_inclusive_sum(const T& v, ::tsm_emu::Site site_ = TSM_EMU_SITE_HERE) {
  return simd_detail::quad_prefix(v, site_, true, T(0), simd_detail::Sum{});
}
template <class T>
inline T quad_prefix_exclusive_sum(const T& v, ::tsm_emu::Site site_ = TSM_EMU_SITE_HERE) {
  return simd_detail::quad_prefix(v, site_, false, T(0), simd_detail::Sum{});
}
template <class T>
inline T quad_prefix_inclusive_product(const T& v, ::tsm_emu::Site site_ = TSM_EMU_SITE_HERE) {
  return simd_detail::quad_prefix(v, site_, true, T(1), simd_detail::Product{});
}
template <class T>
inline T quad_prefix_exclusive_product(const T& v, ::tsm_emu::Site site_ = TSM_EMU_SITE_HERE) {
  return simd_detail::quad_prefix(v, site_, false, T(1), simd_detail::Product{});
}

// simd_shuffle_and_fill_up/down (MSL 2.4): lanes whose source falls off the edge of the
// (modulo-sized) window read `filling` from the lane on the other side of the window.
namespace simd_detail {
template <class T>
struct DataAndFill {
  T data, fill;
};
// `group`: 32 for the SIMD-group, 4 for the caller's quad (whose windows stay inside it).
template <class T>
inline T shuffle_and_fill(T data, T filling, unsigned delta, unsigned modulo, bool up, ::tsm_emu::Site site,
                          unsigned group = 32u) {
  static_assert(2 * sizeof(T) <= tsm_emu::kSimdValueBytes, "shuffle_and_fill takes values of at most 32 bytes");
  auto x = exchange(DataAndFill<T>{data, filling}, site);
  delta = tsm_emu::own_operand(x, delta, 0);
  modulo = tsm_emu::own_operand(x, modulo, 1);
  const unsigned w = modulo ? modulo : group, first = x.lane & ~(group - 1u), in_group = x.lane - first;
  const unsigned base = first + in_group - in_group % w, i = in_group % w;
  const bool inside = up ? i >= delta : i + delta < w;
  const unsigned src = base + (up ? (i + w - delta) % w : (i + delta) % w);
  if (!active(x, src)) {
    if (!x.pending) tsm_emu::inactive_lane_read(src);
    return poison<T>();
  }
  const auto pair = lane_value<DataAndFill<T>>(x, src);
  return inside ? pair.data : pair.fill;
}
}  // namespace simd_detail

template <class T, class D>
inline T simd_shuffle_and_fill_up(T data, T filling, D delta, ::tsm_emu::Site site_ = TSM_EMU_SITE_HERE) {
  return simd_detail::shuffle_and_fill(data, filling, unsigned(delta), 0u, true, site_);
}
template <class T, class D, class M>
inline T simd_shuffle_and_fill_up(T data, T filling, D delta, M modulo, ::tsm_emu::Site site_ = TSM_EMU_SITE_HERE) {
  return simd_detail::shuffle_and_fill(data, filling, unsigned(delta), unsigned(modulo), true, site_);
}
template <class T, class D>
inline T simd_shuffle_and_fill_down(T data, T filling, D delta, ::tsm_emu::Site site_ = TSM_EMU_SITE_HERE) {
  return simd_detail::shuffle_and_fill(data, filling, unsigned(delta), 0u, false, site_);
}
template <class T, class D, class M>
inline T simd_shuffle_and_fill_down(T data, T filling, D delta, M modulo, ::tsm_emu::Site site_ = TSM_EMU_SITE_HERE) {
  return simd_detail::shuffle_and_fill(data, filling, unsigned(delta), unsigned(modulo), false, site_);
}

template <class T, class D>
inline T quad_shuffle_and_fill_up(T data, T filling, D delta, ::tsm_emu::Site site_ = TSM_EMU_SITE_HERE) {
  return simd_detail::shuffle_and_fill(data, filling, unsigned(delta), 0u, true, site_, 4u);
}
template <class T, class D, class M>
inline T quad_shuffle_and_fill_up(T data, T filling, D delta, M modulo, ::tsm_emu::Site site_ = TSM_EMU_SITE_HERE) {
  return simd_detail::shuffle_and_fill(data, filling, unsigned(delta), unsigned(modulo), true, site_, 4u);
}
template <class T, class D>
inline T quad_shuffle_and_fill_down(T data, T filling, D delta, ::tsm_emu::Site site_ = TSM_EMU_SITE_HERE) {
  return simd_detail::shuffle_and_fill(data, filling, unsigned(delta), 0u, false, site_, 4u);
}
template <class T, class D, class M>
inline T quad_shuffle_and_fill_down(T data, T filling, D delta, M modulo, ::tsm_emu::Site site_ = TSM_EMU_SITE_HERE) {
  return simd_detail::shuffle_and_fill(data, filling, unsigned(delta), unsigned(modulo), false, site_, 4u);
}

}  // namespace metal

// Apple's compiler built-ins behind its <metal_simdgroup> (__metal_simd_sum, ...), which
// public code (MLX's bfloat overloads) calls directly. Same semantics as the library
// functions; and, or and xor of floating-point values act on their bits.
namespace tsm_emu {
namespace simd_builtin {
template <class T>
using bits_t = std::conditional_t<sizeof(T) == 1, uint8_t, std::conditional_t<sizeof(T) == 2, uint16_t,
              std::conditional_t<sizeof(T) == 4, uint32_t, uint64_t>>>;
template <class T, class F>
inline T on_bits(T v, F f) {
  if constexpr (std::is_integral<T>::value) {
    return f(v);
  } else {
    static_assert(sizeof(T) <= 8, "bitwise SIMD-group built-ins take scalars");
    return __builtin_bit_cast(T, f(__builtin_bit_cast(bits_t<T>, v)));
  }
}
}  // namespace simd_builtin
}  // namespace tsm_emu
#define TSM_SIMD_BUILTIN1(name)                                                             \
  template <class T>                                                                        \
  inline T __metal_##name(const T& v, ::tsm_emu::Site site_ = TSM_EMU_SITE_HERE) {                \
    return metal::name(v, site_);                                                           \
  }
#define TSM_SIMD_BUILTIN_BITS(name)                                                         \
  template <class T>                                                                        \
  inline T __metal_##name(const T& v, ::tsm_emu::Site site_ = TSM_EMU_SITE_HERE) {                \
    return ::tsm_emu::simd_builtin::on_bits(v, [&](auto b) { return metal::name(b, site_); }); \
  }
#define TSM_SIMD_BUILTIN2(name)                                                             \
  template <class T, class I>                                                               \
  inline T __metal_##name(const T& v, I arg, ::tsm_emu::Site site_ = TSM_EMU_SITE_HERE) {         \
    return metal::name(v, arg, site_);                                                      \
  }
TSM_SIMD_BUILTIN1(simd_sum) TSM_SIMD_BUILTIN1(simd_product) TSM_SIMD_BUILTIN1(simd_min)
TSM_SIMD_BUILTIN1(simd_max) TSM_SIMD_BUILTIN1(simd_prefix_inclusive_sum)
TSM_SIMD_BUILTIN1(simd_prefix_exclusive_sum) TSM_SIMD_BUILTIN1(simd_prefix_inclusive_product)
TSM_SIMD_BUILTIN1(simd_prefix_exclusive_product) TSM_SIMD_BUILTIN1(simd_broadcast_first)
TSM_SIMD_BUILTIN_BITS(simd_and) TSM_SIMD_BUILTIN_BITS(simd_or) TSM_SIMD_BUILTIN_BITS(simd_xor)
TSM_SIMD_BUILTIN2(simd_shuffle) TSM_SIMD_BUILTIN2(simd_broadcast) TSM_SIMD_BUILTIN2(simd_shuffle_up)
TSM_SIMD_BUILTIN2(simd_shuffle_down) TSM_SIMD_BUILTIN2(simd_shuffle_rotate_up)
TSM_SIMD_BUILTIN2(simd_shuffle_rotate_down) TSM_SIMD_BUILTIN2(simd_shuffle_xor)
#undef TSM_SIMD_BUILTIN1
#undef TSM_SIMD_BUILTIN_BITS
#undef TSM_SIMD_BUILTIN2
template <class T, class D, class M>
inline T __metal_simd_shuffle_and_fill_up(T data, T filling, D delta, M modulo,
                                          ::tsm_emu::Site site_ = TSM_EMU_SITE_HERE) {
  return metal::simd_shuffle_and_fill_up(data, filling, delta, modulo, site_);
}
template <class T, class D, class M>
inline T __metal_simd_shuffle_and_fill_down(T data, T filling, D delta, M modulo,
                                            ::tsm_emu::Site site_ = TSM_EMU_SITE_HERE) {
  return metal::simd_shuffle_and_fill_down(data, filling, delta, modulo, site_);
}
template <class T>
constexpr T __metal_get_simdgroup_size(T) { return T(32); }
// The calling thread's lane (MLX's nax.h calls it so, outside any kernel parameter).
template <class T>
inline T __metal_get_thread_index_in_simdgroup(T) {
  return T(::tsm_emu::current_thread().thread_index_in_simdgroup);
}
