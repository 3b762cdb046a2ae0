// Rung 5 of the matmul ladder: for GPUs without simdgroup_matrix (Intel/AMD Macs, Apple
// GPUs before Apple7). No threadgroup memory and no barriers: operands are shared between
// the lanes of a SIMD-group through registers, with SIMD-group broadcasts, as Intel's MPS
// GEMM does (seed 004: SIMD-group sharing plus vectorised loads, 70-85% of peak there).
//
// * A threadgroup of 4 SIMD-groups (128 threads) owns a 64 x 64 tile of C, each SIMD-group
//   a 32 x 32 quarter. Lane l owns column l of the quarter: 32 accumulators, one per row.
// * Per step of 32 along K, the SIMD-group loads the 32 x 32 block of op(A) and lane l the
//   32 values of column l of op(B); then for each row r and each quad of 4 k the
//   SIMD-group broadcasts the lane holding that quad of row r, and every lane does 4
//   multiply-adds with its own B values. Each element loaded feeds 32 FMAs.
// * Device loads run along the memory-contiguous dimension, 32 lanes over 128 bytes or
//   more per instruction (the emulator's transaction counters):
//   - down K (A^T, B): lane l reads element l of a memory row: its own row of op(A) or its
//     own column of op(B), 32 neighbours per instruction;
//   - along K (A, B^T): load q (q < 8) gives lane l the quad 4 (l % 8) .. + 3 of row
//     4q + l / 8 of the block: 4 rows x 128 bytes of float per instruction. One 4-wide
//     vector load when the host says the operand is aligned (vec_ok) and the quad is in
//     range, 4 scalar loads otherwise. (A lane reading a quad of its own row instead put 32
//     rows in each instruction: 32 segments for 512 bytes.) Quads of A are broadcast from
//     where they are; a lane's quads of B^T come from the lanes that loaded them, with
//     simd_shuffle: 8 per quad, one from each load, kept by the lanes whose column it holds.
// * Edges: a SIMD-group whose quarter lies wholly outside C returns at once; in the others,
//   lanes outside C load zeros and keep broadcasting (every lane must be active in a
//   SIMD-group function), and only the epilogue skips elements outside C.
#include "matmul.h"

// Quad (elements k .. k + 3 of row `row`) of a row-major matrix with `cols` columns,
// zeros past the edges; one vector load when `aligned` and the quad is whole.
template <typename T, typename Acc>
inline vec<Acc, 4> tsm_mm_quad(device const T* X, uint ld, uint row, uint rows, uint k,
                               uint cols, bool aligned) {
  vec<Acc, 4> v = vec<Acc, 4>(0);
  if (row >= rows) {
    return v;
  }
  if (aligned && k + 4 <= cols) {
    return vec<Acc, 4>(*reinterpret_cast<device const vec<T, 4>*>(X + row * ld + k));
  }
  for (uint e = 0; e < 4; ++e) {
    v[e] = k + e < cols ? Acc(X[row * ld + k + e]) : Acc(0);
  }
  return v;
}

template <typename T, bool TA, bool TB>
[[kernel]] void matmul_shuffle(TSM_MM_PARAMS,
                               uint2 group [[threadgroup_position_in_grid]],
                               uint sg [[simdgroup_index_in_threadgroup]],
                               uint lane [[thread_index_in_simdgroup]]) {
  TSM_MM_EPILOGUE(out);
  using Acc4 = vec<Acc, 4>;
  constexpr uint KS = 32;  // k per step: 8 quads
  const uint m0 = group.y * 64 + (sg / 2) * 32, n0 = group.x * 64 + (sg % 2) * 32;
  const uint col = n0 + lane;  // the C column this lane owns
  const uint quad = lane % 8, sub = lane / 8;  // loads along K: quad and row within a load
  const bool vec_a = (vec_ok & TSM_MM_VEC_A) != 0, vec_b = (vec_ok & TSM_MM_VEC_B) != 0;
  if (m0 >= M || n0 >= N) {
    return;  // a quarter wholly outside C (edge tiles): the whole SIMD-group leaves, loading nothing
  }

  Acc acc[32];
  for (uint r = 0; r < 32; ++r) {
    acc[r] = Acc(0);
  }
  for (uint k = 0; k < K; k += KS) {
    const uint quads = min(8u, (K - k + 3) / 4);  // quads holding some k < K
    // A^T: a[j] is quad j of this lane's row m0 + lane. A: a[q] is load q (see the top).
    Acc4 a[8], b[8];
    for (uint j = 0; j < 8; ++j) {
      if (TA) {
        for (uint e = 0; e < 4; ++e) {
          const uint kk = k + 4 * j + e;
          a[j][e] = m0 + lane < M && kk < K ? Acc(A[kk * lda + m0 + lane]) : Acc(0);
        }
      } else {
        a[j] = tsm_mm_quad<T, Acc>(A, lda, m0 + 4 * j + sub, M, k + 4 * quad, K, vec_a);
      }
    }
    if (TB) {  // load q holds quad `quad` of column n0 + 4q + sub: lane l takes its quads
      for (uint q = 0; q < 8; ++q) {
        const Acc4 loaded = tsm_mm_quad<T, Acc>(B, ldb, n0 + 4 * q + sub, N, k + 4 * quad, K, vec_b);
        for (uint j = 0; j < 8; ++j) {
          const Acc4 v = simd_shuffle(loaded, ushort(8 * (lane % 4) + j));
          if (lane / 4 == q) {
            b[j] = v;
          }
        }
      }
    } else {   // b[j]: quad j of this lane's column
      for (uint j = 0; j < 8; ++j) {
        for (uint e = 0; e < 4; ++e) {
          const uint kk = k + 4 * j + e;
          b[j][e] = col < N && kk < K ? Acc(B[kk * ldb + col]) : Acc(0);
        }
      }
    }
    for (uint j = 0; j < quads; ++j) {
      for (uint r = 0; r < 32; ++r) {
        Acc4 ar;  // quad j of row m0 + r of op(A)
        if (TA) {
          ar = simd_broadcast(a[j], ushort(r));
        } else {
          ar = simd_broadcast(a[r / 4], ushort(8 * (r % 4) + j));
        }
        acc[r] = fma(ar.x, b[j].x, acc[r]);
        acc[r] = fma(ar.y, b[j].y, acc[r]);
        acc[r] = fma(ar.z, b[j].z, acc[r]);
        acc[r] = fma(ar.w, b[j].w, acc[r]);
      }
    }
  }
  for (uint r = 0; r < 32; ++r) {
    out.store(m0 + r, col, acc[r]);
  }
}

TSM_MM_INSTANTIATE_ALL(shuffle)
