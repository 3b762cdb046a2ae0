// The C interface of every kernel library (defined in runtime.cpp): what Python calls
// through ctypes (torch_sparse_metal/metal/_library.py mirrors tsm_launch) and what a C++
// program linking a library calls directly.
#pragma once

#include <cstdint>

struct tsm_launch {
  void* buffers[31];
  uint64_t buffer_bytes[31];
  int32_t num_buffers;
  uint32_t grid[3];
  uint32_t group[3];
  uint64_t threadgroup_bytes[31];
  int32_t num_threadgroup;
  int32_t num_workers;
  int32_t sanitize;
  const char* buffer_names[31];
  const char* threadgroup_names[31];
  // Out, sanitized dispatches: device bytes read, written, threadgroup accesses, bank
  // conflicts, barriers, FMAs, atomics, device instructions, transactions and minimum
  // transactions, atomic instructions and conflicts, memory instructions, active lanes
  // (see Counters in sanitizer.h).
  uint64_t counters[14];
  int32_t interruptible;  // called from Python's main thread: Ctrl-C stops the dispatch
  double time_limit_s;    // > 0: stop the dispatch after this long, as a "hang" fault
  uint32_t segment_bytes; // sanitized dispatches: a device transaction's bytes (0: 128)
  // Sanitized dispatches: pair the accesses into SIMD-group instructions for the counters
  // that count per instruction (0: those stay 0, and a sanitized tiled matmul takes about
  // half the time: the accesses are logged inline, not by a call each).
  int32_t count_instructions;
  // Called from Python's main thread: Python's C API, with which the calling thread (which
  // then runs no kernel code) runs Python's pending signal handlers every few milliseconds
  // while the dispatch runs. A handler that raised stops the dispatch, and its exception is
  // left in `raised` (PyErr_Fetch's type, value, traceback: references the caller owns).
  // Null functions: the caller runs kernel code too.
  struct {
    int (*gil_ensure)(void);                       // PyGILState_Ensure
    void (*gil_release)(int);                      // PyGILState_Release
    int (*check_signals)(void);                    // PyErr_CheckSignals
    void (*fetch_error)(void**, void**, void**);   // PyErr_Fetch
  } python;
  void* raised[3];
  // [[texture(n)]] and [[sampler(n)]] arguments (tsm_emu::TextureDesc, SamplerDesc; null
  // where none is bound): Metal's argument tables hold 128 textures and 16 samplers.
  const void* textures[128];
  const void* samplers[16];
};

#define TSM_EMU_EXPORT __attribute__((visibility("default")))

extern "C" {
TSM_EMU_EXPORT int tsm_num_kernels();
TSM_EMU_EXPORT const char* tsm_kernel_name(int i);
TSM_EMU_EXPORT int tsm_kernel_num_params(int i);
TSM_EMU_EXPORT void tsm_kernel_param(int k, int i, int32_t* out);
// Runs kernel k. Returns 0, or writes "kind\tmessage" into `error` and returns 1.
TSM_EMU_EXPORT int tsm_dispatch(int k, tsm_launch* l, char* error, int error_len);
}
