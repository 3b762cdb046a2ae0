#include <metal_stdlib>
using namespace metal;

// One-sided differences within a threadgroup, through a [[threadgroup(0)]] block of one
// float per thread; 0 where the neighbour is outside the threadgroup.
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
    const int j = int(lid) + offset;
    y[gid] = (j >= 0 && j < int(ts)) ? t[lid] - t[j] : 0.0f;
}
