#include <metal_stdlib>
using namespace metal;

// Per-threadgroup sums by halving. The barrier after the load is there, the barrier after
// each halving stage is not: a thread reads its partner's slot in one stage while the
// partner is still writing it in an earlier stage.
kernel void tree_reduce(device const float* in [[buffer(0)]],
                        device float* out [[buffer(1)]],
                        constant uint& n [[buffer(2)]],
                        uint gid [[thread_position_in_grid]],
                        uint lid [[thread_position_in_threadgroup]],
                        uint tg [[threadgroup_position_in_grid]])
{
    threadgroup float buf[256];
    buf[lid] = gid < n ? in[gid] : 0.0f;
    threadgroup_barrier(mem_flags::mem_threadgroup);
    for (uint s = 128; s > 0; s >>= 1) {
        if (lid < s) {
            buf[lid] += buf[lid + s];
        }
        // BUG: no threadgroup_barrier(mem_flags::mem_threadgroup) between stages
    }
    if (lid == 0) {
        out[tg] = buf[0];
    }
}
