// <metal_array>: metal::array<T, N>, a fixed-size array that is an aggregate (brace
// initialisation) and copies by value, with size() and operator[] as in Metal; an index
// outside it is an out_of_bounds fault (tsm_emu/thread_array.h), in every build.
#pragma once

#include <cstddef>

#include "tsm_emu/thread_array.h"
#include "tsm_emu/types.h"

namespace metal {

template <class T, size_t N>
struct array {
  T elems_[N > 0 ? N : 1];

  constexpr T& operator[](size_t i) { return elems_[tsm_emu::in_bounds<N>(i, "metal::array", nullptr, 0)]; }
  constexpr const T& operator[](size_t i) const {
    return elems_[tsm_emu::in_bounds<N>(i, "metal::array", nullptr, 0)];
  }
  constexpr size_t size() const { return N; }
  constexpr T* data() { return elems_; }
  constexpr const T* data() const { return elems_; }
  constexpr T* begin() { return elems_; }
  constexpr const T* begin() const { return elems_; }
  constexpr T* end() { return elems_ + N; }
  constexpr const T* end() const { return elems_ + N; }
};

}  // namespace metal

namespace tsm_emu {

// An array's designated initialisers, lowered by the rewriter (torch_sparse_metal/metal/
// _designators.py): `float s[N] = { [0 ... N-1] = v, w };` becomes
// `float s[N] = {}; designated(s).range(0, N-1, v).next(w);`. Each step sets elements in
// the order C initialises them, and the next one without a designator follows the last.
template <class T, std::size_t N>
class designated_array {
 public:
  explicit designated_array(T (&a)[N]) : a_(a) {}
  template <class V>
  designated_array& range(std::ptrdiff_t first, std::ptrdiff_t last, const V& value) {
    for (std::ptrdiff_t i = first; i <= last; ++i) a_[i] = value;
    next_ = last + 1;
    return *this;
  }
  template <class V>
  designated_array& at(std::ptrdiff_t i, const V& value) { return range(i, i, value); }
  template <class V>
  designated_array& next(const V& value) { return range(next_, next_, value); }

 private:
  T (&a_)[N];
  std::ptrdiff_t next_ = 0;
};

template <class T, std::size_t N>
designated_array<T, N> designated(T (&a)[N]) { return designated_array<T, N>(a); }

}  // namespace tsm_emu
