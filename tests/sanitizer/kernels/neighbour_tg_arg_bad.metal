#include <metal_stdlib>
using namespace metal;

// One-sided differences within a threadgroup, through a [[threadgroup(0)]] block of one
// float per thread: y = t[lid] - t[lid + offset], no edge check, so thread 0 reads t[-1]
// (offset -1) and the last thread reads one past the block (offset +1).
kernel void neighbour_tg_arg(device const float* x [[buffer(0)]],
                             device float* y [[buffer(1)]],
                             constant int& offset [[buffer(2)]],
                             threadgroup float* t [[threadgroup(0)]],
                             uint gid [[thread_position_in_grid]],
                             uint lid [[thread_position_in_threadgroup]],
                             uint ts [[threads_per_threadgroup]])
{
    t[lid] = x[gid];
    threadgroup_barrier(mem_flags::mem_threadgroup);
    y[gid] = t[lid] - t[int(lid) + offset];  // BUG: index -1 or ts at the group's edges
}
