// Rung 3 of the matmul ladder: register tiling. A 32 x 8 threadgroup (256 threads) owns a
// 64 x 64 tile of C and each thread 8 x 2 elements of it, kept in registers: per step
// along K a thread reads 8 values of the A block and 2 of the B block from threadgroup
// memory per k and does 16 multiply-adds with them, and the 64-wide tile halves device
// reads against the tiled rung (64 FMAs per element loaded, against 32).
//
// Thread (x, y) owns rows y + 8 i (i < 8) and columns x + 32 j (j < 2). A SIMD-group is one
// y and the 32 x: its A reads are one broadcast word, its B reads 32 consecutive elements,
// and each store of the epilogue writes 32 neighbours in one row of C (one 128-byte segment
// of float; 16 x 16 threads owning 4 x 4 made every store two half-filled segments).
//
// Both blocks are stored K-major, As[k][m] and Bs[k][n], BK rows. Copies run along the
// memory-contiguous dimension in runs of 32 elements, one SIMD-group instruction per run:
// along M (A^T) or N (B) they write 32 consecutive elements of a block row; down K (A, B^T)
// they write one element in each of 32 block rows, which the pitch spreads over 32 banks:
// it is an odd number of 4-byte words (65 floats, 66 halves). BK * sizeof(T) = 128 bytes,
// so a run down K is one whole segment of float and the blocks stay near 16 KB.
#include "matmul.h"

template <typename T, bool TA, bool TB>
[[kernel]] void matmul_register(TSM_MM_PARAMS,
                                uint2 group [[threadgroup_position_in_grid]],
                                uint2 lid [[thread_position_in_threadgroup]],
                                uint t [[thread_index_in_threadgroup]]) {
  constexpr uint BM = 64, BN = 64, BK = 128 / sizeof(T), TM = 8, TN = 2, NT = 256;
  constexpr uint PITCH = 64 + (sizeof(T) == 2 ? 2 : 1);
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
      tsm_mm_copy_block<BK, BM, NT, PITCH, 1, T>(As, A + k0 * lda + m0, lda, left_k, rows_m, t);
    } else {   // A: BM rows (m) x BK columns (k)
      tsm_mm_copy_block<BM, BK, NT, 1, PITCH, T>(As, A + m0 * lda + k0, lda, rows_m, left_k, t);
    }
    if (TB) {  // B^T: BN rows (n) x BK columns (k)
      tsm_mm_copy_block<BN, BK, NT, 1, PITCH, T>(Bs, B + n0 * ldb + k0, ldb, cols_n, left_k, t);
    } else {   // B: BK rows (k) x BN columns (n)
      tsm_mm_copy_block<BK, BN, NT, PITCH, 1, T>(Bs, B + k0 * ldb + n0, ldb, left_k, cols_n, t);
    }
    threadgroup_barrier(mem_flags::mem_threadgroup);
    for (uint k = 0; k < BK; ++k) {
      Acc a[TM], b[TN];
      for (uint i = 0; i < TM; ++i) {
        a[i] = Acc(As[k * PITCH + y + 8 * i]);
      }
      for (uint j = 0; j < TN; ++j) {
        b[j] = Acc(Bs[k * PITCH + x + 32 * j]);
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
      out.store(m0 + y + 8 * i, n0 + x + 32 * j, acc[i][j]);
    }
  }
}

TSM_MM_INSTANTIATE_ALL(register)
