// OpenCL C twins of barrier_heavy.metal's kernels, for PoCL in
// python -m torch_sparse_metal.bench emulator: the same algorithm, memory layout and
// launch geometry, statement for statement, so the two timings compare the runtimes, not
// the code.

#define TILE 16

// C = A @ B, all n x n row-major; one work-item per C element, 16x16 work-groups. Two
// barriers per K-tile. The host rounds the global size up to multiples of 16.
__kernel void tiled_matmul(__global const float* a, __global const float* b, __global float* c,
                           uint n) {
  __local float a_tile[TILE][TILE + 1];
  __local float b_tile[TILE][TILE + 1];
  const uint gx = get_global_id(0), gy = get_global_id(1);
  const uint lx = get_local_id(0), ly = get_local_id(1);
  float acc = 0.0f;
  for (uint k0 = 0; k0 < n; k0 += TILE) {
    const uint ak = k0 + lx, bk = k0 + ly;
    a_tile[ly][lx] = (gy < n && ak < n) ? a[gy * n + ak] : 0.0f;
    b_tile[ly][lx] = (bk < n && gx < n) ? b[bk * n + gx] : 0.0f;
    barrier(CLK_LOCAL_MEM_FENCE);
    for (uint k = 0; k < TILE; ++k) acc = fma(a_tile[ly][k], b_tile[k][lx], acc);
    barrier(CLK_LOCAL_MEM_FENCE);
  }
  if (gy < n && gx < n) c[gy * n + gx] = acc;
}

// One partial sum per work-group: a tree over local memory, a barrier per stage.
// The work-group size must be a power of two.
__kernel void tree_reduce(__global const float* x, __global float* partial, uint count,
                          __local float* scratch) {
  const uint gid = get_global_id(0), lid = get_local_id(0);
  scratch[lid] = gid < count ? x[gid] : 0.0f;
  barrier(CLK_LOCAL_MEM_FENCE);
  for (uint stride = get_local_size(0) / 2; stride > 0; stride /= 2) {
    if (lid < stride) scratch[lid] += scratch[lid + stride];
    barrier(CLK_LOCAL_MEM_FENCE);
  }
  if (lid == 0) partial[get_group_id(0)] = scratch[0];
}
