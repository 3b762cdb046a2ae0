"""Uninitialized threadgroup reads and spin-waits, as the sanitizer must report them.

* which threadgroup bytes have been written is shadow state, not a byte pattern in memory:
  any value a kernel stores (a float16 0xA5A5, a uchar 0xA5, the value already there)
  initializes memory;
* a read of bytes no thread of the threadgroup has written is uninitialized_read, reported
  when the barrier interval ends; if another thread writes them in the same interval (before
  or after the read) it is a threadgroup_race instead: the missing barrier is the cause;
* ``+=`` on never-written memory reads it first: uninitialized_read;
* a thread that only re-accesses a few elements millions of times without stopping (a spin
  on one flag, on two, around a ring) is a hang, reported promptly and in bounded memory.
"""
from __future__ import annotations

import os

import numpy as np
import pytest
import torch

import torch_sparse_metal as tsm
from torch_sparse_metal.emulator import KernelFault, compile_shader

from _hang_guard import call_with_timeout
from _sanitizer_support import HEADER, thread

SOURCE = HEADER + r"""
// Each thread stores its input element in threadgroup memory; after a barrier it reads its
// mirror's. Two threadgroups: the second stores over what the first left there.
kernel void roundtrip_half(device const half* x [[buffer(0)]], device half* y [[buffer(1)]],
                           uint gid [[thread_position_in_grid]],
                           uint lid [[thread_position_in_threadgroup]]) {
  threadgroup half t[64];
  t[lid] = x[gid];
  threadgroup_barrier(mem_flags::mem_threadgroup);
  y[gid] = t[63 - lid];
}

kernel void roundtrip_uchar(device const uchar* x [[buffer(0)]], device uchar* y [[buffer(1)]],
                            threadgroup uchar* t [[threadgroup(0)]],
                            uint gid [[thread_position_in_grid]],
                            uint lid [[thread_position_in_threadgroup]]) {
  t[lid] = x[gid];
  threadgroup_barrier(mem_flags::mem_threadgroup);
  y[gid] = t[63 - lid];
}

// C = A B for 32 x 32 half matrices, through 16 x 16 threadgroup tiles.
kernel void tiled_matmul_half(device const half* a [[buffer(0)]], device const half* b [[buffer(1)]],
                              device float* c [[buffer(2)]],
                              uint2 gid [[thread_position_in_grid]],
                              uint2 lid [[thread_position_in_threadgroup]]) {
  threadgroup half as[16][16];
  threadgroup half bs[16][16];
  float acc = 0.0f;
  for (uint k0 = 0; k0 < 32; k0 += 16) {
    as[lid.y][lid.x] = a[gid.y * 32 + k0 + lid.x];
    bs[lid.y][lid.x] = b[(k0 + lid.y) * 32 + gid.x];
    threadgroup_barrier(mem_flags::mem_threadgroup);
    for (uint k = 0; k < 16; ++k) {
      acc += float(as[lid.y][k]) * float(bs[k][lid.x]);
    }
    threadgroup_barrier(mem_flags::mem_threadgroup);
  }
  c[gid.y * 32 + gid.x] = acc;
}

// Only the even threads store; every thread then reads its odd or even neighbour's slot.
kernel void read_unwritten(device float* y [[buffer(0)]],
                           uint lid [[thread_position_in_threadgroup]]) {
  threadgroup float t[64];
  if (lid % 2 == 0) {
    t[lid] = float(lid);
  }
  threadgroup_barrier(mem_flags::mem_threadgroup);
  y[lid] = t[lid ^ 1u];
}

// Thread `writer` stores t[0] and thread `reader` reads it, with no barrier between them.
kernel void write_read_unordered(device float* y [[buffer(0)]],
                                 constant uint& writer [[buffer(1)]],
                                 constant uint& reader [[buffer(2)]],
                                 uint lid [[thread_position_in_threadgroup]]) {
  threadgroup float t[1];
  if (lid == writer) {
    t[0] = 1.0f;
  }
  if (lid == reader) {
    y[0] = t[0];
  }
  threadgroup_barrier(mem_flags::mem_threadgroup);
}

// The same in a kernel without any barrier (its threads run one after another, no fibers).
kernel void write_read_unordered_no_barrier(device float* y [[buffer(0)]],
                                            constant uint& writer [[buffer(1)]],
                                            constant uint& reader [[buffer(2)]],
                                            uint lid [[thread_position_in_threadgroup]]) {
  threadgroup float t[1];
  if (lid == writer) {
    t[0] = 1.0f;
  }
  if (lid == reader) {
    y[0] = t[0];
  }
}

// Lane 0 reads t[1] before anyone wrote it; lane 1 writes it after a simdgroup_barrier that
// orders the two: the read really read uninitialized memory.
kernel void read_before_ordered_write(device float* y [[buffer(0)]],
                                      uint lid [[thread_position_in_threadgroup]]) {
  threadgroup float t[32];
  if (lid == 0) {
    y[0] = t[1];
  }
  simdgroup_barrier(mem_flags::mem_threadgroup);
  t[lid] = float(lid);
  threadgroup_barrier(mem_flags::mem_threadgroup);
  y[1 + lid] = t[31 - lid];
}

// Thread 0 sums x into sum[0]; with zero_first it stores 0 first (0 may be what is there).
kernel void accumulate(device const float* x [[buffer(0)]], device float* y [[buffer(1)]],
                       constant uint& zero_first [[buffer(2)]],
                       uint lid [[thread_position_in_threadgroup]]) {
  threadgroup float sum[1];
  if (lid == 0) {
    if (zero_first != 0u) {
      sum[0] = 0.0f;
    }
    for (uint k = 0; k < 32; ++k) {
      sum[0] += x[k];
    }
  }
  threadgroup_barrier(mem_flags::mem_threadgroup);
  y[lid] = sum[0];
}

// ---- spin-waits: thread 0 waits for a flag thread 1 sets (it never runs meanwhile) --------
kernel void spin_two_flags(device atomic_uint* flag [[buffer(0)]],
                           uint lid [[thread_position_in_threadgroup]]) {
  if (lid == 0) {
    while (atomic_load_explicit(&flag[0], memory_order_relaxed) == 0u &&
           atomic_load_explicit(&flag[1], memory_order_relaxed) == 0u) {
    }
  } else {
    atomic_store_explicit(&flag[1], 1u, memory_order_relaxed);
  }
}

kernel void spin_ring(device const uint* ring [[buffer(0)]], device uint* out [[buffer(1)]],
                      uint lid [[thread_position_in_threadgroup]]) {
  if (lid == 0) {
    uint i = 0;
    while (ring[i] == 0u) {
      i = (i + 1u) % 8u;
    }
    out[0] = i;
  } else {
    out[1] = 1u;
  }
}

// Thread 3 polls `words` threadgroup words that threads 0 to 2 read first: from the third
// reader on, a read of them adds nothing to their shadow (the sanitizer logs it apart).
kernel void spin_on_words_read_by_others(device uint* out [[buffer(0)]],
                                         constant uint& words [[buffer(1)]],
                                         uint lid [[thread_position_in_threadgroup]]) {
  threadgroup uint ring[8];
  if (lid == 0) {
    for (uint i = 0; i < 8u; ++i) ring[i] = 0u;
  }
  threadgroup_barrier(mem_flags::mem_threadgroup);
  if (lid == 3) {
    uint i = 0;
    while (ring[i] == 0u) {
      i = (i + 1u) % words;
    }
    out[0] = i;
  } else {
    uint sum = 0;
    for (uint i = 0; i < 8u; ++i) sum += ring[i];
    out[1 + lid] = sum;
  }
}

// Thread 2 stores into t[0] `n` times after reading it (threads 0 and 1 read it first, so
// its read adds nothing to the shadow): a race, reported when it stops.
kernel void stores_after_read_by_others(device float* out [[buffer(0)]],
                                        constant uint& n [[buffer(1)]],
                                        uint lid [[thread_position_in_threadgroup]]) {
  threadgroup float t[1];
  if (lid == 0) t[0] = 5.0f;
  threadgroup_barrier(mem_flags::mem_threadgroup);
  const float v = t[0];
  if (lid == 2) {
    for (uint i = 0; i < n; ++i) t[0] = v;
  }
  out[lid] = v;
}

struct Slot {
  uint value;
  atomic_uint ready;
};

// Polls slot[0].ready and a threadgroup flag, both through plain addresses (&x).
kernel void spin_field_and_threadgroup_flag(device Slot* slot [[buffer(0)]],
                                            uint lid [[thread_position_in_threadgroup]]) {
  threadgroup atomic_uint go;
  if (lid == 0) {
    atomic_store_explicit(&go, 0u, memory_order_relaxed);
    while (atomic_load_explicit(&slot[0].ready, memory_order_relaxed) == 0u &&
           atomic_load_explicit(&go, memory_order_relaxed) == 0u) {
    }
  } else {
    atomic_store_explicit(&slot[0].ready, 1u, memory_order_relaxed);
  }
}
"""


@pytest.fixture(scope="module")
def lib():
    return compile_shader(SOURCE, sanitize=True)


def fault_of(kernel, *args, **launch) -> KernelFault:
    with pytest.raises(KernelFault) as info:
        call_with_timeout(kernel, *args, **launch)
    return info.value


# ---- initialization is shadow state: any stored value counts --------------------------------
A5A5 = -23131  # the int16 of the float16 bits 0xA5A5 (-0.02204895)


@pytest.mark.parametrize("bits", [A5A5, 0, -1], ids=["0xA5A5", "0x0000", "0xFFFF"])
def test_any_stored_half_initializes_threadgroup_memory(lib, bits):
    x = torch.full((128,), bits, dtype=torch.int16).view(torch.float16)
    x[::3] = torch.arange(0, 128, 3, dtype=torch.float16)  # and some other values between
    y = torch.zeros(128, dtype=torch.float16)
    call_with_timeout(lib.roundtrip_half, x, y, threads=128, group_size=64)
    want = x.view(2, 64).flip(1).reshape(-1)
    assert torch.equal(y.view(torch.int16), want.view(torch.int16))


@pytest.mark.parametrize("byte", [0xA5, 0x00, 0xFF])
def test_any_stored_byte_initializes_threadgroup_memory(lib, byte):
    """The second threadgroup stores exactly the bytes the first left there."""
    x = torch.full((128,), byte, dtype=torch.uint8)
    y = torch.zeros(128, dtype=torch.uint8)
    call_with_timeout(lib.roundtrip_uchar, x, y, threads=128, group_size=64,
                      threadgroup_memory=[64])
    assert torch.equal(y, x)


def test_a5a5_halves_through_a_tiled_kernel(lib):
    g = torch.Generator().manual_seed(0)
    a, b = torch.randn(32, 32, generator=g).half(), torch.randn(32, 32, generator=g).half()
    a.view(torch.int16)[::5, ::3] = A5A5
    b.view(torch.int16)[1::4, ::2] = A5A5
    c = torch.zeros(32, 32)
    call_with_timeout(lib.tiled_matmul_half, a, b, c, threads=(32, 32), group_size=(16, 16))
    torch.testing.assert_close(c, a.float() @ b.float(), rtol=1e-5, atol=1e-4)


def test_mm_of_float16_randn_512_is_clean():
    """A correct tsm.mm on 512 x 512 float16 randn (which holds 0xA5A5 halves) was reported
    as uninitialized_read when the sanitizer detected writes by a poison byte pattern."""
    g = torch.Generator().manual_seed(0)
    a, b = torch.randn(512, 512, generator=g).half(), torch.randn(512, 512, generator=g).half()
    assert (a.view(torch.int16) == A5A5).any() and (b.view(torch.int16) == A5A5).any()
    with tsm.use_backend("emulator"), tsm.emulator.instrumented():
        c = tsm.mm(a, b)
    torch.testing.assert_close(c.float(), a.float() @ b.float(), rtol=2e-3, atol=5e-2)


# ---- uninitialized reads, and races in their place ----------------------------------------
def test_a_read_of_memory_no_thread_wrote_is_uninitialized(lib):
    fault = fault_of(lib.read_unwritten, torch.zeros(64), threads=64, group_size=64)
    assert fault.kind == "uninitialized_read", str(fault)
    assert (f"{thread(0, 0, 0)} reads threadgroup variable `t` element 1 (byte offset 4) before "
            "any thread of its threadgroup wrote it") in str(fault)


@pytest.mark.parametrize("kernel", ["write_read_unordered", "write_read_unordered_no_barrier"])
@pytest.mark.parametrize("writer,reader", [(0, 1), (1, 0)], ids=["write-first", "read-first"])
def test_a_read_another_thread_writes_unordered_is_a_race(lib, kernel, writer, reader):
    fault = fault_of(lib[kernel], torch.zeros(1), writer, reader, threads=32, group_size=32)
    assert fault.kind == "threadgroup_race", str(fault)
    message = str(fault)
    assert "threadgroup variable `t` element 0" in message
    wrote = f"{thread(writer, writer, 0)} wrote it"
    read = f"{thread(reader, reader, 0)} read it (or stored the value already there)"
    assert (f"{wrote} and {read}" if writer == 0 else f"{read} and {wrote}") in message


def test_a_read_before_an_ordered_write_is_uninitialized(lib):
    fault = fault_of(lib.read_before_ordered_write, torch.zeros(33), threads=32, group_size=32)
    assert fault.kind == "uninitialized_read", str(fault)
    assert f"{thread(0, 0, 0)} reads threadgroup variable `t` element 1 " in str(fault)


def test_accumulating_into_never_written_memory_is_uninitialized(lib):
    fault = fault_of(lib.accumulate, torch.ones(32), torch.zeros(32), 0, threads=32, group_size=32)
    assert fault.kind == "uninitialized_read", str(fault)
    assert f"{thread(0, 0, 0)} reads threadgroup variable `sum` element 0 " in str(fault)


def test_accumulating_after_storing_zero_is_clean(lib):
    y = torch.zeros(32)
    call_with_timeout(lib.accumulate, torch.ones(32), y, 1, threads=32, group_size=32)
    np.testing.assert_array_equal(y.numpy(), 32.0)


# ---- spin-waits ---------------------------------------------------------------------------
def _peak_rss_since_reset():
    """Reset this process's peak RSS (Linux: /proc/self/clear_refs) and return a function
    giving the peak since, in bytes; None where that is not available."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        return None

    def peak() -> int:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
        raise AssertionError("no VmHWM in /proc/self/status")
    return peak


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def test_stores_short_of_the_spin_limit_are_not_a_hang(lib):
    # 3M stores, each one access towards the limit of 4,194,304 repeats (each once counted
    # twice after a read that added nothing: a hang after 2.1M).
    fault = fault_of(lib.stores_after_read_by_others, torch.zeros(4), 3_000_000, threads=4, group_size=4)
    assert fault.kind == "threadgroup_race", str(fault)
    assert f"{thread(0, 0, 0)} read it (or stored the value already there) and {thread(2, 2, 0)} wrote it" \
        in str(fault)


@pytest.mark.parametrize("case", ["two_flags", "ring", "field_and_threadgroup_flag", "word_read_by_others",
                                  "ring_read_by_others"])
def test_a_spin_over_several_addresses_is_a_hang_in_bounded_memory(lib, case):
    spinner = 3 if case.endswith("read_by_others") else 0
    launch = {
        "word_read_by_others": lambda: lib.spin_on_words_read_by_others(
            torch.zeros(4, dtype=torch.int32), 1, threads=4, group_size=4),
        "ring_read_by_others": lambda: lib.spin_on_words_read_by_others(
            torch.zeros(4, dtype=torch.int32), 8, threads=4, group_size=4),
        "two_flags": lambda: lib.spin_two_flags(torch.zeros(2, dtype=torch.int32), threads=2, group_size=2),
        "ring": lambda: lib.spin_ring(torch.zeros(8, dtype=torch.int32), torch.zeros(2, dtype=torch.int32),
                                      threads=2, group_size=2),
        "field_and_threadgroup_flag": lambda: lib.spin_field_and_threadgroup_flag(
            torch.zeros(2, dtype=torch.int32), threads=2, group_size=2),
    }[case]
    peak = _peak_rss_since_reset()
    before = _rss() if peak else 0
    with pytest.raises(KernelFault) as info:
        call_with_timeout(launch)
    assert info.value.kind == "hang", str(info.value)
    message = str(info.value)
    assert f"{thread(spinner, spinner, 0)} made 4194304 accesses in a row" in message
    assert "forward progress" in message
    if peak:  # the access log stays small (it used to grow past a gigabyte)
        assert peak() - before < 64 << 20
