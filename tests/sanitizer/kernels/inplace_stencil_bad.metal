#include <metal_stdlib>
using namespace metal;

// Three-point smoothing, a[i] = (a[i-1] + a[i] + a[i+1]) / 3 for interior i, in place. The
// barrier makes every thread of a threadgroup read before any of them writes, but nothing
// orders threadgroups: the first thread of a threadgroup reads a[i-1], which the last thread
// of the previous threadgroup writes.
kernel void inplace_stencil(device float* a [[buffer(0)]],
                            device float* out [[buffer(1)]],  // unused: the bug is in place
                            constant uint& n [[buffer(2)]],
                            uint i [[thread_position_in_grid]])
{
    const bool interior = i > 0 && i + 1 < n;
    float left = 0.0f, mid = 0.0f, right = 0.0f;
    if (interior) {
        left = a[i - 1];
        mid = a[i];
        right = a[i + 1];
    }
    threadgroup_barrier(mem_flags::mem_device);  // orders this threadgroup only
    if (interior) {
        a[i] = (left + mid + right) / 3.0f;  // BUG: a neighbouring threadgroup reads a[i]
    }
}
