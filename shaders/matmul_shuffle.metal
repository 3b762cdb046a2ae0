// Rung 5 of the matmul ladder: for GPUs without simdgroup_matrix (Intel/AMD Macs, Apple
// GPUs before Apple7). No threadgroup memory and no barriers: operands are shared between
// the lanes of a SIMD-group through registers, with SIMD-group broadcasts, as Intel's MPS
// GEMM does (seed 004: SIMD-group sharing plus vectorised loads, 70-85% of peak there).
//
// * A threadgroup of 4 SIMD-groups (128 threads) owns a 64 x 64 tile of C, each SIMD-group
//   a 32 x 32 quarter. Lane l owns column l of the quarter: 32 accumulators, one per row.
// * Per step of 4 along K, lane l loads 4 values of row l of op(A) and 4 of column l of
//   op(B); then for each row r the SIMD-group broadcasts lane r's A values and every lane
//   does 4 multiply-adds with its own B values. Each element loaded feeds 32 FMAs.
// * Loads along the memory-contiguous dimension are one 4-wide vector load when the host
//   says the operand is aligned (vec_ok) and the 4 values are in range: rows of A (not
//   transposed) and columns of B^T. The other direction is 4 scalar loads in which the 32
//   lanes read 32 neighbouring elements (coalesced).
// * Edges: lanes outside C load zeros and keep broadcasting (every lane must be active in
//   a SIMD-group function); only the epilogue skips elements outside C.
#include "matmul.h"

template <typename T, bool TA, bool TB>
[[kernel]] void matmul_shuffle(TSM_MM_PARAMS,
                               uint2 group [[threadgroup_position_in_grid]],
                               uint sg [[simdgroup_index_in_threadgroup]],
                               uint lane [[thread_index_in_simdgroup]]) {
  TSM_MM_EPILOGUE(out);
  using Acc4 = vec<Acc, 4>;
  const uint m0 = group.y * 64 + (sg / 2) * 32, n0 = group.x * 64 + (sg % 2) * 32;
  const uint row = m0 + lane, col = n0 + lane;  // the A row this lane loads, the C column it owns
  const bool vec_a = !TA && (vec_ok & TSM_MM_VEC_A) != 0 && row < M;
  const bool vec_b = TB && (vec_ok & TSM_MM_VEC_B) != 0 && col < N;

  Acc acc[32];
  for (uint r = 0; r < 32; ++r) {
    acc[r] = Acc(0);
  }
  for (uint k = 0; k < K; k += 4) {
    Acc4 a = Acc4(0), b = Acc4(0);
    if (vec_a && k + 4 <= K) {
      a = Acc4(*reinterpret_cast<device const vec<T, 4>*>(A + row * lda + k));
    } else if (row < M) {
      for (uint e = 0; e < 4; ++e) {
        a[e] = k + e < K ? Acc(tsm_mm_a<TA>(A, lda, row, k + e)) : Acc(0);
      }
    }
    if (vec_b && k + 4 <= K) {
      b = Acc4(*reinterpret_cast<device const vec<T, 4>*>(B + col * ldb + k));
    } else if (col < N) {
      for (uint e = 0; e < 4; ++e) {
        b[e] = k + e < K ? Acc(tsm_mm_b<TB>(B, ldb, k + e, col)) : Acc(0);
      }
    }
    for (uint r = 0; r < 32; ++r) {
      const Acc4 ar = simd_broadcast(a, ushort(r));  // row m0 + r of op(A), k .. k + 3
      acc[r] = fma(ar.x, b.x, acc[r]);
      acc[r] = fma(ar.y, b.y, acc[r]);
      acc[r] = fma(ar.z, b.z, acc[r]);
      acc[r] = fma(ar.w, b.w, acc[r]);
    }
  }
  for (uint r = 0; r < 32; ++r) {
    out.store(m0 + r, col, acc[r]);
  }
}

TSM_MM_INSTANTIATE_ALL(shuffle)
