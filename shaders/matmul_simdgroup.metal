// Rung 4 of the matmul ladder, the production kernel on Apple7+ GPUs (M1 and later):
// simdgroup_matrix, shaped like MLX's steel GEMM and llama.cpp's kernel_mul_mm.
//
// * A threadgroup of 4 SIMD-groups (128 threads) owns a BM x BN = 64 x 64 tile of C; the
//   SIMD-groups sit 2 x 2, each owning a 32 x 32 quarter held as 4 x 4 = 16 accumulators
//   simdgroup_matrix<float, 8, 8> (32 floats per lane).
// * Per step of BK = 32 along K, the threadgroup copies the 64 x 32 block of op(A) and the
//   32 x 64 block of op(B) into threadgroup memory (zeros past the edges), then each
//   SIMD-group, per 8-deep slice, loads 4 fragments of A and 4 of B and does 16 8x8x8
//   multiply-accumulates: every fragment load feeds 4 products. Device reads per FMA: 1/64
//   of an element from each operand, against 2 for the naive rung.
// * Device memory (the emulator's transaction counters): every SIMD-group instruction of
//   the copies reads 32 consecutive elements along the memory-contiguous dimension, a whole
//   128-byte segment of float (BK = 32 makes a block row of A 128 bytes), and the epilogue
//   writes rows of C the same way: the fragments are first stored to threadgroup memory,
//   then the threadgroup writes C row by row. Storing them from thread_elements() directly
//   made each store instruction touch 8 rows of C (8 segments for 128 bytes).
// * Fragments are loaded lane by lane through thread_elements() in Apple's layout (lane l
//   holds row r = (q & 4) + (l / 2) % 4, columns c, c + 1 with c = (q & 2) * 2 + (l % 2) * 2,
//   q = l / 4), as MLX does. The blocks are held in the accumulator type (float for float,
//   half and bfloat; converted on the copy), so one layout and one bank analysis serve
//   every dtype, and the epilogue's staging area reuses the same memory (64 x 64 Acc).
// * Bank conflicts (32 banks of 4-byte words): the blocks are As[k][m] (rows of 64) and
//   Bs[n][k] (rows of 32), unpadded, with the column index of row i XOR-ed with
//   tsm_mm_swizzle(i). A copy instruction's 32 lanes run along one row (A^T, B^T: column
//   index varies, one XOR) or down 32 rows (A, B: the swizzle is a permutation of the row's
//   low 5 bits), so they hit 32 banks either way; a fragment load's lanes take 8 rows r
//   (low 3 bits) of 4 column pairs c = 0, 2, 4, 6, and bits 3-4 of the swizzle are c / 2:
//   32 banks again. The staging area uses tsm_mm_stage_swizzle for the fragments' stores
//   the same way. The emulator's counters check: 0.
// * Edges: M, N, K need not be multiples of anything; every lane stays active for the
//   collective multiplies (the host launches whole threadgroups) and only the epilogue
//   skips elements outside C.
//
// Not done yet (docs/matmul.md): double-buffered copies, and specialised kernels for
// aligned shapes (no edge checks), which are what MLX adds on top of this structure.
#include "matmul.h"

// The XOR mask on the column index of block row i: bit 0 of i stays bit 0, bits 3-4 of i
// go to bits 1-2 and bits 1-2 (a fragment's column pair) to bits 3-4.
inline uint tsm_mm_swizzle(uint i) {
  return (i & 1u) | ((i >> 3) & 3u) << 1 | ((i >> 1) & 3u) << 3;
}

// The XOR mask of row r of the 64 x 64 staging area: a fragment's rows r % 4 go to bits
// 3-4, (r / 4) % 2 to bit 0, so its 8 rows x 4 column pairs hit 32 banks.
inline uint tsm_mm_stage_swizzle(uint r) {
  return (r & 3u) << 3 | ((r >> 2) & 1u);
}

// Copies a ROWS x COLS block of a row-major device matrix (leading dimension ld,
// rows_left x cols_left of it valid, zeros elsewhere) into threadgroup memory: element
// (r, c) goes to row r, column c of a W-wide swizzled tile, or to row c, column r when
// FLIP. COLS is a multiple of 32, so each SIMD-group instruction reads 32 neighbours of one
// row.
template <uint ROWS, uint COLS, bool FLIP, uint W, uint NT, typename Acc, typename T>
inline void tsm_mm_copy_swizzled(threadgroup Acc* dst, device const T* src, uint ld,
                                 uint rows_left, uint cols_left, uint t) {
  static_assert(COLS % 32 == 0 && (ROWS * COLS) % NT == 0, "SIMD-group runs must tile the block");
  for (uint n = 0; n < ROWS * COLS / NT; ++n) {
    const uint idx = t + n * NT, r = idx / COLS, c = idx % COLS;
    const Acc v = (r < rows_left && c < cols_left) ? Acc(src[r * ld + c]) : Acc(0);
    const uint row = FLIP ? c : r, col = FLIP ? r : c;
    dst[row * W + (col ^ tsm_mm_swizzle(row))] = v;
  }
}

template <typename T, bool TA, bool TB>
[[kernel]] void matmul_simdgroup(TSM_MM_PARAMS,
                                 uint2 group [[threadgroup_position_in_grid]],
                                 uint t [[thread_index_in_threadgroup]],
                                 uint sg [[simdgroup_index_in_threadgroup]],
                                 uint lane [[thread_index_in_simdgroup]]) {
  constexpr uint BM = 64, BN = 64, BK = 32, NT = 128;
  TSM_MM_EPILOGUE(out);
  // As[k][m] (BK x BM), then Bs[n][k] (BN x BK); after the K loop, the 64 x 64 staging area.
  threadgroup Acc tiles[BM * BN];
  threadgroup Acc* As = tiles;
  threadgroup Acc* Bs = tiles + BK * BM;
  static_assert(BK * BM + BN * BK <= BM * BN, "the staging area holds both blocks");
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
      tsm_mm_copy_swizzled<BK, BM, false, BM, NT>(As, A + k0 * lda + m0, lda, left_k, rows_m, t);
    } else {   // A: BM rows (m) x BK columns (k) -> As[k][m]
      tsm_mm_copy_swizzled<BM, BK, true, BM, NT>(As, A + m0 * lda + k0, lda, rows_m, left_k, t);
    }
    if (TB) {  // B^T: BN rows (n) x BK columns (k) -> Bs[n][k]
      tsm_mm_copy_swizzled<BN, BK, false, BK, NT>(Bs, B + n0 * ldb + k0, ldb, cols_n, left_k, t);
    } else {   // B: BK rows (k) x BN columns (n) -> Bs[n][k]
      tsm_mm_copy_swizzled<BK, BN, true, BK, NT>(Bs, B + k0 * ldb + n0, ldb, left_k, cols_n, t);
    }
    threadgroup_barrier(mem_flags::mem_threadgroup);
    for (uint kk = 0; kk < BK; kk += 8) {
      simdgroup_matrix<Acc, 8, 8> a[4], b[4];
      for (uint i = 0; i < 4; ++i) {  // A fragment (r, c) = op(A)(wm + 8i + r, kk + c)
        const uint m = wm + 8 * i + fr, k = kk + fc;
        a[i].thread_elements()[0] = As[k * BM + (m ^ tsm_mm_swizzle(k))];
        a[i].thread_elements()[1] = As[(k + 1) * BM + (m ^ tsm_mm_swizzle(k + 1))];
      }
      for (uint j = 0; j < 4; ++j) {  // B fragment (r, c) = op(B)(kk + r, wn + 8j + c)
        const uint n = wn + 8 * j + fc, k = kk + fr;
        b[j].thread_elements()[0] = Bs[n * BK + (k ^ tsm_mm_swizzle(n))];
        b[j].thread_elements()[1] = Bs[(n + 1) * BK + (k ^ tsm_mm_swizzle(n + 1))];
      }
      for (uint i = 0; i < 4; ++i) {
        for (uint j = 0; j < 4; ++j) {
          simdgroup_multiply_accumulate(acc[i][j], a[i], b[j], acc[i][j]);
        }
      }
    }
    threadgroup_barrier(mem_flags::mem_threadgroup);
  }
  // Epilogue: fragments to the staging area (the loop's last barrier freed the blocks),
  // then rows of C out, 32 neighbours per SIMD-group instruction.
  for (uint i = 0; i < 4; ++i) {
    for (uint j = 0; j < 4; ++j) {
      const uint r = wm + 8 * i + fr, c = wn + 8 * j + fc;
      tiles[r * BN + (c ^ tsm_mm_stage_swizzle(r))] = acc[i][j].thread_elements()[0];
      tiles[r * BN + ((c + 1) ^ tsm_mm_stage_swizzle(r))] = acc[i][j].thread_elements()[1];
    }
  }
  threadgroup_barrier(mem_flags::mem_threadgroup);
  for (uint n = 0; n < BM * BN / NT; ++n) {
    const uint idx = t + n * NT, r = idx / BN, c = idx % BN;
    out.store(m0 + r, n0 + c, tiles[r * BN + (c ^ tsm_mm_stage_swizzle(r))]);
  }
}

// double only on the emulator (Metal has none): simdgroup_matrix<double, 8, 8> there lets
// gradcheck run in float64 through this kernel too.
TSM_MM_INSTANTIATE_ALL(simdgroup)
