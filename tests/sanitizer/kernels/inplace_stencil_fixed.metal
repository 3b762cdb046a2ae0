#include <metal_stdlib>
using namespace metal;

// Three-point smoothing, out[i] = (a[i-1] + a[i] + a[i+1]) / 3 for interior i, out[i] = a[i]
// at the ends: reads from one buffer, writes to another, so no thread writes what another
// reads.
kernel void inplace_stencil(device float* a [[buffer(0)]],
                            device float* out [[buffer(1)]],
                            constant uint& n [[buffer(2)]],
                            uint i [[thread_position_in_grid]])
{
    if (i >= n) {
        return;
    }
    if (i > 0 && i + 1 < n) {
        out[i] = (a[i - 1] + a[i] + a[i + 1]) / 3.0f;
    } else {
        out[i] = a[i];
    }
}
