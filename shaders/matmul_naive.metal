// Rung 1 of the matmul ladder: one thread per element of C, a dot product over K read
// straight from device memory. 2 device reads per multiply-add (arithmetic intensity
// 0.25 FMA/byte in float32): memory bound, the baseline the other rungs are measured by.
//
// Grid (N, M) threads, threadgroups of 32 x 8: a SIMD-group is 32 neighbouring columns of
// one row, so its reads of op(B) are coalesced when B is not transposed and its reads of
// op(A) are one broadcast address. Common signature and epilogue: shaders/matmul.h.
#include "matmul.h"

template <typename T, bool TA, bool TB>
[[kernel]] void matmul_naive(TSM_MM_PARAMS, uint2 gid [[thread_position_in_grid]]) {
  TSM_MM_EPILOGUE(out);
  const uint j = gid.x, i = gid.y;
  if (i >= M || j >= N) {
    return;  // no barriers below: the edge threads may leave
  }
  Acc acc = Acc(0);
  for (uint k = 0; k < K; ++k) {
    acc = fma(Acc(tsm_mm_a<TA>(A, lda, i, k)), Acc(tsm_mm_b<TB>(B, ldb, k, j)), acc);
  }
  out.store(i, j, acc);
}

TSM_MM_INSTANTIATE_ALL(naive)
