"""Device transactions, atomic serialisation and active lanes, per SIMD-group instruction
(the k-th access of each lane at one place in the code between two stops), on kernels
whose counts follow by hand. Floats are 4 bytes, a SIMD-group 32 lanes, a segment 128
bytes unless a test says otherwise."""
import warnings

import pytest
import torch

from torch_sparse_metal.emulator import (coalescing_efficiency, compile_shader, instrumented,
                                      lane_efficiency, record)

SOURCE = r"""
#include <metal_stdlib>
using namespace metal;

kernel void copy(device const float* x [[buffer(0)]], device float* y [[buffer(1)]],
                 uint gid [[thread_position_in_grid]]) {
  y[gid] = x[gid];
}
kernel void strided(device const float* x [[buffer(0)]], device float* y [[buffer(1)]],
                    constant uint& stride [[buffer(2)]], uint gid [[thread_position_in_grid]]) {
  y[gid] = x[gid * stride];
}
kernel void broadcast(device const float* x [[buffer(0)]], device float* y [[buffer(1)]],
                      uint gid [[thread_position_in_grid]]) {
  y[gid] = x[0];
}
kernel void gather(device const float* x [[buffer(0)]], device const int* index [[buffer(1)]],
                   device float* y [[buffer(2)]], uint gid [[thread_position_in_grid]]) {
  y[gid] = x[index[gid]];
}
// 48-byte elements, every other one, lanes in reverse order: each lane's load straddles a
// segment boundary or not, and the lanes' ranges come in descending address order.
struct Wide { float4 a; float4 b; float c; };
kernel void wide_reversed(device const Wide* x [[buffer(0)]], device float* y [[buffer(1)]],
                          uint gid [[thread_position_in_grid]]) {
  const Wide w = x[2 * (31 - gid)];
  y[gid] = w.c;
}
kernel void vector_copy(device const float4* x [[buffer(0)]], device float4* y [[buffer(1)]],
                        uint gid [[thread_position_in_grid]]) {
  y[gid] = x[gid];
}
// Even lanes load, odd lanes store a constant: three instructions on 16 lanes each.
kernel void divergent(device const float* x [[buffer(0)]], device float* y [[buffer(1)]],
                      uint gid [[thread_position_in_grid]]) {
  if (gid % 2 == 0) {
    y[gid] = x[gid];
  } else {
    y[gid] = 2.0f;
  }
}
// Lane l loads (l % 4) + 1 times: the k-th load of the loop runs on the lanes still in it.
kernel void uneven_loop(device const float* x [[buffer(0)]], device float* y [[buffer(1)]],
                        uint gid [[thread_position_in_grid]]) {
  float s = 0.0f;
  for (uint k = 0; k < gid % 4 + 1; ++k) {
    s += x[k * 32 + gid % 32];
  }
  y[gid] = s;
}
kernel void atomic_one(device atomic_uint* n [[buffer(0)]], uint gid [[thread_position_in_grid]]) {
  atomic_fetch_add_explicit(n, 1u, memory_order_relaxed);
}
kernel void atomic_distinct(device atomic_uint* n [[buffer(0)]], uint gid [[thread_position_in_grid]]) {
  atomic_fetch_add_explicit(&n[gid], 1u, memory_order_relaxed);
}
// Lanes in pairs on one address: each instruction serialises two lanes.
kernel void atomic_pairs(device atomic_uint* n [[buffer(0)]], uint gid [[thread_position_in_grid]]) {
  atomic_fetch_add_explicit(&n[gid / 2], 1u, memory_order_relaxed);
}
kernel void atomic_threadgroup(device uint* out [[buffer(0)]], uint lid [[thread_position_in_threadgroup]]) {
  threadgroup atomic_uint count[1];
  if (lid == 0) {
    atomic_store_explicit(&count[0], 0u, memory_order_relaxed);
  }
  threadgroup_barrier(mem_flags::mem_threadgroup);
  atomic_fetch_add_explicit(&count[0], 1u, memory_order_relaxed);
  threadgroup_barrier(mem_flags::mem_threadgroup);
  if (lid == 0) {
    out[0] = atomic_load_explicit(&count[0], memory_order_relaxed);
  }
}
// The same copy with a barrier between load and store (barrier regions) and with a
// SIMD-group function there (fibers): the counts must not depend on the execution mode.
kernel void copy_barrier(device const float* x [[buffer(0)]], device float* y [[buffer(1)]],
                         uint gid [[thread_position_in_grid]]) {
  const float v = x[gid * 2];
  threadgroup_barrier(mem_flags::mem_device);
  y[gid] = v;
}
kernel void copy_simd(device const float* x [[buffer(0)]], device float* y [[buffer(1)]],
                      uint gid [[thread_position_in_grid]]) {
  const float v = x[gid * 2];
  y[gid] = v + 0.0f * simd_sum(v);
}
// A helper called twice (not declared inline, so g++ at -O1 would keep it out of line and
// serve both calls from one place): Metal inlines each call, so its load is one
// instruction per call, and lanes with nothing to load in the first are inactive for it.
void load_first(device const float* x, uint n, uint lane, thread float& s) {
  if (lane < n) {
    s += x[lane];
  }
}
kernel void helper_twice(device const float* x [[buffer(0)]], device const float* z [[buffer(1)]],
                         device float* y [[buffer(2)]], uint gid [[thread_position_in_grid]]) {
  float s = 0.0f;
  load_first(x, 8, gid, s);
  load_first(z, 32, gid, s);
  y[gid] = s;
}
"""


@pytest.fixture(scope="module")
def lib():
    with warnings.catch_warnings():  # a kernel falling back from barrier regions fails the module
        warnings.simplefilter("error")
        return compile_shader(SOURCE, sanitize=True)


def counted(lib, kernel, *args, threads, group_size=None):
    with record() as launches:
        getattr(lib, kernel)(*args, threads=threads, group_size=group_size or threads)
    return launches[0].counters


def test_coalesced_copy(lib):
    # 64 threads = 2 SIMD-groups; each loads and stores 128 contiguous aligned bytes.
    c = counted(lib, "copy", torch.randn(64), torch.full((64,), -1.0), threads=64)
    assert c["device_instructions"] == 4
    assert c["device_transactions"] == c["device_min_transactions"] == 4
    assert coalescing_efficiency(c) == 1.0
    assert c["memory_instructions"] == 4 and c["active_lanes"] == 128
    assert lane_efficiency(c) == 1.0


@pytest.mark.parametrize("stride, load_transactions", [
    (1, 1),    # 128 contiguous bytes
    (2, 2),    # 256 bytes of which every other word is used
    (8, 8),
    (32, 32),  # every lane in its own segment
    (64, 32),
])
def test_strided_loads(lib, stride, load_transactions):
    x = torch.randn(32 * stride)
    c = counted(lib, "strided", x, torch.full((32,), -1.0), stride, threads=32)
    assert c["device_instructions"] == 2
    assert c["device_transactions"] == load_transactions + 1  # + the coalesced store
    assert c["device_min_transactions"] == 2
    assert coalescing_efficiency(c) == pytest.approx(2 / (load_transactions + 1))


def test_broadcast_is_one_transaction(lib):
    c = counted(lib, "broadcast", torch.randn(4), torch.full((32,), -1.0), threads=32)
    assert c["device_transactions"] == c["device_min_transactions"] == 2


def test_gather(lib):
    # Lane l reads x[32 * perm[l]]: 32 segments; the index load and the store are coalesced.
    perm = torch.randperm(32, generator=torch.Generator().manual_seed(0))
    index = (perm * 32).int()
    c = counted(lib, "gather", torch.randn(32 * 32), index, torch.full((32,), -1.0), threads=32)
    assert c["device_instructions"] == 3
    assert c["device_transactions"] == 1 + 32 + 1
    assert c["device_min_transactions"] == 3
    # All lanes on one segment (indices 0..31 in any order) is one transaction.
    c = counted(lib, "gather", torch.randn(32), perm.int(), torch.full((32,), -1.0), threads=32)
    assert c["device_transactions"] == 3


def test_vector_loads(lib):
    # float4: 32 lanes x 16 bytes = 512 bytes = 4 segments per instruction, the minimum.
    c = counted(lib, "vector_copy", torch.randn(32, 4), torch.full((32, 4), -1.0), threads=32)
    assert c["device_instructions"] == 2
    assert c["device_transactions"] == c["device_min_transactions"] == 8


def test_elements_across_segments_in_reverse_order(lib):
    # Lane l loads bytes [96k, 96k + 48) with k = 31 - l. In 64-byte segments an even k
    # touches segment 3k/2 only, an odd k the two after: 16 + 2 * 16 distinct segments, for
    # 32 * 48 bytes, whose minimum is 24.
    x = torch.randn(64, 12)
    y = torch.full((32,), -1.0)
    with instrumented(segment_bytes=64), record() as launches:
        lib.wide_reversed(x, y, threads=32, group_size=32)
    c = launches[0].counters
    assert torch.equal(y, x[0::2, 8].flip(0))
    assert c["device_instructions"] == 2
    assert c["device_transactions"] == 48 + 2  # + the coalesced store: 128 bytes
    assert c["device_min_transactions"] == 24 + 2
    assert c["device_bytes_read"] == 32 * 48 and c["device_bytes_written"] == 32 * 4


def test_segment_size_is_a_parameter(lib):
    x, y = torch.randn(32 * 4), torch.full((32,), -1.0)
    with instrumented(segment_bytes=32), record() as launches:
        lib.strided(x, y, 4, threads=32, group_size=32)
    c = launches[0].counters
    # Loads: 32 lanes 16 bytes apart, a 32-byte segment per 2 lanes; the store: 4 segments.
    assert c["device_transactions"] == 16 + 4
    assert c["device_min_transactions"] == 4 + 4


@pytest.mark.parametrize("segment_bytes", [0, 3, 100, 8192, True, 128.0])
def test_segment_size_must_be_a_power_of_two(segment_bytes):
    with pytest.raises(ValueError, match="segment_bytes"):
        with instrumented(segment_bytes=segment_bytes):
            pass


def test_partial_simdgroup(lib):
    # 40 threads: a full SIMD-group and one of 8 lanes (32 contiguous bytes, one segment).
    c = counted(lib, "copy", torch.randn(40), torch.full((40,), -1.0), threads=40)
    assert c["device_instructions"] == 4
    assert c["device_transactions"] == c["device_min_transactions"] == 4
    assert c["active_lanes"] == 2 * (32 + 8)
    assert lane_efficiency(c) == pytest.approx(80 / 128)


def test_divergent_branches(lib):
    c = counted(lib, "divergent", torch.randn(32), torch.full((32,), -1.0), threads=32)
    # The load and the store of the even lanes, the store of the odd lanes.
    assert c["memory_instructions"] == c["device_instructions"] == 3
    assert c["active_lanes"] == 3 * 16
    assert lane_efficiency(c) == 0.5
    # 16 words spread over one segment: one transaction, and one is the minimum.
    assert c["device_transactions"] == c["device_min_transactions"] == 3


def test_loop_of_uneven_trip_counts(lib):
    c = counted(lib, "uneven_loop", torch.randn(4 * 32), torch.full((32,), -1.0), threads=32)
    # Load k runs on the lanes with more than k trips: 32, 24, 16, 8; then the store.
    assert c["device_instructions"] == 5
    assert c["active_lanes"] == 32 + 24 + 16 + 8 + 32
    assert c["device_transactions"] == c["device_min_transactions"] == 5


def test_atomics_on_one_address_serialise(lib):
    n = torch.zeros(1, dtype=torch.int32)
    c = counted(lib, "atomic_one", n, threads=64)
    assert n.item() == 64
    assert c["atomic_instructions"] == 2
    assert c["atomic_conflicts"] == 2 * 31
    assert c["device_transactions"] == 2


def test_atomics_on_distinct_addresses(lib):
    c = counted(lib, "atomic_distinct", torch.zeros(64, dtype=torch.int32), threads=64)
    assert c["atomics"] == 64
    assert c["atomic_instructions"] == 2
    assert c["atomic_conflicts"] == 0
    assert c["device_transactions"] == c["device_min_transactions"] == 2


def test_atomics_in_pairs(lib):
    n = torch.zeros(16, dtype=torch.int32)
    c = counted(lib, "atomic_pairs", n, threads=32)
    assert n.tolist() == [2] * 16
    assert c["atomic_instructions"] == 1 and c["atomic_conflicts"] == 1


def test_threadgroup_atomics(lib):
    out = torch.zeros(1, dtype=torch.int32)
    c = counted(lib, "atomic_threadgroup", out, threads=64)
    assert out.item() == 64
    # The add on every lane of both SIMD-groups: 31 serialised steps each; the store and
    # load of lane 0 one lane each.
    assert c["atomic_conflicts"] == 2 * 31
    assert c["atomic_instructions"] == 2 + 1 + 1


def test_each_call_of_a_helper_is_its_own_instruction(lib):
    x, z = torch.randn(32), torch.randn(32)
    y = torch.full((32,), -1.0)
    c = counted(lib, "helper_twice", x, z, y, threads=32)
    assert torch.equal(y[:8], x[:8] + z[:8]) and torch.equal(y[8:], z[8:])
    # 8 lanes load x[0..7], 32 lanes z[0..31], 32 store: one segment each. Paired across
    # the calls, lanes 8-31's load of z would share an instruction with lanes 0-7's of x.
    assert c["device_instructions"] == 3
    assert c["active_lanes"] == 8 + 32 + 32
    assert c["device_transactions"] == c["device_min_transactions"] == 3


@pytest.mark.parametrize("kernel", ["copy_barrier", "copy_simd"])
def test_counts_do_not_depend_on_the_execution_mode(lib, kernel):
    x = torch.randn(128)
    c = counted(lib, kernel, x, torch.full((64,), -1.0), threads=64, group_size=32)
    # Per SIMD-group: a load of every other word of 256 bytes (2 segments, 128 bytes
    # used: minimum 1) and a coalesced store.
    assert c["device_instructions"] == 4
    assert c["device_transactions"] == 2 * (2 + 1)
    assert c["device_min_transactions"] == 2 * (1 + 1)
    assert c["active_lanes"] == 4 * 32
