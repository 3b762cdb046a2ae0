#include <metal_stdlib>
using namespace metal;

// Seed 002's original reduction (../shared/seeds/002_6f4c44d714fd4094.txt): each thread
// first adds the element `lsize` further on, as if the grid covered half the data. The grid
// covers all of it, so the last `lsize` threads read past the end of `input`; the GPU reads
// whatever lies there, silently.
kernel void seed002_reduce(const device int* input [[buffer(0)]],
                           device atomic_int* output [[buffer(1)]],
                           constant uint& n [[buffer(2)]],
                           threadgroup int* ldata [[threadgroup(0)]],
                           uint gid [[thread_position_in_grid]],
                           uint lid [[thread_position_in_threadgroup]],
                           uint lsize [[threads_per_threadgroup]])
{
    int val = input[gid] + input[gid + lsize];  // BUG: gid + lsize >= n for the last threads
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
