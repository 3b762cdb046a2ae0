#include <metal_stdlib>
using namespace metal;

// Seed 002's corrected reduction: one element per thread, bounded by n (the grid is rounded
// up to whole power-of-two threadgroups; threads past the end contribute 0), a tree
// reduction in threadgroup memory with a barrier per stage, one atomic per threadgroup.
kernel void seed002_reduce(const device int* input [[buffer(0)]],
                           device atomic_int* output [[buffer(1)]],
                           constant uint& n [[buffer(2)]],
                           threadgroup int* ldata [[threadgroup(0)]],
                           uint gid [[thread_position_in_grid]],
                           uint lid [[thread_position_in_threadgroup]],
                           uint lsize [[threads_per_threadgroup]])
{
    int val = gid < n ? input[gid] : 0;
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
