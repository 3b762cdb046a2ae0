// Test kernels for the emulator's AArch64 run (driver.cpp, test_aarch64_qemu.py). double
// and __builtin_trap are emulator-only; the rest is plain MSL.
#include <metal_stdlib>
#include "canary.h"
using namespace metal;

// Fibers switching at threadgroup barriers: a tree reduction over each threadgroup.
kernel void tree_sum(device const float* x [[buffer(0)]], device float* sums [[buffer(1)]],
                     uint gid [[thread_position_in_grid]], uint lid [[thread_index_in_threadgroup]],
                     uint group [[threadgroup_position_in_grid]], uint n [[threads_per_threadgroup]]) {
  threadgroup float partial[1024];
  partial[lid] = x[gid];
  for (uint stride = n / 2; stride > 0; stride /= 2) {
    threadgroup_barrier(mem_flags::mem_threadgroup);
    if (lid < stride) partial[lid] += partial[lid + stride];
  }
  if (lid == 0) sums[group] = partial[0];
}

// SIMD-group collectives, 8 results per thread; the last two check reconvergence: lanes
// inside a branch meet at its collective, and all lanes again after it.
kernel void simd_collectives(device const int* x [[buffer(0)]], device int* out [[buffer(1)]],
                             uint gid [[thread_position_in_grid]], uint lane [[thread_index_in_simdgroup]]) {
  const int v = x[gid];
  device int* o = out + 8 * gid;
  o[0] = simd_sum(v);
  o[1] = simd_shuffle(v, (lane + 1) % 32);
  o[2] = simd_shuffle_xor(v, 5u);
  o[3] = simd_shuffle_down(v, 3u);
  o[4] = simd_prefix_exclusive_sum(v);
  o[5] = int(uint(ulong(simd_ballot((v & 1) != 0))));
  int inside = -1;
  if (lane < 12) inside = simd_sum(1);
  o[6] = inside;
  o[7] = simd_sum(1);
}

// Device atomics racing across worker threads: int, float, and a float added through a
// compare-and-swap loop on its bits.
kernel void atomics(device atomic_int* count [[buffer(0)]], device atomic_float* total [[buffer(1)]],
                    device atomic_uint* cas_total [[buffer(2)]], device const float* x [[buffer(3)]],
                    uint gid [[thread_position_in_grid]]) {
  atomic_fetch_add_explicit(count, 1, memory_order_relaxed);
  atomic_fetch_add_explicit(total, x[gid], memory_order_relaxed);
  uint expected = atomic_load_explicit(cas_total, memory_order_relaxed);
  while (!atomic_compare_exchange_weak_explicit(cas_total, &expected,
                                                as_type<uint>(as_type<float>(expected) + x[gid]),
                                                memory_order_relaxed, memory_order_relaxed)) {
  }
}

// A helper that synchronises: a kernel that calls it runs as fibers, each thread on its own stack.
void on_a_fiber() { simdgroup_barrier(mem_flags::mem_none); }

// Values in callee-saved registers across many fiber switches (see canary.h). Its doubles
// make it emulator-only: Metal has no double.
#ifdef __METAL_EMULATOR__
kernel void canary(device uint* u [[buffer(0)]], device float* f [[buffer(1)]], device double* d [[buffer(2)]],
                   uint gid [[thread_position_in_grid]]) {
  CANARY_INIT(gid);
  for (uint step = 0; step < CANARY_STEPS; ++step) {
    threadgroup_barrier(mem_flags::mem_none);
    CANARY_STEP(step);
    on_a_fiber();
  }
  CANARY_STORE(u, f, d, gid);
}
#endif

// Arithmetic that differs between hosts unless the emulator's flags pin it: a * b + c is not
// fused, `char` is signed, `half` rounds after every operation.
kernel void host_independent_arithmetic(device const float* x [[buffer(0)]], device const char* c [[buffer(1)]],
                                        device const half* h [[buffer(2)]], device float* out [[buffer(3)]]) {
  out[0] = x[0] * x[1] + x[2];
  out[1] = float(int(c[0]));
  out[2] = float(h[0] * h[1] + h[2]);
}

// Faults, each in one thread: the dispatch reports a crash and the process lives on.
kernel void wild_write(device float* x [[buffer(0)]], uint i [[thread_position_in_grid]]) {
  x[i + (i == 77 ? 400000000u : 0u)] = 1.0f;
}
kernel void read_through_null(device int* x [[buffer(0)]], device int* device const* pointers [[buffer(1)]],
                              uint i [[thread_position_in_grid]]) {
  x[i] = i == 3 ? *pointers[0] : 0;
}
kernel void overflow_fiber_stack(device int* x [[buffer(0)]], uint i [[thread_position_in_grid]]) {
  volatile int big[1 << 20];  // 4 MB on a fiber stack of 256 KB
  big[i] = 1;
  x[i] = big[i];
  on_a_fiber();
}
kernel void trap(device int* x [[buffer(0)]], uint i [[thread_position_in_grid]]) {
  if (i == 9) __builtin_trap();  // brk on AArch64: SIGTRAP (ud2 on x86-64: SIGILL)
  x[i] = 1;
}
kernel void fill(device int* x [[buffer(0)]], uint i [[thread_position_in_grid]]) {
  x[i] = int(i);
}
