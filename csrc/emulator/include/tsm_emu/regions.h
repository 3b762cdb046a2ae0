// Barrier regions: a threadgroup's threads as a loop between barriers, without fibers.
//
// For a kernel whose synchronisation (barriers, SIMD-group functions) is all in its own body
// (torch_sparse_metal/metal/_regions.py decides), the translation adds a second definition
// that runs a whole threadgroup. Its body is the kernel's, resumable: each stop becomes
// "record where this thread waits, return", followed by a `case` label to come back to, and
// the kernel's variables that a resumption jumps over live in per-thread slots. The
// scheduler below runs every thread from where it waits to its next stop (or its end), in
// thread order, then releases what the fiber scheduler would (a SIMD-group's lanes at one
// SIMD-group function, else the threadgroup barrier): the same order of execution, the same
// faults, without a context switch.
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <atomic>
#include <cstring>
#include <new>
#include <tuple>
#include <type_traits>
#include <utility>

#include "tsm_emu/bind.h"
#include "tsm_emu/probe.h"
#include "tsm_emu/runtime.h"
#include "tsm_emu/sync.h"

namespace tsm_emu {

// What a thread stops at, per stop k of a kernel (a static table of the translation).
// A SIMD-group function stops its thread twice over: the statement that calls it first
// runs the call only to hand over the lane's value (Group::mode == kPosting), the thread
// returns to the scheduler, and once its SIMD-group's lanes met there the statement runs
// again (kReplaying), the call now computing its result from the values handed over.
enum WaitKind : uint8_t { W_BARRIER = 0, W_COLLECTIVE = 1, W_SIMDGROUP_BARRIER = 2 };
// Where a thread waits at a SIMD-group function or simdgroup_barrier, as the fiber
// scheduler's call paths say it: the site and iteration of each loop around it, then its
// site. Lanes meet where their paths are equal; the first path in the source goes first.
constexpr unsigned kMaxWaitPath = 16;

// One threadgroup, as the runtime hands it to a region-compiled kernel.
struct Group {
  uint32_t n;                     // threads in this threadgroup
  ThreadInfo running;             // the running thread's (the runtime's current thread)
  const u3* local;                // per thread: its position in the threadgroup
  u3 origin;                      // the threadgroup's first thread's position in the grid
  bool sanitized;
  const std::atomic<int>* stop;   // nonzero: a stop was requested (Ctrl-C, a time limit)
  int* at;                        // per thread: 0 not started, k > 0 waits at stop k, -1 returned
  uint8_t* runnable;              // per thread: runs in the next round
  uint64_t* iteration;            // per thread at a barrier: loop iterations of that barrier
  unsigned* flags;                // per thread: mem_flags of its barrier
  uint32_t (*path)[kMaxWaitPath]; // per thread at a SIMD-group stop: where (see above)
  uint8_t* path_len;
  const uint32_t* sites;          // per stop k: its Site (line << 12 | call on the line)
  const uint8_t* kinds;           // per stop k: its WaitKind
  // The SIMD-group functions' values and the running thread's mode (see WaitKind).
  RegionLanes lanes;
  // The group the runtime sees (t_group): itself, or what a copy was made from. A thread's
  // body sets `lanes.mode` there (set_mode), and its SIMD-group functions use those lanes.
  // (Lanes at once pass the mode with each call instead: LaneRef, runtime.h.)
  Group* home = this;

  void set_mode(CollectiveMode m) { home->lanes.mode = m; }

  // A round in which every thread goes where the first goes (a uniform kernel's, see
  // run_regions): how each got to its barrier is not recorded, as nothing compares them.
  bool uniform_round = false;

  // At a barrier: how thread t got there (its mem_flags; the iterations of the loops around
  // it, so the same barrier in two different iterations is two places).
  void arrive(uint32_t t, uint64_t loop_iterations, metal::mem_flags f = metal::mem_flags::mem_none) {
    if (uniform_round) return;
    iteration[t] = loop_iterations;
    flags[t] = unsigned(f);
  }
  // At a SIMD-group stop: where (loop sites and iterations, then the stop's site).
  template <class... W>
  void wait(uint32_t t, metal::mem_flags f, W... where) {
    static_assert(sizeof...(W) <= kMaxWaitPath, "loops nested too deep around a SIMD-group function");
    const uint32_t p[] = {uint32_t(where)...};
    for (unsigned i = 0; i < sizeof...(W); ++i) path[t][i] = p[i];
    path_len[t] = uint8_t(sizeof...(W));
    flags[t] = unsigned(f);
  }
  // Make thread t the running one. A plain dispatch records only its index: the kernel
  // computes its built-ins from it (builtin), and the runtime completes `running` when a
  // report needs the thread (current_thread, the crash handler); the sanitizer reads
  // `running` at every access, so a sanitized dispatch completes it at once.
  // (The loops over threads pass `sanitized` as a local: see run_regions.)
  void enter(uint32_t t, bool sanitized_dispatch) {
    running.thread_index_in_threadgroup = t;
    if (sanitized_dispatch) complete();
  }
  void enter(uint32_t t) { enter(t, sanitized); }
  // (From builtin, so a report names the thread by the values its kernel computed.)
  void complete() {
    const uint32_t t = running.thread_index_in_threadgroup;
    running.thread_position_in_threadgroup = builtin(B_THREAD_POSITION_IN_THREADGROUP, t);
    running.thread_position_in_grid = builtin(B_THREAD_POSITION_IN_GRID, t);
    running.thread_index_in_simdgroup = builtin(B_THREAD_INDEX_IN_SIMDGROUP, t).x;
    running.simdgroup_index_in_threadgroup = builtin(B_SIMDGROUP_INDEX_IN_THREADGROUP, t).x;
  }
  // Thread t's built-in `which` (see builtin_value): the ones that differ between the
  // threads from t, the others from `running`, the same for all.
  u3 builtin(int which, uint32_t t) const {
    switch (which) {
      case B_THREAD_POSITION_IN_GRID: {
        const u3 l = local[t];
        return {origin.x + l.x, origin.y + l.y, origin.z + l.z};
      }
      case B_THREAD_POSITION_IN_THREADGROUP: return local[t];
      case B_THREAD_INDEX_IN_THREADGROUP: return {t, 0, 0};
      case B_THREAD_INDEX_IN_SIMDGROUP: return {t % 32, 0, 0};
      case B_SIMDGROUP_INDEX_IN_THREADGROUP: return {t / 32, 0, 0};
      case B_THREAD_INDEX_IN_QUADGROUP: return {t % 4, 0, 0};
      case B_QUADGROUP_INDEX_IN_THREADGROUP: return {t / 4, 0, 0};
      default: return builtin_value(which, running);
    }
  }
};

// Out of line (runtime.cpp). After a round, with every thread stopped: release the
// SIMD-group functions that can complete, else the threadgroup barrier (faulting on
// divergence); false when all threads returned. Called only when the inline check below
// cannot tell (and always in sanitized dispatches).
bool resolve_regions(Group& g);
// Before it, in a plain dispatch: the common case of SIMD-group functions, every thread that
// has not returned at one, each SIMD-group's lanes at one place, released with no copy of
// their values. kAll: and every thread at thread 0's stop (the next round runs them all
// from it, without runnable flags); kSome: the released threads are flagged runnable;
// kNone: not that case, nothing done (resolve_regions decides).
enum class Released { kNone, kSome, kAll };
Released release_in_place(Group& g);
void end_region_segment();  // sanitized dispatches: the running thread stopped
[[noreturn]] void stop_group();  // a stop was requested: the dispatch ends with its fault

// The loop iterations around a barrier, as one key: exact for two nested loops.
inline uint64_t iteration_key() { return 0; }
inline uint64_t iteration_key(uint32_t a) { return a; }
inline uint64_t iteration_key(uint32_t a, uint32_t b) { return (uint64_t(a) << 32) | b; }
template <class... R>
inline uint64_t iteration_key(uint32_t a, uint32_t b, uint32_t c, R... rest) {
  return iteration_key(uint32_t(iteration_key(a, b) * 0x9E3779B97F4A7C15ull >> 32) ^ c, uint32_t(rest)...);
}

// After a round of a plain dispatch: every thread waits at the same threadgroup barrier in
// the same iteration (all run on), or every thread returned (the threadgroup is done). No
// early exit, so the compiler vectorises the scan.
enum class RoundEnd { kOther, kOneBarrier, kReturned };
inline RoundEnd round_end(const Group& g) {
  const int at = g.at[0];
  const uint64_t iteration = g.iteration[0];
  if (at == 0 || (at > 0 && g.kinds[at] != W_BARRIER) || g.stop->load(std::memory_order_relaxed) != 0)
    return RoundEnd::kOther;
  unsigned differ = 0;
  if (at < 0) {
    for (uint32_t t = 1; t < g.n; ++t) differ |= unsigned(g.at[t] != at);
    return differ ? RoundEnd::kOther : RoundEnd::kReturned;
  }
  for (uint32_t t = 1; t < g.n; ++t) differ |= unsigned(g.at[t] != at) | unsigned(g.iteration[t] != iteration);
  return differ ? RoundEnd::kOther : RoundEnd::kOneBarrier;
}

// Whether every thread waits where thread 0 does, in the same iteration (at a barrier).
inline bool all_where_first(const Group& g) {
  const int at = g.at[0];
  const bool barrier = at > 0 && g.kinds[at] == W_BARRIER;
  for (uint32_t t = 1; t < g.n; ++t)
    if (g.at[t] != at || (barrier && g.iteration[t] != g.iteration[0])) return false;
  return true;
}

// Sanitized dispatches of a uniform kernel: a round that every thread began where thread 0
// did must end so too, as the translation promised (torch_sparse_metal/metal/_uniformity.py).
void broken_uniformity();  // (runtime.cpp) faults

// Whether resolve_regions released every thread (all run in the next round).
inline bool resolved_all(const Group& g) {
  for (uint32_t t = 0; t < g.n; ++t)
    if (!g.runnable[t]) return false;
  return true;
}

// Calls run(std::integral_constant<int, k>) for the stop k in [0, Last] that `at` names.
template <int Last, class Run>
inline void at_stop(int at, Run&& run) {
  if constexpr (Last >= 0) {
    if (at == Last) return run(std::integral_constant<int, Last>{});
    at_stop<Last - 1>(at, run);
  }
}

// Rounds until every thread returned. A round after which all threads met at one
// threadgroup barrier runs them all again without their `runnable` flags (all stay 0
// then); any other goes through resolve_regions, which flags the threads it releases.
// In a plain dispatch, a round whose threads all start from one stop (the kernel's start,
// or that barrier) calls the body with the stop as a constant: the compiler drops the
// resumption's switch and keeps only the code from that stop on (a tree reduction's rounds
// 1.5x faster, a tiled matmul's 1.14x), for one copy of the body per stop (Stops: the
// kernel's stops).
// Uniform: every thread of the kernel takes the same way from stop to stop (the
// translation's analysis, torch_sparse_metal/metal/_uniformity.py). Such a round ends with
// every thread where the first is: where they wait is recorded once for all, and no scan
// compares them (tree reduction, CPU time: 28.4-31.4 -> 21.0-25.6 ms).
// Sanitized dispatches record every thread's, and check the promise.
// `commit` runs after every round: a uniform kernel's variables that are the same in every
// thread (Slots<T, true>) move from what the round's threads stored to what the next
// round's read.
// Probed: the kernel's accesses may be checked for a whole round before it runs (probe.h,
// the translation decides); a uniform kernel's rounds that start from one stop are then
// probed, and run unchecked when the probe finds every access in bounds.
// The body is called as body(mode, bad, group, thread, stop): `mode` an access_mode, `bad`
// what a probe's accesses flag.
// Always inlined into the group function, where the kernel's body is: out of line (the
// uniform rounds' code took it past the inliner's limit) the body reloaded the slots' and
// arguments' addresses through the lambda at every thread (tree reduction: 639 million
// instructions, against 495 inlined; callgrind).
template <int Stops, bool Uniform, bool Probed, class Body, class Commit>
__attribute__((always_inline)) inline void run_regions(Group& g, const uint32_t* sites, const uint8_t* kinds,
                                                       Body&& body, Commit&& commit) {
  g.sites = sites;
  g.kinds = kinds;
  // The group's members the loop reads, read once: with -fno-strict-aliasing any store of
  // the kernel might change them, so read through `g` they were reloaded per thread
  // (tree reduction: 10% of its time; the same in the clearing below, 2 ms of its 9).
  const bool sanitized = g.sanitized;
  const uint32_t n = g.n;
  int* const at = g.at;
  uint8_t* const runnable = g.runnable;
  std::fill(at, at + n, 0);
  std::fill(runnable, runnable + n, uint8_t(0));
  unsigned unused = 0;  // (what a body in checked mode is given to flag)
  for (bool everyone = true;;) {
    // (Not in sanitized builds, whose dispatches are sanitized: no copies to compile. A stop
    // past Stops, a miscount, runs through the general loop.)
#ifndef __TSM_SANITIZE__
    if (everyone && !sanitized && at[0] <= Stops) {
      at_stop<Stops>(at[0], [&](auto stop) {
        // The threads' bodies get a copy of the group, a local whose address does not
        // escape: the compiler keeps the members they use (the per-thread arrays, the
        // built-ins' sources) in registers across the kernel's stores, which with
        // -fno-strict-aliasing could have changed them in `g` (tree reduction 18% faster).
        // The copy's `running` and `mode` go stale in the round: a body reads neither (a
        // thread's built-ins come from its index, `mode` is set through `home`).
        Group copy = g;
        copy.uniform_round = Uniform;
        if (Uniform) {
          // Where the last thread stopped, in a register until the round ends: a store per
          // thread to at[0], which the compiler must assume the kernel's stores may change,
          // kept the threads' uniform variables from registers too (tree reduction 20% slower).
          int last = 0;
          bool checked = true;
          // (Only a row of threads, n x 1 x 1, whose last thread's position is its index:
          // elsewhere a thread's position is a load from the table of positions, and the
          // unchecked loop stays scalar.)
          if constexpr (Probed) {
            if (copy.local[n - 1].x == n - 1) {
              // Each thread flags its own word, ORed into the round's after it: a thread's
              // conditional access (`i < n ? x[i] : 0`) is then a select of its own, where ORed
              // into the round's word it made a conditional reduction, which g++ does not
              // vectorise (the tree reduction's first round stayed scalar: 15% slower).
              unsigned bad = 0;
              for (uint32_t t = 0; t < n; ++t) {
                unsigned mine = 0;
                body(access_mode<Checks::kProbe, true>{}, mine, copy, t, decltype(stop)::value);
                bad |= mine;
              }
              if (!bad) {
                // (No thread is entered: nothing in these bodies can fault or report.)
                for (uint32_t t = 0; t < n; ++t)
                  last = body(access_mode<Checks::kUnchecked, true>{}, bad, copy, t, decltype(stop)::value);
                g.enter(n - 1, false);
                checked = false;
              }
            }
          }
          if (checked) {
            for (uint32_t t = 0; t < n; ++t) {
              g.enter(t, false);
              last = body(checked_access{}, unused, copy, t, decltype(stop)::value);
            }
          }
          at[0] = last;
        } else {
          for (uint32_t t = 0; t < n; ++t) {
            g.enter(t, false);
            at[t] = body(checked_access{}, unused, copy, t, decltype(stop)::value);
          }
        }
      });
      commit();
      if (Uniform) {
        // Every thread stopped where the last did (at[0]), as promised: at a
        // barrier the next round starts them all there again (its iterations and flags are
        // read only by rounds after a SIMD-group stop, which record them per thread).
        const int first = at[0];
        if (first < 0) return;
        if (g.stop->load(std::memory_order_relaxed) != 0) stop_group();
        if (g.kinds[first] == W_BARRIER) continue;
        // At a SIMD-group stop (whose wait() recorded each thread's place): resolved below.
        for (uint32_t t = 1; t < n; ++t) at[t] = first;
      }
    } else
#endif
    {
      // A uniform kernel's every round runs all threads (its uniform variables are one for
      // all) from one place (where the round before left them all, checked below):
      // checked in sanitized dispatches.
      const bool promised = Uniform && sanitized;
      if (promised && !everyone && !resolved_all(g)) broken_uniformity();
      for (uint32_t t = 0; t < n; ++t) {
        if (!everyone) {
          if (!runnable[t]) continue;
          runnable[t] = 0;
        }
        g.enter(t, sanitized);
        at[t] = body(checked_access{}, unused, g, t, at[t]);
        if (sanitized) end_region_segment();
      }
      if (promised && !all_where_first(g)) broken_uniformity();
      commit();
    }
    const RoundEnd end = sanitized ? RoundEnd::kOther : round_end(g);
    if (end == RoundEnd::kReturned) return;
    everyone = end == RoundEnd::kOneBarrier;
    if (!everyone) {
      const Released released = sanitized ? Released::kNone : release_in_place(g);
      everyone = released == Released::kAll;
      if (released == Released::kNone && !resolve_regions(g)) return;
    }
  }
}

// Per-thread storage for one kernel variable: a slot per thread of the group, in a buffer
// the worker keeps for the kernel (static thread_local at the definition), grown to the
// largest threadgroup seen. The slots are raw: a variable is constructed into its slot when
// its declaration runs, and never destroyed (kernel variables are trivially destructible).
struct SlotBuffer {
  unsigned char* data = nullptr;
  size_t bytes = 0;
  ~SlotBuffer() { std::free(data); }
  void* reserve(size_t need) {
    if (need > bytes) {
      std::free(data);
      bytes = (need + 63) / 64 * 64;
      data = static_cast<unsigned char*>(std::aligned_alloc(64, bytes));
      if (!data) fault("launch", "out of memory for a kernel's per-thread variables");
    }
    return data;
  }
};

// A variable's value moves between its slot and a local only by copy construction, never
// by assignment: a type whose copy constructor is trivial (Metal's vectors and
// simdgroup_matrix, whose assignment operators are user-provided, included) copies as bytes.
template <class T>
constexpr bool copies_as_bytes = std::is_trivially_copy_constructible<std::remove_all_extents_t<T>>::value &&
                                 std::is_trivially_destructible<std::remove_all_extents_t<T>>::value;

// Construct the variable in `slot` (declared const, or an array, maybe) from `value`.
template <class T, class U>
inline void construct(T& slot, U& value) {
  using V = std::remove_cv_t<T>;
  void* p = const_cast<void*>(static_cast<const volatile void*>(&slot));
  if constexpr (std::is_array<V>::value) {
    static_assert(copies_as_bytes<V>, "array of a class type across a barrier");
    std::memcpy(p, const_cast<const void*>(static_cast<const volatile void*>(&value)), sizeof(V));
  } else {
    ::new (p) V(value);
  }
}

// A thread's copy of a slot while it runs (R: a reference to the slot): a local the compiler
// can keep in registers when the type copies as bytes, else the slot itself.
template <class R>
struct local_ {
  using T = std::remove_reference_t<R>;
  static constexpr bool copy = copies_as_bytes<T> && !std::is_array<T>::value;
  using type = std::conditional_t<copy, std::remove_cv_t<T>, T&>;
};
template <class R>
using local_t = typename local_<R>::type;

// Whether every thread's variable of these slots (R: a reference to each) is a local copy
// while it runs: a probed round's probe (probe.h) must not write a slot.
template <class... R>
constexpr bool locals_are_copies = (local_<R>::copy && ...);

// Back into its slot at a barrier (nothing to do when the local is the slot).
template <class T, class L>
inline void store_local(T& slot, L& local) {
  if (static_cast<const volatile void*>(&slot) != static_cast<const volatile void*>(&local)) construct(slot, local);
}

// A variable that cannot change (declared const, no `mutable` member: the translation
// decides) is stored into its slot where its declaration runs, never at a stop: a shuffle
// matmul's stops stored its epilogue's struct back at every SIMD-group function. (Not by a
// probe, which stores nothing.)
template <class M, class S, class L>
inline void store_declared(M, S& slot, L& local) {
  if constexpr (!M::probe) store_local(slot, local);
}

// Sanitized dispatches of a uniform kernel: two threads stored different values of a
// variable the translation said has one value in all of them.
[[noreturn]] void broken_uniform_variable(const char* name);  // (runtime.cpp) faults

// A kernel variable's slots (`name`: the kernel's, for reports). Thread t resumes with
// in(t) and stores into out(t) at a stop, which per thread are one slot.
// Uniform: a variable of a uniform kernel with one value in every thread at each stop
// (_uniformity.py), such as a reduction's stride or the counter of a loop around a barrier.
// Every round runs all threads from one stop (run_regions), so one copy serves them all: the
// round's threads read `in` and each stores the same value into `out`, which run_regions'
// commit makes the next round's `in`. Both are members of an object in the group function's
// frame whose address does not escape: the compiler keeps them in registers through a
// round (tree reduction: 20.3 -> 14.5 ms CPU time, against a slot per thread). Scalars
// only: a sanitized dispatch compares each thread's value with the round's first bit for
// bit, which a type with padding could fail on bytes no thread set.
template <class T, bool Uniform = false, bool = Uniform && std::is_scalar<std::remove_cv_t<T>>::value>
class Slots {
  static_assert(alignof(T) <= 64, "over-aligned kernel variable");

 public:
  Slots(SlotBuffer& buffer, uint32_t n, const char* = nullptr)
      : base_(static_cast<T*>(buffer.reserve(sizeof(T) * (n ? n : 1)))) {}
  T& operator[](uint32_t t) const { return base_[t]; }
  T& in(uint32_t t) const { return base_[t]; }
  T& out(uint32_t t) const { return base_[t]; }
  void commit() {}

 private:
  T* base_;
};

template <class T, bool Uniform>
class Slots<T, Uniform, true> {
  using V = std::remove_cv_t<T>;

 public:
  Slots(SlotBuffer&, uint32_t, const char* name = nullptr) : name_(name) {}
  V& in(uint32_t) { return in_; }
#ifdef __TSM_SANITIZE__
  // Where a thread stores: store_local below, which checks the promise.
  Slots& out(uint32_t) { return *this; }
  void store(V value) {
    if (!stored_) {
      out_ = value;
      stored_ = true;
    } else if (!same_bits(out_, value)) {
      broken_uniform_variable(name_);
    }
  }
  void commit() {
    if (stored_) in_ = out_;
    stored_ = false;
  }
  // As integers of its size: a memcmp, which the sanitized builds' -O1 leaves a call, was
  // 3% of a sanitized tiled matmul.
  static bool same_bits(const V& a, const V& b) {
    using U = std::conditional_t<
        sizeof(V) == 1, uint8_t,
        std::conditional_t<sizeof(V) == 2, uint16_t, std::conditional_t<sizeof(V) == 4, uint32_t, uint64_t>>>;
    static_assert(sizeof(U) == sizeof(V), "a scalar of 1, 2, 4 or 8 bytes");
    U x, y;
    std::memcpy(&x, &a, sizeof x);
    std::memcpy(&y, &b, sizeof y);
    return x == y;
  }
#else
  V& out(uint32_t) { return out_; }
  void commit() { in_ = out_; }
#endif

 private:
  V in_{}, out_{};
  const char* name_;
#ifdef __TSM_SANITIZE__
  bool stored_ = false;  // by a thread of this round
#endif
};

#ifdef __TSM_SANITIZE__
template <class T, bool Uniform, class L>
inline void store_local(Slots<T, Uniform, true>& slots, L& local) {
  slots.store(local);
}
#endif

// What the type probes return: the declared types of the variables of one scope.
template <class... T>
struct type_list {};
template <size_t I, class L>
struct type_at_;
template <class H, class... T>
struct type_at_<0, type_list<H, T...>> {
  using type = H;
};
template <size_t I, class H, class... T>
struct type_at_<I, type_list<H, T...>> : type_at_<I - 1, type_list<T...>> {};
template <size_t I, class L>
using type_at = typename type_at_<I, L>::type;

// Thread t's value of a built-in argument (see make_arg).
template <class V>
inline V builtin_arg(int which, const Group& g, uint32_t t) {
  if constexpr (builtin_traits<V>::ok) {
    return builtin_traits<V>::make(g.builtin(which, t));
  } else {
    fault("launch", "built-in parameter of an unsupported type");
  }
}
// The same in a body run in access mode M: in a row of threads, a position from the index
// (see probe.h).
template <class V, class M>
inline V builtin_arg(M, int which, const Group& g, uint32_t t) {
  if constexpr (M::line && builtin_traits<V>::ok) {
    if (which == B_THREAD_POSITION_IN_THREADGROUP) return builtin_traits<V>::make(u3{t, 0, 0});
    if (which == B_THREAD_POSITION_IN_GRID) return builtin_traits<V>::make(u3{g.origin.x + t, g.origin.y, g.origin.z});
  }
  return builtin_arg<V>(which, g, t);
}

template <class... A, size_t... I>
inline void invoke_group_with(void (*f)(Group&, A...), const ParamSpec* p, const DispatchArgs& d, Group& g,
                              std::index_sequence<I...>) {
  g.enter(0);
  f(g, make_arg<A>(p[I], d, g.running)...);
}

// Binds a region-compiled kernel's arguments (built-ins as thread 0's: the kernel reads
// each thread's own from its slots) and runs one threadgroup.
template <class... A>
inline void invoke_group(void (*f)(Group&, A...), const ParamSpec* p, const DispatchArgs& d, Group& g) {
  invoke_group_with(f, p, d, g, std::index_sequence_for<A...>{});
}

// A kernel that does not synchronise at all needs no rounds: a threadgroup is one loop
// calling the kernel for each of its threads, in thread order as the runtime's
// one-call-per-thread path runs them. Its arguments are bound once per threadgroup (a
// buffer's pointer with its bounds, a constant's reference, a value), each call getting its
// own copy of those passed by value; only the built-ins are each thread's. Per thread that
// saves what the runtime's path pays: the ThreadInfo's divisions, a call through a pointer
// and a runtime call for each buffer's bounds.
template <class A>
using bound_arg_t = std::conditional_t<std::is_reference<A>::value, A, std::remove_cv_t<A>>;

template <class A>
inline A thread_arg(const ParamSpec& p, const bound_arg_t<A>& bound, const Group& g, uint32_t t) {
  if constexpr (!std::is_reference<A>::value && builtin_traits<std::remove_cv_t<A>>::ok) {
    if (p.kind == P_BUILTIN) return builtin_arg<std::remove_cv_t<A>>(p.index, g, t);
  }
  return bound;
}

// Not inline: one instantiation per kernel signature, shared by the kernels that have it,
// calling the kernel through `f` and reading its ParamSpecs at run time. Inlined into each
// kernel's group function, with the kernel inlined into the loop, a library of many kernels
// took longer to compile for no measurable speed (g++ on PyTorch's Indexing.metal, 183
// kernels: 12.8 s, against 9.8-11.0 s so; 5.2-7.6 s with one runtime call per thread).
template <class... A, size_t... I>
[[gnu::noinline]] void invoke_straight_with(void (*f)(A...), const ParamSpec* p, const DispatchArgs& d, Group& g,
                                            std::index_sequence<I...>) {
  g.enter(0);
  const std::tuple<bound_arg_t<A>...> bound(make_arg<A>(p[I], d, g.running)...);
  const bool sanitized = g.sanitized;
  const std::atomic<int>& stop = *g.stop;
  for (uint32_t t = 0, n = g.n; t < n; ++t) {
    if (stop.load(std::memory_order_relaxed) != 0) stop_group();
    g.enter(t, sanitized);
    f(thread_arg<A>(p[I], std::get<I>(bound), g, t)...);
    if (sanitized) end_region_segment();
  }
}

template <class... A>
inline void invoke_straight(void (*f)(A...), const ParamSpec* p, const DispatchArgs& d, Group& g) {
  invoke_straight_with(f, p, d, g, std::index_sequence_for<A...>{});
}

}  // namespace tsm_emu
