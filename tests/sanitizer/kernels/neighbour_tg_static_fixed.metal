#include <metal_stdlib>
using namespace metal;

// One-sided differences within a threadgroup of 64, through a threadgroup array declared
// in the kernel; 0 where the neighbour is outside the array.
kernel void neighbour_tg_static(device const float* x [[buffer(0)]],
                                device float* y [[buffer(1)]],
                                constant int& offset [[buffer(2)]],
                                uint gid [[thread_position_in_grid]],
                                uint lid [[thread_position_in_threadgroup]])
{
    threadgroup float t[64];
    t[lid] = x[gid];
    threadgroup_barrier(mem_flags::mem_threadgroup);
    const int j = int(lid) + offset;
    y[gid] = (j >= 0 && j < 64) ? t[lid] - t[j] : 0.0f;
}
