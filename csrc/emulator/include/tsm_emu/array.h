// <metal_array>: metal::array<T, N>, a fixed-size array that is an aggregate (brace
// initialisation) and copies by value, with size() and bounds-unchecked operator[] as in
// Metal. Sanitized builds check accesses through the pointers that reach it, not here.
#pragma once

#include "tsm_emu/types.h"

namespace metal {

template <class T, size_t N>
struct array {
  T elems_[N > 0 ? N : 1];

  constexpr T& operator[](size_t i) { return elems_[i]; }
  constexpr const T& operator[](size_t i) const { return elems_[i]; }
  constexpr size_t size() const { return N; }
  constexpr T* begin() { return elems_; }
  constexpr const T* begin() const { return elems_; }
  constexpr T* end() { return elems_ + N; }
  constexpr const T* end() const { return elems_ + N; }
};

}  // namespace metal
