#include <metal_stdlib>
using namespace metal;

// Bias gradient: grad[c] = sum over rows r of dy[r, c], accumulated with a relaxed atomic
// add, which is safe between threadgroups.
kernel void shared_gradient(device const float* dy [[buffer(0)]],   // rows x cols
                            device atomic_float* grad [[buffer(1)]],  // cols
                            constant uint& cols [[buffer(2)]],
                            uint gid [[thread_position_in_grid]])
{
    atomic_fetch_add_explicit(&grad[gid % cols], dy[gid], memory_order_relaxed);
}
