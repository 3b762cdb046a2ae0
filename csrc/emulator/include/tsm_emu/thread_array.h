// Bounds checks of arrays that are not threadgroup memory: a kernel's or function's local
// `float x[N];` (thread-private), an array member, metal::array. The frontend
// (torch_sparse_metal/metal/_thread_arrays.py) wraps the index of every subscript of such
// an array, `x[i]` -> `x[::tsm_emu::in_bounds<N>(i, "x", __FILE__, __LINE__)]`, so the array
// itself stays a C array: aggregate initialisation, sizeof, passing it to a `thread T*` or
// `thread T (&)[N]` parameter and copying it into a barrier region's slot mean what they
// meant. A constant index the compiler can prove in range costs nothing after inlining; any
// other costs one compare.
//
// A pointer declared `thread T*` becomes a thread_ptr<T> (the rewriter, _rewrite.py), which
// carries the bounds of the array it was taken from: the array's decay (`p = x`, passing x
// to a `thread T*` parameter), `&x[i]` (element_address below) and `x + i` (bounded) give
// them, arithmetic keeps them, and each access through it is checked against them. One
// taken from anything else (a scalar's address, a cast, a raw pointer) has none and is not
// checked.
#pragma once

#include <cstddef>
#include <type_traits>

#include "tsm_emu/sanitize.h"

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

// The fault of an access through a thread_ptr outside the array it points into (runtime.cpp):
// `what` is the subscript's text, or null for `*p` and `p->`.
[[noreturn]] void thread_pointer_out_of_bounds(const char* what, long long element, unsigned long long length,
                                               const char* file, int line);

// `p[i]` of a thread pointer, from clang's AST (_thread_arrays.py): the index, and where
// the subscript is for the fault's message. A raw pointer takes it as the integer it holds.
template <class I>
struct located_index {
  I i;
  const char* what;
  const char* file;
  int line;
  constexpr operator I() const { return i; }
};
template <class I>
__attribute__((always_inline)) inline constexpr auto located(I i, const char* what, const char* file, int line) {
  if constexpr (std::is_integral<I>::value || std::is_enum<I>::value) {
    return located_index<I>{i, what, file, line};
  } else {  // an object that converts to an integer (steel's Int<1>{}): one conversion here
    return located_index<std::ptrdiff_t>{std::ptrdiff_t(i), what, file, line};
  }
}

template <class T>
class thread_ptr;
template <class X>
struct is_thread_ptr : std::false_type {};
template <class T>
struct is_thread_ptr<thread_ptr<T>> : std::true_type {};

template <class T>
class thread_ptr {
 public:
  using element_type = T;

  thread_ptr() = default;
  thread_ptr(std::nullptr_t) {}
  // From an array (its decay: bounded by it) or from a pointer (unbounded). One template, so
  // that an array does not take the pointer's constructor, which C++ would prefer.
  template <class A, class = std::enable_if_t<std::is_convertible<A&&, T*>::value &&
                                              !is_thread_ptr<std::remove_cv_t<std::remove_reference_t<A>>>::value>>
  thread_ptr(A&& from) : p_(from) {
    if constexpr (std::is_array<std::remove_reference_t<A>>::value) {
      begin_ = p_;
      end_ = p_ + std::extent<std::remove_reference_t<A>>::value;
    }
  }
  // thread_ptr<float> -> thread_ptr<const float>
  template <class U, class = std::enable_if_t<std::is_convertible<U*, T*>::value && !std::is_same<U, T>::value>>
  thread_ptr(const thread_ptr<U>& other) : p_(other.get()), begin_(other.lower()), end_(other.upper()) {}
  thread_ptr(T* p, T* begin, T* end) : p_(p), begin_(begin), end_(end) {}

  T* get() const { return p_; }
  T* lower() const { return begin_; }  // the array's bounds [lower, upper), null when it has none
  T* upper() const { return end_; }
  operator T*() const { return p_; }
  // (thread uint*)p: a C-style cast to another pointee type, unbounded as any cast.
  template <class U, class = std::enable_if_t<!std::is_same<std::remove_cv_t<U>, std::remove_cv_t<T>>::value>>
  explicit operator U*() const { return (U*)p_; }
  // An element of an array in a buffer or a program-scope constant one passed on as a
  // checked pointer (&TABLE[i] as `constant T*`), or cast to one of another pointee type
  // (ggml's `(device const uint16_t *)&x[i].qs[0]`): its region is found by address.
  template <class U, class = std::enable_if_t<std::is_convertible<T*, U*>::value>>
  operator ptr<U>() const { return ptr<U>(p_); }
  template <class U, class = std::enable_if_t<!std::is_convertible<T*, U*>::value>, class = void>
  explicit operator ptr<U>() const { return ptr<U>((U*)p_); }

  __attribute__((always_inline)) T& operator[](ptrdiff_t i) const { return at(p_ + i, nullptr, nullptr, 0); }
  template <class I>
  __attribute__((always_inline)) T& operator[](const located_index<I>& i) const {
    return at(p_ + ptrdiff_t(i.i), i.what, i.file, i.line);
  }
  __attribute__((always_inline)) T& operator*() const { return at(p_, nullptr, nullptr, 0); }
  __attribute__((always_inline)) T* operator->() const { return &at(p_, nullptr, nullptr, 0); }

  thread_ptr operator+(ptrdiff_t n) const { return thread_ptr(p_ + n, begin_, end_); }
  thread_ptr operator-(ptrdiff_t n) const { return thread_ptr(p_ - n, begin_, end_); }
  friend thread_ptr operator+(ptrdiff_t n, const thread_ptr& p) { return p + n; }
  thread_ptr& operator+=(ptrdiff_t n) { p_ += n; return *this; }
  thread_ptr& operator-=(ptrdiff_t n) { p_ -= n; return *this; }
  thread_ptr& operator++() { ++p_; return *this; }
  thread_ptr& operator--() { --p_; return *this; }
  thread_ptr operator++(int) { thread_ptr old = *this; ++p_; return old; }
  thread_ptr operator--(int) { thread_ptr old = *this; --p_; return old; }

 private:
  // begin_ is null for a pointer with no bounds: not checked.
  __attribute__((always_inline)) T& at(T* e, const char* what, const char* file, int line) const {
    if (__builtin_expect(begin_ != nullptr && (e < begin_ || e >= end_), 0))
      thread_pointer_out_of_bounds(what, e < begin_ ? -(long long)(begin_ - e) : (long long)(e - begin_),
                                   (unsigned long long)(end_ - begin_), file, line);
    return *e;
  }

  T* p_ = nullptr;
  T* begin_ = nullptr;
  T* end_ = nullptr;
};

// A thread pointer passed to a function template's `A* p` parameter, which the rewriter keeps
// a raw pointer so that calls deduce A from it: the raw pointer (the front end writes the call).
template <class T>
inline T* raw_thread_pointer(const thread_ptr<T>& p) { return p.get(); }
template <class T>
inline T* raw_thread_pointer(T* p) { return p; }

// x + i of a C array (from clang's AST, _thread_arrays.py): the pointer its decay is, bounded.
template <class T, std::size_t N>
__attribute__((always_inline)) inline thread_ptr<T> bounded(T (&a)[N]) {
  return thread_ptr<T>(a);
}

// &x[i] of a C array (a thread array, a row of one, an array member): a pointer bounded by
// it (an address, so one past the end is fine); &p[i] of a thread_ptr: arithmetic on it.
template <class T, std::size_t N, class I>
thread_ptr<T> element_address(T (&a)[N], I i) {
  return thread_ptr<T>(a) + ptrdiff_t(i);
}
template <class T, class I>
thread_ptr<T> element_address(const thread_ptr<T>& p, I i) {
  return p + ptrdiff_t(i);
}

// reinterpret_cast<thread T*>(e) and static_cast<thread T*>(e) (a class type cannot be named
// there): the raw pointer, unbounded.
template <class T, class P>
T* thread_cast(const P& p) {
  if constexpr (is_thread_ptr<P>::value) {
    return (T*)p.get();
  } else {
    return (T*)p;
  }
}

}  // namespace tsm_emu
