// Rung 4 of the matmul ladder, the production kernel on Apple7+ GPUs (M1 and later):
// simdgroup_matrix, shaped like MLX's steel GEMM and llama.cpp's kernel_mul_mm.
//
// * A threadgroup of 4 SIMD-groups (128 threads) owns a BM x BN = 64 x 64 tile of C; the
//   SIMD-groups sit 2 x 2, each owning a 32 x 32 quarter held as 4 x 4 = 16 accumulators
//   simdgroup_matrix<float, 8, 8> (32 floats per lane).
// * Per step of BK = 16 along K, the threadgroup copies the 64 x 16 block of op(A) and the
//   16 x 64 block of op(B) into threadgroup memory (zeros past the edges), then each
//   SIMD-group, per 8-deep slice, loads 4 fragments of A and 4 of B and does 16 8x8x8
//   multiply-accumulates: every fragment load feeds 4 products. Device reads per FMA: 1/64
//   of an element from each operand, against 2 for the naive rung.
// * Fragments are loaded lane by lane through thread_elements() in Apple's layout (lane l
//   holds row r = (q & 4) + (l / 2) % 4, columns c, c + 1 with c = (q & 2) * 2 + (l % 2) * 2,
//   q = l / 4), as MLX does: the values are converted to float on the way, so half and
//   bfloat inputs accumulate in float, and the same code serves every dtype.
// * Bank conflicts: a lane reads the pair (r, c), (r, c + 1), so the two elements a lane
//   holds are never in one threadgroup row: both blocks are stored with the fragment's
//   column dimension strided, As[k][m] (pitch 64 + 4) and Bs[n][k] (pitch 16 + 4). A
//   pitch of 4 (mod 16) words puts the 32 lanes' (c, r) pairs on 32 different banks (c * 4
//   covers multiples of 8, r adds 0..7). The copies run along the memory-contiguous
//   dimension in runs of 64 (A^T), 8 (A, B) or 4 (B^T) elements, the run lengths for which
//   the 32 lanes of each store also hit 32 banks. The emulator's counters check: 0.
// * Edges: M, N, K need not be multiples of anything; every lane stays active for the
//   collective multiplies (the host launches whole threadgroups) and only the epilogue
//   skips elements outside C.
//
// Not done yet (see README): double-buffered copies, and specialised kernels for
// aligned shapes (no edge checks), which are what MLX adds on top of this structure.
#include "matmul.h"

template <typename T, bool TA, bool TB>
[[kernel]] void matmul_simdgroup(TSM_MM_PARAMS,
                                 uint2 group [[threadgroup_position_in_grid]],
                                 uint t [[thread_index_in_threadgroup]],
                                 uint sg [[simdgroup_index_in_threadgroup]],
                                 uint lane [[thread_index_in_simdgroup]]) {
  constexpr uint BM = 64, BN = 64, BK = 16, NT = 128;
  constexpr uint PA = BM + 4, PB = BK + 4;  // pitches, in elements
  threadgroup T As[BK * PA];  // As[k][m]
  threadgroup T Bs[BN * PB];  // Bs[n][k]
  TSM_MM_EPILOGUE(out);
  const uint m0 = group.y * BM, n0 = group.x * BN;
  const uint wm = (sg / 2) * 32, wn = (sg % 2) * 32;  // this SIMD-group's quarter
  const uint q = lane / 4;
  const uint fr = (q & 4) + (lane / 2) % 4, fc = (q & 2) * 2 + (lane % 2) * 2;

  simdgroup_matrix<Acc, 8, 8> acc[4][4];
  for (uint i = 0; i < 4; ++i) {
    for (uint j = 0; j < 4; ++j) {
      acc[i][j] = make_filled_simdgroup_matrix<Acc, 8, 8>(Acc(0));
    }
  }
  const uint rows_m = M - min(m0, M), cols_n = N - min(n0, N);
  for (uint k0 = 0; k0 < K; k0 += BK) {
    const uint left_k = K - k0;
    if (TA) {  // A^T: BK rows (k) x BM columns (m) in memory -> As[k][m]
      tsm_mm_copy_block<BK, BM, BM, NT, PA, 1, T>(As, A + k0 * lda + m0, lda, left_k, rows_m, t);
    } else {   // A: BM rows (m) x BK columns (k) -> As[k][m]
      tsm_mm_copy_block<BM, BK, 8, NT, 1, PA, T>(As, A + m0 * lda + k0, lda, rows_m, left_k, t);
    }
    if (TB) {  // B^T: BN rows (n) x BK columns (k) -> Bs[n][k]
      tsm_mm_copy_block<BN, BK, 4, NT, PB, 1, T>(Bs, B + n0 * ldb + k0, ldb, cols_n, left_k, t);
    } else {   // B: BK rows (k) x BN columns (n) -> Bs[n][k]
      tsm_mm_copy_block<BK, BN, 8, NT, 1, PB, T>(Bs, B + k0 * ldb + n0, ldb, left_k, cols_n, t);
    }
    threadgroup_barrier(mem_flags::mem_threadgroup);
    for (uint kk = 0; kk < BK; kk += 8) {
      simdgroup_matrix<Acc, 8, 8> a[4], b[4];
      for (uint i = 0; i < 4; ++i) {  // A fragment (r, c) = op(A)(wm + 8i + r, kk + c)
        const uint at = (kk + fc) * PA + wm + 8 * i + fr;
        a[i].thread_elements()[0] = Acc(As[at]);
        a[i].thread_elements()[1] = Acc(As[at + PA]);
      }
      for (uint j = 0; j < 4; ++j) {  // B fragment (r, c) = op(B)(kk + r, wn + 8j + c)
        const uint at = (wn + 8 * j + fc) * PB + kk + fr;
        b[j].thread_elements()[0] = Acc(Bs[at]);
        b[j].thread_elements()[1] = Acc(Bs[at + PB]);
      }
      for (uint i = 0; i < 4; ++i) {
        for (uint j = 0; j < 4; ++j) {
          simdgroup_multiply_accumulate(acc[i][j], a[i], b[j], acc[i][j]);
        }
      }
    }
    threadgroup_barrier(mem_flags::mem_threadgroup);
  }
  for (uint i = 0; i < 4; ++i) {
    for (uint j = 0; j < 4; ++j) {
      const uint row = m0 + wm + 8 * i + fr, col = n0 + wn + 8 * j + fc;
      out.store(row, col, acc[i][j].thread_elements()[0]);
      out.store(row, col + 1, acc[i][j].thread_elements()[1]);
    }
  }
}

// double only on the emulator (Metal has none): simdgroup_matrix<double, 8, 8> there lets
// gradcheck run in float64 through this kernel too.
TSM_MM_INSTANTIATE_ALL(simdgroup)
