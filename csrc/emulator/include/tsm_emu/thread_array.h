// Bounds checks of arrays that are not threadgroup memory: a kernel's or function's local
// `float x[N];` (thread-private), an array member, metal::array. The frontend
// (torch_sparse_metal/metal/_thread_arrays.py) wraps the index of every subscript of such
// an array, `x[i]` -> `x[::tsm_emu::in_bounds<N>(i, "x", __FILE__, __LINE__)]`, so the array
// itself stays a C array: aggregate initialisation, sizeof, passing it to a `thread T*` or
// `thread T (&)[N]` parameter and copying it into a barrier region's slot mean what they
// meant. A constant index the compiler can prove in range costs nothing after inlining; any
// other costs one compare. Pointers into such an array (`thread float* p = x;`) are raw
// pointers: accesses through them are not checked.
#pragma once

#include <cstddef>
#include <type_traits>

namespace tsm_emu {

// The fault of an index outside an array of `length` elements (runtime.cpp), in every build.
[[noreturn]] void array_out_of_bounds(const char* array, long long index, unsigned long long length,
                                      const char* file, int line);

template <class I, bool = std::is_enum<I>::value>
struct signed_index : std::is_signed<I> {};
template <class I>
struct signed_index<I, true> : std::is_signed<std::underlying_type_t<I>> {};

template <std::size_t N, class I>
__attribute__((always_inline)) inline constexpr I in_bounds(I i, const char* array, const char* file, int line) {
  if constexpr (std::is_integral<I>::value || std::is_enum<I>::value) {
    const long long v = static_cast<long long>(i);
    const bool outside = signed_index<I>::value ? v < 0 || static_cast<unsigned long long>(v) >= N
                                                : static_cast<unsigned long long>(i) >= N;
    if (__builtin_expect(outside, 0)) array_out_of_bounds(array, v, N, file, line);
  }
  return i;
}

}  // namespace tsm_emu
