// GPU k-means (Lloyd's algorithm, k-means++ seeding, online updates).
//
// Host code: torch_sparse_metal/ops/kmeans.py; plain-torch oracle:
// torch_sparse_metal/reference/kmeans.py. Shapes: x (n, d) points, c (k, d) centroids, all
// row-major and contiguous; labels are int32 (`uint` here: the host guarantees < k);
// counts are uint32. Every scalar is a separate `constant uint&`, and the host rejects
// sizes whose flat offsets (n * d, n * k, blocks * k * d) would not fit in 32 bits.
//
// One Lloyd iteration, as the host sequences it (roles from the seed plan):
//   kmeans_sq_norms       ||x||^2 and the first ||c||^2, once per fit (then kmeans_drift)
//   matmul_<rung>         D' = -2 x @ c.T + ||c||^2: the project's GEMM (shaders/matmul_*),
//                         launched by the host through ops/matmul.py
//   kmeans_assign         D = clamp_min(||x||^2 + D', 0) and argmin over each row of D + the
//                         minimum (inertia, re-seeding)
//   kmeans_zero           clear the accumulators
//   kmeans_accumulate_*   per-cluster sums and counts: threadgroup partials, then either
//                         native float atomics (Metal 3), CAS on atomic_uint (older GPUs), or
//                         per-block slots + kmeans_reduce_partials (deterministic mode)
//   kmeans_finalize       centroid = sum / count (an empty cluster keeps its old centroid;
//                         the host re-seeds it to the farthest point before this runs)
//   kmeans_drift          max and total squared centroid shift (convergence test), and
//                         ||c||^2 of the new centroids for the next iteration's GEMM
// Plus the online and seeding roles: kmeans_assign_one (one new point), kmeans_pp_update
// (k-means++: min distance to the chosen centroids), kmeans_update_affected (partial_fit).
#include <metal_stdlib>
#include "tsm_common.h"
using namespace metal;

// ---------------------------------------------------------------------------------------
// NaN as the reference has it: torch.argmin, torch.min, torch.max, torch.minimum and
// clamp_min propagate NaN, where Metal's min and max (fmin, fmax) drop it. The estimator
// rejects non-finite points, but the ops take any centroids, distances and norms.

// Whether distance d of cluster j comes before `best` of cluster best_j in torch.argmin's
// order: NaN below every number (the first NaN wins), then the smaller, then the lower j.
template <typename T>
inline bool kmeans_before(T d, uint j, T best, uint best_j) {
  if (isnan(d) || isnan(best)) {
    return isnan(d) && (!isnan(best) || j < best_j);
  }
  return d < best || (d == best && j < best_j);
}

// torch.minimum and torch.maximum: a NaN operand is the result.
template <typename T>
inline T kmeans_min(T a, T b) {
  return isnan(a) || a < b ? a : b;
}
template <typename T>
inline T kmeans_max(T a, T b) {
  return isnan(a) || a > b ? a : b;
}

// ---------------------------------------------------------------------------------------
// Distances

// Row staging, shared by kmeans_sq_norms and kmeans_assign: one thread per row, lane l of
// a SIMD-group owning row p0 + l. Each lane reading its own row would put the 32 lanes of
// every load a row apart (one 128-byte segment each when rows are 128 bytes or more: the
// emulator's counters gave 7% of the minimum transactions for kmeans_assign at k = 16, 3%
// for kmeans_sq_norms at d = 32). Instead the SIMD-group stages its 32 rows through
// threadgroup memory, up to 256 bytes of each row at a time (64 float columns, 32
// double): consecutive lanes load consecutive elements of the block, then each lane scans
// its row of the tile, whose pitch is odd so that the 32 lanes' reads fall on 32 banks.
// When the block is the whole row (up to 64 float columns) the SIMD-group's rows are one
// contiguous run of 32 rows starting on a 128-byte boundary (p0 is a multiple of 32):
// every instruction is one whole segment. For wider rows that holds when the row length
// is a multiple of 32; otherwise each 256-byte row piece straddles one more segment than
// it fills (100 columns: about 50%). Blocks of 32 columns made 40 columns take two per
// row, one straddling (47%). The host rounds the grid up to whole threadgroups of
// KMEANS_STAGE_GROUP threads, so every lane exists and reaches the barriers.
constant constexpr uint KMEANS_STAGE_GROUP = 64;  // 2 SIMD-groups

// Columns of a row per block: 256 bytes, so that a 2-SIMD-group tile stays near 16 KB.
template <typename T>
constexpr uint kmeans_stage_cols() {
  return 256 / sizeof(T);
}

// Columns j0 .. j0 + cols of rows p0 .. p0 + rows of `src` (row length ld) -> tile rows
// `pitch` apart.
template <typename T>
inline void kmeans_stage_in(threadgroup T* tile, device const T* src, uint ld, uint p0,
                            uint rows, uint j0, uint cols, uint pitch, uint lane) {
  for (uint e = lane; e < rows * cols; e += 32) {
    const uint r = e / cols, c = e % cols;
    tile[r * pitch + c] = src[(p0 + r) * ld + j0 + c];
  }
}

// out[i] = ||rows[i]||^2, rows staged as above. Done once per fit for x (it never changes)
// and for the initial centroids (kmeans_drift gives the later ones' norms): cheaper than
// recomputing inside the GEMM. The squares are added in column order, as kmeans_drift does.
template <typename T>
[[kernel]] void kmeans_sq_norms(
    device const T* rows      [[buffer(0)]],  // (n, d)
    device T* out             [[buffer(1)]],  // (n)
    constant uint& n          [[buffer(2)]],
    constant uint& d          [[buffer(3)]],
    uint gid                  [[thread_position_in_grid]],
    uint lane                 [[thread_index_in_simdgroup]],
    uint simd                 [[simdgroup_index_in_threadgroup]]) {
  constexpr uint COLS = kmeans_stage_cols<T>(), TILE = 32 * (COLS + 1);  // pitch up to COLS + 1
  constexpr uint TILES = (KMEANS_STAGE_GROUP / 32) * TILE;
  threadgroup T tile[TILES];
  const uint base = simd * TILE;  // this SIMD-group's tile
  const uint p0 = gid - lane;     // the SIMD-group's first row
  const uint count = p0 < n ? min(32u, n - p0) : 0u;
  T acc = T(0);
  for (uint j0 = 0; j0 < d; j0 += COLS) {
    const uint cols = min(COLS, d - j0);
    const uint pitch = cols | 1u;
    kmeans_stage_in(tile + base, rows, d, p0, count, j0, cols, pitch, lane);
    threadgroup_barrier(mem_flags::mem_threadgroup);
    if (gid < n) {
      for (uint c = 0; c < cols; ++c) {
        const T v = tile[base + lane * pitch + c];
        acc = fma(v, v, acc);
      }
    }
    threadgroup_barrier(mem_flags::mem_threadgroup);
  }
  if (gid < n) {
    out[gid] = acc;
  }
}

// Distances go through the project's GEMM (ops/matmul.py: launch_matmul, whichever rung
// its chooser picks): the host runs D' = -2 x @ c.T + ||c||^2 (alpha = -2, the centroid
// norms a broadcast row bias, c.T read in place), which turns the n*k*d
// subtract-square-add work into a matrix product. kmeans_assign then finishes each row,
// D = clamp_min(||x||^2 + D', 0), while it scans it: no dispatch of its own.

// Flags of kmeans_assign.
constant constexpr uint KMEANS_ASSIGN_ADD_X_SQ = 1u;  // dist holds D': add x_sq, clamp at 0
constant constexpr uint KMEANS_ASSIGN_STORE = 2u;     // write the finished row back to dist

// labels[i] = argmin_j D[i, j] (the lowest j on ties, as torch.argmin and scikit-learn;
// a NaN is the minimum, as torch's: kmeans_before), min_dist[i] = that minimum. With
// KMEANS_ASSIGN_ADD_X_SQ the row read is the GEMM's D' and each entry becomes
// clamp_min(x_sq[i] + D'[i, j], 0) before the comparison: the clamp because cancellation
// can make the exact 0 of a point sitting on its centroid come out slightly negative. With
// KMEANS_ASSIGN_STORE the finished entries are written back in place (the host's
// `distances`, which returns D). Without flags, dist is a finished D, only read, and x_sq
// is not read. Rows are staged as described above kmeans_sq_norms; finished entries go
// back the same way, the SIMD-group's 32 lanes writing consecutive elements of the block.
template <typename T>
[[kernel]] void kmeans_assign(
    device T* dist            [[buffer(0)]],  // (n, k)
    device const T* x_sq      [[buffer(1)]],  // (n), read with KMEANS_ASSIGN_ADD_X_SQ only
    device int* labels        [[buffer(2)]],  // (n)
    device T* min_dist        [[buffer(3)]],  // (n)
    constant uint& n          [[buffer(4)]],
    constant uint& k          [[buffer(5)]],
    constant uint& flags      [[buffer(6)]],
    uint gid                  [[thread_position_in_grid]],
    uint lane                 [[thread_index_in_simdgroup]],
    uint simd                 [[simdgroup_index_in_threadgroup]]) {
  constexpr uint COLS = kmeans_stage_cols<T>(), TILE = 32 * (COLS + 1);  // pitch up to COLS + 1
  constexpr uint TILES = (KMEANS_STAGE_GROUP / 32) * TILE;
  threadgroup T tile[TILES];
  const uint base = simd * TILE;  // this SIMD-group's tile
  const uint p0 = gid - lane;  // the SIMD-group's first point
  const uint rows = p0 < n ? min(32u, n - p0) : 0u;
  const bool add = (flags & KMEANS_ASSIGN_ADD_X_SQ) != 0;
  const bool store = add && (flags & KMEANS_ASSIGN_STORE) != 0;
  const T xs = add && gid < n ? x_sq[gid] : T(0);
  T best = T(0);
  uint best_j = 0;
  for (uint j0 = 0; j0 < k; j0 += COLS) {
    const uint cols = min(COLS, k - j0);
    const uint pitch = cols | 1u;
    kmeans_stage_in(tile + base, dist, k, p0, rows, j0, cols, pitch, lane);
    threadgroup_barrier(mem_flags::mem_threadgroup);
    if (gid < n) {
      for (uint c = 0; c < cols; ++c) {
        T v = tile[base + lane * pitch + c];
        if (add) {
          v = kmeans_max(xs + v, T(0));
          if (store) {
            tile[base + lane * pitch + c] = v;
          }
        }
        if ((j0 == 0 && c == 0) || kmeans_before(v, j0 + c, best, best_j)) {
          best = v;
          best_j = j0 + c;
        }
      }
    }
    threadgroup_barrier(mem_flags::mem_threadgroup);
    if (store) {
      for (uint e = lane; e < rows * cols; e += 32) {
        const uint r = e / cols, c = e % cols;
        dist[(p0 + r) * k + j0 + c] = tile[base + r * pitch + c];
      }
      threadgroup_barrier(mem_flags::mem_threadgroup);  // before the next block overwrites it
    }
  }
  if (gid < n) {
    labels[gid] = int(best_j);
    min_dist[gid] = best;
  }
}

// ---------------------------------------------------------------------------------------
// Accumulation: sums[c, f] = sum of x[p, f] over points p with label c; counts[c] = |c|.

// sums[i] = 0 for i < k * d and counts[c] = 0 for c < k: one thread per sum (d >= 1, so the
// k * d grid covers the counts too). The atomic variants add into these.
template <typename T>
[[kernel]] void kmeans_zero(
    device T* sums            [[buffer(0)]],  // (k, d)
    device uint* counts       [[buffer(1)]],  // (k)
    constant uint& k          [[buffer(2)]],
    constant uint& d          [[buffer(3)]],
    uint gid                  [[thread_position_in_grid]]) {
  if (gid < k * d) {
    sums[gid] = T(0);
  }
  if (gid < k) {
    counts[gid] = 0;
  }
}

// The shared first half of every accumulate kernel, run by each thread on its own slots
// (no barrier inside: the kernels place it).
//
// Grid: (feature tiles * TF, point blocks * TP), threadgroups of exactly (TF, TP) threads
// (the host rounds both dimensions up to whole groups). Threadgroup (gx, gy) handles the
// features [gx * TF, gx * TF + TF) of the points [gy * block, gy * block + block). Thread
// (lf, lp) walks the points lp, lp + TP, ... of the block and adds feature lf into its own
// row of the partial sums, partial[lp][c][lf], so no two threads ever write one slot and
// threadgroup memory needs no atomics (Metal has no threadgroup atomic_float anyway).
// Column lf == 0 also counts the points per cluster into partial_counts[lp][c].
//
// Apple GPUs serialise contended float atomics (M1/M2 run them as CAS loops), so this
// turns one device atomic per point and feature into one per (block, cluster present in
// the block, feature): `block` times fewer when the clusters are mixed, and the contention
// on a cluster's row drops by the same factor.
template <typename T>
inline void kmeans_accumulate_block(device const T* x, device const int* labels,
                                    threadgroup T* partial, threadgroup uint* partial_counts,
                                    uint n, uint k, uint d, uint block,
                                    uint2 lid, uint2 group, uint2 size) {
  const uint tf = size.x, tp = size.y;
  const uint f = group.x * tf + lid.x;
  threadgroup T* mine = partial + lid.y * k * tf + lid.x;   // slot of cluster c: mine[c * tf]
  threadgroup uint* my_counts = partial_counts + lid.y * k;
  for (uint c = 0; c < k; ++c) {
    mine[c * tf] = T(0);
  }
  if (lid.x == 0) {
    for (uint c = 0; c < k; ++c) {
      my_counts[c] = 0;
    }
  }
  const uint start = group.y * block;
  const uint end = min(start + block, n);
  for (uint p = start + lid.y; p < end; p += tp) {
    const uint c = uint(labels[p]);
    if (c >= k) {
      continue;  // the host never sends one; a bad label must not write outside partial
    }
    if (f < d) {
      mine[c * tf] += x[p * d + f];
    }
    if (lid.x == 0) {
      my_counts[c] += 1;
    }
  }
}

// How many points of cluster c the block held: the column lf == 0 of each row lp counted.
inline uint kmeans_block_count(threadgroup const uint* partial_counts, uint c, uint k, uint tp) {
  uint total = 0;
  for (uint q = 0; q < tp; ++q) {
    total += partial_counts[q * k + c];
  }
  return total;
}

// The block's sum for (c, lf), adding the TP rows in a fixed order. Callers name T: in
// sanitized emulator builds `threadgroup const T*` is a checked-pointer class, and a
// template cannot deduce T through the const from a non-const argument.
template <typename T>
inline T kmeans_block_sum(threadgroup const T* partial, uint c, uint lf, uint k, uint tf,
                          uint tp) {
  T total = T(0);
  for (uint q = 0; q < tp; ++q) {
    total += partial[(q * k + c) * tf + lf];
  }
  return total;
}

// Native float atomics: `atomic<T>` is atomic_float, which needs Metal 3 (macOS 13, an
// Apple7+ or Metal-3 GPU family). The guard keeps the library compiling under older
// language versions, where the host picks kmeans_accumulate_cas instead. (The emulator
// also instantiates atomic<double>.)
#if __METAL_VERSION__ >= 300
template <typename T>
[[kernel]] void kmeans_accumulate_atomic(
    device const T* x              [[buffer(0)]],  // (n, d)
    device const int* labels       [[buffer(1)]],  // (n)
    device atomic<T>* sums         [[buffer(2)]],  // (k, d), zeroed by kmeans_zero
    device atomic_uint* counts     [[buffer(3)]],  // (k), zeroed by kmeans_zero
    constant uint& n               [[buffer(4)]],
    constant uint& k               [[buffer(5)]],
    constant uint& d               [[buffer(6)]],
    constant uint& block           [[buffer(7)]],  // points per threadgroup row of the grid
    threadgroup T* partial         [[threadgroup(0)]],  // (TP, k, TF)
    threadgroup uint* partial_counts [[threadgroup(1)]],  // (TP, k)
    uint2 lid                      [[thread_position_in_threadgroup]],
    uint2 group                    [[threadgroup_position_in_grid]],
    uint2 size                     [[threads_per_threadgroup]]) {
  kmeans_accumulate_block(x, labels, partial, partial_counts, n, k, d, block, lid, group, size);
  threadgroup_barrier(mem_flags::mem_threadgroup);
  // Flush: the group's threads share the k * TF (cluster, feature) sums, then the counts.
  const uint tf = size.x, tp = size.y;
  const uint tid = lid.y * tf + lid.x, nthreads = tf * tp;
  for (uint s = tid; s < k * tf; s += nthreads) {
    const uint c = s / tf, lf = s % tf, f = group.x * tf + lf;
    // Clusters absent from the block add nothing: skip their atomics.
    if (f >= d || kmeans_block_count(partial_counts, c, k, tp) == 0) {
      continue;
    }
    atomic_fetch_add_explicit(&sums[c * d + f], kmeans_block_sum<T>(partial, c, lf, k, tf, tp),
                              memory_order_relaxed);
  }
  if (group.x == 0) {  // every feature tile counted the same points: count them once
    for (uint c = tid; c < k; c += nthreads) {
      const uint cnt = kmeans_block_count(partial_counts, c, k, tp);
      if (cnt != 0) {
        atomic_fetch_add_explicit(&counts[c], cnt, memory_order_relaxed);
      }
    }
  }
}
#endif

// sum += value on a float stored as the bits of an atomic_uint: the seed's emulation of
// atomic_float for GPUs without Metal 3. The weak CAS may fail spuriously, and on failure
// it reloads `expected` with the current bits, so the loop recomputes from fresh data and
// retries until its own exchange lands (the emulator's sanitizer injects spurious failures
// to prove the retry).
inline void kmeans_atomic_add_float_cas(device atomic_uint* addr, float value) {
  uint expected = atomic_load_explicit(addr, memory_order_relaxed);
  while (!atomic_compare_exchange_weak_explicit(addr, &expected,
                                                as_type<uint>(as_type<float>(expected) + value),
                                                memory_order_relaxed, memory_order_relaxed)) {
  }
}

// kmeans_accumulate_atomic for GPUs without atomic_float: the same float sums, bound as
// atomic_uint (a float 0.0 is all-zero bits, so kmeans_zero serves both). float only (a
// plain kernel, its host name written out): the bits of the value must fit the 32-bit
// atomic.
kernel void kmeans_accumulate_cas_float(
    device const float* x         [[buffer(0)]],
    device const int* labels      [[buffer(1)]],
    device atomic_uint* sums      [[buffer(2)]],  // (k, d) floats as bits, zeroed
    device atomic_uint* counts    [[buffer(3)]],
    constant uint& n              [[buffer(4)]],
    constant uint& k              [[buffer(5)]],
    constant uint& d              [[buffer(6)]],
    constant uint& block          [[buffer(7)]],
    threadgroup float* partial    [[threadgroup(0)]],
    threadgroup uint* partial_counts [[threadgroup(1)]],
    uint2 lid                     [[thread_position_in_threadgroup]],
    uint2 group                   [[threadgroup_position_in_grid]],
    uint2 size                    [[threads_per_threadgroup]]) {
  kmeans_accumulate_block(x, labels, partial, partial_counts, n, k, d, block, lid, group, size);
  threadgroup_barrier(mem_flags::mem_threadgroup);
  const uint tf = size.x, tp = size.y;
  const uint tid = lid.y * tf + lid.x, nthreads = tf * tp;
  for (uint s = tid; s < k * tf; s += nthreads) {
    const uint c = s / tf, lf = s % tf, f = group.x * tf + lf;
    if (f >= d || kmeans_block_count(partial_counts, c, k, tp) == 0) {
      continue;
    }
    kmeans_atomic_add_float_cas(&sums[c * d + f], kmeans_block_sum<float>(partial, c, lf, k, tf, tp));
  }
  if (group.x == 0) {
    for (uint c = tid; c < k; c += nthreads) {
      const uint cnt = kmeans_block_count(partial_counts, c, k, tp);
      if (cnt != 0) {
        atomic_fetch_add_explicit(&counts[c], cnt, memory_order_relaxed);
      }
    }
  }
}

// Deterministic mode, pass 1: the same threadgroup partials, but each block writes its sums
// to its own slots, block_sums[gy][c][f] and block_counts[gy][c], instead of adding them
// atomically: no two threads of the dispatch touch one slot, so there is nothing to order.
// Every slot is written (zeros included): pass 2 reads them all.
template <typename T>
[[kernel]] void kmeans_accumulate_blocks(
    device const T* x              [[buffer(0)]],
    device const int* labels       [[buffer(1)]],
    device T* block_sums           [[buffer(2)]],  // (blocks, k, d)
    device uint* block_counts      [[buffer(3)]],  // (blocks, k)
    constant uint& n               [[buffer(4)]],
    constant uint& k               [[buffer(5)]],
    constant uint& d               [[buffer(6)]],
    constant uint& block           [[buffer(7)]],
    threadgroup T* partial         [[threadgroup(0)]],
    threadgroup uint* partial_counts [[threadgroup(1)]],
    uint2 lid                      [[thread_position_in_threadgroup]],
    uint2 group                    [[threadgroup_position_in_grid]],
    uint2 size                     [[threads_per_threadgroup]]) {
  kmeans_accumulate_block(x, labels, partial, partial_counts, n, k, d, block, lid, group, size);
  threadgroup_barrier(mem_flags::mem_threadgroup);
  const uint tf = size.x, tp = size.y;
  const uint tid = lid.y * tf + lid.x, nthreads = tf * tp;
  for (uint s = tid; s < k * tf; s += nthreads) {
    const uint c = s / tf, lf = s % tf, f = group.x * tf + lf;
    if (f < d) {
      block_sums[(group.y * k + c) * d + f] = kmeans_block_sum<T>(partial, c, lf, k, tf, tp);
    }
  }
  if (group.x == 0) {
    for (uint c = tid; c < k; c += nthreads) {
      block_counts[group.y * k + c] = kmeans_block_count(partial_counts, c, k, tp);
    }
  }
}

// Deterministic mode, pass 2: sums[c, f] = block_sums[0][c][f] + block_sums[1][c][f] + ...
// in block order, one thread per (c, f) (the thread of f == 0 also adds the counts). The
// order of every addition is fixed by the launch shape alone, so results are bit-identical
// run to run, whatever order the GPU ran the threadgroups in.
template <typename T>
[[kernel]] void kmeans_reduce_blocks(
    device const T* block_sums     [[buffer(0)]],  // (blocks, k, d)
    device const uint* block_counts [[buffer(1)]],  // (blocks, k)
    device T* sums                 [[buffer(2)]],  // (k, d)
    device uint* counts            [[buffer(3)]],  // (k)
    constant uint& blocks          [[buffer(4)]],
    constant uint& k               [[buffer(5)]],
    constant uint& d               [[buffer(6)]],
    uint gid                       [[thread_position_in_grid]]) {
  if (gid >= k * d) {
    return;
  }
  const uint kd = k * d;
  T total = T(0);
  for (uint b = 0; b < blocks; ++b) {
    total += block_sums[b * kd + gid];
  }
  sums[gid] = total;
  if (gid % d == 0) {
    const uint c = gid / d;
    uint cnt = 0;
    for (uint b = 0; b < blocks; ++b) {
      cnt += block_counts[b * k + c];
    }
    counts[c] = cnt;
  }
}

// ---------------------------------------------------------------------------------------
// Update and convergence

// centroid[c] = sums[c] / counts[c]. A cluster with no points keeps its previous centroid
// instead of dividing 0 by 0: the host re-seeds empty clusters (to the points farthest from
// their centroids, as scikit-learn does) by editing sums and counts before this runs, so a
// count of 0 reaching here is only a fallback, and never a NaN.
template <typename T>
[[kernel]] void kmeans_finalize(
    device const T* sums          [[buffer(0)]],  // (k, d)
    device const uint* counts     [[buffer(1)]],  // (k)
    device const T* old_centroids [[buffer(2)]],  // (k, d)
    device T* centroids           [[buffer(3)]],  // (k, d) out
    constant uint& k              [[buffer(4)]],
    constant uint& d              [[buffer(5)]],
    uint gid                      [[thread_position_in_grid]]) {
  if (gid >= k * d) {
    return;
  }
  const uint cnt = counts[gid / d];
  centroids[gid] = cnt != 0 ? sums[gid] / T(cnt) : old_centroids[gid];
}

// out[0] = max_c ||new_c - old_c||^2 (the seed's drift) and out[1] = the sum over c
// (scikit-learn's center_shift_tot, the tolerance test). One threadgroup of a power-of-two
// size: k is small, and a single group reduces in a fixed order with no atomics (max has no
// float atomic anyway), so the result is deterministic. Threads stride over the centroids,
// then a tree over threadgroup memory, a barrier per stage.
//
// While it reads the new centroids it also writes new_sq[c] = ||new_c||^2, the bias row of
// the next iteration's distance GEMM, with the same fma order as kmeans_sq_norms (so the
// same bits): that saves the loop a kmeans_sq_norms dispatch per iteration.
template <typename T>
[[kernel]] void kmeans_drift(
    device const T* old_centroids [[buffer(0)]],  // (k, d)
    device const T* new_centroids [[buffer(1)]],  // (k, d)
    device T* out                 [[buffer(2)]],  // (2)
    device T* new_sq              [[buffer(3)]],  // (k)
    constant uint& k              [[buffer(4)]],
    constant uint& d              [[buffer(5)]],
    threadgroup T* scratch        [[threadgroup(0)]],  // (2 * group size): maxima, sums
    uint lid                      [[thread_position_in_threadgroup]],
    uint size                     [[threads_per_threadgroup]]) {
  T local_max = T(0), local_sum = T(0);
  for (uint c = lid; c < k; c += size) {
    T shift = T(0), norm = T(0);
    for (uint f = 0; f < d; ++f) {
      const T value = new_centroids[c * d + f];
      const T delta = value - old_centroids[c * d + f];
      shift = fma(delta, delta, shift);
      norm = fma(value, value, norm);
    }
    new_sq[c] = norm;
    local_max = kmeans_max(local_max, shift);
    local_sum += shift;
  }
  threadgroup T* maxima = scratch;
  threadgroup T* totals = scratch + size;
  maxima[lid] = local_max;
  totals[lid] = local_sum;
  threadgroup_barrier(mem_flags::mem_threadgroup);
  for (uint stride = size / 2; stride > 0; stride /= 2) {
    if (lid < stride) {
      maxima[lid] = kmeans_max(maxima[lid], maxima[lid + stride]);
      totals[lid] += totals[lid + stride];
    }
    threadgroup_barrier(mem_flags::mem_threadgroup);
  }
  if (lid == 0) {
    out[0] = maxima[0];
    out[1] = totals[0];
  }
}

// ---------------------------------------------------------------------------------------
// Online updates and seeding

// The nearest centroid of ONE point (the seed's real-time tier 1): a GEMM tile would idle
// 15/16 of its threads, so one threadgroup of a power-of-two size strides over the k
// centroids with the direct ||x - c||^2 (exact: no cancellation), then reduces
// (distance, index) pairs in a tree, lowest index on ties, as kmeans_assign.
constant constexpr uint KMEANS_NO_CLUSTER = 0xFFFFFFFFu;

template <typename T>
[[kernel]] void kmeans_assign_one(
    device const T* point         [[buffer(0)]],  // (d)
    device const T* c             [[buffer(1)]],  // (k, d)
    device int* label             [[buffer(2)]],  // (1)
    device T* distance            [[buffer(3)]],  // (1)
    constant uint& k              [[buffer(4)]],
    constant uint& d              [[buffer(5)]],
    threadgroup T* best_dist      [[threadgroup(0)]],  // (group size)
    threadgroup uint* best_index  [[threadgroup(1)]],  // (group size)
    uint lid                      [[thread_position_in_threadgroup]],
    uint size                     [[threads_per_threadgroup]]) {
  T mine = T(0);
  uint mine_j = KMEANS_NO_CLUSTER;  // threads past k hold no candidate
  for (uint j = lid; j < k; j += size) {
    T acc = T(0);
    for (uint f = 0; f < d; ++f) {
      const T delta = point[f] - c[j * d + f];
      acc = fma(delta, delta, acc);
    }
    if (mine_j == KMEANS_NO_CLUSTER || kmeans_before(acc, j, mine, mine_j)) {
      mine = acc;
      mine_j = j;
    }
  }
  best_dist[lid] = mine;
  best_index[lid] = mine_j;
  threadgroup_barrier(mem_flags::mem_threadgroup);
  for (uint stride = size / 2; stride > 0; stride /= 2) {
    if (lid < stride) {
      const T other = best_dist[lid + stride];
      const uint other_j = best_index[lid + stride];
      const uint cur_j = best_index[lid];
      const T cur = best_dist[lid];
      const bool take = other_j != KMEANS_NO_CLUSTER &&
                        (cur_j == KMEANS_NO_CLUSTER || kmeans_before(other, other_j, cur, cur_j));
      if (take) {
        best_dist[lid] = other;
        best_index[lid] = other_j;
      }
    }
    threadgroup_barrier(mem_flags::mem_threadgroup);
  }
  if (lid == 0) {
    label[0] = int(best_index[0]);
    distance[0] = best_dist[0];
  }
}

// k-means++ seeding step: after the host picks a new centroid, every point's squared
// distance to its nearest chosen centroid becomes min(old, ||x - chosen||^2); the next
// centroid is sampled in proportion to these. One thread per point; the direct difference
// (one centroid: no GEMM to gain, and no cancellation). The host passes +inf as `min_in`
// for the first centroid. In and out are separate buffers so the op never edits its input.
template <typename T>
[[kernel]] void kmeans_pp_update(
    device const T* x             [[buffer(0)]],  // (n, d)
    device const T* chosen        [[buffer(1)]],  // (d)
    device const T* min_in        [[buffer(2)]],  // (n)
    device T* min_out             [[buffer(3)]],  // (n)
    constant uint& n              [[buffer(4)]],
    constant uint& d              [[buffer(5)]],
    uint gid                      [[thread_position_in_grid]]) {
  if (gid >= n) {
    return;
  }
  device const T* r = x + gid * d;
  T acc = T(0);
  for (uint f = 0; f < d; ++f) {
    const T delta = r[f] - chosen[f];
    acc = fma(delta, delta, acc);
  }
  min_out[gid] = kmeans_min(min_in[gid], acc);
}

// partial_fit (the seed's real-time tier 2): fold a batch's per-cluster sums and counts
// (from the accumulate kernels) into running means. Only clusters the batch touched move:
// c += (batch_sum - batch_count * c) / (count + batch_count), the running mean of every
// point each centroid has absorbed. One thread per (c, f); the f == 0 thread writes the new
// count. Outputs are separate buffers: threads of cluster c read counts[c] while another
// would be writing it in place.
template <typename T>
[[kernel]] void kmeans_update_affected(
    device const T* centroids     [[buffer(0)]],  // (k, d)
    device const uint* counts     [[buffer(1)]],  // (k) points absorbed so far
    device const T* batch_sums    [[buffer(2)]],  // (k, d)
    device const uint* batch_counts [[buffer(3)]],  // (k)
    device T* new_centroids       [[buffer(4)]],  // (k, d)
    device uint* new_counts       [[buffer(5)]],  // (k)
    constant uint& k              [[buffer(6)]],
    constant uint& d              [[buffer(7)]],
    uint gid                      [[thread_position_in_grid]]) {
  if (gid >= k * d) {
    return;
  }
  const uint c = gid / d;
  const uint added = batch_counts[c];
  const uint total = counts[c] + added;  // the host keeps counts below 2^32 - batch
  const T old = centroids[gid];
  new_centroids[gid] = added != 0 ? old + (batch_sums[gid] - T(added) * old) / T(total) : old;
  if (gid % d == 0) {
    new_counts[c] = total;
  }
}

// ---------------------------------------------------------------------------------------
// Instantiations: float everywhere; double on the emulator only (Metal has no double).

TSM_FOR_FLOAT(TSM_INSTANTIATE_KERNEL("kmeans_sq_norms_float", kmeans_sq_norms, float))
TSM_FOR_FLOAT(TSM_INSTANTIATE_KERNEL("kmeans_assign_float", kmeans_assign, float))
TSM_FOR_FLOAT(TSM_INSTANTIATE_KERNEL("kmeans_zero_float", kmeans_zero, float))
TSM_FOR_FLOAT(TSM_INSTANTIATE_KERNEL("kmeans_accumulate_blocks_float", kmeans_accumulate_blocks, float))
TSM_FOR_FLOAT(TSM_INSTANTIATE_KERNEL("kmeans_reduce_blocks_float", kmeans_reduce_blocks, float))
TSM_FOR_FLOAT(TSM_INSTANTIATE_KERNEL("kmeans_finalize_float", kmeans_finalize, float))
TSM_FOR_FLOAT(TSM_INSTANTIATE_KERNEL("kmeans_drift_float", kmeans_drift, float))
TSM_FOR_FLOAT(TSM_INSTANTIATE_KERNEL("kmeans_assign_one_float", kmeans_assign_one, float))
TSM_FOR_FLOAT(TSM_INSTANTIATE_KERNEL("kmeans_pp_update_float", kmeans_pp_update, float))
TSM_FOR_FLOAT(TSM_INSTANTIATE_KERNEL("kmeans_update_affected_float", kmeans_update_affected, float))
TSM_EMULATOR_ONLY(TSM_INSTANTIATE_KERNEL("kmeans_sq_norms_double", kmeans_sq_norms, double))
TSM_EMULATOR_ONLY(TSM_INSTANTIATE_KERNEL("kmeans_assign_double", kmeans_assign, double))
TSM_EMULATOR_ONLY(TSM_INSTANTIATE_KERNEL("kmeans_zero_double", kmeans_zero, double))
TSM_EMULATOR_ONLY(TSM_INSTANTIATE_KERNEL("kmeans_accumulate_blocks_double", kmeans_accumulate_blocks, double))
TSM_EMULATOR_ONLY(TSM_INSTANTIATE_KERNEL("kmeans_reduce_blocks_double", kmeans_reduce_blocks, double))
TSM_EMULATOR_ONLY(TSM_INSTANTIATE_KERNEL("kmeans_finalize_double", kmeans_finalize, double))
TSM_EMULATOR_ONLY(TSM_INSTANTIATE_KERNEL("kmeans_drift_double", kmeans_drift, double))
TSM_EMULATOR_ONLY(TSM_INSTANTIATE_KERNEL("kmeans_assign_one_double", kmeans_assign_one, double))
TSM_EMULATOR_ONLY(TSM_INSTANTIATE_KERNEL("kmeans_pp_update_double", kmeans_pp_update, double))
TSM_EMULATOR_ONLY(TSM_INSTANTIATE_KERNEL("kmeans_update_affected_double", kmeans_update_affected, double))

#if __METAL_VERSION__ >= 300
TSM_FOR_FLOAT(TSM_INSTANTIATE_KERNEL("kmeans_accumulate_atomic_float", kmeans_accumulate_atomic, float))
TSM_EMULATOR_ONLY(TSM_INSTANTIATE_KERNEL("kmeans_accumulate_atomic_double",
                                         kmeans_accumulate_atomic, double))
#endif
