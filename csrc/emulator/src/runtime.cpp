// The emulator's dispatcher: threadgroups over worker threads, Metal threads as fibers.
//
// Compiled once per machine into an object that every kernel library links. Kernel
// libraries are loaded with RTLD_LOCAL, so each has its own copy of this state.
#include <setjmp.h>
#include <signal.h>
#include <sys/mman.h>
#include <unistd.h>

#include <pthread.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <cinttypes>
#include <chrono>
#include <condition_variable>
#include <cstdio>
#include <cstring>
#include <exception>
#include <memory>
#include <mutex>
#include <new>
#include <string>
#include <thread>
#include <vector>

#ifndef MAP_ANONYMOUS  // older macOS SDKs name it MAP_ANON only
#define MAP_ANONYMOUS MAP_ANON
#endif

#include "c_interface.h"
#include "fiber_switch.h"
#include "sanitizer.h"
#include "sanitizer_access.h"
#include "tsm_emu/regions.h"
#include "tsm_emu/runtime.h"
#include "tsm_emu/thread_array.h"

extern "C" {
// Defined by the generated part of every kernel library.
extern const tsm_emu::KernelEntry tsm_kernel_table[];
extern const int tsm_kernel_count;
}

namespace tsm_emu {
namespace {

constexpr uint32_t kSimdWidth = 32;
constexpr uint32_t kMaxThreadsPerThreadgroup = 1024;
constexpr size_t kMaxThreadgroupMemory = 32 * 1024;

struct KernelFault {
  std::string kind;
  std::string message;
};

enum class State { Runnable, AtThreadgroupBarrier, AtSimd, Done };

struct Exchange {
  uint64_t active = 0;
  alignas(16) unsigned char values[kSimdWidth][kSimdValueBytes];
  uint64_t serial = 0;  // of the values it holds (Worker::exchanges)
  SimdMemo memo;

  // Emptied for a collective's values, which get the worker's next serial (`filled`: its
  // count of exchanges filled): what keeps a lane from reading an earlier one's memo.
  void begin_fill(uint64_t& filled) {
    active = 0;
    serial = ++filled;
  }
  // What a lane of the collective reads.
  void hand_out(SimdExchange& out) {
    out.active = active;
    out.values = values;
    out.memo = &memo;
    out.serial = serial;
  }
};

struct Fiber {
  FiberContext context;
  State state = State::Runnable;
  // Where in the kernel source the fiber waits: the call sites of the helper functions it
  // is inside (outermost first), then the barrier's or collective's own (tsm_emu::Site).
  std::vector<uint32_t> site;
  std::vector<uint32_t> calls;  // call sites of the helper functions it is in now
  alignas(16) unsigned char slot[kSimdValueBytes];
  Exchange* exchange = nullptr;
  bool at_simdgroup_barrier = false;  // AtSimd for a simdgroup_barrier, not a collective
  unsigned barrier_flags = 0;         // mem_flags of the barrier it waits at
  ThreadInfo info;
  AccessLog touches;                  // sanitized dispatches: accesses since it last stopped
};

void free_stack(char* stack, size_t bytes);

// One worker's state: it runs whole threadgroups one after the other.
struct Worker {
  const KernelEntry* kernel = nullptr;
  std::vector<Fiber> fibers;
  std::vector<char*> stacks;
  size_t stack_bytes = 0;
  FiberContext scheduler;
  // One per SIMD-group: a round releases at most one collective per SIMD-group, and its
  // lanes read their values as soon as they resume, before any later round.
  std::vector<std::unique_ptr<Exchange>> exchange;
  uint64_t exchanges = 0;  // exchanges filled, fibers' and regions' (Exchange::begin_fill)
  std::vector<std::vector<unsigned char>> dynamic_tg;                 // per [[threadgroup(n)]]
  std::vector<void*> dynamic_tg_ptrs;
  std::vector<uint64_t> dynamic_tg_bytes;  // as requested (the blocks carry 16 bytes of slack)
  const char* const* threadgroup_names = nullptr;  // parameter names, for sanitizer reports
  std::vector<const void*> static_tg;  // static threadgroup arrays seen in this group
  size_t dynamic_tg_total = 0;
  size_t static_tg_total = 0;
  Fiber* current = nullptr;
  AccessLog plain_touches;  // sanitized plain-loop and region dispatches
  // Region dispatches (regions.h): each thread's place, where it waits, how it got there.
  std::vector<u3> local;
  u3 local_shape{0, 0, 0};
  std::vector<uint8_t> runnable, path_len;
  std::vector<std::array<uint32_t, kMaxWaitPath>> path;
  // Per thread, what it hands to a SIMD-group function: two buffers, as a release in place
  // (release_in_place) leaves the values in one while the lanes post their next in the other.
  std::vector<std::array<unsigned char, kSimdValueBytes>> slots, slots_back;
  std::vector<Exchange> region_exchange;  // per SIMD-group: the released collective's values
  std::vector<SimdExchange> met;          // per SIMD-group: what its released lanes read
  std::vector<std::array<uint32_t, 2>> operands;  // per thread: its collective's own_operand()s
  std::vector<int> at;
  std::vector<uint64_t> iteration;
  std::vector<unsigned> flags;
  Regions regions;          // unsanitized dispatches: what checked pointers point into
  DispatchArgs args;
  bool fault_raised = false;
  KernelFault fault;

  ~Worker() {
    for (char* s : stacks) free_stack(s, stack_bytes);
  }
};

// The runtime's thread-locals: local-dynamic, one look-up of this library's TLS block per
// function, where g++ otherwise calls __tls_get_addr once per variable (macOS has a single
// TLS model). A sanitized dispatch's per-access calls read none (Region::sanitizer).
#if defined(__linux__)
#define TSM_RUNTIME_TLS __attribute__((tls_model("local-dynamic")))
#else
#define TSM_RUNTIME_TLS
#endif

thread_local Worker* t_worker TSM_RUNTIME_TLS = nullptr;
thread_local const ThreadInfo* t_plain_thread TSM_RUNTIME_TLS = nullptr;  // plain-loop mode
thread_local Group* t_group TSM_RUNTIME_TLS = nullptr;                     // barrier-region mode
thread_local Sanitizer* t_sanitizer TSM_RUNTIME_TLS = nullptr;            // sanitized dispatches only
// The same, in a sanitized dispatch with one worker (a library runs one dispatch at a time:
// g_dispatch_lock): the services kernel code calls without a region (count_fmas, note_store)
// read it instead of the thread-local (with the thread-local, count_fmas and __tls_get_addr
// were 6% of a sanitized tiled matmul's samples in perf).
Sanitizer* g_sole_sanitizer = nullptr;

// The sanitizer of the worker running the calling kernel code (null: unsanitized).
inline Sanitizer* running_sanitizer() {
  Sanitizer* s = g_sole_sanitizer;
  return s ? s : t_sanitizer;
}

// The regions of the running dispatch as this worker sees them: the sanitizer's, or the
// worker's own table in an unsanitized dispatch.
Regions* regions() {
  if (t_sanitizer) return t_sanitizer;
  return t_worker ? &t_worker->regions : nullptr;
}

// ---- stopping a dispatch from outside (Ctrl-C, a time limit) ----------------------------
//
// A kernel in an endless loop never returns to the runtime, so a stop request reaches its
// worker as a signal that jumps out of kernel code (as a crash does, see below). Kernel
// code may be left at any instruction; runtime code may not (it allocates, and edits the
// scheduler's and the sanitizer's state), so the depth of runtime calls is tracked per
// thread: 0 while kernel code runs. A request that arrives in runtime code takes effect
// where it returns to kernel code, or at the next check of the scheduling loops.
enum StopReason : int { kRunning = 0, kInterrupted = 1, kTimedOut = 2, kSignalled = 3 };
std::atomic<int> g_stop{kRunning};
thread_local volatile sig_atomic_t t_runtime_depth TSM_RUNTIME_TLS = 1;
thread_local sigjmp_buf* t_crash_jump TSM_RUNTIME_TLS = nullptr;  // this worker's way out (set per dispatch)
thread_local bool t_jumped_to_stop = false;       // why it took it: a stop, else a crash

double g_time_limit_s = 0;  // of the current dispatch, for the message

bool stop_requested() { return g_stop.load(std::memory_order_relaxed) != kRunning; }

KernelFault stop_fault() {
  if (g_stop.load() == kTimedOut) {
    char limit[32];
    std::snprintf(limit, sizeof limit, "%g", g_time_limit_s);
    return KernelFault{"hang", std::string("the dispatch did not finish within its time limit of ") +
                                   limit + " s (stopped; memory it wrote may be incomplete)"};
  }
  if (g_stop.load() == kSignalled)
    return KernelFault{"interrupted", "stopped: a Python signal handler raised while it ran"};
  return KernelFault{"interrupted", "stopped by Ctrl-C (SIGINT)"};
}

// At the edge between kernel and runtime code (depth 0): leave the kernel if asked to.
[[noreturn]] void jump_out_to_stop() {
  t_jumped_to_stop = true;
  siglongjmp(*t_crash_jump, 1);
}

void stop_here_if_requested() {
  if (stop_requested() && t_crash_jump) jump_out_to_stop();
}

void enter_runtime() {
  if (t_runtime_depth == 0) stop_here_if_requested();
  t_runtime_depth = t_runtime_depth + 1;
}
void leave_runtime() {
  t_runtime_depth = t_runtime_depth - 1;
  if (t_runtime_depth == 0) stop_here_if_requested();
}

// Every runtime service kernel code calls holds one for its duration (or, in the services
// called once per access, enter_runtime() and leave_runtime() on the way out: a throw
// skips the latter, as the destructor below does).
struct RuntimeScope {
  RuntimeScope() { enter_runtime(); }
  ~RuntimeScope() {
    // While an exception unwinds (to a catch in the runtime, which resets the depth), the
    // code below is still the runtime's: the unwinder may hold the loader's lock.
    if (std::uncaught_exceptions() > 0) return;
    leave_runtime();
  }
  RuntimeScope(const RuntimeScope&) = delete;
  RuntimeScope& operator=(const RuntimeScope&) = delete;
};

// Run kernel code (depth 0) and come back to runtime code (depth 1).
template <class F>
void run_kernel_code(F&& f) {
  t_runtime_depth = 0;
  f();
  t_runtime_depth = 1;
}

class SanitizedThreadScope {
 public:
  SanitizedThreadScope(const ThreadInfo* info, AccessLog* touches, const uint8_t* mode = nullptr)
      : sanitizer_(t_sanitizer) {
    if (sanitizer_) sanitizer_->set_running(info, touches, mode);
  }
  ~SanitizedThreadScope() {
    if (sanitizer_) sanitizer_->set_running(nullptr, nullptr, nullptr);
  }
  SanitizedThreadScope(const SanitizedThreadScope&) = delete;
  SanitizedThreadScope& operator=(const SanitizedThreadScope&) = delete;

 private:
  Sanitizer* sanitizer_;
};

// The sanitizer's calls from kernel code (per access, per stop): Sanitizer::in_call instead
// of enter_runtime(), which would read thread-locals; a stop requested meanwhile is taken on
// the way out, as leave_runtime() takes it.
class SanitizerCallScope {
 public:
  explicit SanitizerCallScope(Sanitizer& s) : sanitizer_(s) { mark(1); }
  ~SanitizerCallScope() {
    mark(0);
    // During an exception's unwinding the code below is still the runtime's (RuntimeScope).
    if (stop_requested() && std::uncaught_exceptions() == 0 && t_runtime_depth == 0) stop_here_if_requested();
  }
  SanitizerCallScope(const SanitizerCallScope&) = delete;
  SanitizerCallScope& operator=(const SanitizerCallScope&) = delete;

 private:
  void mark(sig_atomic_t value) {
    std::atomic_signal_fence(std::memory_order_seq_cst);
    sanitizer_.in_call = value;
    std::atomic_signal_fence(std::memory_order_seq_cst);
  }
  Sanitizer& sanitizer_;
};

// The Metal thread `s`'s worker runs and its access log, for the sanitizer (false: none, or
// not sanitized).
inline bool current_accesses(const Sanitizer* s, const ThreadInfo** info, AccessLog** touches) {
  if (!s) return false;
  const Sanitizer::Running& t = s->running;
  if (!t.info) return false;
  // A statement that calls a SIMD-group function runs twice in barrier regions (regions.h):
  // the first run's evaluation of the arguments is the kernel's, the second's is not.
  if (s->pending.mode && *s->pending.mode == kReplaying) return false;
  *info = t.info;
  *touches = t.touches;
  return true;
}

void end_segment() {
  Sanitizer* s = running_sanitizer();
  const ThreadInfo* info;
  AccessLog* touches;
  if (!current_accesses(s, &info, &touches)) return;
  SanitizerCallScope scope(*s);
  s->end_segment(s->who(*info), *touches);
}

size_t stack_size() {
  static size_t bytes = [] {
    const char* env = getenv("TSM_EMU_STACK_KB");
    size_t kb = env ? strtoul(env, nullptr, 10) : 256;
    return std::max<size_t>(kb, 64) * 1024;
  }();
  return bytes;
}

// A guard region below each fiber stack turns an overflow into a crash at the overflow, not
// a silent overwrite of a neighbouring fiber's stack. It spans at least 64 KB, not one page:
// GCC's stack-clash protection on AArch64 probes a large frame every 64 KB, so it would
// step over a smaller guard. It costs address space only.
size_t guard_bytes() {
  static const size_t bytes = [] {
    const size_t page = static_cast<size_t>(sysconf(_SC_PAGESIZE));
    return (size_t(64 * 1024) + page - 1) / page * page;
  }();
  return bytes;
}

// A stack of `bytes` usable bytes, [stack, stack + bytes), with its guard region below.
char* allocate_stack(size_t bytes) {
  void* p = mmap(nullptr, guard_bytes() + bytes, PROT_READ | PROT_WRITE,
                 MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
  if (p == MAP_FAILED) throw KernelFault{"launch", "could not allocate a fiber stack"};
  mprotect(p, guard_bytes(), PROT_NONE);
  return static_cast<char*>(p) + guard_bytes();
}

void free_stack(char* stack, size_t bytes) { munmap(stack - guard_bytes(), guard_bytes() + bytes); }

std::string fmt3(u3 v) {
  return "(" + std::to_string(v.x) + ", " + std::to_string(v.y) + ", " + std::to_string(v.z) + ")";
}

}  // namespace

u3 ceil_div(u3 a, u3 b) {  // in 64 bits: a grid of 2^32 - 1 threads must not wrap
  auto div = [](uint32_t n, uint32_t d) { return uint32_t((uint64_t(n) + d - 1) / d); };
  return {div(a.x, b.x), div(a.y, b.y), div(a.z, b.z)};
}

// Describe thread i of threadgroup `group` (position), given the dispatch geometry.
ThreadInfo thread_info(u3 grid, u3 group_size, u3 groups, u3 group, uint32_t i) {
  ThreadInfo t;
  u3 actual{std::min(group_size.x, grid.x - group.x * group_size.x),
            std::min(group_size.y, grid.y - group.y * group_size.y),
            std::min(group_size.z, grid.z - group.z * group_size.z)};
  uint32_t n = actual.x * actual.y * actual.z;
  u3 local{i % actual.x, (i / actual.x) % actual.y, i / (actual.x * actual.y)};
  t.thread_position_in_threadgroup = local;
  t.threadgroup_position_in_grid = group;
  t.threads_per_threadgroup = actual;
  t.dispatch_threads_per_threadgroup = group_size;
  t.threadgroups_per_grid = groups;
  t.threads_per_grid = grid;
  t.thread_position_in_grid = {group.x * group_size.x + local.x, group.y * group_size.y + local.y,
                               group.z * group_size.z + local.z};
  t.thread_index_in_threadgroup = i;
  t.thread_index_in_simdgroup = i % kSimdWidth;
  t.simdgroup_index_in_threadgroup = i / kSimdWidth;
  t.simdgroups_per_threadgroup = (n + kSimdWidth - 1) / kSimdWidth;
  uint32_t full = group_size.x * group_size.y * group_size.z;
  t.dispatch_simdgroups_per_threadgroup = (full + kSimdWidth - 1) / kSimdWidth;
  return t;
}

namespace {

void fiber_entry() {
  Worker* w = t_worker;
  Fiber* f = w->current;
  try {
    run_kernel_code([&] { w->kernel->invoke(w->args, f->info); });
    end_segment();
  } catch (KernelFault& e) {
    if (!w->fault_raised) {
      w->fault_raised = true;
      w->fault = e;
    }
  } catch (std::exception& e) {
    if (!w->fault_raised) {
      w->fault_raised = true;
      w->fault = KernelFault{"launch", e.what()};
    }
  } catch (...) {  // nothing may unwind out of a fiber's entry: that would terminate
    if (!w->fault_raised) {
      w->fault_raised = true;
      w->fault = KernelFault{"launch", "a kernel threw an unknown exception"};
    }
  }
  t_runtime_depth = 1;  // after an exception, which left it as it was where thrown
  f->state = State::Done;
  // Back to the scheduler for good: a fiber has no caller to return to.
  switch_fiber(&f->context, &w->scheduler);
}

[[noreturn]] void raise(std::string kind, std::string message) {
  throw KernelFault{std::move(kind), std::move(message)};
}

}  // namespace

std::string where_info(const ThreadInfo& t) {
  return "thread " + fmt3(t.thread_position_in_grid) + " (index " +
         std::to_string(t.thread_index_in_threadgroup) + " in threadgroup " +
         fmt3(t.threadgroup_position_in_grid) + ")";
}

namespace {

std::string where(const Fiber& f) { return where_info(f.info); }

std::string line_name(uint32_t site) {
  std::string s = "line " + std::to_string(site >> 12);
  if (site & 0xFFF) s += " (call " + std::to_string(site & 0xFFF) + " on that line)";
  return s;
}

std::string site_name(const std::vector<uint32_t>& path) {
  if (path.empty()) return "an unknown site";
  std::string s = line_name(path.back());
  for (size_t i = path.size() - 1; i-- > 0;) s += ", called from " + line_name(path[i]);
  return s;
}

// Suspend the calling fiber until the scheduler resumes it.
void suspend(Worker* w) {
  Fiber* f = w->current;
  end_segment();
  const sig_atomic_t depth = t_runtime_depth;  // each fiber has its own
  switch_fiber(&f->context, &w->scheduler);  // never resumed after another thread faulted
  t_runtime_depth = depth;
}

// Release the SIMD collectives that can complete; true if any did. Called only when no
// fiber is runnable, so every live lane of every SIMD-group is waiting somewhere: the lanes
// waiting at one collective call site are that collective's active lanes.
//
// When a SIMD-group's lanes wait at different sites, they diverged, and only the site that
// comes first in the source is released: lanes still inside a branch or a loop run on
// until they reach the lanes that skipped ahead, so a collective after the branch sees all
// of them again (reconvergence, as the GPU's lockstep execution gives).
// Lenient mode (TSM_EMU_EXITED_THREADS_ARRIVE=1): threads that returned count as having
// arrived at every later barrier, as some GPUs behave. Read once per loaded library.
bool exited_threads_arrive() {
  static const bool arrive = [] {
    const char* env = getenv("TSM_EMU_EXITED_THREADS_ARRIVE");
    return env && env[0] == '1';
  }();
  return arrive;
}

// A simdgroup_barrier must be reached by every lane of its SIMD-group, like a threadgroup
// barrier by every thread of the threadgroup.
void check_simdgroup_barrier(Worker* w, uint32_t first, uint32_t lanes, const std::vector<uint32_t>& site) {
  const Fiber* waiting = nullptr;
  for (uint32_t lane = 0; lane < lanes; ++lane) {
    const Fiber& f = w->fibers[first + lane];
    if (f.state == State::AtSimd && f.site == site) waiting = &f;
  }
  for (uint32_t lane = 0; lane < lanes; ++lane) {
    const Fiber& f = w->fibers[first + lane];
    if (f.state == State::AtSimd && f.site == site) continue;
    if (f.state == State::Done && exited_threads_arrive()) continue;
    raise("barrier_divergence",
          where(*waiting) + " waits at the simdgroup_barrier at " + site_name(site) + " but " + where(f) +
              (f.state == State::Done ? " of its SIMD-group returned before it"
                                      : " of its SIMD-group waits at " + site_name(f.site) +
                                            " instead (a simdgroup_barrier needs every lane)"));
  }
}

bool resolve_simd(Worker* w, uint32_t n) {
  bool released = false;
  for (uint32_t first = 0, sg = 0; first < n; first += kSimdWidth, ++sg) {
    uint32_t lanes = std::min(n - first, kSimdWidth);
    const std::vector<uint32_t>* first_site = nullptr;
    for (uint32_t lane = 0; lane < lanes; ++lane) {
      const Fiber& f = w->fibers[first + lane];
      if (f.state != State::AtSimd) continue;
      if (!first_site || f.site < *first_site) first_site = &f.site;
    }
    if (!first_site) continue;
    const std::vector<uint32_t> site = *first_site;
    for (uint32_t lane = 0; lane < lanes; ++lane) {
      const Fiber& f = w->fibers[first + lane];
      if (f.state == State::AtSimd && f.site == site && f.at_simdgroup_barrier) {
        check_simdgroup_barrier(w, first, lanes, site);
        break;
      }
    }
    if (!w->exchange[sg]) w->exchange[sg].reset(new Exchange);
    Exchange* ex = w->exchange[sg].get();
    ex->begin_fill(w->exchanges);
    unsigned flags = 0;
    for (uint32_t lane = 0; lane < lanes; ++lane) {
      Fiber& f = w->fibers[first + lane];
      if (f.state != State::AtSimd || f.site != site) continue;
      ex->active |= uint64_t(1) << lane;
      std::memcpy(ex->values[lane], f.slot, sizeof f.slot);
      f.exchange = ex;
      f.state = State::Runnable;
      flags |= f.at_simdgroup_barrier ? f.barrier_flags : 0u;
    }
    if (t_sanitizer && flags) t_sanitizer->simdgroup_barrier(sg, flags);
    released = true;
  }
  return released;
}

void resolve_threadgroup_barrier(Worker* w, uint32_t n) {
  const Fiber* waiting = nullptr;
  const Fiber* exited = nullptr;
  for (uint32_t i = 0; i < n; ++i) {
    const Fiber& f = w->fibers[i];
    if (f.state == State::Done) {
      if (!exited) exited = &f;
      continue;
    }
    if (!waiting) {
      waiting = &f;
    } else if (f.site != waiting->site) {
      raise("barrier_divergence", "threads wait at different threadgroup_barrier calls: " +
                                      where(*waiting) + " at " + site_name(waiting->site) + ", " +
                                      where(f) + " at " + site_name(f.site));
    }
  }
  if (!waiting) return;
  if (exited && !exited_threads_arrive())
    raise("barrier_divergence", where(*exited) + " returned before the threadgroup_barrier at " +
                                    site_name(waiting->site) + " that " + where(*waiting) +
                                    " waits at (undefined in Metal: it hangs "
                                    "on some GPUs; set TSM_EMU_EXITED_THREADS_ARRIVE=1 to count "
                                    "exited threads as arrived)");
  unsigned flags = 0;
  for (uint32_t i = 0; i < n; ++i)
    if (w->fibers[i].state == State::AtThreadgroupBarrier) {
      flags |= w->fibers[i].barrier_flags;
      w->fibers[i].state = State::Runnable;
    }
  if (t_sanitizer) t_sanitizer->threadgroup_barrier(flags);
}

void run_group_fibers(Worker* w, u3 grid, u3 group_size, u3 groups, u3 group, uint32_t n) {
  if (w->fibers.size() < n) w->fibers.resize(n);
  while (w->stacks.size() < n) w->stacks.push_back(allocate_stack(w->stack_bytes));
  for (uint32_t i = 0; i < n; ++i) {
    Fiber& f = w->fibers[i];
    f.state = State::Runnable;
    f.exchange = nullptr;
    f.at_simdgroup_barrier = false;  // a fault may have left a fiber of an earlier dispatch there
    f.site.clear();
    f.calls.clear();
    f.touches.clear();
    f.info = thread_info(grid, group_size, groups, group, i);
    start_fiber(&f.context, w->stacks[i], w->stack_bytes, fiber_entry);
  }
  for (;;) {
    bool ran = false, live = false;
    for (uint32_t i = 0; i < n; ++i) {
      Fiber& f = w->fibers[i];
      if (f.state == State::Runnable) {
        w->current = &f;
        {
          SanitizedThreadScope running(&f.info, &f.touches);
          switch_fiber(&w->scheduler, &f.context);
        }
        t_runtime_depth = 1;
        w->current = nullptr;
        ran = true;
        if (w->fault_raised) throw w->fault;
        if (stop_requested()) throw stop_fault();
      }
      live |= f.state != State::Done;
    }
    if (t_sanitizer && (!ran || !live)) t_sanitizer->flush_instruction_log();  // every thread is stopped
    if (!live) return;
    if (ran) continue;
    if (resolve_simd(w, n)) continue;
    resolve_threadgroup_barrier(w, n);
  }
}

// A kernel with a group function (barrier regions, or a loop over the threads of one that
// does not synchronise: regions.h) runs the whole threadgroup in one call.
void run_group_regions(Worker* w, u3 grid, u3 group_size, u3 groups, u3 group, uint32_t n) {
  ThreadInfo first = thread_info(grid, group_size, groups, group, 0);
  const u3 actual = first.threads_per_threadgroup;
  if (w->local.size() != n || !(w->local_shape.x == actual.x && w->local_shape.y == actual.y)) {
    w->local.resize(n);
    u3 l{0, 0, 0};
    for (uint32_t i = 0; i < n; ++i) {  // x fastest, as thread_info numbers them
      w->local[i] = l;
      if (++l.x == actual.x) {
        l.x = 0;
        if (++l.y == actual.y) {
          l.y = 0;
          ++l.z;
        }
      }
    }
    w->local_shape = actual;
  }
  w->at.resize(n);
  w->runnable.resize(n);
  w->iteration.resize(n);
  w->flags.resize(n);
  w->path.resize(n);
  w->path_len.resize(n);
  w->slots.resize(n);
  w->slots_back.resize(n);
  w->region_exchange.resize((n + kSimdWidth - 1) / kSimdWidth);
  w->met.resize(w->region_exchange.size());
  w->operands.resize(n);
  Group g{n, first, w->local.data(), {group.x * group_size.x, group.y * group_size.y, group.z * group_size.z},
          t_sanitizer != nullptr, &g_stop, w->at.data(), w->runnable.data(), w->iteration.data(),
          w->flags.data(), reinterpret_cast<uint32_t(*)[kMaxWaitPath]>(w->path.data()), w->path_len.data(),
          nullptr, nullptr};
  g.lanes.slots = reinterpret_cast<unsigned char(*)[kSimdValueBytes]>(w->slots.data());
  g.lanes.met = w->met.data();
  g.lanes.operands = reinterpret_cast<uint32_t(*)[2]>(w->operands.data());
  t_plain_thread = &g.running;
  t_group = &g;
  SanitizedThreadScope running(&g.running, &w->plain_touches, &g.lanes.mode);
  try {
    run_kernel_code([&] { w->kernel->group(w->args, g); });
  } catch (...) {
    t_plain_thread = nullptr;
    t_group = nullptr;
    t_runtime_depth = 1;
    throw;
  }
  t_plain_thread = nullptr;
  t_group = nullptr;
}

void run_group(Worker* w, u3 grid, u3 group_size, u3 groups, u3 group) {
  const bool regions = w->kernel->group != nullptr, fibers = !regions && w->kernel->synchronises;
  u3 actual{std::min(group_size.x, grid.x - group.x * group_size.x),
            std::min(group_size.y, grid.y - group.y * group_size.y),
            std::min(group_size.z, grid.z - group.z * group_size.z)};
  uint32_t n = actual.x * actual.y * actual.z;
  w->static_tg.clear();
  w->static_tg_total = 0;
  w->plain_touches.clear();  // a fault may have left a thread's accesses behind
  if (t_sanitizer) {
    const uint32_t linear = group.x + groups.x * (group.y + groups.y * group.z);
    t_sanitizer->begin_group(linear, (n + kSimdWidth - 1) / kSimdWidth, w->dynamic_tg_ptrs.data(),
                             w->dynamic_tg_bytes.data(), int(w->dynamic_tg_bytes.size()),
                             w->threadgroup_names);
  }
  if (regions || fibers) {
    if (regions)
      run_group_regions(w, grid, group_size, groups, group, n);
    else
      run_group_fibers(w, grid, group_size, groups, group, n);
    if (t_sanitizer) t_sanitizer->end_group();
    return;
  }
  for (uint32_t i = 0; i < n; ++i) {
    if (stop_requested()) throw stop_fault();
    ThreadInfo info = thread_info(grid, group_size, groups, group, i);
    t_plain_thread = &info;
    SanitizedThreadScope running(&info, &w->plain_touches);
    try {
      run_kernel_code([&] { w->kernel->invoke(w->args, info); });
      end_segment();
    } catch (...) {
      t_plain_thread = nullptr;
      t_runtime_depth = 1;
      throw;
    }
    t_plain_thread = nullptr;
    if (t_sanitizer && (i % kSimdWidth == kSimdWidth - 1 || i + 1 == n)) t_sanitizer->flush_instruction_log();
  }
  if (t_sanitizer) t_sanitizer->end_group();
}

// ---- hardware faults in kernel code ---------------------------------------------------
//
// A wild read, a stack overflow or an integer division by zero in a kernel must not take
// the Python process down: while a worker runs kernel code, SIGSEGV/SIGBUS/SIGFPE/SIGILL/
// SIGTRAP jump back to its dispatch loop, which reports a "crash" fault. Faults outside
// kernel code go to whatever handler was installed before (Python's faulthandler, say).

thread_local int t_crash_signal = 0;
thread_local void* t_crash_address = nullptr;
thread_local int t_crash_code = 0;  // the signal's si_code
thread_local ThreadInfo t_crash_thread;
thread_local bool t_crash_thread_known = false;

constexpr int kCrashSignals[] = {SIGSEGV, SIGBUS, SIGFPE, SIGILL, SIGTRAP};
struct sigaction g_previous[sizeof kCrashSignals / sizeof kCrashSignals[0]];

void on_crash(int sig, siginfo_t* info, void* context) {
  if (t_crash_jump) {
    t_crash_signal = sig;
    t_crash_address = info ? info->si_addr : nullptr;
    t_crash_code = info ? info->si_code : 0;
    Worker* w = t_worker;
    if (Group* g = t_group) g->complete();
    const ThreadInfo* t = (w && w->current) ? &w->current->info : t_plain_thread;
    t_crash_thread_known = t != nullptr;
    if (t) std::memcpy(&t_crash_thread, t, sizeof t_crash_thread);
    t_jumped_to_stop = false;
    siglongjmp(*t_crash_jump, 1);
  }
  for (size_t i = 0; i < sizeof kCrashSignals / sizeof kCrashSignals[0]; ++i) {
    if (kCrashSignals[i] != sig) continue;
    const struct sigaction& old = g_previous[i];
    if (old.sa_flags & SA_SIGINFO) {
      old.sa_sigaction(sig, info, context);
      return;
    }
    if (old.sa_handler != SIG_DFL && old.sa_handler != SIG_IGN) {
      old.sa_handler(sig);
      return;
    }
    sigaction(sig, &old, nullptr);  // default action: re-raised when the handler returns
    return;
  }
}

void install_crash_handlers() {
  static std::once_flag once;
  std::call_once(once, [] {
    for (size_t i = 0; i < sizeof kCrashSignals / sizeof kCrashSignals[0]; ++i) {
      struct sigaction sa;
      std::memset(&sa, 0, sizeof sa);
      sa.sa_sigaction = on_crash;
      sa.sa_flags = SA_SIGINFO | SA_ONSTACK | SA_NODEFER;
      sigemptyset(&sa.sa_mask);
      sigaction(kCrashSignals[i], &sa, &g_previous[i]);
    }
  });
}

// For the lifetime of one worker's dispatch: an alternate signal stack (a fiber that
// overflows its stack cannot run a handler on it) and the jump target.
class CrashGuard {
 public:
  explicit CrashGuard(sigjmp_buf* jump) : altstack_(kAltStackBytes) {
    stack_t ss;
    ss.ss_sp = altstack_.data();
    ss.ss_size = altstack_.size();
    ss.ss_flags = 0;
    sigaltstack(&ss, &previous_);
    t_crash_jump = jump;
  }
  ~CrashGuard() {
    t_crash_jump = nullptr;
    sigaltstack(&previous_, nullptr);
  }

 private:
  static constexpr size_t kAltStackBytes = 64 * 1024;
  std::vector<char> altstack_;
  stack_t previous_;
};

// Whether `address` lies in the guard region below one of the worker's fiber stacks.
bool in_stack_guard(const Worker& w, const void* address) {
  const char* a = static_cast<const char*>(address);
  for (const char* stack : w.stacks)
    if (a >= stack - guard_bytes() && a < stack) return true;
  return false;
}

const char* signal_name(int sig) {
  switch (sig) {
    case SIGSEGV: return "SIGSEGV";
    case SIGBUS: return "SIGBUS";
    case SIGFPE: return "SIGFPE";
    case SIGILL: return "SIGILL";
    case SIGTRAP: return "SIGTRAP";
  }
  return "a signal";
}

// What went wrong, in words that do not depend on the OS's choice of signal: a guard-page
// hit is SIGSEGV on Linux and SIGBUS on macOS; a trap instruction is SIGILL on x86-64
// (ud2) and SIGTRAP on AArch64 (brk).
struct CrashCause {
  const char* what;
  std::string hint;
};

// x86-64 raises a general-protection fault, not a page fault, for a load or store of 16 or
// more bytes that must be aligned and is not: Linux delivers it as SIGSEGV with si_code
// SI_KERNEL and no address. Kernels meet it through a pointer cast, `(device float4*)(p + 1)`:
// the emulator's vectors are aligned as Metal's (a float4 to 16 bytes), and an access through
// a misaligned pointer is undefined in Metal as in C++, though an Apple GPU may not fault.
bool misaligned_access(int sig, int code, const void* address) {
#ifdef BUS_ADRALN
  if (sig == SIGBUS && code == BUS_ADRALN) return true;
#endif
#if defined(__x86_64__) && defined(SI_KERNEL)
  if (sig == SIGSEGV && code == SI_KERNEL && address == nullptr) return true;
#endif
  (void)sig, (void)code, (void)address;
  return false;
}

CrashCause crash_cause(const Worker& w, int sig, int code, const void* address) {
  switch (sig) {
    case SIGSEGV:
    case SIGBUS:
      if (in_stack_guard(w, address))
        return {"fiber stack overflow", "TSM_EMU_STACK_KB sets the stack size, now " +
                                            std::to_string(stack_size() / 1024) + " KB"};
      if (misaligned_access(sig, code, address))
        return {"misaligned or invalid memory access",
                "most likely a vector or other over-aligned type read or written at an address "
                "not aligned to it, through a pointer cast such as (device float4*)(p + 1) "
                "(undefined in Metal), else a wild pointer"};
      return {"invalid memory access", "a wild index or pointer"};
    case SIGFPE: return {"arithmetic fault", "an integer division by zero or overflow"};
    case SIGILL:
    case SIGTRAP: return {"trap or illegal instruction", ""};
  }
  return {"unexpected signal", ""};
}

KernelFault crash_fault(const Worker& w) {
  const CrashCause cause = crash_cause(w, t_crash_signal, t_crash_code, t_crash_address);
  char address[32];
  std::snprintf(address, sizeof address, "0x%" PRIxPTR, reinterpret_cast<uintptr_t>(t_crash_address));
  std::string msg = std::string(cause.what) + " (" + signal_name(t_crash_signal) + ") at address " + address;
  if (t_crash_thread_known) msg += " in " + where_info(t_crash_thread);
  if (!cause.hint.empty()) msg += ": " + cause.hint;
  msg += "; the emulator stopped the dispatch instead of the process (memory the kernel "
         "wrote before the fault may be corrupt)";
  return KernelFault{"crash", msg};
}

// ---- stop requests: the signals ------------------------------------------------------
//
// A stop reaches each worker as kStopSignal (SIGURG: ignored by default and used by nothing
// else here; Go's runtime preempts goroutines with it for the same reason). Its handler
// jumps out of kernel code; in runtime code it does nothing (see RuntimeScope). Workers
// register in slots so that a signal handler can find them; a worker leaves its slot only
// when nobody is signalling it, as pthread_kill on a thread that has exited is undefined.
constexpr int kStopSignal = SIGURG;
constexpr unsigned kMaxWorkers = 256;

struct WorkerSlot {
  std::atomic<int> state{0};  // 0 free, 1 a worker runs, 2 being signalled
  pthread_t thread;
};
WorkerSlot g_slots[kMaxWorkers];
std::atomic<bool> g_dispatch_running{false};
struct sigaction g_previous_stop_signal;
struct sigaction g_previous_sigint;

class SlotGuard {
 public:
  explicit SlotGuard(unsigned index) : slot_(g_slots[index]) {
    slot_.thread = pthread_self();
    slot_.state.store(1);
  }
  ~SlotGuard() {
    int running = 1;
    while (!slot_.state.compare_exchange_weak(running, 0)) running = 1;
  }

 private:
  WorkerSlot& slot_;
};

// Async-signal-safe (lock-free atomics and pthread_kill): called from the SIGINT handler.
void request_stop(StopReason reason) {
  int running = kRunning;
  g_stop.compare_exchange_strong(running, reason);
  for (WorkerSlot& slot : g_slots) {
    int live = 1;
    if (slot.state.compare_exchange_strong(live, 2)) {
      pthread_kill(slot.thread, kStopSignal);
      slot.state.store(1);
    }
  }
}

// Hand a signal on to the handler installed before ours (SIG_DFL of SIGURG: nothing).
void chain(const struct sigaction& previous, int sig, siginfo_t* info, void* context) {
  if (previous.sa_flags & SA_SIGINFO) {
    previous.sa_sigaction(sig, info, context);
  } else if (previous.sa_handler != SIG_DFL && previous.sa_handler != SIG_IGN) {
    previous.sa_handler(sig);
  }
}

void on_stop_signal(int sig, siginfo_t* info, void* context) {
  if (t_worker != nullptr && t_crash_jump != nullptr) {  // a worker of this library
    if (t_runtime_depth == 0 && !(t_sanitizer && t_sanitizer->in_call) && stop_requested()) jump_out_to_stop();
    return;
  }
  chain(g_previous_stop_signal, sig, info, context);  // another library's worker, say
}

void on_interrupt(int sig, siginfo_t* info, void* context) {
  if (g_dispatch_running.load()) request_stop(kInterrupted);
  chain(g_previous_sigint, sig, info, context);  // Python's: KeyboardInterrupt once we return
}

void install_stop_signal_handler() {
  static std::once_flag once;
  std::call_once(once, [] {
    struct sigaction sa;
    std::memset(&sa, 0, sizeof sa);
    sa.sa_sigaction = on_stop_signal;
    sa.sa_flags = SA_SIGINFO | SA_ONSTACK | SA_RESTART;
    sigemptyset(&sa.sa_mask);
    sigaction(kStopSignal, &sa, &g_previous_stop_signal);
  });
}

// For a dispatch from Python's main thread, which Ctrl-C should stop: our SIGINT handler in
// front of Python's, for the duration. Nothing is installed when SIGINT is ignored or left
// to its default (ending the process), as the user chose.
class InterruptGuard {
 public:
  explicit InterruptGuard(bool wanted) {
    struct sigaction current;
    if (!wanted || sigaction(SIGINT, nullptr, &current) != 0) return;
    if (!(current.sa_flags & SA_SIGINFO) &&
        (current.sa_handler == SIG_IGN || current.sa_handler == SIG_DFL))
      return;
    g_previous_sigint = current;
    struct sigaction ours;
    std::memset(&ours, 0, sizeof ours);
    ours.sa_sigaction = on_interrupt;
    ours.sa_flags = SA_SIGINFO | SA_ONSTACK | SA_RESTART;
    sigemptyset(&ours.sa_mask);
    sigaddset(&ours.sa_mask, kStopSignal);  // a worker's own stop signal waits for our return
    installed_ = sigaction(SIGINT, &ours, nullptr) == 0;
  }
  ~InterruptGuard() {
    struct sigaction current;
    if (installed_ && sigaction(SIGINT, nullptr, &current) == 0 &&
        (current.sa_flags & SA_SIGINFO) && current.sa_sigaction == on_interrupt)
      sigaction(SIGINT, &g_previous_sigint, nullptr);  // unless someone replaced ours since
  }
  InterruptGuard(const InterruptGuard&) = delete;
  InterruptGuard& operator=(const InterruptGuard&) = delete;

 private:
  bool installed_ = false;
};

// A time limit: a thread that requests the stop when the limit passes before the dispatch
// ends.
class Watchdog {
 public:
  explicit Watchdog(double seconds) {
    if (seconds > 0)
      thread_ = std::thread([this, seconds] {
        std::unique_lock<std::mutex> lock(lock_);
        if (!done_cv_.wait_for(lock, std::chrono::duration<double>(seconds), [this] { return done_; }))
          request_stop(kTimedOut);
      });
  }
  ~Watchdog() {
    if (!thread_.joinable()) return;
    {
      std::lock_guard<std::mutex> lock(lock_);
      done_ = true;
    }
    done_cv_.notify_all();
    thread_.join();
  }
  Watchdog(const Watchdog&) = delete;
  Watchdog& operator=(const Watchdog&) = delete;

 private:
  std::mutex lock_;
  std::condition_variable done_cv_;
  bool done_ = false;
  std::thread thread_;
};

// Python's pending signal handlers, run as its main thread would between bytecodes; true
// when one raised (its exception is then in l->raised).
bool run_python_signal_handlers(tsm_launch* l) {
  const int gil = l->python.gil_ensure();
  const bool raised = l->python.check_signals() != 0;
  if (raised) l->python.fetch_error(&l->raised[0], &l->raised[1], &l->raised[2]);
  l->python.gil_release(gil);
  return raised && l->raised[0] != nullptr;
}

// ---- fork() ----------------------------------------------------------------------------
//
// A child forked while another thread of the parent is inside a dispatch has only the
// forking thread: the dispatch lock, the workers' state and the slots belong to threads
// that do not exist there. The child starts afresh (the old pool is left to it unused: its
// state is whatever the parent's threads were doing).
std::mutex g_dispatch_lock;  // workers' stacks are reused between dispatches
// How often a dispatch with a poll function (tsm_launch.poll) lets Python run its signal
// handlers: a handler that raises stops the dispatch this long after the signal, at most.
constexpr int kPollMs = 20;
std::vector<std::unique_ptr<Worker>>* g_pool = nullptr;

void after_fork_in_child() {
  new (&g_dispatch_lock) std::mutex();
  g_pool = nullptr;
  for (WorkerSlot& slot : g_slots) slot.state.store(0);
  g_dispatch_running.store(false);
  g_stop.store(kRunning);
  g_sole_sanitizer = nullptr;
}

[[maybe_unused]] const int g_fork_handler_registered =
    pthread_atfork(nullptr, nullptr, after_fork_in_child);

}  // namespace

// ---- services called from kernel code -------------------------------------------------

// Services that allocate or edit the runtime's state hold a RuntimeScope: a stop request
// never lands inside them.
void fault(const char* kind, const char* message) {
  RuntimeScope scope;
  raise(kind, message);
}

static const ThreadInfo* current_thread_or_null() {
  Worker* w = t_worker;
  if (w && w->current) return &w->current->info;
  if (Group* g = t_group) g->complete();  // a plain dispatch's Group::enter records the index only
  return t_plain_thread;
}

const ThreadInfo& current_thread() {
  if (const ThreadInfo* t = current_thread_or_null()) return *t;
  raise("launch", "a Metal built-in was used outside a kernel launch");
}

static Worker* fiber_worker(const char* what) {
  Worker* w = t_worker;
  if (!w || !w->current)
    raise("launch", std::string(what) + " called outside a fiber: the library was compiled "
                                        "without synchronisation support (emulator bug)");
  return w;
}

SimdExchange simd_exchange(const void* value, size_t size, uint32_t site) {
  RuntimeScope scope;
  // Barrier regions (a call whose site did not carry its lane): hand over, or read what the
  // lanes met with.
  if (Group* g = t_group) return lane_exchange(value, size, LaneRef{&g->lanes, g->running.thread_index_in_threadgroup});
  Worker* w = fiber_worker("a SIMD-group function");
  Fiber* f = w->current;
  if (size > sizeof f->slot) raise("launch", "SIMD-group function on a value wider than 64 bytes");
  std::memcpy(f->slot, value, size);
  f->site = f->calls;
  f->site.push_back(site);
  f->exchange = nullptr;
  f->state = State::AtSimd;
  suspend(w);
  SimdExchange out;
  f->exchange->hand_out(out);
  out.lane = f->info.thread_index_in_simdgroup;
  return out;
}

void collective_outside_stop() {
  RuntimeScope scope;
  raise("launch", "a SIMD-group function ran outside a stop of its kernel's barrier-region "
                  "translation (emulator bug; TSM_EMU_REGIONS=0 runs the kernel as fibers)");
}

void simdgroup_barrier_wait(uint32_t site, unsigned flags) {
  RuntimeScope scope;
  Worker* w = fiber_worker("simdgroup_barrier");
  Fiber* f = w->current;
  f->site = f->calls;
  f->site.push_back(site);
  f->exchange = nullptr;
  f->at_simdgroup_barrier = true;
  f->barrier_flags = flags;
  f->state = State::AtSimd;
  suspend(w);
  f->at_simdgroup_barrier = false;
}

void threadgroup_barrier_wait(uint32_t site, unsigned flags) {
  RuntimeScope scope;
  Worker* w = fiber_worker("threadgroup_barrier");
  Fiber* f = w->current;
  f->site = f->calls;
  f->site.push_back(site);
  f->barrier_flags = flags;
  f->state = State::AtThreadgroupBarrier;
  suspend(w);
}

void end_region_segment() {
  end_segment();
  // A round runs the threads in order: after the last lane of a SIMD-group (the group's
  // last thread, for a partial one) every lane of it is stopped, and its instructions are
  // counted while their log is still in cache (a threadgroup's logs together outgrow it).
  Sanitizer* s = running_sanitizer();
  const ThreadInfo* info = s ? s->running.info : nullptr;
  if (!info) return;
  const u3 n = info->threads_per_threadgroup;
  const uint32_t i = info->thread_index_in_threadgroup;
  if (i % kSimdWidth == kSimdWidth - 1 || i + 1 == n.x * n.y * n.z)
    s->flush_instruction_log(info->simdgroup_index_in_threadgroup);
}

void stop_group() {
  RuntimeScope scope;
  throw stop_fault();
}

// The uniformity analysis promised what a sanitized run found untrue (`what`: the promise
// and how it broke).
[[noreturn]] static void broken_promise(const std::string& what) {
  RuntimeScope scope;
  raise("internal", "the emulator's translation said " + what + ": a bug of the emulator (torch_sparse_metal/"
                    "metal/_uniformity.py); TSM_EMU_REGIONS=0 runs the kernel without it");
}

void broken_uniformity() {
  broken_promise("this kernel's threads all take the same way from barrier to barrier, but they did not");
}

void broken_uniform_variable(const char* name) {
  broken_promise((name ? "the variable `" + std::string(name) + "`" : std::string("a variable")) +
                 " of this kernel has one value in every thread of a threadgroup, but two threads stored "
                 "different ones at a barrier");
}

// Whether threads a and b wait at one SIMD-group stop in the same loop iterations (their
// paths equal). A loop of compares: std::equal was a call of memcmp per lane.
__attribute__((always_inline)) static inline bool same_place(const Group& g, uint32_t a, uint32_t b) {
  if (g.path_len[a] != g.path_len[b]) return false;
  for (unsigned i = 0; i < g.path_len[a]; ++i)
    if (g.path[a][i] != g.path[b][i]) return false;
  return true;
}

// The fiber scheduler's resolve_simd, for threads that ran as a loop: in each SIMD-group,
// the lanes waiting at the SIMD-group stop whose path comes first (loops' sites and
// iterations, then the stop's site, as fibers' call paths compare) meet; the others keep
// waiting. True if any SIMD-group met.
template <class Describe>  // thread t -> its words in a report
bool release_simd_groups(Group& g, const Describe& thread) {
  Worker* w = t_worker;
  auto waits_at_simd = [&](uint32_t t) { return g.at[t] > 0 && g.kinds[g.at[t]] != W_BARRIER; };
  auto before = [&](uint32_t a, uint32_t b) {
    return std::lexicographical_compare(g.path[a], g.path[a] + g.path_len[a], g.path[b], g.path[b] + g.path_len[b]);
  };
  auto where = [&](uint32_t t) { return std::vector<uint32_t>(g.path[t], g.path[t] + g.path_len[t]); };
  bool released = false;
  for (uint32_t first = 0, sg = 0; first < g.n; first += kSimdWidth, ++sg) {
    const uint32_t lanes = std::min(g.n - first, kSimdWidth);
    int leader = -1;
    for (uint32_t t = first; t < first + lanes; ++t)
      if (waits_at_simd(t) && (leader < 0 || before(t, uint32_t(leader)))) leader = int(t);
    if (leader < 0) continue;
    const uint32_t lead = uint32_t(leader);
    if (g.kinds[g.at[lead]] == W_SIMDGROUP_BARRIER) {  // every lane of the SIMD-group, as fibers require
      uint32_t named = lead;  // the report names the last lane there, as the fiber scheduler's
      for (uint32_t t = first; t < first + lanes; ++t)
        if (waits_at_simd(t) && same_place(g, t, lead)) named = t;
      for (uint32_t t = first; t < first + lanes; ++t) {
        if (waits_at_simd(t) && same_place(g, t, lead)) continue;
        if (g.at[t] < 0 && exited_threads_arrive()) continue;
        raise("barrier_divergence",
              thread(named) + " waits at the simdgroup_barrier at " + site_name(where(lead)) + " but " + thread(t) +
                  (g.at[t] < 0 ? " of its SIMD-group returned before it"
                               : " of its SIMD-group waits at " +
                                     (waits_at_simd(t) ? site_name(where(t)) : site_name({g.sites[g.at[t]]})) +
                                     " instead (a simdgroup_barrier needs every lane)"));
      }
    }
    Exchange& ex = w->region_exchange[sg];
    ex.begin_fill(w->exchanges);
    unsigned flags = 0;
    for (uint32_t t = first; t < first + lanes; ++t) {
      if (!waits_at_simd(t) || !same_place(g, t, lead)) continue;
      ex.active |= uint64_t(1) << (t - first);
      std::memcpy(ex.values[t - first], g.lanes.slots[t], kSimdValueBytes);
      if (g.kinds[g.at[t]] == W_SIMDGROUP_BARRIER) flags |= g.flags[t];
      g.runnable[t] = 1;
    }
    ex.hand_out(w->met[sg]);
    if (t_sanitizer && flags) t_sanitizer->simdgroup_barrier(sg, flags);
    released = true;
  }
  return released;
}

// After every SIMD-group's lanes in mask_of(first, end) (the mask of threads first..end-1 that
// handed their values to one SIMD-group function): they meet there, their values where they
// handed them (not the exchange's copy), and the next function's values go to the other
// buffer (a lane handing over its next value must not overwrite one its SIMD-group's later
// lanes have yet to read).
template <class MaskOf>
void meet_in_place(Group& g, MaskOf mask_of) {
  Worker* w = t_worker;
  const uint32_t n = g.n;
  for (uint32_t first = 0, sg = 0; first < n; first += kSimdWidth, ++sg) {
    const uint32_t end = std::min(n, first + kSimdWidth);
    Exchange& ex = w->region_exchange[sg];
    ex.begin_fill(w->exchanges);
    ex.active = mask_of(first, end);
    if (!ex.active) continue;
    ex.hand_out(w->met[sg]);
    w->met[sg].values = g.lanes.slots + first;
  }
  using Values = unsigned char(*)[kSimdValueBytes];
  const Values front = reinterpret_cast<Values>(w->slots.data()), back = reinterpret_cast<Values>(w->slots_back.data());
  g.lanes.slots = g.lanes.slots == front ? back : front;
}

// The mask of threads first..end-1 for which meets(t), in a local: through the exchange,
// each lane's bit was a load and a store.
template <class Meets>
uint64_t lane_mask(uint32_t first, uint32_t end, Meets meets) {
  uint64_t m = 0;
  for (uint32_t t = first; t < end; ++t)
    if (meets(t)) m |= uint64_t(1) << (t - first);
  return m;
}

// After a plain round: the case of release_simd_groups that the project's kernels with
// SIMD-group functions meet at nearly every round, without its copies. Every thread that
// has not returned waits at a SIMD-group function (no barrier), and in each SIMD-group the
// waiting lanes wait at one place (the same stop, loops' iterations and all): they all meet.
// Their values stay where they handed them, and the next round's go to the other buffer.
Released release_in_place(Group& g) {
  if (t_sanitizer || g.stop->load(std::memory_order_relaxed) != 0) return Released::kNone;
  const uint32_t n = g.n;
  const int* at = g.at;
  bool one_stop = true;  // every thread at the stop thread 0 waits at
  for (uint32_t first = 0; first < n; first += kSimdWidth) {
    const uint32_t end = std::min(n, first + kSimdWidth);
    int lead = -1;
    for (uint32_t t = first; t < end; ++t) {
      if (at[t] < 0) {
        one_stop = false;
        continue;
      }
      if (at[t] == 0 || g.kinds[at[t]] != W_COLLECTIVE) return Released::kNone;
      if (lead < 0) {
        lead = int(t);
        one_stop = one_stop && at[t] == at[0];
        continue;
      }
      const uint32_t l = uint32_t(lead);
      if (at[t] != at[l] || !same_place(g, t, l)) return Released::kNone;
    }
  }
  meet_in_place(g, [&](uint32_t first, uint32_t end) {
    return lane_mask(first, end, [&](uint32_t t) {
      if (at[t] < 0) return false;
      if (!one_stop) g.runnable[t] = 1;  // (the next round runs them all, without flags)
      return true;
    });
  });
  return one_stop ? Released::kAll : Released::kSome;
}

// A fault caught in kernel code (lanes.h): the runtime code it was raised in is left.
void caught_in_kernel_code() { t_runtime_depth = 0; }

// Lanes at once (lanes.h): every thread running (state 0) handed its value to one SIMD-group
// function.
void release_lanes(Group& g, const uint8_t* state) {
  meet_in_place(g, [&](uint32_t first, uint32_t end) {
    if (end - first == kSimdWidth) {  // all 32 running, as nearly always: four loads
      uint64_t words[kSimdWidth / 8], any = 0;
      std::memcpy(words, state + first, sizeof words);
      for (uint64_t word : words) any |= word;
      if (any == 0) return (uint64_t(1) << kSimdWidth) - 1;
    }
    return lane_mask(first, end, [&](uint32_t t) { return state[t] == 0; });
  });
}

// The fiber scheduler's resolve_threadgroup_barrier, for threads that ran as a loop: the
// same checks, in the same order, with the same words.
bool resolve_regions(Group& g) {
  RuntimeScope scope;
  if (stop_requested()) throw stop_fault();
  if (t_sanitizer) t_sanitizer->flush_instruction_log();  // every thread is stopped
  auto thread = [&](uint32_t t) {
    Group h = g;
    h.running.thread_index_in_threadgroup = t;
    h.complete();
    return where_info(h.running);
  };
  if (release_simd_groups(g, thread)) return true;
  auto where_at = [&](uint32_t t) { return thread(t) + " at " + site_name({g.sites[g.at[t]]}); };
  int waiting = -1, exited = -1;
  for (uint32_t t = 0; t < g.n; ++t) {
    if (g.at[t] < 0) {
      if (exited < 0) exited = int(t);
      continue;
    }
    if (waiting < 0) {
      waiting = int(t);
    } else if (g.at[t] != g.at[waiting]) {
      raise("barrier_divergence", "threads wait at different threadgroup_barrier calls: " + where_at(waiting) +
                                      ", " + where_at(t));
    } else if (g.iteration[t] != g.iteration[waiting]) {
      raise("barrier_divergence", "threads wait at different threadgroup_barrier calls: " + where_at(waiting) +
                                      ", " + where_at(t) + " in a different iteration of the loop around it");
    }
  }
  if (waiting < 0) return false;
  if (exited >= 0 && !exited_threads_arrive())
    raise("barrier_divergence", thread(exited) + " returned before the threadgroup_barrier at " +
                                    site_name({g.sites[g.at[waiting]]}) + " that " + thread(waiting) +
                                    " waits at (undefined in Metal: it hangs "
                                    "on some GPUs; set TSM_EMU_EXITED_THREADS_ARRIVE=1 to count "
                                    "exited threads as arrived)");
  unsigned flags = 0;
  for (uint32_t t = 0; t < g.n; ++t)
    if (g.at[t] > 0) {
      flags |= g.flags[t];
      g.runnable[t] = 1;
    }
  if (t_sanitizer) t_sanitizer->threadgroup_barrier(flags);
  return true;
}

void register_static_threadgroup_memory(const void* address, size_t bytes, const char* name) {
  RuntimeScope scope;
  Worker* w = t_worker;
  if (!w) return;
  for (const void* seen : w->static_tg)
    if (seen == address) return;
  w->static_tg.push_back(address);
  if (t_sanitizer)
    t_sanitizer->static_variable(address, bytes, name);
  else
    w->regions.static_variable(address, bytes, name);
  w->static_tg_total += bytes;
  if (w->static_tg_total + w->dynamic_tg_total > kMaxThreadgroupMemory)
    raise("launch", "threadgroup memory exceeds 32 KB: " + std::to_string(w->static_tg_total) +
                        " bytes declared in the kernel + " + std::to_string(w->dynamic_tg_total) +
                        " bytes of [[threadgroup(n)]] arguments");
}

const Bounds* region_of(const void* address) {
  RuntimeScope scope;
  const Regions* r = regions();
  return r ? r->find(address) : nullptr;
}

void out_of_bounds(const Bounds* region, const void* address, size_t bytes) {
  RuntimeScope scope;
  const ThreadInfo* t = current_thread_or_null();
  raise("out_of_bounds", (t ? where_info(*t) + " " : std::string()) +
                             out_of_bounds_message(static_cast<const Region*>(region),
                                                   static_cast<const char*>(address), bytes));
}

// `file` is the path the kernel's line markers give; messages name the file alone, as the
// compile errors do.
static const char* base_name(const char* file) {
  const char* slash = strrchr(file, '/');
  return slash ? slash + 1 : file;
}

void array_out_of_bounds(const char* array, long long index, unsigned long long length, const char* file,
                         int line) {
  RuntimeScope scope;
  const ThreadInfo* t = current_thread_or_null();
  raise("out_of_bounds", (t ? where_info(*t) + " " : std::string()) + "accesses array `" + array +
                             "` at element " + std::to_string(index) + " but it holds " +
                             std::to_string(length) + " elements" +
                             (file ? std::string(" (") + base_name(file) + ":" + std::to_string(line) + ")" : ""));
}

void thread_pointer_out_of_bounds(const char* what, long long element, unsigned long long length,
                                  const char* file, int line) {
  RuntimeScope scope;
  const ThreadInfo* t = current_thread_or_null();
  raise("out_of_bounds", (t ? where_info(*t) + " " : std::string()) + "accesses " +
                             (what ? "`" + std::string(what) + "`, " : std::string()) + "element " +
                             std::to_string(element) + " of a thread array that holds " + std::to_string(length) +
                             " elements" + (what ? "" : ", through a `thread` pointer") +
                             (file ? std::string(" (") + base_name(file) + ":" + std::to_string(line) + ")" : ""));
}

void sanitizer_access(const Bounds* bounds, const void* element, size_t element_bytes,
                      const void* field, size_t field_bytes, bool atomic) {
  const Region* region = static_cast<const Region*>(bounds);
  // The worker's sanitizer, through the region (a program constant's is everyone's, and no
  // region is a fault: those two read the thread-local).
  Sanitizer* s = region && region->sanitizer ? region->sanitizer : running_sanitizer();
  const ThreadInfo* info;
  AccessLog* touches;
  if (!current_accesses(s, &info, &touches)) return;
  SanitizerCallScope scope(*s);
  // The caller's return address tells the access's place in the kernel's code apart: the
  // checked accesses of sanitize.h are always inlined into it.
  s->access(region, element, element_bytes, field, field_bytes, atomic, s->who(*info), *touches,
            uintptr_t(__builtin_return_address(0)));
}

void sanitizer_note_atomic(const void* address, size_t bytes) {
  RuntimeScope scope;
  const ThreadInfo* info;
  AccessLog* touches;
  Sanitizer* s = running_sanitizer();
  if (current_accesses(s, &info, &touches))
    s->note_atomic(address, bytes, s->who(*info), *touches, uintptr_t(__builtin_return_address(0)));
}

void sanitizer_note_store(const void* address, size_t bytes, bool updates) {
  Sanitizer* s = running_sanitizer();
  const ThreadInfo* info;
  AccessLog* touches;
  if (!current_accesses(s, &info, &touches)) return;
  SanitizerCallScope scope(*s);
  s->note_store(address, bytes, updates, s->who(*info), *touches);
}

void inactive_lane_read(uint32_t lane) {
  RuntimeScope scope;
  const ThreadInfo* info;
  AccessLog* touches;
  if (!current_accesses(running_sanitizer(), &info, &touches)) return;
  raise("inactive_lane", where_info(*info) + " read lane " + std::to_string(lane) +
                             " of its SIMD-group through a shuffle, but that lane is not active "
                             "at this call (it does not exist, returned, or is in another branch): "
                             "Metal leaves the value undefined");
}

void enter_call(uint32_t caller_site) {
  RuntimeScope scope;
  Worker* w = t_worker;
  if (w && w->current) w->current->calls.push_back(caller_site);
}

void leave_call() {
  RuntimeScope scope;
  Worker* w = t_worker;
  if (w && w->current && !w->current->calls.empty()) w->current->calls.pop_back();
}

bool counting_fmas = false;

void count_fmas(unsigned n) {
  const ThreadInfo* info;
  AccessLog* touches;
  Sanitizer* s = running_sanitizer();
  if (current_accesses(s, &info, &touches)) s->count_fmas(n);
}

bool inject_spurious_cas_failure() {
  const ThreadInfo* info;
  AccessLog* touches;
  Sanitizer* s = running_sanitizer();
  if (!current_accesses(s, &info, &touches)) return false;
  return s->spurious_cas_failure();
}

const Bounds* buffer_region(int index) {
  const Regions* r = regions();
  return r ? r->buffer(index) : nullptr;
}

const Bounds* threadgroup_region(int index) {
  const Regions* r = regions();
  return r ? r->threadgroup_arg(index) : nullptr;
}

}  // namespace tsm_emu

// ---- the C interface (c_interface.h) Python calls through ctypes ----------------------

extern "C" {

TSM_EMU_EXPORT int tsm_num_kernels() { return tsm_kernel_count; }

TSM_EMU_EXPORT const char* tsm_kernel_name(int i) {
  return tsm_kernel_table[i].name;
}
TSM_EMU_EXPORT int tsm_kernel_num_params(int i) {
  return tsm_kernel_table[i].num_params;
}
TSM_EMU_EXPORT void tsm_kernel_param(int k, int i, int32_t* out) {
  const tsm_emu::KernelEntry& e = tsm_kernel_table[k];
  out[0] = e.params[i].kind;
  out[1] = e.params[i].index;
  out[2] = e.types[i].passing;
  out[3] = e.types[i].size;
  out[4] = e.types[i].scalar;
  out[5] = e.types[i].is_const;
}

static int dispatch(int k, tsm_launch* l, char* error, int error_len) {
  using namespace tsm_emu;
  std::lock_guard<std::mutex> lock(g_dispatch_lock);

  u3 grid{l->grid[0], l->grid[1], l->grid[2]};
  u3 group{l->group[0], l->group[1], l->group[2]};
  auto fail = [&](const std::string& kind, const std::string& msg) {
    std::snprintf(error, size_t(error_len), "%s\t%s", kind.c_str(), msg.c_str());
    return 1;
  };
  if (k < 0 || k >= tsm_kernel_count) return fail("launch", "no such kernel");
  if (grid.x == 0 || grid.y == 0 || grid.z == 0) return 0;
  uint64_t group_threads = uint64_t(group.x) * group.y * group.z;
  if (group_threads == 0 || group_threads > kMaxThreadsPerThreadgroup)
    return fail("launch", "threadgroup size " + fmt3(group) + " has " + std::to_string(group_threads) +
                              " threads; Metal allows 1 to 1024");
  size_t dynamic_total = 0;
  for (int i = 0; i < l->num_threadgroup; ++i) dynamic_total += size_t(l->threadgroup_bytes[i]);
  if (dynamic_total > kMaxThreadgroupMemory)
    return fail("launch", "threadgroup memory arguments total " + std::to_string(dynamic_total) +
                              " bytes; Metal allows 32 KB");

  u3 groups = ceil_div(grid, group);
  uint64_t num_groups = uint64_t(groups.x) * groups.y * groups.z;
  unsigned workers = unsigned(std::max(1, l->num_workers));
  workers = unsigned(std::min<uint64_t>({workers, num_groups, kMaxWorkers}));
  // Sanitized, each worker has a sanitizer of its own, sharing the buffers' shadows (sanitizer.h).
  std::vector<std::unique_ptr<Shadow>> shadows;
  std::vector<std::unique_ptr<Sanitizer>> sanitizers;
  counting_fmas = l->sanitize && l->count_instructions;
  if (l->sanitize) {
    for (int i = 0; i < l->num_buffers; ++i) shadows.emplace_back(new Shadow(size_t(l->buffer_bytes[i]), workers));
    for (unsigned i = 0; i < workers; ++i)
      sanitizers.emplace_back(new Sanitizer(grid, group, l->buffers, l->buffer_bytes, l->buffer_names,
                                            l->num_buffers, l->segment_bytes ? l->segment_bytes : 128,
                                            l->count_instructions != 0, shadows));
  }

  install_crash_handlers();
  install_stop_signal_handler();
  if (!g_pool) g_pool = new std::vector<std::unique_ptr<Worker>>();
  std::vector<std::unique_ptr<Worker>>& pool = *g_pool;
  while (pool.size() < workers) pool.emplace_back(new Worker);
  g_stop.store(kRunning);
  g_time_limit_s = l->time_limit_s;

  std::atomic<uint64_t> next{0};
  std::atomic<bool> stop{false};
  std::mutex fault_lock;
  bool faulted = false;
  KernelFault first_fault;

  auto work_body = [&](Worker* w, unsigned index) {
    t_runtime_depth = 1;
    t_worker = w;
    t_sanitizer = sanitizers.empty() ? nullptr : sanitizers[index].get();
    w->kernel = &tsm_kernel_table[k];
    w->fault_raised = false;
    w->stack_bytes = w->stacks.empty() ? stack_size() : w->stack_bytes;
    w->dynamic_tg.resize(size_t(l->num_threadgroup));
    w->dynamic_tg_ptrs.assign(31, nullptr);
    w->dynamic_tg_total = dynamic_total;
    w->dynamic_tg_bytes.assign(l->threadgroup_bytes, l->threadgroup_bytes + l->num_threadgroup);
    w->threadgroup_names = l->threadgroup_names;
    for (int i = 0; i < l->num_threadgroup; ++i) {
      w->dynamic_tg[i].assign(size_t(l->threadgroup_bytes[i]) + 16, 0);
      w->dynamic_tg_ptrs[i] = w->dynamic_tg[i].data();
    }
    if (!t_sanitizer) {  // the sanitizer keeps its own regions
      w->regions.set_buffers(l->buffers, l->buffer_bytes, l->buffer_names, l->num_buffers);
      w->regions.set_threadgroup_args(w->dynamic_tg_ptrs.data(), w->dynamic_tg_bytes.data(),
                                      l->num_threadgroup, l->threadgroup_names);
    }
    uint32_t sgs = (uint32_t(group_threads) + kSimdWidth - 1) / kSimdWidth;
    if (w->exchange.size() < sgs) w->exchange.resize(sgs);
    w->args = DispatchArgs{l->buffers, l->buffer_bytes, w->dynamic_tg_ptrs.data(),
                           reinterpret_cast<const TextureDesc* const*>(l->textures),
                           reinterpret_cast<const SamplerDesc* const*>(l->samplers)};
    sigjmp_buf jump;
    CrashGuard guard(&jump);
    SlotGuard slot(index);  // stop requests reach this thread from here on
    if (sigsetjmp(jump, 1) != 0) {
      w->current = nullptr;
      t_plain_thread = nullptr;
      if (t_sanitizer) {  // the jump skipped the scopes that reset these
        t_sanitizer->set_running(nullptr, nullptr, nullptr);
        t_sanitizer->in_call = 0;
      }
      t_runtime_depth = 1;
      std::lock_guard<std::mutex> g(fault_lock);
      if (!faulted) {
        faulted = true;
        first_fault = t_jumped_to_stop ? stop_fault() : crash_fault(*w);
      }
      stop = true;
      t_worker = nullptr;
      t_sanitizer = nullptr;
      return;
    }
    try {
      for (;;) {
        if (stop.load(std::memory_order_relaxed)) break;
        if (stop_requested()) throw stop_fault();
        uint64_t g = next.fetch_add(1);
        if (g >= num_groups) break;
        u3 pos{uint32_t(g % groups.x), uint32_t((g / groups.x) % groups.y),
               uint32_t(g / (uint64_t(groups.x) * groups.y))};
        run_group(w, grid, group, groups, pos);
      }
    } catch (KernelFault& e) {
      std::lock_guard<std::mutex> g(fault_lock);
      if (!faulted) {
        faulted = true;
        first_fault = e;
      }
      stop = true;
    } catch (std::exception& e) {
      std::lock_guard<std::mutex> g(fault_lock);
      if (!faulted) {
        faulted = true;
        first_fault = KernelFault{"launch", e.what()};
      }
      stop = true;
    }
    t_worker = nullptr;
    t_sanitizer = nullptr;
  };
  // Whatever escapes a worker (its set-up allocating, say) becomes the dispatch's fault:
  // an exception leaving a thread's function, or a C function, would terminate Python.
  auto work = [&](Worker* w, unsigned index) {
    try {
      work_body(w, index);
    } catch (...) {
      std::lock_guard<std::mutex> g(fault_lock);
      if (!faulted) {
        faulted = true;
        first_fault = KernelFault{"launch", "the emulator's worker failed (out of memory?)"};
      }
      stop = true;
      t_worker = nullptr;
      t_sanitizer = nullptr;
    }
  };

  {
    InterruptGuard interrupt(l->interruptible != 0);
    Watchdog watchdog(l->time_limit_s);
    g_dispatch_running.store(true);
    if (l->python.check_signals != nullptr) {
      // Python's signal handlers run only in its main thread, between bytecodes: this
      // thread, the dispatch's caller, runs no kernel code but asks Python to run the
      // handlers of signals that arrived, and stops the dispatch when one raised.
      g_sole_sanitizer = workers == 1 && !sanitizers.empty() ? sanitizers[0].get() : nullptr;
      std::mutex done_lock;
      std::condition_variable done_cv;
      unsigned running = 0;
      std::vector<std::thread> threads;
      auto run = [&](unsigned i) {
        work(pool[i].get(), i);
        std::lock_guard<std::mutex> g(done_lock);
        --running;
        done_cv.notify_all();
      };
      try {
        for (unsigned i = 0; i < workers; ++i) {
          {
            std::lock_guard<std::mutex> g(done_lock);
            ++running;
          }
          threads.emplace_back(run, i);
        }
      } catch (...) {  // out of threads
        std::lock_guard<std::mutex> g(done_lock);
        --running;
      }
      if (threads.empty()) {
        work(pool[0].get(), 0);
      } else {
        std::unique_lock<std::mutex> g(done_lock);
        while (!done_cv.wait_for(g, std::chrono::milliseconds(kPollMs), [&] { return running == 0; })) {
          g.unlock();
          if (l->raised[0] == nullptr && run_python_signal_handlers(l)) request_stop(kSignalled);
          g.lock();
        }
      }
      for (auto& t : threads) t.join();
      g_sole_sanitizer = nullptr;
    } else if (workers == 1) {
      g_sole_sanitizer = sanitizers.empty() ? nullptr : sanitizers[0].get();
      work(pool[0].get(), 0);  // catches everything
      g_sole_sanitizer = nullptr;
    } else {
      std::vector<std::thread> threads;
      try {
        for (unsigned i = 1; i < workers; ++i) threads.emplace_back(work, pool[i].get(), i);
      } catch (...) {  // out of threads: run with the ones started (joinable threads must be joined)
      }
      work(pool[0].get(), 0);
      for (auto& t : threads) t.join();
    }
    g_dispatch_running.store(false);
  }
  if (faulted) return fail(first_fault.kind, first_fault.message);
  if (!sanitizers.empty()) {
    Counters c;
    for (const auto& s : sanitizers) c += s->counters();
    static_assert(std::size(Counters::kFields) == std::size(tsm_launch{}.counters), "tsm_launch.counters lists every counter");
    for (size_t i = 0; i < std::size(Counters::kFields); ++i) l->counters[i] = c.*Counters::kFields[i];
  }
  return 0;
}

// Returns 0, or writes "kind\tmessage" into `error` and returns 1. No C++ exception may
// leave: the caller is ctypes.
TSM_EMU_EXPORT int tsm_dispatch(int k, tsm_launch* l, char* error, int error_len) {
  try {
    return dispatch(k, l, error, error_len);
  } catch (std::exception& e) {
    std::snprintf(error, size_t(error_len), "launch\t%s", e.what());
  } catch (...) {
    std::snprintf(error, size_t(error_len), "launch\tunknown failure in the emulator");
  }
  return 1;
}

}  // extern "C"
