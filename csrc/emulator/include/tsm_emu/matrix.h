// <metal_matrix>: matrix<T, Cols, Rows> of half or float, stored as Cols column vectors.
// Construction (a scalar on the diagonal; column vectors; Cols * Rows scalars, column by
// column), m[c] (a column), +, -, products with matrices, vectors and scalars, transpose
// and determinant.
#pragma once

#include <type_traits>

#include "tsm_emu/types.h"

namespace metal {

template <class T, int C, int R>
struct matrix {
  static_assert(C >= 2 && C <= 4 && R >= 2 && R <= 4, "matrix<T, Cols, Rows>: 2 to 4 of each");
  vec<T, R> columns[C];

  matrix() = default;
  explicit matrix(T diagonal) {
    for (int c = 0; c < C; ++c)
      for (int r = 0; r < R; ++r) columns[c][r] = c == r ? diagonal : T(0);
  }
  template <class U, std::enable_if_t<!std::is_same<U, T>::value, int> = 0>
  explicit matrix(const matrix<U, C, R>& other) {
    for (int c = 0; c < C; ++c) columns[c] = vec<T, R>(other.columns[c]);
  }
  template <class... V, std::enable_if_t<sizeof...(V) == C && C != 1 &&
                                             (std::is_convertible<V, vec<T, R>>::value && ...), int> = 0>
  matrix(const V&... cols) : columns{vec<T, R>(cols)...} {}
  template <class... S, std::enable_if_t<sizeof...(S) == C * R && (tsm_detail::is_scalar<S>::value && ...), int> = 0>
  matrix(S... s) {
    const T values[] = {T(s)...};
    for (int c = 0; c < C; ++c)
      for (int r = 0; r < R; ++r) columns[c][r] = values[c * R + r];
  }
  vec<T, R>& operator[](int c) { return columns[c]; }
  const vec<T, R>& operator[](int c) const { return columns[c]; }
};

#define TSM_MATRIX_NAMES(T)                                                        \
  typedef matrix<T, 2, 2> T##2x2; typedef matrix<T, 2, 3> T##2x3;                  \
  typedef matrix<T, 2, 4> T##2x4; typedef matrix<T, 3, 2> T##3x2;                  \
  typedef matrix<T, 3, 3> T##3x3; typedef matrix<T, 3, 4> T##3x4;                  \
  typedef matrix<T, 4, 2> T##4x2; typedef matrix<T, 4, 3> T##4x3;                  \
  typedef matrix<T, 4, 4> T##4x4;
TSM_MATRIX_NAMES(half)
TSM_MATRIX_NAMES(float)
#undef TSM_MATRIX_NAMES

template <class T, int C, int R>
inline matrix<T, C, R> operator+(const matrix<T, C, R>& a, const matrix<T, C, R>& b) {
  matrix<T, C, R> out;
  for (int c = 0; c < C; ++c) out[c] = a[c] + b[c];
  return out;
}
template <class T, int C, int R>
inline matrix<T, C, R> operator-(const matrix<T, C, R>& a, const matrix<T, C, R>& b) {
  matrix<T, C, R> out;
  for (int c = 0; c < C; ++c) out[c] = a[c] - b[c];
  return out;
}
template <class T, int C, int R>
inline matrix<T, C, R> operator*(const matrix<T, C, R>& a, T s) {
  matrix<T, C, R> out;
  for (int c = 0; c < C; ++c) out[c] = a[c] * s;
  return out;
}
template <class T, int C, int R>
inline matrix<T, C, R> operator*(T s, const matrix<T, C, R>& a) { return a * s; }
// (Rows x Cols) * (Cols) -> (Rows): the sum of the columns weighted by v.
template <class T, int C, int R>
inline vec<T, R> operator*(const matrix<T, C, R>& m, const vec<T, C>& v) {
  vec<T, R> out = m[0] * v[0];
  for (int c = 1; c < C; ++c) out += m[c] * v[c];
  return out;
}
// (Rows) * (Rows x Cols) -> (Cols): a dot product with each column.
template <class T, int C, int R>
inline vec<T, C> operator*(const vec<T, R>& v, const matrix<T, C, R>& m) {
  vec<T, C> out;
  for (int c = 0; c < C; ++c) {
    T sum = T(0);
    for (int r = 0; r < R; ++r) sum += v[r] * m[c][r];
    out[c] = sum;
  }
  return out;
}
template <class T, int K, int R, int C>
inline matrix<T, C, R> operator*(const matrix<T, K, R>& a, const matrix<T, C, K>& b) {
  matrix<T, C, R> out;
  for (int c = 0; c < C; ++c) out[c] = a * b[c];
  return out;
}
template <class T, int C, int R>
inline matrix<T, C, R>& operator*=(matrix<T, C, R>& a, const matrix<T, C, C>& b) { return a = a * b; }
template <class T, int C, int R>
inline matrix<T, C, R>& operator+=(matrix<T, C, R>& a, const matrix<T, C, R>& b) { return a = a + b; }
template <class T, int C, int R>
inline matrix<T, C, R>& operator-=(matrix<T, C, R>& a, const matrix<T, C, R>& b) { return a = a - b; }
template <class T, int C, int R>
inline matrix<T, C, R>& operator*=(matrix<T, C, R>& a, T s) { return a = a * s; }

template <class T, int C, int R>
inline matrix<T, R, C> transpose(const matrix<T, C, R>& m) {
  matrix<T, R, C> out;
  for (int c = 0; c < C; ++c)
    for (int r = 0; r < R; ++r) out[r][c] = m[c][r];
  return out;
}
template <class T>
inline T determinant(const matrix<T, 2, 2>& m) { return m[0][0] * m[1][1] - m[1][0] * m[0][1]; }
template <class T>
inline T determinant(const matrix<T, 3, 3>& m) {
  return m[0][0] * (m[1][1] * m[2][2] - m[2][1] * m[1][2]) -
         m[1][0] * (m[0][1] * m[2][2] - m[2][1] * m[0][2]) +
         m[2][0] * (m[0][1] * m[1][2] - m[1][1] * m[0][2]);
}
template <class T>
inline T determinant(const matrix<T, 4, 4>& m) {
  T det = T(0);
  for (int c = 0; c < 4; ++c) {  // expansion along row 0
    matrix<T, 3, 3> minor;
    for (int k = 0, cc = 0; k < 4; ++k) {
      if (k == c) continue;
      minor[cc++] = vec<T, 3>(m[k][1], m[k][2], m[k][3]);
    }
    const T term = m[c][0] * determinant(minor);
    det = (c % 2) ? det - term : det + term;
  }
  return det;
}

}  // namespace metal
