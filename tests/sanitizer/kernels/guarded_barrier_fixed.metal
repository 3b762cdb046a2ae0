#include <metal_stdlib>
using namespace metal;

// Each thread averages its value with its right-hand neighbour's in the threadgroup. Every
// thread loads (0 past the end) and reaches the barrier; only the store is bounded.
kernel void guarded_barrier(device const float* x [[buffer(0)]],
                            device float* y [[buffer(1)]],
                            constant uint& n [[buffer(2)]],
                            uint gid [[thread_position_in_grid]],
                            uint lid [[thread_position_in_threadgroup]],
                            uint ts [[threads_per_threadgroup]])
{
    threadgroup float t[64];
    t[lid] = gid < n ? x[gid] : 0.0f;
    threadgroup_barrier(mem_flags::mem_threadgroup);
    if (gid < n) {
        const uint j = (lid + 1) % ts;
        y[gid] = 0.5f * (t[lid] + t[j]);
    }
}
