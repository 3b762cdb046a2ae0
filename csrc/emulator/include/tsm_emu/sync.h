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

// `site_` names the call in the kernel source: the rewriter passes each call's own site; a
// call it did not see (from a macro in a header, say) defaults to its line.
inline void threadgroup_barrier(mem_flags flags, ::tsm_emu::Site site_ = TSM_EMU_SITE_HERE) {
  tsm_emu::threadgroup_barrier_wait(site_.value, unsigned(flags));
  __asm__ volatile("" ::: "memory");
}
inline void threadgroup_barrier(::tsm_emu::Site site_ = TSM_EMU_SITE_HERE) {
  threadgroup_barrier(mem_flags::mem_none, site_);
}
inline void simdgroup_barrier(mem_flags flags, ::tsm_emu::Site site_ = TSM_EMU_SITE_HERE) {
  tsm_emu::simdgroup_barrier_wait(site_.value, unsigned(flags));
  __asm__ volatile("" ::: "memory");
}
inline void simdgroup_barrier(::tsm_emu::Site site_ = TSM_EMU_SITE_HERE) {
  simdgroup_barrier(mem_flags::mem_none, site_);
}

}  // namespace metal
