#include <metal_stdlib>
using namespace metal;

// One-sided differences within a threadgroup of 64, through a threadgroup array declared
// in the kernel: y = t[lid] - t[lid + offset], no edge check, so thread 0 reads t[-1]
// (offset -1) and thread 63 reads t[64] (offset +1).
kernel void neighbour_tg_static(device const float* x [[buffer(0)]],
                                device float* y [[buffer(1)]],
                                constant int& offset [[buffer(2)]],
                                uint gid [[thread_position_in_grid]],
                                uint lid [[thread_position_in_threadgroup]])
{
    threadgroup float t[64];
    t[lid] = x[gid];
    threadgroup_barrier(mem_flags::mem_threadgroup);
    y[gid] = t[lid] - t[int(lid) + offset];  // BUG: index -1 or 64 at the group's edges
}
