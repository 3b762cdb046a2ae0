#include <metal_stdlib>
using namespace metal;

// C = A * B with 16x16 tiles staged in threadgroup memory (rows padded to 17 floats against
// bank conflicts). The barrier after the multiply loop is missing: a thread that finishes
// its dot products loads the next tile over values other threads of its group still read.
kernel void tiled_matmul(device const float* A [[buffer(0)]],  // M x K
                         device const float* B [[buffer(1)]],  // K x N
                         device float* C [[buffer(2)]],        // M x N
                         constant uint& M [[buffer(3)]],
                         constant uint& N [[buffer(4)]],
                         constant uint& K [[buffer(5)]],
                         uint2 gid [[thread_position_in_grid]],
                         uint2 lid [[thread_position_in_threadgroup]])
{
    threadgroup float As[16][17];
    threadgroup float Bs[16][17];
    const uint row = gid.y, col = gid.x;
    float acc = 0.0f;
    for (uint t = 0; t < K; t += 16) {
        As[lid.y][lid.x] = (row < M && t + lid.x < K) ? A[row * K + t + lid.x] : 0.0f;
        Bs[lid.y][lid.x] = (t + lid.y < K && col < N) ? B[(t + lid.y) * N + col] : 0.0f;
        threadgroup_barrier(mem_flags::mem_threadgroup);
        for (uint k = 0; k < 16; ++k) {
            acc += As[lid.y][k] * Bs[k][lid.x];
        }
        // BUG: no threadgroup_barrier here; the next iteration's loads race with these reads
    }
    if (row < M && col < N) {
        C[row * N + col] = acc;
    }
}
