#include <metal_stdlib>
using namespace metal;

// One-sided differences y[i] = x[i] - x[i + offset] (offset -1: backward, +1: forward)
// without an edge check: thread 0 reads x[-1] (offset -1), thread n-1 reads x[n] (offset +1).
kernel void neighbour_device(device const float* x [[buffer(0)]],
                             device float* y [[buffer(1)]],
                             constant int& offset [[buffer(2)]],
                             constant uint& n [[buffer(3)]],
                             uint gid [[thread_position_in_grid]])
{
    const int j = int(gid) + offset;
    y[gid] = x[gid] - x[j];  // BUG: j is -1 or n at the edges
}
