// Switching between the Metal threads of a threadgroup: cooperative fibers, each on its
// own stack (internal to the runtime object).
//
// A switch happens at every barrier and SIMD-group function of every Metal thread, so it
// must be cheap: on x86-64 and AArch64 (Linux and macOS) a few instructions save the
// callee-saved registers and the floating-point control register(s) in user space. glibc's
// swapcontext, which also saves the signal mask with a system call on every switch, remains
// as the fallback on Linux: for any other architecture, and with TSM_EMU_UCONTEXT=1.
// macOS deprecates ucontext (its header refuses to compile without _XOPEN_SOURCE), so it is
// never used there.
#pragma once

#include <cstddef>

#if (defined(__x86_64__) || defined(__aarch64__)) && (defined(__linux__) || defined(__APPLE__))
#define TSM_EMU_HAVE_ASM_SWITCH 1
#else
#define TSM_EMU_HAVE_ASM_SWITCH 0
#endif

#if defined(__APPLE__)
#if !TSM_EMU_HAVE_ASM_SWITCH
#error "The Metal emulator switches fibers in assembly on macOS, written for x86_64 and arm64 only; this architecture is not supported."
#endif
#define TSM_EMU_HAVE_UCONTEXT 0
#else
#define TSM_EMU_HAVE_UCONTEXT 1
#include <ucontext.h>
#endif

namespace tsm_emu {

// Where a suspended fiber (or the scheduler) resumes.
struct FiberContext {
#if TSM_EMU_HAVE_UCONTEXT
  ucontext_t uc;        // the ucontext fallback
#endif
  void* sp = nullptr;   // the user-space switch: the suspended stack's pointer
};

// Prepares `c` to run `entry` on [stack, stack + bytes) when first switched to. `entry`
// must never return: it ends by switching away for good.
void start_fiber(FiberContext* c, char* stack, size_t bytes, void (*entry)());

// Saves the running context in `save` and resumes `load`.
void switch_fiber(FiberContext* save, FiberContext* load);

}  // namespace tsm_emu
