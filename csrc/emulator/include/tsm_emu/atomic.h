// Metal atomics: atomic<T> with the *_explicit functions. Device memory is shared by the
// worker threads that run different threadgroups, so these are real CPU atomics.
#pragma once

#include <type_traits>

#include "tsm_emu/sanitize.h"
#include "tsm_emu/sync.h"

namespace metal {

enum memory_order {
  memory_order_relaxed = __ATOMIC_RELAXED,
  memory_order_acquire = __ATOMIC_ACQUIRE,
  memory_order_release = __ATOMIC_RELEASE,
  memory_order_acq_rel = __ATOMIC_ACQ_REL,
  memory_order_seq_cst = __ATOMIC_SEQ_CST,
};

// Metal 3.2's fence. Device memory is real shared memory here: a CPU fence orders it.
enum class thread_scope : int {
  thread_scope_thread = 0,
  thread_scope_simdgroup = 1,
  thread_scope_threadgroup = 2,
  thread_scope_device = 3,
};
constexpr thread_scope thread_scope_thread = thread_scope::thread_scope_thread;
constexpr thread_scope thread_scope_simdgroup = thread_scope::thread_scope_simdgroup;
constexpr thread_scope thread_scope_threadgroup = thread_scope::thread_scope_threadgroup;
constexpr thread_scope thread_scope_device = thread_scope::thread_scope_device;
inline void atomic_thread_fence(mem_flags, memory_order order, thread_scope = thread_scope_device) {
  __atomic_thread_fence(order);
}

// Same size and alignment as T, as in Metal (atomic_float is a float in memory).
template <class T>
struct atomic {
  T value_;
};

using atomic_int = atomic<int>;
using atomic_uint = atomic<unsigned int>;
using atomic_bool = atomic<bool>;
using atomic_float = atomic<float>;
using atomic_ulong = atomic<unsigned long>;
using atomic_long = atomic<long>;

namespace atomic_detail {
template <class T>
using plain = std::remove_cv_t<T>;

template <class T>
inline T* raw(const volatile atomic<T>* a) {
#ifdef __TSM_SANITIZE__
  tsm_emu::note_atomic(const_cast<const atomic<T>*>(a), sizeof(T));
#endif
  return const_cast<T*>(&a->value_);
}

// Floating-point read-modify-write through compare-and-swap on the bits, which is also how
// Apple GPUs without native float atomics execute it.
template <class T, class F>
inline T rmw(T* p, F f) {
  T expected;
  __atomic_load(p, &expected, __ATOMIC_RELAXED);
  T desired;
  do {
    desired = f(expected);
  } while (!__atomic_compare_exchange(p, &expected, &desired, true, __ATOMIC_RELAXED,
                                      __ATOMIC_RELAXED));
  return expected;
}
}  // namespace atomic_detail

// Through a checked pointer (sanitized builds): bounds-checked, recorded as atomic.
#define TSM_ATOMIC_THROUGH_CHECKED_PTR(name)                                             \
  template <class A, class... Rest>                                                     \
  inline auto name(const tsm_emu::ptr<A>& p, Rest... rest) {                            \
    tsm_emu::check_access(p.region(), p.get(), sizeof(A), true);                        \
    return name(p.get(), rest...);                                                      \
  }

template <class T, class U>
inline void atomic_store_explicit(volatile atomic<T>* a, U v, memory_order) {
  T t = T(v);
  __atomic_store(atomic_detail::raw(a), &t, __ATOMIC_RELAXED);
}
template <class T>
inline T atomic_load_explicit(const volatile atomic<T>* a, memory_order) {
  T t;
  __atomic_load(atomic_detail::raw(a), &t, __ATOMIC_RELAXED);
  return t;
}
template <class T, class U>
inline T atomic_exchange_explicit(volatile atomic<T>* a, U v, memory_order) {
  T t = T(v), old;
  __atomic_exchange(atomic_detail::raw(a), &t, &old, __ATOMIC_RELAXED);
  return old;
}
template <class T, class U>
inline bool atomic_compare_exchange_weak_explicit(volatile atomic<T>* a, T* expected, U desired,
                                                  memory_order, memory_order) {
#ifdef __TSM_SANITIZE__
  // The weak form may fail even when the value matches; a correct CAS loop retries. The
  // sanitizer makes that happen, so a loop that does not retry is caught.
  if (tsm_emu::inject_spurious_cas_failure()) {
    __atomic_load(atomic_detail::raw(a), expected, __ATOMIC_RELAXED);
    return false;
  }
#endif
  T d = T(desired);
  return __atomic_compare_exchange(atomic_detail::raw(a), expected, &d, true, __ATOMIC_RELAXED,
                                   __ATOMIC_RELAXED);
}
template <class T, class U>
inline bool atomic_compare_exchange_strong_explicit(volatile atomic<T>* a, T* expected, U desired,
                                                    memory_order, memory_order) {
  T d = T(desired);
  return __atomic_compare_exchange(atomic_detail::raw(a), expected, &d, false, __ATOMIC_RELAXED,
                                   __ATOMIC_RELAXED);
}

#define TSM_ATOMIC_FETCH(name, int_builtin, float_expr)                                  \
  template <class T, class U>                                                           \
  inline T name(volatile atomic<T>* a, U v, memory_order) {                             \
    T* p = atomic_detail::raw(a);                                                       \
    const T operand = T(v);                                                             \
    if constexpr (std::is_integral<T>::value) {                                         \
      return int_builtin(p, operand, __ATOMIC_RELAXED);                                 \
    } else {                                                                            \
      return atomic_detail::rmw(p, [&](T current) -> T { return float_expr; });         \
    }                                                                                   \
  }
TSM_ATOMIC_FETCH(atomic_fetch_add_explicit, __atomic_fetch_add, current + operand)
TSM_ATOMIC_FETCH(atomic_fetch_sub_explicit, __atomic_fetch_sub, current - operand)
TSM_ATOMIC_FETCH(atomic_fetch_and_explicit, __atomic_fetch_and, current)
TSM_ATOMIC_FETCH(atomic_fetch_or_explicit, __atomic_fetch_or, current)
TSM_ATOMIC_FETCH(atomic_fetch_xor_explicit, __atomic_fetch_xor, current)
#undef TSM_ATOMIC_FETCH

template <class T, class U>
inline T atomic_fetch_min_explicit(volatile atomic<T>* a, U v, memory_order) {
  const T operand = T(v);
  return atomic_detail::rmw(atomic_detail::raw(a),
                            [&](T current) -> T { return operand < current ? operand : current; });
}
template <class T, class U>
inline T atomic_fetch_max_explicit(volatile atomic<T>* a, U v, memory_order) {
  const T operand = T(v);
  return atomic_detail::rmw(atomic_detail::raw(a),
                            [&](T current) -> T { return operand > current ? operand : current; });
}

// Metal's 64-bit atomics (atomic_ulong, device memory): min and max that return nothing.
template <class U>
inline void atomic_max_explicit(volatile atomic<unsigned long>* a, U v, memory_order o) {
  atomic_fetch_max_explicit(a, v, o);
}
template <class U>
inline void atomic_min_explicit(volatile atomic<unsigned long>* a, U v, memory_order o) {
  atomic_fetch_min_explicit(a, v, o);
}

TSM_ATOMIC_THROUGH_CHECKED_PTR(atomic_max_explicit)
TSM_ATOMIC_THROUGH_CHECKED_PTR(atomic_min_explicit)
TSM_ATOMIC_THROUGH_CHECKED_PTR(atomic_store_explicit)
TSM_ATOMIC_THROUGH_CHECKED_PTR(atomic_load_explicit)
TSM_ATOMIC_THROUGH_CHECKED_PTR(atomic_exchange_explicit)
TSM_ATOMIC_THROUGH_CHECKED_PTR(atomic_compare_exchange_weak_explicit)
TSM_ATOMIC_THROUGH_CHECKED_PTR(atomic_compare_exchange_strong_explicit)
TSM_ATOMIC_THROUGH_CHECKED_PTR(atomic_fetch_add_explicit)
TSM_ATOMIC_THROUGH_CHECKED_PTR(atomic_fetch_sub_explicit)
TSM_ATOMIC_THROUGH_CHECKED_PTR(atomic_fetch_and_explicit)
TSM_ATOMIC_THROUGH_CHECKED_PTR(atomic_fetch_or_explicit)
TSM_ATOMIC_THROUGH_CHECKED_PTR(atomic_fetch_xor_explicit)
TSM_ATOMIC_THROUGH_CHECKED_PTR(atomic_fetch_min_explicit)
TSM_ATOMIC_THROUGH_CHECKED_PTR(atomic_fetch_max_explicit)
#undef TSM_ATOMIC_THROUGH_CHECKED_PTR

}  // namespace metal
