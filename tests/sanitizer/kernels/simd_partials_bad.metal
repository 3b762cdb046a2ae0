#include <metal_stdlib>
using namespace metal;

// Per-threadgroup sums: simd_sum within each SIMD-group, lane 0 of each stores its partial
// in threadgroup memory, SIMD-group 0 adds the partials. The partials cross SIMD-groups but
// the barrier between the stores and the loads is a simdgroup_barrier, which orders the
// lanes of one SIMD-group only (seed 002's mix of SIMD and threadgroup stages).
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
    simdgroup_barrier(mem_flags::mem_threadgroup);  // BUG: needs threadgroup_barrier
    if (sg == 0) {
        float p = lane < nsg ? partial[lane] : 0.0f;
        p = simd_sum(p);
        if (lane == 0) {
            out[tg] = p;
        }
    }
}
