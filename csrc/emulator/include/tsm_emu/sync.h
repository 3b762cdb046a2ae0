// threadgroup_barrier / simdgroup_barrier: real suspension points of the calling fiber.
#pragma once

#include "tsm_emu/runtime.h"

namespace metal {

enum class mem_flags : unsigned {
  mem_none = 0,
  mem_device = 1,
  mem_threadgroup = 2,
  mem_texture = 4,
  mem_threadgroup_imageblock = 8,
  mem_object_data = 16,
};
inline constexpr mem_flags operator|(mem_flags a, mem_flags b) {
  return mem_flags(unsigned(a) | unsigned(b));
}

// The defaulted line and column arguments are evaluated at the caller: they name the call
// site (see tsm_emu::site_of).
inline void threadgroup_barrier(mem_flags = mem_flags::mem_none, unsigned line = __builtin_LINE(),
                                unsigned column = TSM_EMU_COLUMN) {
  tsm_emu::threadgroup_barrier_wait(tsm_emu::site_of(line, column));
  __asm__ volatile("" ::: "memory");
}
inline void simdgroup_barrier(mem_flags = mem_flags::mem_none, unsigned line = __builtin_LINE(),
                              unsigned column = TSM_EMU_COLUMN) {
  tsm_emu::simdgroup_barrier_wait(tsm_emu::site_of(line, column));
  __asm__ volatile("" ::: "memory");
}

}  // namespace metal
