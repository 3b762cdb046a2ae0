"""The reduction kernel of seed 002 (../shared/seeds/002_6f4c44d714fd4094.txt) on the emulator.

The seed's corrected kernel loads one element per thread into threadgroup memory, halves
the active threads per stage with a barrier after each, and adds each threadgroup's total
to the output with one atomic. Its comment says the load needs a guard ("We must ensure
gid does not exceed input count"): the grid is rounded up to whole threadgroups, so every
threadgroup is full (a power of two: the halving loop needs that) and the threads past the
end load 0.

The seed's original kernel read `input[gid + lsize]`, which is past the end of the input
for the last `lsize` threads of the grid: an out-of-bounds read the emulator's sanitizer
(a later issue) must report; the test for it is below, skipped until then.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch

from torch_sparse_metal.emulator import KernelFault, compile_shader

SOURCE = r"""
#include <metal_stdlib>
using namespace metal;

// Seed 002's corrected kernel, with the bounds guard on the load (gid < n).
kernel void reduce(const device int* input [[buffer(0)]],
                   device atomic_int* output [[buffer(1)]],
                   constant uint& n [[buffer(2)]],
                   threadgroup int* ldata [[threadgroup(0)]],
                   uint gid [[thread_position_in_grid]],
                   uint lid [[thread_position_in_threadgroup]],
                   uint lsize [[threads_per_threadgroup]])
{
    // 1. Load data into threadgroup memory (threads past the end contribute 0)
    int val = gid < n ? input[gid] : 0;
    ldata[lid] = val;

    // 2. Synchronize to ensure all threads have written to threadgroup memory
    threadgroup_barrier(mem_flags::mem_threadgroup);

    // 3. Perform reduction in threadgroup memory
    for (uint active_threads = lsize / 2; active_threads > 0; active_threads /= 2) {
        if (lid < active_threads) {
            // Read from the upper half of the active threads
            val += ldata[lid + active_threads];
            // Write back to the lower half
            ldata[lid] = val;
        }
        // Barrier is needed after each stage of the reduction
        threadgroup_barrier(mem_flags::mem_threadgroup);
    }

    // 4. Atomically update the global result
    if (lid == 0) {
        atomic_fetch_add_explicit(output, val, memory_order_relaxed);
    }
}
"""

# A reconstruction of the seed's original kernel: each thread first adds the element
# `lsize` further on, which does not exist for the grid's last `lsize` threads.
ORIGINAL_SOURCE = r"""
#include <metal_stdlib>
using namespace metal;

kernel void reduce_original(const device int* input [[buffer(0)]],
                            device atomic_int* output [[buffer(1)]],
                            threadgroup int* ldata [[threadgroup(0)]],
                            uint gid [[thread_position_in_grid]],
                            uint lid [[thread_position_in_threadgroup]],
                            uint lsize [[threads_per_threadgroup]])
{
    int val = input[gid] + input[gid + lsize];
    ldata[lid] = val;
    threadgroup_barrier(mem_flags::mem_threadgroup);
    for (uint s = lsize / 2; s > 0; s >>= 1) {
        if (lid < s) {
            val += ldata[lid + s];
            ldata[lid] = val;
        }
        threadgroup_barrier(mem_flags::mem_threadgroup);
    }
    if (lid == 0) {
        atomic_fetch_add_explicit(output, val, memory_order_relaxed);
    }
}
"""


@pytest.fixture(scope="module")
def lib():
    return compile_shader(SOURCE)


def run_reduce(lib, x, group, padded=True):
    n = len(x)
    threads = -(-n // group) * group if padded else n
    out = torch.zeros(1, dtype=torch.int32)
    lib.reduce(torch.from_numpy(x), out, n, threads=threads, group_size=group,
               threadgroup_memory=[group * 4])
    return out.item()


@pytest.mark.parametrize("group", [64, 256, 1024])
@pytest.mark.parametrize("n", [1, 64, 256, 1000, 1024, 4097, 20000])
def test_corrected_reduction_matches_numpy(lib, n, group):
    x = np.random.default_rng(n).integers(-1000, 1001, size=n).astype(np.int32)
    assert run_reduce(lib, x, group) == int(x.astype(np.int64).sum())


def test_corrected_reduction_of_all_ones_counts_elements(lib):
    x = np.ones(3000, dtype=np.int32)
    assert run_reduce(lib, x, 256) == 3000


@pytest.mark.parametrize("n,group", [(1000, 256), (300, 64)])
def test_unpadded_grid_loses_elements_of_the_smaller_edge_threadgroup(lib, n, group):
    """Why the grid must be padded: with threads=n the last threadgroup has n % group
    threads (1000 % 256 = 232, 300 % 64 = 44), not a power of two, and halving it skips
    elements (232 -> 116 -> 58 -> 29 -> 14 leaves element 28 out)."""
    x = np.ones(n, dtype=np.int32)
    got = run_reduce(lib, x, group, padded=False)
    assert got < n


def test_seed002_original_kernel_reads_input_out_of_bounds():
    """Unsanitized, the read past the end is silent; the sanitizer reports it."""
    lib = compile_shader(ORIGINAL_SOURCE, sanitize=True)
    n, group = 1024, 256
    x = torch.ones(n, dtype=torch.int32)
    out = torch.zeros(1, dtype=torch.int32)
    with pytest.raises(KernelFault) as info:
        lib.reduce_original(x, out, threads=n, group_size=group, threadgroup_memory=[group * 4])
    assert info.value.kind == "out_of_bounds"
    assert "input" in str(info.value) or "buffer(0)" in str(info.value)
