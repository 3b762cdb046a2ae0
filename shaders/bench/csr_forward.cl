// OpenCL C twin of csr_forward.metal, for PoCL in python -m torch_sparse_metal.bench emulator.

// out = x @ W.T with W (rows x cols) in CSR; one work-item per (row, batch element).
__kernel void csr_forward(__global const float* x, __global const int* indptr,
                          __global const int* indices, __global const float* values,
                          __global float* out, uint batch, uint cols, uint rows) {
  const uint gid = get_global_id(0);
  if (gid >= batch * rows) return;
  const uint row = gid % rows;
  __global const float* xb = x + (gid / rows) * cols;
  const int end = indptr[row + 1];
  float acc = 0.0f;
  for (int e = indptr[row]; e < end; ++e) acc = fma(values[e], xb[indices[e]], acc);
  out[gid] = acc;
}
