#include <metal_stdlib>
using namespace metal;

// Each thread accumulates len[gid] chunks of a weight table the threadgroup stages through
// threadgroup memory, one chunk per iteration. The trip count is per thread, so threads
// with short rows leave the loop (and return) while the others wait at its barrier: on a
// GPU the threadgroup deadlocks or the barrier is silently broken.
kernel void ragged_loop_barrier(device const float* w [[buffer(0)]],     // chunks x 32
                                device const uint* len [[buffer(1)]],    // chunks per thread
                                device float* y [[buffer(2)]],
                                constant uint& max_len [[buffer(3)]],
                                uint gid [[thread_position_in_grid]],
                                uint lid [[thread_position_in_threadgroup]])
{
    threadgroup float wt[32];
    float acc = 0.0f;
    for (uint c = 0; c < len[gid]; ++c) {  // BUG: thread-dependent trip count around barriers
        wt[lid] = w[c * 32 + lid];
        threadgroup_barrier(mem_flags::mem_threadgroup);
        acc += wt[(lid + c) % 32];
        threadgroup_barrier(mem_flags::mem_threadgroup);
    }
    y[gid] = acc;
}
