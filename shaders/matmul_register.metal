// Rung 3 of the matmul ladder: register tiling. A 16 x 16 threadgroup (256 threads) owns a
// 64 x 64 tile of C and each thread a 4 x 4 block of it, kept in registers: per step of
// BK = 16 along K a thread reads 4 values of the A block and 4 of the B block from
// threadgroup memory and does 16 multiply-adds with them (4x the FMAs per threadgroup read
// of the tiled rung), and the 64-wide tile halves device reads again (64 FMAs per element
// loaded, against 32).
//
// Thread (x, y) owns rows y + 16 i and columns x + 16 j (i, j < 4), strided rather than
// contiguous, so the 16 lanes of a SIMD-group that share a row read 16 consecutive words
// of Bs (and 2 broadcast words of As): no bank conflict.
//
// Both blocks are stored K-major, As[k][m] and Bs[k][n], with rows of 64 + 2 words. Copies
// run along the memory-contiguous dimension (tsm_mm_copy_block): 64-element runs when that
// is M (A^T) or N (B), 16-element runs down K otherwise, which a SIMD-group writes as 16
// k-rows x 2 m-columns: banks 2k + m, all 32 different because the pitch is 2 mod 32.
#include "matmul.h"

template <typename T, bool TA, bool TB>
[[kernel]] void matmul_register(TSM_MM_PARAMS,
                                uint2 group [[threadgroup_position_in_grid]],
                                uint2 lid [[thread_position_in_threadgroup]],
                                uint t [[thread_index_in_threadgroup]]) {
  constexpr uint BM = 64, BN = 64, BK = 16, TM = 4, TN = 4, NT = 256, PITCH = 64 + 2;
  threadgroup T As[BK * PITCH];  // As[k][m]
  threadgroup T Bs[BK * PITCH];  // Bs[k][n]
  TSM_MM_EPILOGUE(out);
  const uint m0 = group.y * BM, n0 = group.x * BN;
  const uint x = lid.x, y = lid.y;

  Acc acc[TM][TN];
  for (uint i = 0; i < TM; ++i) {
    for (uint j = 0; j < TN; ++j) {
      acc[i][j] = Acc(0);
    }
  }
  const uint rows_m = M - min(m0, M), cols_n = N - min(n0, N);
  for (uint k0 = 0; k0 < K; k0 += BK) {
    const uint left_k = K - k0;
    if (TA) {  // A^T: BK rows (k) x BM columns (m) in memory
      tsm_mm_copy_block<BK, BM, BM, NT, PITCH, 1, T>(As, A + k0 * lda + m0, lda, left_k, rows_m, t);
    } else {   // A: BM rows (m) x BK columns (k)
      tsm_mm_copy_block<BM, BK, BK, NT, 1, PITCH, T>(As, A + m0 * lda + k0, lda, rows_m, left_k, t);
    }
    if (TB) {  // B^T: BN rows (n) x BK columns (k)
      tsm_mm_copy_block<BN, BK, BK, NT, 1, PITCH, T>(Bs, B + n0 * ldb + k0, ldb, cols_n, left_k, t);
    } else {   // B: BK rows (k) x BN columns (n)
      tsm_mm_copy_block<BK, BN, BN, NT, PITCH, 1, T>(Bs, B + k0 * ldb + n0, ldb, left_k, cols_n, t);
    }
    threadgroup_barrier(mem_flags::mem_threadgroup);
    for (uint k = 0; k < BK; ++k) {
      Acc a[TM], b[TN];
      for (uint i = 0; i < TM; ++i) {
        a[i] = Acc(As[k * PITCH + y + 16 * i]);
      }
      for (uint j = 0; j < TN; ++j) {
        b[j] = Acc(Bs[k * PITCH + x + 16 * j]);
      }
      for (uint i = 0; i < TM; ++i) {
        for (uint j = 0; j < TN; ++j) {
          acc[i][j] = fma(a[i], b[j], acc[i][j]);
        }
      }
    }
    threadgroup_barrier(mem_flags::mem_threadgroup);
  }
  for (uint i = 0; i < TM; ++i) {
    for (uint j = 0; j < TN; ++j) {
      out.store(m0 + y + 16 * i, n0 + x + 16 * j, acc[i][j]);
    }
  }
}

TSM_MM_INSTANTIATE_ALL(register)
