#include <metal_stdlib>
using namespace metal;

// Per-threadgroup sums by halving, with a barrier after the load and after every stage.
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
        threadgroup_barrier(mem_flags::mem_threadgroup);
    }
    if (lid == 0) {
        out[tg] = buf[0];
    }
}
