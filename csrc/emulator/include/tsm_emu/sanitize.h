// What sanitized kernels are compiled against (torch_sparse_metal.metal, sanitize=True).
//
// The rewriter turns every `device`, `constant` and `threadgroup` pointer in the kernel
// source into tsm_emu::ptr<T>, and every threadgroup array into tsm_emu::tg_var<T[N]...>.
// Each element access goes through the runtime, which checks it against the bounds of the
// buffer or variable the pointer came from and records it for race detection. Accesses
// return plain references, so kernel code type-checks exactly as before; whether an access
// wrote is decided when the thread next stops (at a barrier, a SIMD-group function or its
// end) by comparing the element with its value at first touch: only one thread runs at a
// time in a sanitized dispatch.
#pragma once

#include <cstddef>
#include <cstdint>
#include <type_traits>

namespace tsm_emu {

struct Region;  // a buffer or threadgroup variable of the current dispatch (runtime.cpp)

// The region holding `address`, or nullptr.
const Region* region_of(const void* address);
// Check that [address, address + bytes) lies in `region` (faults with kind out_of_bounds
// otherwise) and record the access for race detection (`atomic`: never a race).
void check_access(const Region* region, const void* address, size_t bytes, bool atomic);
// An atomic operation through a raw pointer (from &p[i]): the access p[i] recorded is
// atomic, not a plain write.
void note_atomic(const void* address, size_t bytes);

template <class T>
class ptr;

namespace sanitize_detail {
template <class E>
struct element_access {
  // p[i] of a pointer to E: a checked reference, or for an array E (a row of a 2-D array)
  // a checked pointer to its first element, as the array would decay to.
  static E& get(E* p, const Region* r) {
    check_access(r, p, sizeof(E), false);
    return *p;
  }
};
template <class U, size_t M>
struct element_access<U[M]> {
  static ptr<U> get(U (*p)[M], const Region* r) { return ptr<U>(&(*p)[0], r); }
};
}  // namespace sanitize_detail

template <class T>
class ptr {
 public:
  using element_type = T;

  ptr() = default;
  ptr(std::nullptr_t) {}
  ptr(T* p, const Region* r) : p_(p), r_(r) {}
  // From a raw pointer, such as &buffer[i]: its region is found by address.
  ptr(T* p) : p_(p), r_(p ? region_of(p) : nullptr) {}
  template <class U, class = std::enable_if_t<std::is_convertible<U*, T*>::value>>
  ptr(const ptr<U>& other) : p_(other.get()), r_(other.region()) {}
  // A cast between pointee types, (device uint*)float_ptr, keeps the region.
  template <class U, class = std::enable_if_t<!std::is_convertible<U*, T*>::value>, class = void>
  explicit ptr(const ptr<U>& other)
      : p_(reinterpret_cast<T*>(const_cast<std::remove_cv_t<U>*>(other.get()))), r_(other.region()) {}

  T* get() const { return p_; }
  const Region* region() const { return r_; }
  explicit operator bool() const { return p_ != nullptr; }

  decltype(auto) operator[](ptrdiff_t i) const { return sanitize_detail::element_access<T>::get(p_ + i, r_); }
  decltype(auto) operator*() const { return (*this)[0]; }
  T* operator->() const {
    check_access(r_, p_, sizeof(T), false);
    return p_;
  }

  ptr operator+(ptrdiff_t n) const { return ptr(p_ + n, r_); }
  ptr operator-(ptrdiff_t n) const { return ptr(p_ - n, r_); }
  ptrdiff_t operator-(const ptr& o) const { return p_ - o.p_; }
  ptr& operator+=(ptrdiff_t n) { p_ += n; return *this; }
  ptr& operator-=(ptrdiff_t n) { p_ -= n; return *this; }
  ptr& operator++() { ++p_; return *this; }
  ptr& operator--() { --p_; return *this; }
  ptr operator++(int) { ptr old = *this; ++p_; return old; }
  ptr operator--(int) { ptr old = *this; --p_; return old; }
  friend ptr operator+(ptrdiff_t n, const ptr& p) { return p + n; }
  friend bool operator==(const ptr& a, const ptr& b) { return a.p_ == b.p_; }
  friend bool operator!=(const ptr& a, const ptr& b) { return a.p_ != b.p_; }
  friend bool operator<(const ptr& a, const ptr& b) { return a.p_ < b.p_; }
  friend bool operator<=(const ptr& a, const ptr& b) { return a.p_ <= b.p_; }
  friend bool operator>(const ptr& a, const ptr& b) { return a.p_ > b.p_; }
  friend bool operator>=(const ptr& a, const ptr& b) { return a.p_ >= b.p_; }
  friend bool operator==(const ptr& a, std::nullptr_t) { return a.p_ == nullptr; }
  friend bool operator!=(const ptr& a, std::nullptr_t) { return a.p_ != nullptr; }

 private:
  T* p_ = nullptr;
  const Region* r_ = nullptr;
};

// A threadgroup array declared in a kernel body, `threadgroup float tile[32][33];`.
template <class A>
class tg_var {
  static_assert(std::is_array<A>::value, "tg_var holds threadgroup arrays");
  using E = std::remove_extent_t<A>;

 public:
  decltype(auto) operator[](ptrdiff_t i) { return pointer()[i]; }
  operator ptr<E>() { return pointer(); }
  ptr<E> operator+(ptrdiff_t n) { return pointer() + n; }

 private:
  ptr<E> pointer() { return ptr<E>(&storage_[0], region_of(&storage_)); }
  alignas(16) A storage_;
};

// reinterpret_cast<device T*>(p) in a sanitized build: the same pointer, same region.
template <class T, class U>
ptr<T> ptr_cast(const ptr<U>& p) {
  return ptr<T>(p);
}

// A threadgroup scalar, `threadgroup float m;`: the rewriter turns each use into m.ref().
template <class T>
class tg_scalar {
 public:
  T& ref() {
    check_access(region_of(&value_), &value_, sizeof(T), false);
    return value_;
  }

 private:
  T value_;
};

template <class T>
struct is_checked_ptr : std::false_type {};
template <class T>
struct is_checked_ptr<ptr<T>> : std::true_type {};

}  // namespace tsm_emu
