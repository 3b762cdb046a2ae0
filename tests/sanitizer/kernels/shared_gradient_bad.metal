#include <metal_stdlib>
using namespace metal;

// Bias gradient: grad[c] = sum over rows r of dy[r, c]. One thread per element of dy, one
// threadgroup per row: the threads of different threadgroups add into the same grad[c]
// with a plain read-modify-write, so concurrent updates are lost.
kernel void shared_gradient(device const float* dy [[buffer(0)]],   // rows x cols
                            device float* grad [[buffer(1)]],       // cols
                            constant uint& cols [[buffer(2)]],
                            uint gid [[thread_position_in_grid]])
{
    grad[gid % cols] += dy[gid];  // BUG: non-atomic += from many threadgroups
}
