#include <metal_stdlib>
using namespace metal;

// Each thread accumulates len[gid] chunks of a weight table staged through threadgroup
// memory. Every thread runs the same (uniform) number of iterations, max_len, so every
// thread reaches every barrier; only the accumulation depends on the thread's own length.
kernel void ragged_loop_barrier(device const float* w [[buffer(0)]],     // chunks x 32
                                device const uint* len [[buffer(1)]],    // chunks per thread
                                device float* y [[buffer(2)]],
                                constant uint& max_len [[buffer(3)]],
                                uint gid [[thread_position_in_grid]],
                                uint lid [[thread_position_in_threadgroup]])
{
    threadgroup float wt[32];
    float acc = 0.0f;
    const uint mine = len[gid];
    for (uint c = 0; c < max_len; ++c) {
        wt[lid] = w[c * 32 + lid];
        threadgroup_barrier(mem_flags::mem_threadgroup);
        if (c < mine) {
            acc += wt[(lid + c) % 32];
        }
        threadgroup_barrier(mem_flags::mem_threadgroup);
    }
    y[gid] = acc;
}
