// Checked pointers: what every kernel is compiled against (torch_sparse_metal.metal).
//
// The rewriter turns every `device`, `constant` and `threadgroup` pointer in the kernel
// source into tsm_emu::ptr<T>, and every threadgroup array into tsm_emu::tg_var<T[N]...>.
// A checked pointer carries the bounds of the buffer or threadgroup variable it points
// into, and every element access is checked against them, in every build: an access
// outside them raises KernelFault(kind="out_of_bounds") and touches nothing. Accesses return
// plain references, so kernel code type-checks exactly as before.
//
// Sanitized builds (__TSM_SANITIZE__) also record each access for race detection, in the
// runtime (most of them through PendingAccesses, appended to inline). The rewriter adds
// what a reference cannot say there
// (torch_sparse_metal/metal/_access_rewrite.py): `p[i].f` becomes member_of(<address of
// p[i]>, ...), an access of the field's bytes only, and the target of an assignment is
// wrapped in stored() (`=`) or updated() (`+=`, `++`, ...), so a store counts as a write
// even when it leaves the bytes as they were. Any other access is a write if it changed the
// element's bytes, which is decided when the thread next stops (at a barrier, a SIMD-group
// function or its end) by comparing them with their value at first touch: only one thread
// runs at a time in a sanitized dispatch.
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <utility>

namespace metal {
namespace tsm_detail {
template <class X>
struct is_vec_like;  // tsm_emu/types.h: vectors, packed vectors, swizzles
}  // namespace tsm_detail
}  // namespace metal

namespace tsm_emu {

// How the running thread runs the statement calling a SIMD-group function, in barrier
// regions (regions.h, WaitKind): replaying, its accesses were made once already.
enum CollectiveMode : uint8_t { kOrdinary = 0, kPosting = 1, kReplaying = 2 };

// Sanitized: an access kernel code logged inline (check_access), for the runtime to take
// into the running thread's log at its next call (sanitizer.h, flush_pending). A call per
// access, with what it saves and restores, cost as much as logging the access.
struct Bounds;
struct PendingAccess {
  const char* address;
  const Bounds* region;
  uint32_t bytes;
  unsigned char before[16];  // the bytes at the access: what tells a write at the stop
};
// The running thread's: entries [begin, next); an access inline only while next != end.
// The runtime closes it (end = next) when no thread runs, while it counts SIMD-group
// instructions (which need each access's place in the code), and when it is full.
struct PendingAccesses {
  PendingAccess* next = nullptr;
  PendingAccess* end = nullptr;
  const uint8_t* mode = nullptr;  // the running thread's CollectiveMode, in barrier regions
};

// A buffer or threadgroup variable of the current dispatch: its bytes [begin, end). The
// runtime's Region (src/sanitizer.h) extends it with its name and, sanitized, what the
// sanitizer tracks.
struct Bounds {
  const char* begin = nullptr;
  const char* end = nullptr;
  PendingAccesses* pending = nullptr;  // sanitized, of a buffer or threadgroup memory
};

inline const void* untyped(const volatile void* p) { return const_cast<const void*>(p); }

// The region holding `address`, or nullptr.
const Bounds* region_of(const void* address);
inline const Bounds* region_of(const volatile void* address) { return region_of(untyped(address)); }

// The runtime's side (runtime.cpp), for the checks below.
// Sanitized: check [address, address + bytes) against `region` (faults with kind
// out_of_bounds outside it) and record the access for race detection (`atomic`: never a
// race); for a field, `element` and `element_bytes` are the element it lies in.
void sanitizer_access(const Bounds* region, const void* element, size_t element_bytes,
                      const void* address, size_t bytes, bool atomic);
// An atomic operation through a raw pointer (from &p[i]): the access p[i] recorded is
// atomic, not a plain write.
void sanitizer_note_atomic(const void* address, size_t bytes);
// The latest access, to [address, address + bytes), was the target of an assignment: a
// write, which read the old value first if `updates` (+=, ++, ...).
void sanitizer_note_store(const void* address, size_t bytes, bool updates);
// Unsanitized: the fault of an access outside its region.
[[noreturn]] void out_of_bounds(const Bounds* region, const void* address, size_t bytes);

// Sanitized, the runtime tells an access's place in the kernel's code by the address
// sanitizer_access returns to (the counters pair the lanes of a SIMD-group by it): every
// function between a kernel's access and that call is inlined into the kernel's code.
#define TSM_ACCESS_INLINE __attribute__((always_inline)) inline

#ifdef __TSM_SANITIZE__
TSM_ACCESS_INLINE void check_access(const Bounds* region, const void* address, size_t bytes, bool atomic) {
  const char* a = static_cast<const char*>(address);
  PendingAccesses* pending = region ? region->pending : nullptr;
  if (__builtin_expect(pending && !atomic && bytes <= sizeof(PendingAccess::before) && pending->next != pending->end &&
                           a >= region->begin && a + bytes <= region->end, 1)) {
    if (pending->mode && *pending->mode == kReplaying) return;  // as sanitizer_access does
    PendingAccess* p = pending->next;
    p->address = a;
    p->region = region;
    p->bytes = uint32_t(bytes);
    std::memcpy(p->before, a, bytes);
    pending->next = p + 1;
    return;
  }
  sanitizer_access(region, address, bytes, address, bytes, atomic);
}
TSM_ACCESS_INLINE void check_field_access(const Bounds* region, const void* element, size_t element_bytes,
                                          const void* field, size_t field_bytes) {
  sanitizer_access(region, element, element_bytes, field, field_bytes, false);
}
TSM_ACCESS_INLINE void note_atomic(const void* address, size_t bytes) { sanitizer_note_atomic(address, bytes); }
inline void note_store(const void* address, size_t bytes, bool updates) {
  sanitizer_note_store(address, bytes, updates);
}
#else
// Unsanitized: the bounds check alone, inline.
inline void check_access(const Bounds* region, const void* address, size_t bytes, bool) {
  const char* a = static_cast<const char*>(address);
  if (__builtin_expect(region == nullptr || a < region->begin || a + bytes > region->end, 0))
    out_of_bounds(region, address, bytes);
}
inline void check_field_access(const Bounds* region, const void* element, size_t element_bytes,
                               const void*, size_t) {
  check_access(region, element, element_bytes, false);
}
inline void note_atomic(const void*, size_t) {}
inline void note_store(const void*, size_t, bool) {}
#endif

// Addresses of volatile objects go to the functions above as plain addresses.
TSM_ACCESS_INLINE void check_access(const Bounds* region, const volatile void* address, size_t bytes, bool atomic) {
  check_access(region, untyped(address), bytes, atomic);
}
TSM_ACCESS_INLINE void note_atomic(const volatile void* address, size_t bytes) { note_atomic(untyped(address), bytes); }

// The rewriter's marks on assignment targets: `stored(p[i]) = v;`, `updated(p[i]) += v;`.
// Anything else (a local, a swizzle proxy) passes through unmarked.
template <class T>
T& stored(T& target) {
  note_store(untyped(&target), sizeof(T), false);
  return target;
}
template <class T>
T& updated(T& target) {
  note_store(untyped(&target), sizeof(T), true);
  return target;
}
template <class T, class = std::enable_if_t<!std::is_lvalue_reference<T>::value>>
T&& stored(T&& target) {
  return static_cast<T&&>(target);
}
template <class T, class = std::enable_if_t<!std::is_lvalue_reference<T>::value>>
T&& updated(T&& target) {
  return static_cast<T&&>(target);
}

template <class T>
class ptr;

// The pointee of a `volatile device T*` (or reference): volatile where T is a scalar, which
// keeps a spinning load a load; a vector, matrix or struct stays as it is, since C++ gives
// a volatile object of a class no assignment or copy (_rewrite._checked_pointee).
template <class T>
using volatile_t = std::conditional_t<std::is_scalar<std::remove_cv_t<T>>::value, volatile T, T>;

namespace sanitize_detail {
template <class E>
struct element_access {
  // p[i] of a pointer to E: a checked reference, or for an array E (a row of a 2-D array)
  // a checked pointer to its first element, as the array would decay to.
  template <class P>
  TSM_ACCESS_INLINE static E& get(E* p, const P& from) {
    from.check(untyped(p), sizeof(E));
    return *p;
  }
};
template <class U, size_t M>
struct element_access<U[M]> {
  template <class P>
  static ptr<U> get(U (*p)[M], const P& from) { return ptr<U>(&(*p)[0], from); }
};
}  // namespace sanitize_detail

namespace sanitize_detail {
// The pointer and its region. ptr<T> derives from ptr<const T> (which holds these), so a
// template parameter `ptr<const T>` deduces from a ptr<float> argument through the base
// class, as `device const T*` deduces from a `device float*` in MSL.
struct ptr_marker {};  // every ptr<T> (and so every tg_var) derives from it

// With a copy of the region's bounds (a region does not move while a pointer into it
// lives: a dispatch's buffers, a threadgroup's memory), the unsanitized check compares with
// values the compiler can keep in registers and hoist out of loops, instead of loading them
// through the region pointer at every access, which it may not hoist (the pointer may be
// null, and stores through float pointers may alias the region).
template <class T>
struct ptr_data : ptr_marker {
  ptr_data() = default;
  ptr_data(T* p, const Bounds* r) : p_(p), r_(r), begin_(r ? r->begin : nullptr), end_(r ? r->end : nullptr) {}
  template <class U>
  ptr_data(T* p, const ptr_data<U>& bounds) : p_(p), r_(bounds.r_), begin_(bounds.begin_), end_(bounds.end_) {}

  // An access of `bytes` at `address` (see check_access): a region of none, null, has
  // empty bounds, so every access through it faults.
  TSM_ACCESS_INLINE void check(const void* address, size_t bytes) const {
#ifdef __TSM_SANITIZE__
    check_access(r_, address, bytes, false);
#else
    const char* a = static_cast<const char*>(address);
    if (__builtin_expect(a < begin_ || a + bytes > end_, 0)) out_of_bounds(r_, address, bytes);
#endif
  }

  T* p_ = nullptr;
  const Bounds* r_ = nullptr;
  const char* begin_ = nullptr;
  const char* end_ = nullptr;
};
template <class T>
using ptr_base = std::conditional_t<std::is_const<T>::value, ptr_data<T>, ptr<const T>>;

// What `device T&` names, for ptr's constructor from an element: a `device void*` has no
// element, so its constructor takes a type no argument has.
struct no_element {};
template <class T, bool = std::is_void<T>::value>
struct element_ref {
  using type = T&;
};
template <class T>
struct element_ref<T, true> {
  using type = no_element&;
};
}  // namespace sanitize_detail

template <class T>
class ptr : public sanitize_detail::ptr_base<T> {
  using base = sanitize_detail::ptr_base<T>;

 public:
  using element_type = T;

  ptr() = default;
  ptr(std::nullptr_t) {}
  ptr(T* p, const Bounds* r) : base(p, r) {}
  // At `p`, in the region of `other` (pointer arithmetic, casts).
  template <class U>
  ptr(T* p, const sanitize_detail::ptr_data<U>& other) : base(p, other) {}
  // From a raw pointer, such as &buffer[i]: its region is found by address.
  ptr(T* p) : base(p, p ? region_of(p) : nullptr) {}
  // From an element, for a `device T&` parameter of a helper given `out[i]`.
  ptr(typename sanitize_detail::element_ref<T>::type element) : ptr(&element) {}
  // A C-style cast of a raw pointer to another pointee type, (device uint*)&out[i].
  template <class U, class = std::enable_if_t<!std::is_convertible<U*, T*>::value>>
  explicit ptr(U* p) : ptr(reinterpret_cast<T*>(const_cast<std::remove_cv_t<U>*>(p))) {}
  // From a buffer's device address, (device T*)address (SPIRV-Cross's buffer device
  // addresses): its region is found by address, as a raw pointer's.
  template <class I, std::enable_if_t<std::is_integral<I>::value && sizeof(I) == sizeof(void*), int> = 0>
  explicit ptr(I address) : ptr(reinterpret_cast<T*>(static_cast<uintptr_t>(address))) {}
  // ptr<float> -> ptr<volatile float> (to ptr<const float> it is its own base class).
  template <class U, class = std::enable_if_t<std::is_convertible<U*, T*>::value &&
                                              !std::is_base_of<ptr, ptr<U>>::value>>
  ptr(const ptr<U>& other) : base(other.get(), other) {}
  // A cast between pointee types, (device uint*)float_ptr, keeps the region.
  template <class U, class = std::enable_if_t<!std::is_convertible<U*, T*>::value>, class = void>
  explicit ptr(const ptr<U>& other)
      : base(reinterpret_cast<T*>(const_cast<std::remove_cv_t<U>*>(other.get())), other) {}

  T* get() const { return const_cast<T*>(this->p_); }
  const Bounds* region() const { return this->r_; }
  explicit operator bool() const { return this->p_ != nullptr; }

  TSM_ACCESS_INLINE decltype(auto) operator[](ptrdiff_t i) const {
    return sanitize_detail::element_access<T>::get(get() + i, *this);
  }
  TSM_ACCESS_INLINE decltype(auto) operator*() const { return (*this)[0]; }
  TSM_ACCESS_INLINE T* operator->() const {
    this->check(untyped(get()), sizeof(T));
    return get();
  }

  ptr operator+(ptrdiff_t n) const { return ptr(get() + n, *this); }
  ptr operator-(ptrdiff_t n) const { return ptr(get() - n, *this); }
  ptrdiff_t operator-(const ptr& o) const { return get() - o.get(); }
  ptr& operator+=(ptrdiff_t n) { return *this = *this + n; }
  ptr& operator-=(ptrdiff_t n) { return *this = *this - n; }
  ptr& operator++() { return *this += 1; }
  ptr& operator--() { return *this -= 1; }
  ptr operator++(int) { ptr old = *this; *this += 1; return old; }
  ptr operator--(int) { ptr old = *this; *this -= 1; return old; }
  friend ptr operator+(ptrdiff_t n, const ptr& p) { return p + n; }
  friend bool operator==(const ptr& a, const ptr& b) { return a.get() == b.get(); }
  friend bool operator!=(const ptr& a, const ptr& b) { return a.get() != b.get(); }
  friend bool operator<(const ptr& a, const ptr& b) { return a.get() < b.get(); }
  friend bool operator<=(const ptr& a, const ptr& b) { return a.get() <= b.get(); }
  friend bool operator>(const ptr& a, const ptr& b) { return a.get() > b.get(); }
  friend bool operator>=(const ptr& a, const ptr& b) { return a.get() >= b.get(); }
  friend bool operator==(const ptr& a, std::nullptr_t) { return a.get() == nullptr; }
  friend bool operator!=(const ptr& a, std::nullptr_t) { return a.get() != nullptr; }
};

// A threadgroup array declared in a kernel body, `threadgroup float tile[32][33];`. It is
// also the pointer its name decays to (ptr<float[33]> here), so `f(tile)` deduces `T` for
// a `threadgroup T*` parameter as the array decay does in MSL. Registering it where the
// declaration runs (below) points it at this threadgroup's region.
template <class A>
class tg_var : public ptr<std::remove_extent_t<A>> {
  static_assert(std::is_array<A>::value, "tg_var holds threadgroup arrays");
  using E = std::remove_extent_t<A>;

 public:
  A& storage() { return storage_; }
  void bind() { static_cast<ptr<E>&>(*this) = ptr<E>(&storage_[0], region_of(&storage_)); }
  // for (threadgroup float& v : t)
  ptr<E> begin() { return *this; }
  ptr<E> end() { return ptr<E>(*this) + ptrdiff_t(std::extent<A>::value); }

 private:
  alignas(16) A storage_;
};

// The same array as a barrier region's threads use it (regions.h): a copy of its pointer,
// which the compiler can keep in registers, bounds included, and what a kernel may ask of the
// array besides (its storage, for sizeof; a range-for).
template <class A>
class tg_view : public ptr<std::remove_extent_t<A>> {
  using E = std::remove_extent_t<A>;

 public:
  explicit tg_view(tg_var<A>& var) : ptr<E>(var), var_(&var) {}
  A& storage() const { return var_->storage(); }
  ptr<E> begin() const { return *this; }
  ptr<E> end() const { return ptr<E>(*this) + ptrdiff_t(std::extent<A>::value); }

 private:
  tg_var<A>* var_;
};
template <class A>
tg_view<A> view_of(tg_var<A>& var) {
  return tg_view<A>(var);
}

// A threadgroup array passed whole to a function: the pointer it decays to in MSL, so a
// template parameter taking it by value deduces a pointer (the rewriter writes the calls).
template <class A>
ptr<std::remove_extent_t<A>> decayed(tg_var<A>& var) {
  return var;
}
template <class A>
ptr<std::remove_extent_t<A>> decayed(const tg_view<A>& view) {
  return view;
}

void register_static_threadgroup_memory(const void* address, size_t bytes, const char* name);

// A program-scope `constant` variable (ggml's lookup tables), which a `constant T*` may
// point into: the rewriter declares one of these after it, which registers its bytes as a
// region of every dispatch of the library as the library loads.
void register_program_constant(const void* address, size_t bytes, const char* name);
struct program_constant {
  program_constant(const volatile void* address, size_t bytes, const char* name) {
    register_program_constant(untyped(address), bytes, name);
  }
};

// The array's region is its storage, not the pointer in front of it.
template <class A>
void register_static_threadgroup_memory(tg_var<A>* var, size_t, const char* name) {
  register_static_threadgroup_memory(&var->storage(), sizeof(A), name);
  var->bind();
}

// A threadgroup scalar, `threadgroup float m;`: the rewriter turns each use into m.ref().
template <class T>
class tg_scalar {
 public:
  TSM_ACCESS_INLINE T& ref() {
#ifdef __TSM_SANITIZE__
    check_access(region_of(&value_), &value_, sizeof(T), false);
#endif
    return value_;
  }
  // For m.f: the variable's address, no access yet (member_of below records the field).
  ptr<T> pointer() { return ptr<T>(&value_, region_of(&value_)); }

 private:
  T value_;
};

// A threadgroup variable bound to a `threadgroup T&` parameter: the rewriter writes its
// checked pointer in place of the call (no access); this stands in where it does not.
template <class X>
X&& reference_argument(X&& x) { return static_cast<X&&>(x); }

// A pointer passed to a function template's `device A*` (or constant, threadgroup)
// parameter, which the emulator's C++ declares `ptr<A>`: a raw pointer (`&buf.inner[i]`)
// becomes the checked pointer A is deduced from, its region found by address; a checked
// pointer or threadgroup array passes through (_cxx_forms.template_pointer_arguments,
// pointer_argument_conversions).
template <class T>
ptr<T> checked_pointer(T* p) {  // (an array in a buffer's struct decays to it)
  return ptr<T>(p);
}
template <class P, std::enable_if_t<!std::is_pointer<std::remove_reference_t<P>>::value &&
                                        !std::is_array<std::remove_reference_t<P>>::value, int> = 0>
P&& checked_pointer(P&& p) {
  return static_cast<P&&>(p);
}

// &p[i] in a sanitized build: an element's address is pointer arithmetic on a checked
// pointer or threadgroup array (no access recorded, one past the end allowed); anything
// else indexable keeps its own meaning.
template <class P, class I>
auto element_address(P& p, I i) {
  if constexpr (std::is_base_of<sanitize_detail::ptr_marker, std::remove_cv_t<P>>::value) {
    return p + ptrdiff_t(i);
  } else {
    return &p[i];
  }
}
// Of a temporary: a row's ptr (p[i] of a row), or a value subscripted in the expression that
// made it (Tint's `transpose(m)[0].y`), which lives to the end of that expression.
template <class P, class I, std::enable_if_t<!std::is_lvalue_reference<P>::value, int> = 0>
auto element_address(P&& p, I i) {
  if constexpr (std::is_base_of<sanitize_detail::ptr_marker, std::remove_cv_t<P>>::value || std::is_pointer<P>::value) {
    return p + ptrdiff_t(i);
  } else {
    return &p[i];
  }
}

namespace sanitize_detail {
template <class X>
decltype(auto) apply(X&& x) {
  return static_cast<X&&>(x);
}
template <class X, class F, class... Fs>
decltype(auto) apply(X&& x, F step, Fs... rest) {
  return apply(step(static_cast<X&&>(x)), rest...);
}

// Follow a member path from an element, and record the access of what it ends at: a
// field of a struct (nested ones included), but a vector whole, as Metal counts a write
// of one component as a write of the vector.
template <class X>
TSM_ACCESS_INLINE X& walk(const Bounds* r, const void* element, size_t element_bytes, X& x) {
  check_field_access(r, element, element_bytes, untyped(&x), sizeof(X));
  return x;
}
template <class X, class F, class... Fs>
TSM_ACCESS_INLINE decltype(auto) walk(const Bounds* r, const void* element, size_t element_bytes, X& x,
                                      F step, Fs... rest) {
  if constexpr (metal::tsm_detail::is_vec_like<std::remove_cv_t<X>>::value) {
    check_field_access(r, element, element_bytes, untyped(&x), sizeof(X));
    return apply(x, step, rest...);
  } else {
    return walk(r, element, element_bytes, step(x), rest...);
  }
}
}  // namespace sanitize_detail

// p[i].a.b, p->a, (*p).a in a sanitized build: member_of(address of the element, one step
// per member), so that two threads writing different fields of one element do not race.
template <class P, class... Path>
TSM_ACCESS_INLINE decltype(auto) member_of(P&& p, Path... path) {
  using Q = std::remove_cv_t<std::remove_reference_t<P>>;
  if constexpr (std::is_base_of<sanitize_detail::ptr_marker, Q>::value) {
    auto* element = p.get();
    return sanitize_detail::walk(p.region(), untyped(element), sizeof(*element), *element, path...);
  } else if constexpr (std::is_pointer<Q>::value) {
    return sanitize_detail::apply(*p, path...);
  } else {
    return sanitize_detail::apply(*p.operator->(), path...);
  }
}

// reinterpret_cast<device T*>(p) in a sanitized build: the same pointer, same region.
template <class T, class U>
ptr<T> ptr_cast(const ptr<U>& p) {
  return ptr<T>(p);
}

// reinterpret_cast<device T*>(address) of a 64-bit integer, or of a raw pointer.
template <class T, class I, std::enable_if_t<std::is_integral<I>::value, int> = 0>
ptr<T> ptr_cast(I address) {
  static_assert(sizeof(I) == sizeof(void*), "an integer converts to a pointer when it is 64-bit (a device address)");
  return ptr<T>(address);
}
template <class T, class U>
ptr<T> ptr_cast(U* p) {
  return ptr<T>(reinterpret_cast<T*>(const_cast<std::remove_cv_t<U>*>(p)));
}

// reinterpret_cast<ulong>(p) of a checked pointer (PyTorch's atomic.h aligns one so): its
// address.
template <class I, class T>
I integer_cast(const ptr<T>& p) {
  static_assert(std::is_integral<I>::value && sizeof(I) == sizeof(void*), "a pointer converts to a 64-bit integer");
  return reinterpret_cast<I>(untyped(p.get()));
}
template <class I, class T>
I integer_cast(T* p) {
  return reinterpret_cast<I>(p);
}

template <class T>
struct is_checked_ptr : std::false_type {};
template <class T>
struct is_checked_ptr<ptr<T>> : std::true_type {};

}  // namespace tsm_emu
