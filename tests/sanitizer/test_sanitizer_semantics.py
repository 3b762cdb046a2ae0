"""The sanitizer's rules, one at a time, on small kernels (csrc/emulator/src/sanitizer.h).

* reads never race, however many threads and threadgroups read;
* two accesses of different threads, one writing, are ordered only by a barrier whose
  memory flags cover that memory: threadgroup memory by mem_threadgroup, device memory by
  mem_device and only within a threadgroup (threads of different threadgroups are never
  ordered within a dispatch); mem_none orders nothing;
* a simdgroup_barrier orders the lanes of one SIMD-group, never two SIMD-groups;
* two atomic accesses never race; an atomic and a plain write of the same bytes do;
* a store is a write even when it stores the value already there;
* an access is to the bytes it touches: a field of a struct element, but a whole vector;
* threads that return before a barrier the others reach are barrier_divergence, unless
  TSM_EMU_EXITED_THREADS_ARRIVE=1 (read once per loaded library, hence a source of its own);
* bounds are element-precise in both directions, for device buffers (whatever the element
  type), [[threadgroup(n)]] blocks and threadgroup arrays; a tensor view's bounds are its
  own numel, not its storage's.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch

from torch_sparse_metal.emulator import KernelFault, LaunchError, compile_shader

from _hang_guard import call_with_timeout
from _sanitizer_support import HEADER, thread

SOURCE = HEADER + r"""
// A threadgroup_barrier whose memory flags are chosen at run time (uniformly: every thread
// of the group takes the same branch, so every thread reaches the same barrier).
// flags: 0 mem_none, 1 mem_device, 2 mem_threadgroup, 3 both.
static void barrier_with(uint flags) {
  if (flags == 0) {
    threadgroup_barrier(mem_flags::mem_none);
  } else if (flags == 1) {
    threadgroup_barrier(mem_flags::mem_device);
  } else if (flags == 2) {
    threadgroup_barrier(mem_flags::mem_threadgroup);
  } else {
    threadgroup_barrier(mem_flags::mem_device | mem_flags::mem_threadgroup);
  }
}

static void simd_barrier_with(uint flags) {
  if (flags == 0) {
    simdgroup_barrier(mem_flags::mem_none);
  } else if (flags == 1) {
    simdgroup_barrier(mem_flags::mem_device);
  } else {
    simdgroup_barrier(mem_flags::mem_threadgroup);
  }
}

// ---- reads ------------------------------------------------------------------------------
// Every thread of every group reads x[0], c[0] and the threadgroup value thread 0 stored.
kernel void many_readers(device const float* x [[buffer(0)]],
                         constant float* c [[buffer(1)]],
                         device float* y [[buffer(2)]],
                         uint gid [[thread_position_in_grid]],
                         uint lid [[thread_position_in_threadgroup]]) {
  threadgroup float s[1];
  if (lid == 0) {
    s[0] = x[1];
  }
  threadgroup_barrier(mem_flags::mem_threadgroup);
  float acc = 0.0f;
  for (uint k = 0; k < 4; ++k) {
    acc += x[0] + c[0] + s[0];
  }
  y[gid] = acc;
}

// ---- two writers in different barrier epochs ---------------------------------------------
// Thread 0 writes, a barrier with the given flags, thread 1 writes the same element.
kernel void tg_two_writers(device float* out [[buffer(0)]],
                           constant uint& flags [[buffer(1)]],
                           uint lid [[thread_position_in_threadgroup]]) {
  threadgroup float s[4];
  if (lid == 0) {
    s[0] = 1.0f;
  }
  barrier_with(flags);
  if (lid == 1) {
    s[0] = 2.0f;
  }
  threadgroup_barrier(mem_flags::mem_threadgroup);
  out[lid] = s[0];
}

kernel void dev_two_writers(device float* buf [[buffer(0)]],
                            constant uint& flags [[buffer(1)]],
                            uint lid [[thread_position_in_threadgroup]],
                            uint tg [[threadgroup_position_in_grid]]) {
  if (lid == 0) {
    buf[tg] = 1.0f;
  }
  barrier_with(flags);
  if (lid == 1) {
    buf[tg] = 2.0f;
  }
}

// Thread 0 of every threadgroup writes element 0, barriers of every kind around it.
kernel void dev_writers_in_two_groups(device float* buf [[buffer(0)]],
                                      uint lid [[thread_position_in_threadgroup]],
                                      uint tg [[threadgroup_position_in_grid]]) {
  threadgroup_barrier(mem_flags::mem_device | mem_flags::mem_threadgroup);
  if (lid == 0) {
    buf[0] = float(tg) + 1.0f;
  }
  threadgroup_barrier(mem_flags::mem_device | mem_flags::mem_threadgroup);
}

// No barrier anywhere in the kernel (run without fibers): every thread stores its id.
kernel void dev_writers_no_barrier(device float* buf [[buffer(0)]],
                                   uint gid [[thread_position_in_grid]]) {
  buf[0] = float(gid) + 1.0f;
}

// Every thread stores 5.
kernel void dev_same_value(device float* buf [[buffer(0)]],
                           uint gid [[thread_position_in_grid]]) {
  buf[0] = 5.0f;
}

// ---- SIMD-groups --------------------------------------------------------------------------
// Store, simdgroup_barrier with the given flags, read the slot of lane lid ^ partner.
kernel void tg_simd_exchange(device uint* out [[buffer(0)]],
                             constant uint& partner [[buffer(1)]],
                             constant uint& flags [[buffer(2)]],
                             uint lid [[thread_position_in_threadgroup]]) {
  threadgroup uint t[64];
  t[lid] = lid * 3u + 1u;
  simd_barrier_with(flags);
  out[lid] = t[lid ^ partner];
}

// Threads 0 and 1 (SIMD-group 0) and `reader` read t[0]; after a simdgroup_barrier, which
// orders SIMD-group 0's reads before it, thread 0 writes t[0]: a race with `reader` unless it
// too is in SIMD-group 0 (the sanitizer keeps two reads of a word; the third's must not be
// dropped when it is of another SIMD-group).
kernel void tg_three_readers_then_simd_write(device float* out [[buffer(0)]],
                                             constant uint& reader [[buffer(1)]],
                                             uint lid [[thread_position_in_threadgroup]]) {
  threadgroup float t[1];
  if (lid == 0) t[0] = 1.0f;
  threadgroup_barrier(mem_flags::mem_threadgroup);
  if (lid < 2 || lid == reader) out[lid] = t[0];
  simdgroup_barrier(mem_flags::mem_threadgroup);
  if (lid == 0) t[0] = 2.0f;
}

// ---- reads that add nothing to the shadow ---------------------------------------------------
// Every thread reads t[0].v, which thread 0 set. From the third reader on a read of it adds
// nothing to its shadow (the reads of threads 0 and 1 stand: covered_read), and the
// sanitizer keeps only its bytes; thread `writer` then writes it, which must race with
// those reads all the same: `how` 0 stores the value read, right after reading it again (a
// marked store: a write whatever it stores); 1 stores 7 through a method, after another
// access (unmarked: a write because the bytes changed); 2 the same, storing the value read
// (unmarked and the bytes unchanged: a read, as ever).
struct Box {
  float v;
  void set(float x) threadgroup { v = x; }
};

kernel void tg_write_after_covered_read(device float* out [[buffer(0)]],
                                        constant uint& writer [[buffer(1)]],
                                        constant uint& how [[buffer(2)]],
                                        uint lid [[thread_position_in_threadgroup]]) {
  threadgroup Box t[1];
  if (lid == 0) t[0].v = 5.0f;
  threadgroup_barrier(mem_flags::mem_threadgroup);
  const float v = t[0].v;
  if (lid == writer) {
    if (how == 0) {
      t[0].v = v;
    } else {
      out[lid] = v;
      t[0].set(how == 1 ? 7.0f : v);
    }
  }
  out[lid] = v;
}

kernel void dev_simd_exchange(device uint* buf [[buffer(0)]],
                              device uint* out [[buffer(1)]],
                              constant uint& partner [[buffer(2)]],
                              constant uint& flags [[buffer(3)]],
                              uint gid [[thread_position_in_grid]]) {
  buf[gid] = gid * 3u + 1u;
  simd_barrier_with(flags);
  out[gid] = buf[gid ^ partner];
}

// ---- atomics ------------------------------------------------------------------------------
// Every thread of every group updates the same elements atomically: a counter (fetch_add),
// a running maximum (fetch_max), a CAS-loop counter, a float sum through a cast pointer, and
// a threadgroup counter.
kernel void atomics_everywhere(device atomic_uint* counters [[buffer(0)]],  // [add, max, cas]
                               device float* fsum [[buffer(1)]],
                               device uint* per_group [[buffer(2)]],
                               uint gid [[thread_position_in_grid]],
                               uint lid [[thread_position_in_threadgroup]],
                               uint tg [[threadgroup_position_in_grid]]) {
  threadgroup atomic_uint local;
  if (lid == 0) {
    atomic_store_explicit(&local, 0u, memory_order_relaxed);
  }
  threadgroup_barrier(mem_flags::mem_threadgroup);
  atomic_fetch_add_explicit(&counters[0], 1u, memory_order_relaxed);
  atomic_fetch_max_explicit(&counters[1], gid, memory_order_relaxed);
  uint expected = atomic_load_explicit(&counters[2], memory_order_relaxed);
  while (!atomic_compare_exchange_weak_explicit(&counters[2], &expected, expected + 1u,
                                                memory_order_relaxed, memory_order_relaxed)) {
  }
  atomic_fetch_add_explicit((device atomic_float*)fsum, 0.5f, memory_order_relaxed);
  atomic_fetch_add_explicit(&local, 1u, memory_order_relaxed);
  threadgroup_barrier(mem_flags::mem_threadgroup);
  if (lid == 0) {
    per_group[tg] = atomic_load_explicit(&local, memory_order_relaxed);
  }
}

// The same counter updated with a plain read-modify-write: the control.
kernel void plain_counter(device uint* counter [[buffer(0)]],
                          uint gid [[thread_position_in_grid]]) {
  counter[0] += 1u;
}

// Thread 0 (re)initialises the total with a plain store while every other thread adds into
// it atomically, with nothing ordering the store before the adds.
kernel void plain_init_then_atomic_adds(device const float* x [[buffer(0)]],
                                        device float* total [[buffer(1)]],
                                        uint gid [[thread_position_in_grid]]) {
  if (gid == 0) {
    total[0] = 0.0f;
  }
  atomic_fetch_add_explicit((device atomic_float*)total, x[gid], memory_order_relaxed);
}

// ---- aliasing -----------------------------------------------------------------------------
// Reads one buffer, writes another: correct unless both are the same memory.
kernel void smooth_into(device const float* a [[buffer(0)]],
                        device float* out [[buffer(1)]],
                        constant uint& n [[buffer(2)]],
                        uint i [[thread_position_in_grid]]) {
  out[i] = (i > 0 && i + 1 < n) ? (a[i - 1] + a[i] + a[i + 1]) / 3.0f : a[i];
}

// ---- threads that return before a barrier (strict mode; the lenient twin is below) --------
kernel void early_exit(device float* y [[buffer(0)]],
                       uint gid [[thread_position_in_grid]],
                       uint lid [[thread_position_in_threadgroup]]) {
  threadgroup float t[32];
  if (lid >= 16) {
    return;
  }
  t[lid] = float(gid);
  threadgroup_barrier(mem_flags::mem_threadgroup);
  y[gid] = t[15 - lid];
}

// ---- bounds -------------------------------------------------------------------------------
// One thread touches element i of one memory. mode: 0 device write, 1 device read,
// 2 [[threadgroup(0)]] write, 3 [[threadgroup(0)]] read (after filling), 4 threadgroup array
// write, 5 threadgroup array read (after filling). Both threadgroup memories hold 40 floats.
kernel void touch(device float* x [[buffer(0)]],
                  device float* sink [[buffer(1)]],
                  constant int& i [[buffer(2)]],
                  constant uint& mode [[buffer(3)]],
                  threadgroup float* ta [[threadgroup(0)]]) {
  threadgroup float tv[40];
  if (mode == 0) {
    x[i] = 7.0f;
  } else if (mode == 1) {
    sink[0] = x[i];
  } else if (mode == 2) {
    ta[i] = 7.0f;
  } else if (mode == 3) {
    for (int k = 0; k < 40; ++k) ta[k] = float(k);
    sink[0] = ta[i];
  } else if (mode == 4) {
    tv[i] = 7.0f;
  } else {
    for (int k = 0; k < 40; ++k) tv[k] = float(k);
    sink[0] = tv[i];
  }
}

kernel void touch_half(device half* h [[buffer(0)]], constant int& i [[buffer(1)]]) {
  h[i] = 1.0h;
}

kernel void touch_float4(device float4* v [[buffer(0)]], constant int& i [[buffer(1)]]) {
  v[i] = float4(1.0f);
}

kernel void touch_uchar(device uchar* b [[buffer(0)]], constant int& i [[buffer(1)]]) {
  b[i] = 1;
}

// Pointer arithmetic keeps the buffer's bounds: p = x + 39, then p[k].
kernel void through_pointer(device float* x [[buffer(0)]], constant int& k [[buffer(1)]]) {
  device float* p = x + 39;
  p[k] = 1.0f;
}

// x[gid - 1] with an unsigned gid: for gid 0 the index wraps to 2^32 - 1, as on the GPU.
kernel void unsigned_minus_one(device const float* x [[buffer(0)]],
                               device float* y [[buffer(1)]],
                               uint gid [[thread_position_in_grid]]) {
  y[gid] = x[gid - 1];
}

// ---- probes for the bugs below ------------------------------------------------------------
// A threadgroup scalar (not an array) written by thread 0 and read by all, no barrier.
kernel void tg_scalar_no_barrier(device const float* x [[buffer(0)]],
                                 device float* y [[buffer(1)]],
                                 uint gid [[thread_position_in_grid]],
                                 uint lid [[thread_position_in_threadgroup]]) {
  threadgroup float m;
  if (lid == 0) {
    m = x[0];
  }
  y[gid] = x[gid] - m;
  threadgroup_barrier(mem_flags::mem_threadgroup);
}

// The same with a one-element array: the control.
kernel void tg_array1_no_barrier(device const float* x [[buffer(0)]],
                                 device float* y [[buffer(1)]],
                                 uint gid [[thread_position_in_grid]],
                                 uint lid [[thread_position_in_threadgroup]]) {
  threadgroup float m[1];
  if (lid == 0) {
    m[0] = x[0];
  }
  y[gid] = x[gid] - m[0];
  threadgroup_barrier(mem_flags::mem_threadgroup);
}

// A device buffer bound by reference: every thread adds into it, non-atomically.
kernel void dev_reference_sum(device const float* x [[buffer(0)]],
                              device float& total [[buffer(1)]],
                              uint gid [[thread_position_in_grid]]) {
  total += x[gid];
}

// Two-byte elements: threads 0 and 1 store h[0] and h[1] (one 4-byte word), thread 2 reads
// h[0] with no barrier: a race with thread 0.
kernel void tg_half_neighbours(device const half* x [[buffer(0)]],
                               device half* y [[buffer(1)]],
                               uint lid [[thread_position_in_threadgroup]]) {
  threadgroup half t[64];
  if (lid < 2) {
    t[lid] = x[lid];
  }
  if (lid == 2) {
    y[0] = t[0];
  }
  threadgroup_barrier(mem_flags::mem_threadgroup);
}

// The same with one writer: the control.
kernel void tg_half_one_writer(device const half* x [[buffer(0)]],
                               device half* y [[buffer(1)]],
                               uint lid [[thread_position_in_threadgroup]]) {
  threadgroup half t[64];
  if (lid == 0) {
    t[0] = x[0];
  }
  if (lid == 2) {
    y[0] = t[0];
  }
  threadgroup_barrier(mem_flags::mem_threadgroup);
}

// Different threads write different components of one float4 / fields of one struct:
// different bytes, no race.
kernel void tg_vector_components(device const float* x [[buffer(0)]],
                                 device float* y [[buffer(1)]],
                                 uint gid [[thread_position_in_grid]],
                                 uint lid [[thread_position_in_threadgroup]]) {
  threadgroup float4 t[16];
  t[lid / 4][lid % 4] = x[gid];
  threadgroup_barrier(mem_flags::mem_threadgroup);
  y[gid] = t[(63 - lid) / 4][(63 - lid) % 4];
}

struct Pair {
  float a;
  float b;
};

kernel void dev_struct_fields(device Pair* p [[buffer(0)]],
                              uint gid [[thread_position_in_grid]]) {
  if (gid % 2 == 0) {
    p[gid / 2].a = float(gid) + 1.0f;
  } else {
    p[gid / 2].b = float(gid) + 1.0f;
  }
}

// Threads 2k and 2k + 1 both store p[k].a: a race on the field.
kernel void dev_struct_same_field(device Pair* p [[buffer(0)]],
                                  uint gid [[thread_position_in_grid]]) {
  device Pair* q = p + gid / 2;
  q->a = float(gid) + 1.0f;
}

// Thread 2k stores p[k].a; thread 2k + 1 reads p[k].a (a race) or p[k].b (none).
kernel void dev_struct_read_field(device Pair* p [[buffer(0)]],
                                  device float* out [[buffer(1)]],
                                  constant uint& other_field [[buffer(2)]],
                                  uint gid [[thread_position_in_grid]]) {
  if (gid % 2 == 0) {
    p[gid / 2].a = float(gid) + 1.0f;
  } else {
    out[gid / 2] = other_field != 0u ? p[gid / 2].b : p[gid / 2].a;
  }
}

struct Halves {
  half lo;
  half hi;
};

// Threads 2k and 2k + 1 store the two fields of t[k] and h[k] (two halves in one word), or
// with `same` the first field both; threads 0 and 1 the fields of a threadgroup struct.
kernel void tg_struct_fields(device float* y [[buffer(0)]],
                             constant uint& same [[buffer(1)]],
                             uint lid [[thread_position_in_threadgroup]]) {
  threadgroup Pair t[32];
  threadgroup Halves h[32];
  threadgroup Pair s;
  const uint k = lid / 2;
  if (lid % 2 == 0 || same != 0u) {
    t[k].a = float(lid) + 1.0f;
    h[k].lo = half(lid);
  } else {
    t[k].b = float(lid) + 1.0f;
    h[k].hi = half(lid);
  }
  if (lid == 0) {
    s.a = 100.0f;
  } else if (lid == 1) {
    s.b = 200.0f;
  }
  threadgroup_barrier(mem_flags::mem_threadgroup);
  y[lid] = (lid % 2 == 0 ? t[k].a + float(h[k].lo) : t[k].b + float(h[k].hi)) + s.a + s.b;
}

// A simdgroup_barrier taken by lane 0 only: the other lanes skip it.
kernel void simd_barrier_in_branch(device float* y [[buffer(0)]],
                                   uint lid [[thread_position_in_threadgroup]],
                                   uint lane [[thread_index_in_simdgroup]]) {
  threadgroup float t[32];
  t[lid] = float(lid) + 1.0f;
  if (lane == 0) {
    t[0] = 100.0f;
    simdgroup_barrier(mem_flags::mem_threadgroup);
  }
  y[lid] = simd_sum(t[lid]) + t[0];
}

// One barrier helper, called from both sides of a divergent branch: two call sites.
static void sync_threadgroup() {
  threadgroup_barrier(mem_flags::mem_threadgroup);
}

kernel void helper_barrier_in_if_else(device float* y [[buffer(0)]],
                                      uint lid [[thread_position_in_threadgroup]]) {
  threadgroup float t[64];
  t[lid] = float(lid);
  if (lid < 16) {
    sync_threadgroup();
    y[lid] = t[63 - lid];
  } else {
    sync_threadgroup();
    y[lid] = 2.0f * t[63 - lid];
  }
}

// Thread 0 reads t[5] before the middle barrier; after it threads 1 and 2 read t[5], then
// (after a SIMD-group stop) thread 2 writes it: a race between thread 1's read and thread
// 2's write.
kernel void read_then_write_after_stop(device float* y [[buffer(0)]],
                                       device const float* x [[buffer(1)]],
                                       constant uint& first_reader [[buffer(2)]],
                                       uint lid [[thread_position_in_threadgroup]]) {
  threadgroup float t[64];
  t[lid] = x[lid];
  threadgroup_barrier(mem_flags::mem_threadgroup);
  float v = 0.0f;
  if (first_reader != 0u && lid == 0) {
    v = t[5];
  }
  threadgroup_barrier(mem_flags::mem_threadgroup);
  if (lid == 1 || lid == 2) {
    v += t[5];
  }
  simdgroup_barrier(mem_flags::mem_none);
  if (lid == 2) {
    t[5] = v + 1.0f;
  }
  y[lid] = v;
  threadgroup_barrier(mem_flags::mem_threadgroup);
}
"""

# The lenient mode is read once per loaded library: this source is loaded only with
# TSM_EMU_EXITED_THREADS_ARRIVE=1 set.
LENIENT_SOURCE = HEADER + r"""
// lenient twin (TSM_EMU_EXITED_THREADS_ARRIVE=1)
kernel void early_exit(device float* y [[buffer(0)]],
                       uint gid [[thread_position_in_grid]],
                       uint lid [[thread_position_in_threadgroup]]) {
  threadgroup float t[32];
  if (lid >= 16) {
    return;
  }
  t[lid] = float(gid);
  threadgroup_barrier(mem_flags::mem_threadgroup);
  y[gid] = t[15 - lid];
}

// Exited threads count as arrived; the rest still must not race: no barrier here.
kernel void early_exit_racy(device float* y [[buffer(0)]],
                            uint gid [[thread_position_in_grid]],
                            uint lid [[thread_position_in_threadgroup]]) {
  threadgroup float t[32];
  if (lid >= 16) {
    return;
  }
  t[lid] = float(gid) + 1.0f;
  y[gid] = lid > 0 ? t[lid - 1] : 0.0f;  // thread 1 reads what thread 0 wrote, unordered
  threadgroup_barrier(mem_flags::mem_threadgroup);
}

// Live threads at two different barriers: divergence in any mode.
kernel void barrier_if_else(device float* y [[buffer(0)]],
                            uint lid [[thread_position_in_threadgroup]]) {
  if (lid < 16) {
    threadgroup_barrier(mem_flags::mem_threadgroup);
  } else {
    threadgroup_barrier(mem_flags::mem_threadgroup);
  }
  y[lid] = 1.0f;
}
"""

FLAG_NAMES = {0: "mem_none", 1: "mem_device", 2: "mem_threadgroup", 3: "mem_device|mem_threadgroup"}


@pytest.fixture(scope="module")
def lib():
    return compile_shader(SOURCE, sanitize=True)


def run(kernel, *args, **launch):
    call_with_timeout(kernel, *args, **launch)


def fault_of(kernel, *args, **launch) -> KernelFault:
    with pytest.raises(KernelFault) as info:
        call_with_timeout(kernel, *args, **launch)
    return info.value


# ---- reads never race ---------------------------------------------------------------------
def test_reads_by_every_thread_of_every_group_never_race(lib):
    x = torch.tensor([1.5, 2.0, 3.0])
    c = torch.tensor([0.25])
    y = torch.zeros(512)
    run(lib.many_readers, x, c, y, threads=512, group_size=128)
    np.testing.assert_array_equal(y.numpy(), 4 * (1.5 + 0.25 + 2.0))


# ---- barrier epochs and memory flags ------------------------------------------------------
@pytest.mark.parametrize("flags", [2, 3], ids=lambda f: FLAG_NAMES[f])
def test_threadgroup_writes_in_different_epochs_do_not_race(lib, flags):
    out = torch.zeros(64)
    run(lib.tg_two_writers, out, flags, threads=64, group_size=64)
    np.testing.assert_array_equal(out.numpy(), 2.0)


@pytest.mark.parametrize("flags", [0, 1], ids=lambda f: FLAG_NAMES[f])
def test_barrier_without_mem_threadgroup_does_not_order_threadgroup_memory(lib, flags):
    fault = fault_of(lib.tg_two_writers, torch.zeros(64), flags, threads=64, group_size=64)
    assert fault.kind == "threadgroup_race", str(fault)
    message = str(fault)
    assert "threadgroup variable `s` element 0" in message
    assert f"{thread(0, 0, 0)} wrote it and {thread(1, 1, 0)} wrote it" in message


@pytest.mark.parametrize("flags", [1, 3], ids=lambda f: FLAG_NAMES[f])
def test_device_writes_in_one_group_ordered_by_mem_device_barrier(lib, flags):
    buf = torch.zeros(3)
    run(lib.dev_two_writers, buf, flags, threads=3 * 32, group_size=32)
    np.testing.assert_array_equal(buf.numpy(), 2.0)


@pytest.mark.parametrize("flags", [0, 2], ids=lambda f: FLAG_NAMES[f])
def test_barrier_without_mem_device_does_not_order_device_memory(lib, flags):
    fault = fault_of(lib.dev_two_writers, torch.zeros(3), flags, threads=3 * 32, group_size=32)
    assert fault.kind == "device_race", str(fault)
    message = str(fault)
    assert "[[buffer(0)]] `buf` element 0" in message
    assert f"{thread(0, 0, 0)} wrote it and {thread(1, 1, 0)} wrote it" in message
    assert "threadgroup_barrier(mem_flags::mem_device)" in message


def test_threads_of_different_threadgroups_are_never_ordered(lib):
    fault = fault_of(lib.dev_writers_in_two_groups, torch.zeros(1), threads=64, group_size=32)
    assert fault.kind == "device_race", str(fault)
    message = str(fault)
    assert f"{thread(0, 0, 0)} wrote it and {thread(32, 0, 1)} wrote it" in message
    assert "threads of different threadgroups are never ordered" in message


def test_one_threadgroup_alone_with_the_same_barriers_is_clean(lib):
    buf = torch.zeros(1)
    run(lib.dev_writers_in_two_groups, buf, threads=32, group_size=32)
    assert buf.item() == 1.0


def test_races_are_found_in_kernels_without_any_barrier(lib):
    # No barrier: the emulator runs the threads one after another, without fibers.
    fault = fault_of(lib.dev_writers_no_barrier, torch.zeros(1), threads=64, group_size=64)
    assert fault.kind == "device_race", str(fault)
    assert f"{thread(0, 0, 0)} wrote it and {thread(1, 1, 0)}" in str(fault)


@pytest.mark.parametrize("before", [5.0, 0.0], ids=["same-value", "other-value"])
def test_stores_of_one_value_race_whatever_was_there(lib, before):
    # Every store is a write, also one that leaves the bytes as they were (5.0 over 5.0).
    fault = fault_of(lib.dev_same_value, torch.full((1,), before), threads=64, group_size=64)
    assert fault.kind == "device_race", str(fault)
    assert f"{thread(0, 0, 0)} wrote it and {thread(1, 1, 0)} wrote it" in str(fault)


# ---- reads that add nothing to the shadow ---------------------------------------------------
@pytest.mark.parametrize("writer", [1, 2, 40])  # 2 and 40: after two reads
@pytest.mark.parametrize("how", [0, 1], ids=["marked-store", "changed-bytes"])
def test_a_write_after_a_read_that_added_nothing_races(lib, writer, how):
    fault = fault_of(lib.tg_write_after_covered_read, torch.zeros(64), writer, how,
                     threads=64, group_size=64)
    assert fault.kind == "threadgroup_race", str(fault)
    assert "threadgroup variable `t` element 0" in str(fault)
    assert f"{thread(0, 0, 0)} read it (or stored the value already there) and " \
           f"{thread(writer, writer, 0)} wrote it" in str(fault)


def test_an_unmarked_store_of_the_value_there_after_such_a_read_is_a_read(lib):
    out = torch.zeros(64)
    run(lib.tg_write_after_covered_read, out, 40, 2, threads=64, group_size=64)
    np.testing.assert_array_equal(out.numpy(), 5.0)


# ---- simdgroup_barrier --------------------------------------------------------------------
def test_simdgroup_barrier_orders_lanes_of_one_simdgroup(lib):
    out = torch.zeros(64, dtype=torch.int32)
    run(lib.tg_simd_exchange, out, 1, 2, threads=64, group_size=64)
    np.testing.assert_array_equal(out.numpy(), (np.arange(64) ^ 1) * 3 + 1)


def test_simdgroup_barrier_does_not_order_different_simdgroups(lib):
    fault = fault_of(lib.tg_simd_exchange, torch.zeros(64, dtype=torch.int32), 32, 2,
                     threads=64, group_size=64)
    assert fault.kind == "threadgroup_race", str(fault)
    # Lane 0 of SIMD-group 0 reads t[32], which lane 0 of SIMD-group 1 wrote.
    assert "threadgroup variable `t` element 32" in str(fault)
    assert f"{thread(32, 32, 0)} wrote it and {thread(0, 0, 0)} read it" in str(fault)


@pytest.mark.parametrize("reader", [2, 31, 32, 63])
def test_a_third_read_of_another_simdgroup_is_remembered(lib, reader):
    out = torch.zeros(64)
    if reader < 32:  # all three ordered before the write by the simdgroup_barrier
        run(lib.tg_three_readers_then_simd_write, out, reader, threads=64, group_size=64)
        assert out[reader].item() == 1.0
        return
    fault = fault_of(lib.tg_three_readers_then_simd_write, out, reader, threads=64, group_size=64)
    assert fault.kind == "threadgroup_race", str(fault)
    assert "threadgroup variable `t` element 0" in str(fault)
    assert f"{thread(reader, reader, 0)} read it (or stored the value already there) and " \
           f"{thread(0, 0, 0)} wrote it" in str(fault)


@pytest.mark.parametrize("flags", [0, 1], ids=lambda f: FLAG_NAMES[f])
def test_simdgroup_barrier_without_mem_threadgroup_orders_nothing_there(lib, flags):
    fault = fault_of(lib.tg_simd_exchange, torch.zeros(64, dtype=torch.int32), 1, flags,
                     threads=64, group_size=64)
    assert fault.kind == "threadgroup_race", str(fault)
    assert f"{thread(1, 1, 0)} wrote it and {thread(0, 0, 0)} read it" in str(fault)


def test_simdgroup_barrier_with_mem_device_orders_device_memory_in_a_simdgroup(lib):
    buf, out = torch.zeros(128, dtype=torch.int32), torch.zeros(128, dtype=torch.int32)
    run(lib.dev_simd_exchange, buf, out, 1, 1, threads=128, group_size=64)
    np.testing.assert_array_equal(out.numpy(), (np.arange(128) ^ 1) * 3 + 1)


def test_simdgroup_barrier_does_not_order_device_memory_across_simdgroups(lib):
    buf, out = torch.zeros(128, dtype=torch.int32), torch.zeros(128, dtype=torch.int32)
    fault = fault_of(lib.dev_simd_exchange, buf, out, 32, 1, threads=128, group_size=64)
    assert fault.kind == "device_race", str(fault)
    assert f"{thread(32, 32, 0)} wrote it and {thread(0, 0, 0)} read it" in str(fault)


# ---- atomics ------------------------------------------------------------------------------
def test_atomics_on_one_element_from_many_threadgroups_never_race(lib):
    n, group = 512, 64
    counters = torch.zeros(3, dtype=torch.int32)
    fsum = torch.zeros(1)
    per_group = torch.zeros(n // group, dtype=torch.int32)
    run(lib.atomics_everywhere, counters, fsum, per_group, threads=n, group_size=group)
    np.testing.assert_array_equal(counters.numpy(), [n, n - 1, n])
    assert fsum.item() == 0.5 * n
    np.testing.assert_array_equal(per_group.numpy(), group)


def test_the_same_counter_without_atomics_is_a_device_race(lib):
    fault = fault_of(lib.plain_counter, torch.zeros(1, dtype=torch.int32), threads=128,
                     group_size=64)
    assert fault.kind == "device_race", str(fault)


def test_a_plain_store_racing_atomic_adds_is_a_device_race(lib):
    fault = fault_of(lib.plain_init_then_atomic_adds, torch.ones(128), torch.full((1,), 7.0),
                     threads=128, group_size=64)
    assert fault.kind == "device_race"


# ---- aliasing -----------------------------------------------------------------------------
def test_two_buffers_of_one_tensor_are_one_memory(lib):
    a = torch.randn(256)
    out = torch.zeros(256)
    run(lib.smooth_into, a, out, 256, threads=256, group_size=64)  # distinct: clean
    fault = fault_of(lib.smooth_into, a, a, 256, threads=256, group_size=64)  # in place again
    assert fault.kind == "device_race", str(fault)
    message = str(fault)
    # Thread 0 stores a[0] (its own value: still a write), which thread 1 reads.
    assert "element 0 " in message
    assert f"{thread(0, 0, 0)} wrote it and {thread(1, 1, 0)} read it" in message


# ---- threads that return before a barrier -------------------------------------------------
def test_threads_returning_before_a_barrier_are_divergence_by_default(lib, monkeypatch):
    monkeypatch.delenv("TSM_EMU_EXITED_THREADS_ARRIVE", raising=False)
    fault = fault_of(lib.early_exit, torch.zeros(64), threads=64, group_size=32)
    assert fault.kind == "barrier_divergence", str(fault)
    message = str(fault)
    assert f"{thread(16, 16, 0)} returned before the threadgroup_barrier" in message
    assert f"that {thread(0, 0, 0)} waits at" in message
    assert "TSM_EMU_EXITED_THREADS_ARRIVE=1" in message


@pytest.fixture
def lenient(monkeypatch):
    monkeypatch.setenv("TSM_EMU_EXITED_THREADS_ARRIVE", "1")
    return compile_shader(LENIENT_SOURCE, sanitize=True)


def test_lenient_mode_counts_exited_threads_as_arrived(lenient):
    y = torch.full((64,), -1.0)
    run(lenient.early_exit, y, threads=64, group_size=32)
    gid = np.arange(64)
    lid = gid % 32
    want = np.where(lid < 16, (gid - lid) + 15 - lid, -1.0)
    np.testing.assert_array_equal(y.numpy(), want)


def test_lenient_mode_still_reports_races(lenient):
    fault = fault_of(lenient.early_exit_racy, torch.zeros(32), threads=32, group_size=32)
    assert fault.kind == "threadgroup_race", str(fault)
    assert f"{thread(0, 0, 0)} wrote it and {thread(1, 1, 0)} read it" in str(fault)


def test_lenient_mode_still_reports_live_threads_at_different_barriers(lenient):
    fault = fault_of(lenient.barrier_if_else, torch.zeros(32), threads=32, group_size=32)
    assert fault.kind == "barrier_divergence", str(fault)
    assert "different threadgroup_barrier calls" in str(fault)


# ---- bounds: element-precise, both directions, every memory -------------------------------
MEMORIES = {  # mode -> (what the report calls it, needs threadgroup memory)
    0: "[[buffer(0)]] `x`",
    1: "[[buffer(0)]] `x`",
    2: "[[threadgroup(0)]]",
    3: "[[threadgroup(0)]]",
    4: "threadgroup variable `tv`",
    5: "threadgroup variable `tv`",
}
MODE_IDS = {0: "device-write", 1: "device-read", 2: "tg-arg-write", 3: "tg-arg-read",
            4: "tg-array-write", 5: "tg-array-read"}


def touch(lib, mode, i, x=None):
    x = torch.zeros(40) if x is None else x
    sink = torch.zeros(1)
    run(lib.touch, x, sink, i, mode, threads=1, group_size=1, threadgroup_memory=[160])
    return x, sink


@pytest.mark.parametrize("mode", sorted(MEMORIES), ids=MODE_IDS.get)
def test_the_last_element_is_in_bounds(lib, mode):
    x, sink = touch(lib, mode, 39)
    if mode == 0:
        assert x[39].item() == 7.0
    if mode in (3, 5):
        assert sink.item() == 39.0


@pytest.mark.parametrize("index", [40, -1], ids=["n", "minus-1"])
@pytest.mark.parametrize("mode", sorted(MEMORIES), ids=MODE_IDS.get)
def test_one_past_either_end_is_out_of_bounds(lib, mode, index):
    with pytest.raises(KernelFault) as info:
        touch(lib, mode, index)
    fault = info.value
    assert fault.kind == "out_of_bounds", str(fault)
    message = str(fault)
    assert message.startswith("out_of_bounds: kernel touch: ")
    assert f"{thread(0, 0, 0)} accesses {MEMORIES[mode]}" in message
    assert f"at element {index} " in message
    assert "holds 40 elements (160 bytes)" in message


def test_reports_on_a_threadgroup_argument_name_the_parameter(lib):
    with pytest.raises(KernelFault) as info:
        touch(lib, 2, 40)
    assert "[[threadgroup(0)]] `ta`" in str(info.value), str(info.value)


@pytest.mark.parametrize("kernel,dtype,n,itemsize", [
    ("touch_half", torch.float16, 41, 2),     # 82 bytes: not a whole number of words
    ("touch_uchar", torch.uint8, 7, 1),
    ("touch_float4", torch.float32, 40, 16),  # 10 float4
], ids=["half", "uchar", "float4"])
def test_bounds_are_counted_in_the_buffers_own_elements(lib, kernel, dtype, n, itemsize):
    buf = torch.zeros(n, dtype=dtype)
    elements = n * buf.element_size() // itemsize
    run(lib[kernel], buf, elements - 1, threads=1, group_size=1)
    assert buf.view(torch.uint8).any()
    for index in (elements, -1):
        with pytest.raises(KernelFault) as info:
            run(lib[kernel], torch.zeros(n, dtype=dtype), index, threads=1, group_size=1)
        assert info.value.kind == "out_of_bounds"
        assert f"at element {index} " in str(info.value)
        assert f"holds {elements} elements" in str(info.value)


@pytest.mark.parametrize("k,element", [(0, None), (1, 40), (-40, -1)])
def test_pointer_arithmetic_keeps_the_buffers_bounds(lib, k, element):
    if element is None:
        run(lib.through_pointer, torch.zeros(40), k, threads=1, group_size=1)
        return
    with pytest.raises(KernelFault) as info:
        run(lib.through_pointer, torch.zeros(40), k, threads=1, group_size=1)
    assert info.value.kind == "out_of_bounds"
    assert f"[[buffer(0)]] `x` at element {element} " in str(info.value)


def test_unsigned_index_minus_one_is_the_element_the_gpu_would_address(lib):
    with pytest.raises(KernelFault) as info:
        run(lib.unsigned_minus_one, torch.zeros(8), torch.zeros(8), threads=8, group_size=8)
    assert info.value.kind == "out_of_bounds"
    message = str(info.value)
    assert f"{thread(0, 0, 0)} accesses [[buffer(0)]] `x` at element {2**32 - 1} " in message


@pytest.mark.parametrize("make_view", [
    lambda base: base[10:50],                       # a slice: contiguous, offset storage
    lambda base: base.view(10, 10)[2:6],            # rows of a matrix
    lambda base: base[::2][:40].contiguous(),       # strided: .contiguous() copies
    lambda base: base.view(10, 10).t().contiguous()[:4],
], ids=["slice", "rows", "strided-copy", "transposed-copy"])
def test_a_views_bounds_are_its_own_numel(lib, make_view):
    base = torch.zeros(100)
    view = make_view(base).contiguous()
    assert view.numel() == 40
    x, _ = touch(lib, 0, 39, view)  # the view's last element is fine
    assert x.reshape(-1)[39].item() == 7.0
    for index in (40, -1):  # one past either end is caught, though the storage goes on
        with pytest.raises(KernelFault) as info:
            touch(lib, 0, index, view)
        assert info.value.kind == "out_of_bounds"
        assert f"at element {index} " in str(info.value)
        assert "holds 40 elements" in str(info.value)
    assert base.count_nonzero().item() <= 1  # nothing else of the storage was written


def test_a_strided_view_must_be_made_contiguous_first(lib):
    with pytest.raises(LaunchError, match=r"argument .*: tensor must be contiguous "
                                          r"\(Metal buffers have no strides"):
        touch(lib, 0, 0, torch.zeros(100)[::2][:40])


# ---- sanitizer bugs -----------------------------------------------------------------------
def test_race_on_a_threadgroup_scalar_is_reported(lib):
    x, y = torch.randn(64), torch.zeros(64)
    fault = fault_of(lib.tg_scalar_no_barrier, x, y, threads=64, group_size=64)
    assert fault.kind == "threadgroup_race"


def test_race_on_a_one_element_threadgroup_array_is_reported(lib):
    fault = fault_of(lib.tg_array1_no_barrier, torch.randn(64), torch.zeros(64), threads=64,
                     group_size=64)
    assert fault.kind == "threadgroup_race"
    assert "threadgroup variable `m` element 0" in str(fault)


def test_race_through_a_device_reference_parameter_is_reported(lib):
    fault = fault_of(lib.dev_reference_sum, torch.ones(128), torch.zeros(1), threads=128,
                     group_size=64)
    assert fault.kind == "device_race"


def test_race_on_two_byte_elements_sharing_a_word_is_reported(lib):
    x, y = torch.randn(64).half(), torch.zeros(64).half()
    fault = fault_of(lib.tg_half_neighbours, x, y, threads=64, group_size=64)
    assert fault.kind == "threadgroup_race"


def test_race_on_a_two_byte_element_with_one_writer_is_reported(lib):
    x, y = torch.randn(64).half(), torch.zeros(64).half()
    fault = fault_of(lib.tg_half_one_writer, x, y, threads=64, group_size=64)
    assert fault.kind == "threadgroup_race"
    assert f"{thread(0, 0, 0)} wrote it and {thread(2, 2, 0)} read it" in str(fault)


def test_threads_writing_different_components_of_a_float4_race(lib):
    """Metal treats a write of one component as a write of the whole vector (the project's
    notes on Metal semantics), so two threads writing t[i].x and t[i].y race."""
    x, y = torch.randn(64), torch.zeros(64)
    fault = fault_of(lib.tg_vector_components, x, y, threads=64, group_size=64)
    assert fault.kind == "threadgroup_race"


def test_threads_writing_different_fields_of_a_struct_do_not_race(lib):
    p = torch.zeros(64)
    run(lib.dev_struct_fields, p, threads=64, group_size=64)
    np.testing.assert_array_equal(p.numpy(), np.arange(64) + 1.0)


def test_threads_writing_one_field_of_a_struct_race(lib):
    fault = fault_of(lib.dev_struct_same_field, torch.zeros(64), threads=64, group_size=64)
    assert fault.kind == "device_race", str(fault)
    message = str(fault)
    assert "[[buffer(0)]] `p` element 0 (byte offset 0)" in message
    assert f"{thread(0, 0, 0)} wrote it and {thread(1, 1, 0)} wrote it" in message


def test_a_read_of_a_field_another_thread_writes_races(lib):
    fault = fault_of(lib.dev_struct_read_field, torch.zeros(64), torch.zeros(32), 0,
                     threads=64, group_size=64)
    assert fault.kind == "device_race", str(fault)
    message = str(fault)
    assert "[[buffer(0)]] `p` element 0 (byte offset 0)" in message
    assert f"{thread(0, 0, 0)} wrote it and {thread(1, 1, 0)} read it" in message


def test_a_read_of_the_other_field_does_not_race(lib):
    p = torch.arange(64, dtype=torch.float32) * 10
    out = torch.zeros(32)
    run(lib.dev_struct_read_field, p, out, 1, threads=64, group_size=64)
    np.testing.assert_array_equal(out.numpy(), np.arange(32) * 20.0 + 10.0)   # the old .b
    np.testing.assert_array_equal(p.numpy()[0::2], np.arange(0, 64, 2) + 1.0)  # the new .a


def test_threadgroup_struct_fields_written_by_different_threads_do_not_race(lib):
    y = torch.zeros(64)
    run(lib.tg_struct_fields, y, 0, threads=64, group_size=64)
    lid = np.arange(64)
    np.testing.assert_array_equal(y.numpy(), (lid + 1.0) + lid + 300.0)


def test_threadgroup_struct_field_written_by_two_threads_races(lib):
    fault = fault_of(lib.tg_struct_fields, torch.zeros(64), 1, threads=64, group_size=64)
    assert fault.kind == "threadgroup_race", str(fault)
    message = str(fault)
    assert "threadgroup variable `t` element 0 (byte offset 0)" in message
    assert f"{thread(0, 0, 0)} wrote it and {thread(1, 1, 0)} wrote it" in message


def test_simdgroup_barrier_in_a_branch_is_reported(lib):
    fault = fault_of(lib.simd_barrier_in_branch, torch.zeros(32), threads=32, group_size=32)
    assert fault.kind in ("barrier_divergence", "threadgroup_race")


def test_barrier_helper_called_from_both_branches_is_divergence(lib):
    fault = fault_of(lib.helper_barrier_in_if_else, torch.zeros(64), threads=64, group_size=64)
    assert fault.kind == "barrier_divergence"


def test_read_then_write_by_other_threads_after_a_simd_stop_is_a_race(lib):
    x = torch.arange(64, dtype=torch.float32)
    fault = fault_of(lib.read_then_write_after_stop, torch.zeros(64), x, 0, threads=64,
                     group_size=64)
    assert fault.kind == "threadgroup_race"
    assert (f"{thread(1, 1, 0)} read it (or stored the value already there) and "
            f"{thread(2, 2, 0)} wrote it") in str(fault)


def test_the_same_race_is_reported_when_an_older_epoch_read_the_element_first(lib):
    x = torch.arange(64, dtype=torch.float32)
    fault = fault_of(lib.read_then_write_after_stop, torch.zeros(64), x, 1, threads=64,
                     group_size=64)
    assert fault.kind == "threadgroup_race"


LOOP_BARRIER_SOURCE = HEADER + r"""
// Thread 0 reaches the barrier in iteration 1, the others in iteration 0: divergence,
// though it is one barrier call in the source.
kernel void barrier_in_different_iterations(device float* out [[buffer(0)]],
                                            uint lid [[thread_position_in_threadgroup]]) {
  for (uint i = 0; i < 2; ++i) {
    if ((lid == 0) == (i == 0)) continue;
    threadgroup_barrier(mem_flags::mem_none);
  }
  out[lid] = 1.0f;
}
"""


def test_barrier_reached_in_different_iterations_is_divergence():
    lib = compile_shader(LOOP_BARRIER_SOURCE, sanitize=True)
    with pytest.raises(KernelFault) as info:
        call_with_timeout(lib.barrier_in_different_iterations, torch.zeros(4), threads=4,
                          group_size=4)
    assert info.value.kind == "barrier_divergence"
