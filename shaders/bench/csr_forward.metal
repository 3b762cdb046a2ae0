// A CSR product with no barrier, for python -m torch_sparse_metal.bench emulator (its OpenCL
// twin is csr_forward.cl). Not used by any op.
#include <metal_stdlib>
using namespace metal;

// out = x @ W.T with W (rows x cols) in CSR; x (batch, cols), out (batch, rows), row-major.
// sparse_linear_forward's layout: one thread per (row, batch element), gid = b * rows + row,
// each walking its CSR row.
kernel void csr_forward(device const float* x [[buffer(0)]],
                        device const int* indptr [[buffer(1)]],
                        device const int* indices [[buffer(2)]],
                        device const float* values [[buffer(3)]],
                        device float* out [[buffer(4)]],
                        constant uint& batch [[buffer(5)]],
                        constant uint& cols [[buffer(6)]],
                        constant uint& rows [[buffer(7)]],
                        uint gid [[thread_position_in_grid]]) {
  if (gid >= batch * rows) return;
  const uint row = gid % rows;
  device const float* xb = x + (gid / rows) * cols;
  const int end = indptr[row + 1];
  float acc = 0.0f;
  for (int e = indptr[row]; e < end; ++e) acc = fma(values[e], xb[indices[e]], acc);
  out[gid] = acc;
}
