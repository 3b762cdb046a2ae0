// Shared by every shader in this directory. Compiled by Metal and by the emulator.
#pragma once

#include <metal_stdlib>

// A kernel's signature is written once, as a template; each dtype gets an explicit
// instantiation registered under a host name built the way the Python side builds it
// (torch_sparse_metal/_kernel_names.py: "<base>_<dtype>").
#define TSM_INSTANTIATE_KERNEL(host_name_string, func, ...)                     \
  template [[host_name(host_name_string)]] [[kernel]] decltype(func<__VA_ARGS__>) \
      func<__VA_ARGS__>;

// One library per dtype. The Metal launcher compiles each shader once per dtype it is asked
// for, with TSM_LIBRARY_DTYPE naming that dtype (torch_sparse_metal/_metal_backend.py), so
// a construct Apple's compiler rejects in one dtype's kernels (bfloat's, say) costs that
// dtype only: the others' libraries do not contain them. Without it (the emulator, a
// whole-file compile) every dtype is instantiated. Wrap each instantiation in its dtype's
// macro. bfloat also needs MSL 3.1 (macOS 14).
#define TSM_DTYPE_FLOAT 1
#define TSM_DTYPE_HALF 2
#define TSM_DTYPE_BFLOAT 3
#define TSM_DTYPE_DOUBLE 4  // the emulator's only (TSM_EMULATOR_ONLY)

// Metal has no double. The emulator defines __METAL_EMULATOR__ and gets double
// instantiations so torch.autograd.gradcheck can run in float64 through the kernels.
#if defined(__METAL_EMULATOR__) && \
    (!defined(TSM_LIBRARY_DTYPE) || TSM_LIBRARY_DTYPE == TSM_DTYPE_DOUBLE)
#define TSM_EMULATOR_ONLY(...) __VA_ARGS__
#else
#define TSM_EMULATOR_ONLY(...)
#endif

#if !defined(TSM_LIBRARY_DTYPE) || TSM_LIBRARY_DTYPE == TSM_DTYPE_FLOAT
#define TSM_FOR_FLOAT(...) __VA_ARGS__
#else
#define TSM_FOR_FLOAT(...)
#endif
#if !defined(TSM_LIBRARY_DTYPE) || TSM_LIBRARY_DTYPE == TSM_DTYPE_HALF
#define TSM_FOR_HALF(...) __VA_ARGS__
#else
#define TSM_FOR_HALF(...)
#endif
#if (!defined(TSM_LIBRARY_DTYPE) || TSM_LIBRARY_DTYPE == TSM_DTYPE_BFLOAT) && \
    (defined(__METAL_EMULATOR__) || __METAL_VERSION__ >= 310)
#define TSM_FOR_BFLOAT(...) __VA_ARGS__
#else
#define TSM_FOR_BFLOAT(...)
#endif

// `func` for every dtype, as "<base>_<dtype>", each under its dtype's macro: float, half and
// bfloat (MSL 3.1+) on Metal, and double on the emulator only.
#define TSM_INSTANTIATE_ALL_DTYPES(base, func)                                  \
  TSM_FOR_FLOAT(TSM_INSTANTIATE_KERNEL(base "_float", func, float))             \
  TSM_FOR_HALF(TSM_INSTANTIATE_KERNEL(base "_half", func, half))                \
  TSM_FOR_BFLOAT(TSM_INSTANTIATE_KERNEL(base "_bfloat", func, bfloat))          \
  TSM_EMULATOR_ONLY(TSM_INSTANTIATE_KERNEL(base "_double", func, double))

// The type sums are carried in: float for float, half and bfloat (2-byte types hold 8 and
// 11 bits of mantissa, too few for a sum of hundreds of terms), double for the emulator's
// double. A kernel reads T, sums in tsm_acc<T>::type and rounds once when it stores.
template <typename T>
struct tsm_acc {
  using type = float;
};
TSM_EMULATOR_ONLY(template <> struct tsm_acc<double> { using type = double; };)

// Bits of the per-device error word (torch_sparse_metal/checks.py: BAD_LABEL, ...). A kernel
// that meets data the host could not check without reading it back (a label out of range,
// an index array written behind torch's back) writes NaN where the result would depend on
// it and ORs its bit in; checks.check_errors() reads the word where the host syncs anyway.
enum TsmError : uint {
  TSM_ERROR_BAD_LABEL = 1,
  TSM_ERROR_BAD_PATTERN_INDEX = 2,
};

inline void tsm_flag_error(device metal::atomic_uint* errors, uint bit) {
  metal::atomic_fetch_or_explicit(errors, bit, metal::memory_order_relaxed);
}

// Whether [begin, end) is a valid range of a compressed row (or column) of nnz entries: the
// sparse kernels check the index arrays they follow, written behind torch's back or not.
inline bool tsm_edge_range_ok(int begin, int end, uint nnz) {
  return begin >= 0 && begin <= end && uint(end) <= nnz;
}
