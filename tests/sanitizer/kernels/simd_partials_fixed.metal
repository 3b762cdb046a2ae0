#include <metal_stdlib>
using namespace metal;

// Per-threadgroup sums: simd_sum within each SIMD-group, lane 0 of each stores its partial
// in threadgroup memory, a threadgroup_barrier, then SIMD-group 0 adds the partials.
kernel void simd_partials(device const float* x [[buffer(0)]],
                          device float* out [[buffer(1)]],
                          uint gid [[thread_position_in_grid]],
                          uint lane [[thread_index_in_simdgroup]],
                          uint sg [[simdgroup_index_in_threadgroup]],
                          uint nsg [[simdgroups_per_threadgroup]],
                          uint tg [[threadgroup_position_in_grid]])
{
    threadgroup float partial[32];
    const float v = simd_sum(x[gid]);
    if (lane == 0) {
        partial[sg] = v;
    }
    threadgroup_barrier(mem_flags::mem_threadgroup);
    if (sg == 0) {
        float p = lane < nsg ? partial[lane] : 0.0f;
        p = simd_sum(p);
        if (lane == 0) {
            out[tg] = p;
        }
    }
}
