// Probed rounds: a barrier region's bounds checks made for the whole round before it runs.
//
// A round of a plain dispatch whose threads all start from one stop is a loop over the
// threads of the code from that stop to the next (run_regions, regions.h). A checked access
// branches to a fault, and the compiler vectorises no loop with such a branch. For a kernel
// whose accesses' indices and control flow never depend on what it reads from memory (the
// translation decides: torch_sparse_metal/metal/_bounds_probe.py), the round's code runs
// three ways, chosen by the body's first argument:
//
// * kProbe: every access is a bounds test that touches no memory and gives a dummy; the
//   thread's stores to its slots are skipped. Nothing the indices or branches depend on
//   comes from memory, so each thread tests the indices the round will use, in order.
// * kUnchecked, once the probe found every access in bounds: accesses without the branch,
//   a loop the compiler can vectorise across threads (the tree reduction's rounds are).
// * kChecked otherwise, and in every other round: as before, faulting at the same thread
//   and access.
//
// `Line`: the threadgroup is one row (n x 1 x 1), so a thread's position is its index, not
// a load from the table of positions, which kept the loop scalar.
#pragma once

#include <cstddef>
#include <cstdint>
#include <type_traits>

#include "tsm_emu/runtime.h"
#include "tsm_emu/sanitize.h"
#include "tsm_emu/types.h"

namespace tsm_emu {

enum class Checks { kChecked, kProbe, kUnchecked };

template <Checks A, bool Line>
struct access_mode {
  static constexpr Checks checks = A;
  static constexpr bool probe = A == Checks::kProbe;
  static constexpr bool line = Line;
};
using checked_access = access_mode<Checks::kChecked, false>;

// The elements a probe may stand in for with a dummy: scalars and vectors (no pointer in
// them, no array with checks of its own). The translation checks a template's here.
template <class T>
struct probe_element : std::is_arithmetic<T> {};
template <>
struct probe_element<metal::half> : std::true_type {};
template <>
struct probe_element<metal::bfloat> : std::true_type {};
template <class T, int N>
struct probe_element<metal::vec<T, N>> : probe_element<T> {};
template <class T, int N>
struct probe_element<metal::packed_vec<T, N>> : probe_element<T> {};
// P: the kernel's checked pointers and threadgroup arrays' views (or references to them).
template <class... P>
constexpr bool probe_elements = (probe_element<std::remove_cv_t<std::remove_all_extents_t<
                                     typename std::remove_reference_t<P>::element_type>>>::value && ...);

// A pointer as the probe uses it: an access ORs "out of bounds" into `bad` and gives a
// dummy element of its own (a local's member: its stores are dead). A row of a 2-D array
// is a probe of the row, as ptr<U[M]> gives ptr<U>.
template <class T>
class probe_ptr {
 public:
  probe_ptr(T* p, const char* begin, const char* end, unsigned* bad) : p_(p), begin_(begin), end_(end), bad_(bad) {}
  TSM_ACCESS_INLINE decltype(auto) operator[](ptrdiff_t i) const {
    if constexpr (std::is_array<T>::value) {
      return probe_ptr<std::remove_extent_t<T>>(&p_[i][0], begin_, end_, bad_);
    } else {
      // (Flags, not branches, and an unsigned OR: the probe's loop vectorises too.)
      const char* a = reinterpret_cast<const char*>(p_ + i);
      *bad_ |= unsigned(a < begin_) | unsigned(a + sizeof(T) > end_);
      return (dummy_);
    }
  }
  TSM_ACCESS_INLINE decltype(auto) operator*() const { return (*this)[0]; }

 private:
  T* p_;
  const char* begin_;
  const char* end_;
  unsigned* bad_;
  mutable std::remove_cv_t<T> dummy_{};
};

// A pointer whose every access the probe found in bounds.
template <class T>
class unchecked_ptr {
 public:
  explicit unchecked_ptr(T* p) : p_(p) {}
  TSM_ACCESS_INLINE decltype(auto) operator[](ptrdiff_t i) const {
    if constexpr (std::is_array<T>::value) {
      return unchecked_ptr<std::remove_extent_t<T>>(&p_[i][0]);
    } else {
      return (p_[i]);
    }
  }
  TSM_ACCESS_INLINE decltype(auto) operator*() const { return (*this)[0]; }

 private:
  T* p_;
};

// A kernel's pointer parameter or threadgroup array (a checked pointer, P) as the mode `M`
// accesses it; checked, the pointer itself.
template <class M, class P>
TSM_ACCESS_INLINE auto access_view(M, const P& pointer, unsigned& bad) {
  using T = typename P::element_type;
  if constexpr (M::checks == Checks::kProbe) {
    return probe_ptr<T>(pointer.get(), pointer.begin_, pointer.end_, &bad);
  } else if constexpr (M::checks == Checks::kUnchecked) {
    return unchecked_ptr<T>(pointer.get());
  } else {
    (void)bad;
    return pointer;
  }
}

}  // namespace tsm_emu
