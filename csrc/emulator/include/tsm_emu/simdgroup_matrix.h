// simdgroup_matrix<T, 8, 8> (Apple7+): an 8x8 matrix spread over the 32 lanes of a
// SIMD-group, two elements per lane, in the layout Apple's GPUs use (as MLX hard-codes it
// through thread_elements()): lane l holds row (q & 4) + (l / 2) % 4, columns
// (q & 2) * 2 + (l % 2) * 2 and the next one, where q = l / 4.
//
// Each lane keeps only its own two elements, as on the GPU: loads and stores touch only
// those (so the sanitizer and the traffic counters see the real accesses), and a multiply
// is a SIMD-group collective that gathers the operands from all 32 lanes, which must all be
// active (Metal requires uniform control flow for these operations).
#pragma once

#include <type_traits>

#include "tsm_emu/runtime.h"
#include "tsm_emu/types.h"

namespace metal {

namespace simdgroup_detail {
struct Place {
  unsigned row, col;  // of the lane's first element; the second is (row, col + 1)
};
inline Place place(unsigned lane) {
  const unsigned q = lane / 4;
  return {(q & 4u) + (lane / 2) % 4, (q & 2u) * 2 + (lane % 2) * 2};
}
inline unsigned lane() { return tsm_emu::current_thread().thread_index_in_simdgroup; }

// Where the calling lane's element i (0 or 1) lives in memory for simdgroup_load/store:
// element (r, c) of the matrix is at (origin.y + r) * elements_per_row + origin.x + c, or
// the transpose. `origin` is a ulong2 (x = column, y = row) or a scalar for both.
template <class O>
inline unsigned long element_offset(unsigned i, unsigned long elements_per_row, const O& origin,
                                    bool transpose) {
  unsigned long ox, oy;
  if constexpr (std::is_arithmetic<O>::value) {
    ox = oy = (unsigned long)origin;
  } else {
    ox = (unsigned long)origin.x;
    oy = (unsigned long)origin.y;
  }
  const Place p = place(lane());
  const unsigned long r = p.row, c = p.col + i;
  return transpose ? (oy + c) * elements_per_row + ox + r : (oy + r) * elements_per_row + ox + c;
}
}  // namespace simdgroup_detail

template <class T, int Cols, int Rows>
struct simdgroup_matrix {
  static_assert(Cols == 8 && Rows == 8, "the emulator, like Apple's GPUs, has 8x8 simdgroup matrices");

  simdgroup_matrix() = default;
  // Metal: a diagonal matrix with `dval` on the diagonal.
  explicit simdgroup_matrix(T dval) {
    const auto p = simdgroup_detail::place(simdgroup_detail::lane());
    elements_[0] = p.row == p.col ? dval : T(0);
    elements_[1] = p.row == p.col + 1 ? dval : T(0);
  }

  vec<T, 2>& thread_elements() { return elements_; }
  const vec<T, 2>& thread_elements() const { return elements_; }

  vec<T, 2> elements_;
};

using simdgroup_float8x8 = simdgroup_matrix<float, 8, 8>;
using simdgroup_half8x8 = simdgroup_matrix<half, 8, 8>;
using simdgroup_bfloat8x8 = simdgroup_matrix<bfloat, 8, 8>;

template <class T, int C, int R = C>
inline simdgroup_matrix<T, C, R> make_filled_simdgroup_matrix(T value) {
  simdgroup_matrix<T, C, R> m;
  m.elements_ = vec<T, 2>(value);
  return m;
}

// `src` / `dst` are device or threadgroup pointers (checked in sanitized builds).
template <class T, int C, int R, class P, class O = unsigned long>
inline void simdgroup_load(simdgroup_matrix<T, C, R>& d, P src, unsigned long elements_per_row = C,
                           O matrix_origin = 0, bool transpose_matrix = false) {
  for (unsigned i = 0; i < 2; ++i)
    d.elements_[i] = T(src[simdgroup_detail::element_offset(i, elements_per_row, matrix_origin, transpose_matrix)]);
}

template <class T, int C, int R, class P, class O = unsigned long>
inline void simdgroup_store(const simdgroup_matrix<T, C, R>& m, P dst, unsigned long elements_per_row = C,
                            O matrix_origin = 0, bool transpose_matrix = false) {
  for (unsigned i = 0; i < 2; ++i)
    tsm_emu::stored(dst[simdgroup_detail::element_offset(i, elements_per_row, matrix_origin, transpose_matrix)]) =
        m.elements_[i];
}

namespace simdgroup_detail {
template <class T>
struct Operands {
  vec<T, 2> a, b, c;
};

// The precision a product of these element types is computed in.
template <class... T>
using wide_t = std::conditional_t<(std::is_same<T, double>::value || ...), double, float>;
template <class W, class T>
inline vec<W, 2> widen(const vec<T, 2>& v) {
  return vec<W, 2>(W(v[0]), W(v[1]));
}

// One rounding per step in the accumulator's own type: __builtin_fma on floats would compute
// in double and round twice, and g++ narrows that pattern or not depending on inlining.
inline float fused(float a, float b, float c) { return __builtin_fmaf(a, b, c); }
inline double fused(double a, double b, double c) { return __builtin_fma(a, b, c); }

// The SIMD-group's whole product D = A * B + C (8x8, row-major), from the operands of all
// 32 lanes. A row at a time, D's columns innermost, which the compiler vectorises (on an
// x86-64 with FMA, 8 packed fmas a row in float, 16 in double): each element still
// accumulates its eight products in k order, one rounding per step, as one lane did alone.
template <class T>
inline void whole_product(const tsm_emu::SimdExchange& x, T (&D)[8][8]) {
  T A[8][8], B[8][8];
  for (unsigned l = 0; l < 32; ++l) {
    Operands<T> o;
    __builtin_memcpy(static_cast<void*>(&o), x.values[l], sizeof o);
    const Place p = place(l);
    for (unsigned i = 0; i < 2; ++i) {
      A[p.row][p.col + i] = o.a[i];
      B[p.row][p.col + i] = o.b[i];
      D[p.row][p.col + i] = o.c[i];
    }
  }
  for (unsigned i = 0; i < 8; ++i) {
    T row[8];  // (a local: through D itself g++ 12 vectorised none of it)
    for (unsigned j = 0; j < 8; ++j) row[j] = D[i][j];
    for (unsigned k = 0; k < 8; ++k) {
      const T aik = A[i][k];
      for (unsigned j = 0; j < 8; ++j) row[j] = fused(aik, B[k][j], row[j]);
    }
    for (unsigned j = 0; j < 8; ++j) D[i][j] = row[j];
  }
}

// d = a * b + c for the calling lane's two elements of d, gathering a, b and c from the
// whole SIMD-group (T: float, or double for double matrices, the precision the product is
// computed in). The first lane to get here computes the whole product into the exchange's
// memo and the others read theirs from it: each lane computing it alone spent 32x the work
// on gathering the operands (perf: a fifth of a kmeans_iteration run's samples).
// False when the exchange is only pending (see SimdExchange): d is then not written.
template <class T>
inline bool multiply_accumulate(const vec<T, 2>& a, const vec<T, 2>& b, const vec<T, 2>& c, ::tsm_emu::Site site,
                                vec<T, 2>& d) {
  static_assert(sizeof(Operands<T>) <= tsm_emu::kSimdValueBytes, "simdgroup matrix element type too wide");
  static_assert(std::is_same<T, float>::value || std::is_same<T, double>::value, "products in float or double");
  const Operands<T> mine{a, b, c};
  const auto x = tsm_emu::simd_exchange(&mine, sizeof mine, site);
  if (x.pending) return false;
  if (x.active != 0xFFFFFFFFull)
    tsm_emu::fault("inactive_lane", "a simdgroup_matrix multiply needs all 32 lanes of the SIMD-group "
                                    "active (uniform control flow, threadgroup size a multiple of 32)");
  const auto& D = tsm_emu::memoised<T[8][8]>(x, [&](T(&product)[8][8]) { whole_product(x, product); });
  const Place p = place(x.lane);
  d[0] = D[p.row][p.col];
  d[1] = D[p.row][p.col + 1];
  tsm_emu::counted_fmas(16);  // this lane's share of the 512 of an 8x8x8 product
  return true;
}
}  // namespace simdgroup_detail

// Operands may differ in element type (half products into a float accumulator, say): each
// is widened to float (double if any is double), multiplied, and rounded once into d.
template <class Td, class Ta, class Tb, class Tc, int C, int R>
inline void simdgroup_multiply_accumulate(simdgroup_matrix<Td, C, R>& d, const simdgroup_matrix<Ta, C, R>& a,
                                          const simdgroup_matrix<Tb, C, R>& b,
                                          const simdgroup_matrix<Tc, C, R>& c,
                                          ::tsm_emu::Site site_ = TSM_EMU_SITE_HERE) {
  using W = simdgroup_detail::wide_t<Td, Ta, Tb, Tc>;
  vec<W, 2> r;
  if (simdgroup_detail::multiply_accumulate(simdgroup_detail::widen<W>(a.elements_),
                                            simdgroup_detail::widen<W>(b.elements_),
                                            simdgroup_detail::widen<W>(c.elements_), site_, r))
    d.elements_ = vec<Td, 2>(Td(r[0]), Td(r[1]));
}

template <class Td, class Ta, class Tb, int C, int R>
inline void simdgroup_multiply(simdgroup_matrix<Td, C, R>& d, const simdgroup_matrix<Ta, C, R>& a,
                               const simdgroup_matrix<Tb, C, R>& b, ::tsm_emu::Site site_ = TSM_EMU_SITE_HERE) {
  simdgroup_multiply_accumulate(d, a, b, make_filled_simdgroup_matrix<Td, C, R>(Td(0)), site_);
}

// Metal's `a * b`, the product simdgroup_multiply stores. The translation turns every such
// product into this call (torch_sparse_metal/metal/_matrix_products.py), for its site: an
// operator cannot take one. While the exchange is pending (barrier regions) the result is
// zero, and unused.
template <class T, int C, int R>
inline simdgroup_matrix<T, C, R> __tsm_simdgroup_product(const simdgroup_matrix<T, C, R>& a,
                                                         const simdgroup_matrix<T, C, R>& b,
                                                         ::tsm_emu::Site site_ = TSM_EMU_SITE_HERE) {
  auto d = make_filled_simdgroup_matrix<T, C, R>(T(0));
  simdgroup_multiply(d, a, b, site_);
  return d;
}

template <class T, int C, int R>
simdgroup_matrix<T, C, R> operator*(const simdgroup_matrix<T, C, R>&, const simdgroup_matrix<T, C, R>&) {
  static_assert(sizeof(T) == 0, "a simdgroup_matrix product whose operands' types the emulator's translation "
                                "could not tell (a template parameter): name them as simdgroup_matrix<T, 8, 8>");
  return {};
}

}  // namespace metal
