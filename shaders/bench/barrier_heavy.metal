// Barrier-heavy kernels for measuring the emulator and its sanitizer
// (python -m torch_sparse_metal.bench sanitizer, and emulator with their OpenCL twins in
// barrier_heavy.cl). Not used by any op.
#include <metal_stdlib>
using namespace metal;

constant constexpr uint TILE = 16;

// C = A @ B, all n x n row-major; one thread per C element, 16x16 threadgroups. Two
// barriers per K-tile: after the tiles are loaded, and before they are overwritten.
// Rows padded by one float so a column walk of `b` touches 16 different banks.
kernel void tiled_matmul(device const float* a [[buffer(0)]],
                         device const float* b [[buffer(1)]],
                         device float* c [[buffer(2)]],
                         constant uint& n [[buffer(3)]],
                         uint2 gid [[thread_position_in_grid]],
                         uint2 lid [[thread_position_in_threadgroup]]) {
  threadgroup float a_tile[TILE][TILE + 1];
  threadgroup float b_tile[TILE][TILE + 1];
  float acc = 0.0f;
  for (uint k0 = 0; k0 < n; k0 += TILE) {
    const uint ak = k0 + lid.x, bk = k0 + lid.y;
    a_tile[lid.y][lid.x] = (gid.y < n && ak < n) ? a[gid.y * n + ak] : 0.0f;
    b_tile[lid.y][lid.x] = (bk < n && gid.x < n) ? b[bk * n + gid.x] : 0.0f;
    threadgroup_barrier(mem_flags::mem_threadgroup);
    for (uint k = 0; k < TILE; ++k) acc = fma(a_tile[lid.y][k], b_tile[k][lid.x], acc);
    threadgroup_barrier(mem_flags::mem_threadgroup);
  }
  if (gid.y < n && gid.x < n) c[gid.y * n + gid.x] = acc;
}

// One partial sum per threadgroup: a tree over threadgroup memory, a barrier per stage.
// The group size must be a power of two.
kernel void tree_reduce(device const float* x [[buffer(0)]],
                        device float* partial [[buffer(1)]],
                        constant uint& count [[buffer(2)]],
                        threadgroup float* scratch [[threadgroup(0)]],
                        uint gid [[thread_position_in_grid]],
                        uint lid [[thread_position_in_threadgroup]],
                        uint group [[threadgroup_position_in_grid]],
                        uint size [[dispatch_threads_per_threadgroup]]) {
  scratch[lid] = gid < count ? x[gid] : 0.0f;
  threadgroup_barrier(mem_flags::mem_threadgroup);
  for (uint stride = size / 2; stride > 0; stride /= 2) {
    if (lid < stride) scratch[lid] += scratch[lid + stride];
    threadgroup_barrier(mem_flags::mem_threadgroup);
  }
  if (lid == 0) partial[group] = scratch[0];
}
