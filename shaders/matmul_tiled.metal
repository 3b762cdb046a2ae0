// Rung 2 of the matmul ladder: threadgroup tiling. A 32 x 32 threadgroup (1024 threads)
// owns a 32 x 32 tile of C; per step of 32 along K it copies a 32 x 32 block of op(A) and
// of op(B) into threadgroup memory (one element per thread, coalesced: the memory-
// contiguous dimension runs along the SIMD-group) and every thread reads its row of the A
// block and column of the B block from there. Device reads drop 32x against the naive rung.
//
// A pipeline may allow fewer than 1024 threads per threadgroup (maxTotalThreadsPerThreadgroup
// falls with register use). The host then launches 32 x ROWS threads (ROWS < 32): the tile
// of C shrinks to ROWS x 32, the A block to ROWS x 32, and each thread copies 32 / ROWS
// rows of the B block. With ROWS = 32 every index below is the one-element-per-thread copy.
//
// Padding: the blocks are [32][32 + one word]. A transposed operand is stored transposed (thread
// (x, y) writes block[x][y]): with rows of 33 words (33 floats, 34 halves), the 32 lanes of a SIMD-group (32
// neighbouring x) write 32 different banks instead of one. Reads are a broadcast (As[y][k])
// or 32 consecutive words (Bs[k][x]). The emulator's counters check: 0 bank conflicts.
#include "matmul.h"

template <typename T, bool TA, bool TB>
[[kernel]] void matmul_tiled(TSM_MM_PARAMS,
                             uint2 group [[threadgroup_position_in_grid]],
                             uint2 lid [[thread_position_in_threadgroup]],
                             uint2 threads [[threads_per_threadgroup]]) {
  // One 4-byte word of padding per row: 1 float, 2 halves (a row of 33 halves would put
  // two lanes' elements in one word and others on one bank).
  constexpr uint TILE = 32, PITCH = TILE + (sizeof(T) < 4 ? 4 / sizeof(T) : 1);
  threadgroup T As[TILE * PITCH];  // As[m][k], rows < ROWS used
  threadgroup T Bs[TILE * PITCH];  // Bs[k][n]
  TSM_MM_EPILOGUE(out);
  const uint ROWS = threads.y;  // rows of C per threadgroup: TILE unless the pipeline allows fewer
  const uint m0 = group.y * ROWS, n0 = group.x * TILE;
  const uint x = lid.x, y = lid.y;
  // A^T is K x M in memory: consecutive threads take consecutive m (in x when ROWS = TILE).
  const uint flat = y * TILE + x, am = flat % ROWS, ak = flat / ROWS;

  Acc acc = Acc(0);
  for (uint k0 = 0; k0 < K; k0 += TILE) {
    // Element (row, col) of each block is loaded by the thread whose x runs along memory.
    if (TA) {
      As[am * PITCH + ak] = (m0 + am < M && k0 + ak < K) ? A[(k0 + ak) * lda + m0 + am] : T(0);
    } else {
      As[y * PITCH + x] = (m0 + y < M && k0 + x < K) ? A[(m0 + y) * lda + k0 + x] : T(0);
    }
    for (uint r = y; r < TILE; r += ROWS) {
      if (TB) {  // B^T is N x K in memory: x runs along K
        Bs[x * PITCH + r] = (k0 + x < K && n0 + r < N) ? B[(n0 + r) * ldb + k0 + x] : T(0);
      } else {
        Bs[r * PITCH + x] = (k0 + r < K && n0 + x < N) ? B[(k0 + r) * ldb + n0 + x] : T(0);
      }
    }
    threadgroup_barrier(mem_flags::mem_threadgroup);
    for (uint k = 0; k < TILE; ++k) {
      acc = fma(Acc(As[y * PITCH + k]), Acc(Bs[k * PITCH + x]), acc);
    }
    threadgroup_barrier(mem_flags::mem_threadgroup);
  }
  out.store(m0 + y, n0 + x, acc);
}

TSM_MM_INSTANTIATE_ALL(tiled)
