// Built-in parameters of vector type (uint2, ushort3, ...): filled from the thread's
// position components.
#pragma once

#include "tsm_emu/runtime.h"
#include "tsm_emu/types.h"

namespace tsm_emu {

template <>
struct scalar_code<metal::bfloat> {
  static constexpr char value = 'b';
};

template <class E, int N>
struct builtin_traits<metal::vec<E, N>> {
  static constexpr bool ok = std::is_integral<E>::value && N <= 3;
  static metal::vec<E, N> make(u3 v) {
    metal::vec<E, N> out{};
    const uint32_t c[3] = {v.x, v.y, v.z};
    for (int i = 0; i < N; ++i) out[i] = static_cast<E>(c[i]);
    return out;
  }
};

}  // namespace tsm_emu
