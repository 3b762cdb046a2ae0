#include <metal_stdlib>
using namespace metal;

// Two layers of a small network, one sample per threadgroup, one hidden unit per thread,
// exchanging the hidden activations through device memory: the barrier between writing and
// reading them has device scope (mem_device), which is what orders device memory.
kernel void seed000_barrier_scope(device const float* x [[buffer(0)]],    // B x D
                                  device const float* w1 [[buffer(1)]],   // H x D
                                  device const float* w2 [[buffer(2)]],   // H x H
                                  device float* hidden [[buffer(3)]],     // B x H scratch
                                  device float* y [[buffer(4)]],          // B x H
                                  constant uint& D [[buffer(5)]],
                                  uint b [[threadgroup_position_in_grid]],
                                  uint j [[thread_position_in_threadgroup]],
                                  uint H [[threads_per_threadgroup]])
{
    float h = 0.0f;
    for (uint k = 0; k < D; ++k) {
        h += w1[j * D + k] * x[b * D + k];
    }
    hidden[b * H + j] = max(h, 0.0f);
    threadgroup_barrier(mem_flags::mem_device);
    float o = 0.0f;
    for (uint k = 0; k < H; ++k) {
        o += w2[j * H + k] * hidden[b * H + k];
    }
    y[b * H + j] = o;
}
