#include "fiber_switch.h"

#include <cstdint>
#include <cstdlib>
#include <cstring>

#if TSM_EMU_HAVE_ASM_SWITCH
extern "C" void tsm_emu_switch(void** save_sp, void* load_sp);
#if defined(__aarch64__)
extern "C" void tsm_emu_fiber_start();
#endif
#endif

namespace tsm_emu {
namespace {

#if TSM_EMU_HAVE_ASM_SWITCH
// tsm_emu_switch(save_sp, load_sp) pushes the callee-saved registers and the floating-point
// control register(s) on the running stack, stores the stack pointer in *save_sp, moves to
// load_sp, pops the same frame there and returns into the resumed context. A new fiber's
// stack starts with such a frame built by start_fiber.
//
// The symbols stay hidden (each kernel library has its own copy). Mach-O prefixes C names
// with an underscore and has no .type/.size.
#define TSM_EMU_STRINGIFY_(x) #x
#define TSM_EMU_STRINGIFY(x) TSM_EMU_STRINGIFY_(x)
#define TSM_EMU_SYMBOL(name) TSM_EMU_STRINGIFY(__USER_LABEL_PREFIX__) #name
#if defined(__APPLE__)
#define TSM_EMU_ASM_HIDE(name) ".private_extern " TSM_EMU_SYMBOL(name) "\n"
#define TSM_EMU_ASM_END(name) ""
#else
#define TSM_EMU_ASM_HIDE(name) \
  ".hidden " TSM_EMU_SYMBOL(name) "\n.type " TSM_EMU_SYMBOL(name) ", %function\n"
#define TSM_EMU_ASM_END(name) ".size " TSM_EMU_SYMBOL(name) ", .-" TSM_EMU_SYMBOL(name) "\n"
#endif
#define TSM_EMU_ASM_BEGIN(name) \
  ".text\n.globl " TSM_EMU_SYMBOL(name) "\n" TSM_EMU_ASM_HIDE(name) ".p2align 4\n" TSM_EMU_SYMBOL(name) ":\n"
#endif

#if TSM_EMU_HAVE_ASM_SWITCH && defined(__x86_64__)
// System V: rbx, rbp, r12-r15, MXCSR's control bits and the x87 control word.
__asm__(TSM_EMU_ASM_BEGIN(tsm_emu_switch)
        "  pushq %rbp\n"
        "  pushq %rbx\n"
        "  pushq %r12\n"
        "  pushq %r13\n"
        "  pushq %r14\n"
        "  pushq %r15\n"
        "  subq $8, %rsp\n"
        "  stmxcsr (%rsp)\n"
        "  fnstcw 4(%rsp)\n"
        "  movq %rsp, (%rdi)\n"
        "  movq %rsi, %rsp\n"
        "  ldmxcsr (%rsp)\n"
        "  fldcw 4(%rsp)\n"
        "  addq $8, %rsp\n"
        "  popq %r15\n"
        "  popq %r14\n"
        "  popq %r13\n"
        "  popq %r12\n"
        "  popq %rbx\n"
        "  popq %rbp\n"
        "  ret\n" TSM_EMU_ASM_END(tsm_emu_switch));

void start_asm_fiber(FiberContext* c, uintptr_t top, void (*entry)()) {
  // The frame tsm_emu_switch pops: control words, r15..rbp, then the return address
  // (entry); above it, in the top slot, a zero where entry's own return address would be.
  // `ret` then leaves rsp at top - 8: aligned as right after a call.
  uint64_t* frame = reinterpret_cast<uint64_t*>(top) - 9;
  uint32_t control[2];
  __asm__ volatile("stmxcsr %0" : "=m"(control[0]));
  __asm__ volatile("fnstcw %0" : "=m"(control[1]));
  std::memset(frame, 0, 9 * sizeof *frame);
  std::memcpy(&frame[0], control, sizeof control);
  frame[7] = reinterpret_cast<uint64_t>(entry);
  c->sp = frame;
}

#elif TSM_EMU_HAVE_ASM_SWITCH && defined(__aarch64__)
// AAPCS64 (Linux and Apple): x19-x28, the frame pointer x29, the link register x30, the
// low halves d8-d15 of v8-v15, and FPCR (rounding mode, flush-to-zero). The frame is 22
// words (176 bytes, keeping sp 16-byte aligned): x19..x30 at 0-88, d8..d15 at 96-152,
// FPCR at 160. Writing FPCR can stall the pipeline, so it is written only when it differs.
__asm__(TSM_EMU_ASM_BEGIN(tsm_emu_switch)
        "  sub sp, sp, #176\n"
        "  stp x19, x20, [sp, #0]\n"
        "  stp x21, x22, [sp, #16]\n"
        "  stp x23, x24, [sp, #32]\n"
        "  stp x25, x26, [sp, #48]\n"
        "  stp x27, x28, [sp, #64]\n"
        "  stp x29, x30, [sp, #80]\n"
        "  stp d8, d9, [sp, #96]\n"
        "  stp d10, d11, [sp, #112]\n"
        "  stp d12, d13, [sp, #128]\n"
        "  stp d14, d15, [sp, #144]\n"
        "  mrs x9, fpcr\n"
        "  str x9, [sp, #160]\n"
        "  mov x10, sp\n"
        "  str x10, [x0]\n"
        "  mov sp, x1\n"
        "  ldr x10, [sp, #160]\n"
        "  cmp x9, x10\n"
        "  b.eq 1f\n"
        "  msr fpcr, x10\n"
        "1:\n"
        "  ldp x19, x20, [sp, #0]\n"
        "  ldp x21, x22, [sp, #16]\n"
        "  ldp x23, x24, [sp, #32]\n"
        "  ldp x25, x26, [sp, #48]\n"
        "  ldp x27, x28, [sp, #64]\n"
        "  ldp x29, x30, [sp, #80]\n"
        "  ldp d8, d9, [sp, #96]\n"
        "  ldp d10, d11, [sp, #112]\n"
        "  ldp d12, d13, [sp, #128]\n"
        "  ldp d14, d15, [sp, #144]\n"
        "  add sp, sp, #176\n"
        "  ret\n" TSM_EMU_ASM_END(tsm_emu_switch)
        // A new fiber's first frame: calls the entry start_fiber left in x19. With no
        // unwind information here, debuggers' and exception unwinders' walks stop at it;
        // the trap catches an entry that returns.
        TSM_EMU_ASM_BEGIN(tsm_emu_fiber_start)
        "  blr x19\n"
        "  brk #1\n" TSM_EMU_ASM_END(tsm_emu_fiber_start));

void start_asm_fiber(FiberContext* c, uintptr_t top, void (*entry)()) {
  uint64_t* frame = reinterpret_cast<uint64_t*>(top) - 22;
  uint64_t fpcr;
  __asm__ volatile("mrs %0, fpcr" : "=r"(fpcr));
  std::memset(frame, 0, 22 * sizeof *frame);
  frame[0] = reinterpret_cast<uint64_t>(entry);                 // x19
  frame[11] = reinterpret_cast<uint64_t>(&tsm_emu_fiber_start);  // x30: where `ret` goes
  frame[20] = fpcr;
  c->sp = frame;
}
#endif

#if TSM_EMU_HAVE_ASM_SWITCH
bool use_asm_switch() {
#if TSM_EMU_HAVE_UCONTEXT
  static const bool yes = [] {
    const char* env = getenv("TSM_EMU_UCONTEXT");
    return !(env && env[0] == '1');
  }();
  return yes;
#else
  return true;
#endif
}
#endif

}  // namespace

void start_fiber(FiberContext* c, char* stack, size_t bytes, void (*entry)()) {
#if TSM_EMU_HAVE_ASM_SWITCH
  if (use_asm_switch()) {
    start_asm_fiber(c, (reinterpret_cast<uintptr_t>(stack) + bytes) & ~uintptr_t(15), entry);
    return;
  }
#endif
#if TSM_EMU_HAVE_UCONTEXT
  getcontext(&c->uc);
  c->uc.uc_stack.ss_sp = stack;
  c->uc.uc_stack.ss_size = bytes;
  c->uc.uc_link = nullptr;
  makecontext(&c->uc, entry, 0);
#endif
}

void switch_fiber(FiberContext* save, FiberContext* load) {
#if TSM_EMU_HAVE_ASM_SWITCH
  if (use_asm_switch()) {
    tsm_emu_switch(&save->sp, load->sp);
    return;
  }
#endif
#if TSM_EMU_HAVE_UCONTEXT
  swapcontext(&save->uc, &load->uc);
#endif
}

}  // namespace tsm_emu
