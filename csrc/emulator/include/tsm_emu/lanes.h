// Lanes at once: a barrier-region kernel's threadgroup run statement by statement, the code
// between two stops a loop over the threads, as a GPU runs a SIMD-group's lanes (the
// translation is torch_sparse_metal/metal/_lanes.py, which says when this is exact and what
// differs).
//
// Barrier regions (regions.h) run each thread from where it waits to its next stop before
// the next thread: a thread's resumption (its variables out of their slots and back, its
// built-ins, the round's bookkeeping) is paid per thread and stop, and a kernel with a
// SIMD-group function every few instructions (matmul_shuffle: four FMAs per broadcast)
// spends most of its time resuming. Here the control flow around the stops runs once for
// the threadgroup, and only what lies between them runs per thread.
#pragma once

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <exception>
#include <new>
#include <type_traits>

#include "tsm_emu/regions.h"

namespace tsm_emu {

// (runtime.cpp) Every thread running (state 0, see Lanes) handed its value to one SIMD-group
// function: each SIMD-group's lanes meet there, as release_in_place releases them.
void release_lanes(Group& g, const uint8_t* state);
// (runtime.cpp) A fault was caught in kernel code: the runtime code it was raised in is left.
void caught_in_kernel_code();

// A kernel variable declared without a value (`Acc4 ar;`), in its thread's slot.
template <class T>
inline void construct_default(T& slot) {
  using V = std::remove_cv_t<T>;
  if constexpr (!std::is_trivially_default_constructible<V>::value)
    ::new (const_cast<void*>(static_cast<const volatile void*>(&slot))) V;
}
// Whether declaring variables of these types without a value does nothing: a loop over the
// threads that only declares them is left out.
template <class... T>
constexpr bool trivially_declared = (std::is_trivially_default_constructible<std::remove_cv_t<T>>::value && ...);

// A thread's array in element-major slots: element i of thread t's array at i * n + t (n
// threads), so that one statement's access of it by the threads of a loop over them is
// contiguous, as the C++ compiler vectorises it (slots by thread put a matmul_shuffle lane's
// `acc[32]` 128 bytes from the next lane's: gathers). For a variable used only through
// subscripts (the translation checks, _lanes.py); its thread's binding is this view, whose
// subscripts give the elements.
template <class A>
class lane_major_view;
template <class E, size_t N>
class lane_major_view<E[N]> {
  using Scalar = std::remove_all_extents_t<E>;

 public:
  lane_major_view(Scalar* first, size_t n) : first_(first), n_(n) {}
  __attribute__((always_inline)) decltype(auto) operator[](size_t i) const {
    if constexpr (std::is_array<E>::value) {
      return lane_major_view<E>(first_ + i * (sizeof(E) / sizeof(Scalar)) * n_, n_);
    } else {
      return (first_[i * n_]);
    }
  }
  // (construct: the flat elements in order)
  Scalar& flat(size_t i) const { return first_[i * n_]; }

 private:
  Scalar* first_;
  size_t n_;
};

// Per-thread storage for one variable of a kernel run lanes at once: element-major for an
// array of values that copy as bytes and need no construction, else Slots' (a slot per
// thread).
template <class T>
constexpr bool lane_major = std::is_array<T>::value && copies_as_bytes<T> &&
                            std::is_trivially_default_constructible<std::remove_all_extents_t<T>>::value;
template <class T, bool = lane_major<T>>
class LaneSlots : public Slots<T> {
 public:
  using Slots<T>::Slots;
};
template <class T>
class LaneSlots<T, true> {
  using A = std::remove_cv_t<T>;  // (a const array's elements are written once, constructed)
  using Scalar = std::remove_all_extents_t<A>;
  static_assert(alignof(Scalar) <= 64, "over-aligned kernel variable");

 public:
  LaneSlots(SlotBuffer& buffer, uint32_t n)
      : n_(n ? n : 1), first_(static_cast<Scalar*>(buffer.reserve(sizeof(A) * n_))) {}
  lane_major_view<A> operator[](uint32_t t) const { return lane_major_view<A>(first_ + t, n_); }

 private:
  size_t n_;
  Scalar* first_;
};

template <class A, class U>
inline void construct(const lane_major_view<A>& slot, const U& value) {
  using Scalar = std::remove_all_extents_t<A>;
  static_assert(std::is_same<std::remove_cv_t<std::remove_all_extents_t<U>>, std::remove_cv_t<Scalar>>::value &&
                sizeof(U) == sizeof(A), "an array's value of another type");
  const Scalar* from = reinterpret_cast<const Scalar*>(&value);
  for (size_t i = 0; i < sizeof(A) / sizeof(Scalar); ++i) slot.flat(i) = from[i];
}
template <class A>
inline void construct_default(const lane_major_view<A>&) {}  // (arrays of values: nothing)

class Lanes {
 public:
  // Per thread: running the code at hand (0); waiting where its way parted from it, at a
  // code of the translation's (the end of a branch it did not take or of a loop it left:
  // 2 level - 1; a loop's next iteration: 2 level, level the nesting of such structures);
  // returned (inactive at the SIMD-group functions after, as a fiber that returned); or
  // stopped by a fault (raised at the next stop).
  enum : uint8_t { kRunning = 0, kReturned = 254, kFaulted = 255 };

  Lanes(Group& g, const uint32_t* sites, const uint8_t* kinds) : g_(g) {
    static thread_local SlotBuffer buffer;
    state = static_cast<uint8_t*>(buffer.reserve(g.n ? g.n : 1));
    std::fill(state, state + g.n, uint8_t(kRunning));
    g.sites = sites;
    g.kinds = kinds;
  }
  Lanes(const Lanes&) = delete;
  Lanes& operator=(const Lanes&) = delete;

  uint8_t* state;

  // Thread t faulted (called from the catch of its loop): it runs no further. Fibers run
  // each thread to its next stop before the next thread, so the fault they raise is the
  // first, in thread order, of the threads that fault before the next stop; each thread's
  // code up to its first fault is the same either way, so that fault is raised there.
  void fault(uint32_t t) {
    caught_in_kernel_code();
    state[t] = kFaulted;
    if (t < fault_thread_) {
      fault_thread_ = t;
      fault_ = std::current_exception();
    }
  }
  // At every stop and where the threadgroup ends: a fault (see above), or a stop requested.
  void settle() {
    if (fault_) std::rethrow_exception(fault_);
    if (g_.stop->load(std::memory_order_relaxed) != 0) stop_group();
  }
  bool all_gone() const {
    for (uint32_t t = 0, n = g_.n; t < n; ++t)
      if (state[t] < kReturned) return false;
    return true;
  }
  // Whether every thread runs the code at hand: none waits elsewhere, returned or faulted
  // (the loops over the threads that cannot fault but alike then drop their per-thread
  // test, see _lanes.py). Eight states a load: byte by byte, g++ left the scan scalar, 32 M
  // of tsm.mm[shuffle]'s 619 M instructions (it asks before most of its loops).
  bool all_running() const {
    const uint32_t n = g_.n;
    uint64_t waiting = 0;
    uint32_t t = 0;
    for (; t + 8 <= n; t += 8) {
      uint64_t word;
      std::memcpy(&word, state + t, sizeof word);
      waiting |= word;
    }
    for (; t < n; ++t) waiting |= state[t];
    return waiting == 0;
  }
  // Whether a thread runs the code at hand (a branch, a loop's next iteration).
  bool any_running() const {
    unsigned running = 0;
    for (uint32_t t = 0, n = g_.n; t < n; ++t) running |= state[t] == kRunning;
    return running != 0;
  }
  // The threads waiting at `code` run on (the end of the structure, the loop's next iteration).
  void unpark(uint8_t code) {
    for (uint32_t t = 0, n = g_.n; t < n; ++t)
      if (state[t] == code) state[t] = kRunning;
  }
  // An if's else: the threads that ran its first branch wait at `code`, those that waited run.
  void flip(uint8_t code) {
    for (uint32_t t = 0, n = g_.n; t < n; ++t)
      state[t] = state[t] == kRunning ? code : state[t] == code ? uint8_t(kRunning) : state[t];
  }
  // Before a SIMD-group function's lanes read what they handed over.
  void release() {
    settle();
    release_lanes(g_, state);
  }
  // A threadgroup or simdgroup barrier, stop k of the translation, where every thread goes
  // alike: every thread still running waits there. One that returned is what fibers check
  // (resolve_regions: a divergence, unless TSM_EMU_EXITED_THREADS_ARRIVE).
  void barrier(int k) {
    settle();
    const uint32_t n = g_.n;
    bool returned = false;
    for (uint32_t t = 0; t < n; ++t) returned |= state[t] != kRunning;
    if (!returned) return;
    g_.uniform_round = false;
    for (uint32_t t = 0; t < n; ++t) {
      g_.at[t] = state[t] != kRunning ? -1 : k;
      g_.iteration[t] = 0;
      g_.flags[t] = 0;
      g_.path_len[t] = 0;
    }
    resolve_regions(g_);
  }

 private:
  Group& g_;
  uint32_t fault_thread_ = UINT32_MAX;
  std::exception_ptr fault_;
};

}  // namespace tsm_emu
