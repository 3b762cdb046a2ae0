#include <metal_stdlib>
using namespace metal;

// Each thread averages its value with its right-hand neighbour's in the threadgroup,
// exchanged through threadgroup memory. The bounds check wraps the whole body, barrier
// included: in the last (padded) threadgroup the threads past n skip the barrier the others
// wait at. Undefined in Metal; some GPUs hang.
kernel void guarded_barrier(device const float* x [[buffer(0)]],
                            device float* y [[buffer(1)]],
                            constant uint& n [[buffer(2)]],
                            uint gid [[thread_position_in_grid]],
                            uint lid [[thread_position_in_threadgroup]],
                            uint ts [[threads_per_threadgroup]])
{
    threadgroup float t[64];
    if (gid < n) {
        t[lid] = x[gid];
        threadgroup_barrier(mem_flags::mem_threadgroup);  // BUG: not reached by gid >= n
        const uint j = (lid + 1) % ts;
        y[gid] = 0.5f * (t[lid] + t[j]);
    }
}
