#include <metal_stdlib>
using namespace metal;

// One-sided differences y[i] = x[i] - x[i + offset], 0 where the neighbour is outside x.
kernel void neighbour_device(device const float* x [[buffer(0)]],
                             device float* y [[buffer(1)]],
                             constant int& offset [[buffer(2)]],
                             constant uint& n [[buffer(3)]],
                             uint gid [[thread_position_in_grid]])
{
    const int j = int(gid) + offset;
    y[gid] = (j >= 0 && j < int(n)) ? x[gid] - x[j] : 0.0f;
}
