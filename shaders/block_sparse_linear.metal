// Block-sparse linear layer: out = x @ W.T + bias, W stored as BSR of B x B blocks (B = 8,
// 16 or 32), block rows by target neuron.
//
// Host code: torch_sparse_metal/ops/block_sparse_linear.py. The layout:
//   crow (out_features / B + 1): block row r holds blocks crow[r] .. crow[r + 1]
//   col (nnzb): the block column of each block
//   values (nnzb, B, B): values[k][i][j] = W[r B + i, c B + j] for block k at (r, c)
// and its by-source twin for the backward, built once per pattern on the device:
//   src_ptr (in_features / B + 1), src_rows (nnzb): the block row of each block in
//   block-column order, src_perm (nnzb): its block id k (where its values live).
// Activations are (batch, features), row-major, as torch's. T is float, half or bfloat
// (double on the emulator); sums run in Acc = tsm_acc<T>::type and are rounded once.
//
// Two families, chosen by the host from the GPU's capabilities as the matmul ladder is:
// * *_simdgroup: simdgroup_matrix 8x8 fragments (Apple7+, M1 and later). A block is
//   (B / 8)^2 fragments; each lane loads its two elements of a fragment through
//   thread_elements() in Apple's layout (lane l holds row fr = (q & 4) + (l / 2) % 4, columns
//   fc, fc + 1 with fc = (q & 2) * 2 + (l % 2) * 2, q = l / 4), as matmul_simdgroup does, from
//   device memory: a block is read whole, so there is no edge to stage around except the
//   batch's, whose missing rows load as zeros.
// * *_shuffle: plain FMAs for GPUs without simdgroup_matrix. A SIMD-group's lanes split the
//   same tile; a row of activations is loaded once, a lane per element, and simd_shuffle
//   hands each element to the lanes that need it.
//
// Work is per SIMD-group ("task"): the grid is tasks x 32 threads, whole SIMD-groups, so
// every lane of a task reaches its collectives. The forward's task is (block row r, a tile
// of batch rows: 32 for the simdgroup kernels, so that each weight fragment feeds 4
// products, 8 for the shuffle kernels); the backward's tasks are three ranges, each present
// only when its gradient is needed (as sparse_linear_backward_deterministic's): (block
// column c, a tile of batch rows) for grad_input through the by-source twin; one block (by-source position p) for its
// grad_values, the B x B sum over the batch; 32 output features for grad_bias. Every output
// has one writer: no atomics, no zero-fill, and the same bits every run.
//
// The host validates every pattern when it is built; the kernels check each index they
// follow as sparse_linear.metal's do: an index written behind torch's back makes the
// outputs that depend on it NaN and flags TSM_ERROR_BAD_PATTERN_INDEX, never a read outside
// a buffer.
#include <metal_stdlib>
#include "tsm_common.h"
using namespace metal;

// Apple's fragment layout: the (row, column) of this lane's first element (the second is
// one column to the right).
struct TsmFragmentLane {
  uint row, col;
  explicit TsmFragmentLane(uint lane)
      : row(((lane / 4) & 4u) + (lane / 2) % 4), col(((lane / 4) & 2u) * 2 + (lane % 2) * 2) {}
};

// Batch rows per task of the simdgroup kernels' forward and grad_input: 4 fragments, so each
// weight fragment loaded feeds 4 products (the shuffle kernels take 8: one per lane group).
constant constexpr uint TSM_BLOCK_TASK_ROWS = 32;

// Copies rows of COLS elements (ld apart, rows_left of them valid, zeros after) of a device
// matrix into threadgroup memory, COUNT elements a lane: consecutive lanes read consecutive
// elements of a row, so a SIMD-group instruction reads whole rows (the 128-byte segments
// that fragment loads, 8 rows of 2 elements each, would touch 8 of). The simdgroup kernels
// run one SIMD-group per threadgroup (the host launches groups of 32 threads) and take their
// task from the threadgroup's position, so each stages its own tiles and every barrier is
// reached by the whole threadgroup.
template <uint COUNT, uint COLS, typename Acc, typename T>
inline void tsm_stage_rows(threadgroup Acc* dst, device const T* src, uint ld, uint rows_left,
                           uint lane) {
  for (uint n = 0; n < COUNT; ++n) {
    const uint e = lane + 32 * n, r = e / COLS, c = e % COLS;
    dst[e] = r < rows_left ? Acc(src[r * ld + c]) : Acc(0);
  }
}

template <typename T, uint B>
[[kernel]] void block_sparse_linear_forward_simdgroup(
    device const T* input          [[buffer(0)]],   // (batch, in_features)
    device const int* crow         [[buffer(1)]],   // (out_features / B + 1)
    device const int* col          [[buffer(2)]],   // (nnzb)
    device const T* values         [[buffer(3)]],   // (nnzb, B, B)
    device const T* bias           [[buffer(4)]],   // (out_features), read only if has_bias
    device T* output               [[buffer(5)]],   // (batch, out_features)
    constant uint& batch           [[buffer(6)]],
    constant uint& in_features     [[buffer(7)]],
    constant uint& out_features    [[buffer(8)]],
    constant uint& has_bias        [[buffer(9)]],
    constant uint& nnzb            [[buffer(10)]],
    device atomic_uint* errors     [[buffer(11)]],
    uint task                      [[threadgroup_position_in_grid]],  // a SIMD-group each
    uint lane                      [[thread_index_in_simdgroup]]) {
  using Acc = typename tsm_acc<T>::type;
  constexpr uint F = B / 8;  // fragments along a block's side
  const uint tiles = (batch + TSM_BLOCK_TASK_ROWS - 1) / TSM_BLOCK_TASK_ROWS;
  const uint r = task / tiles, b0 = (task % tiles) * TSM_BLOCK_TASK_ROWS;
  if (r >= out_features / B) {
    return;  // a whole SIMD-group: tasks are SIMD-group-sized
  }
  const TsmFragmentLane at(lane);
  constexpr uint BT = TSM_BLOCK_TASK_ROWS / 8;  // 8-row fragments of the batch per task
  threadgroup Acc xs[TSM_BLOCK_TASK_ROWS * B];  // the task's rows of x in the block's columns
  threadgroup Acc ws[B * B];                    // the block

  // acc[t][i]: outputs (b0 + 8 t .. + 8) x (r B + 8 i .. + 8), starting from the bias.
  simdgroup_matrix<Acc, 8, 8> acc[BT][F];
  for (uint i = 0; i < F; ++i) {
    const uint o = r * B + 8 * i + at.col;
    const Acc b_0 = has_bias != 0 ? Acc(bias[o]) : Acc(0);
    const Acc b_1 = has_bias != 0 ? Acc(bias[o + 1]) : Acc(0);
    for (uint t = 0; t < BT; ++t) {
      acc[t][i].thread_elements()[0] = b_0;
      acc[t][i].thread_elements()[1] = b_1;
    }
  }
  const int begin = crow[r], end = crow[r + 1];
  bool bad = !tsm_edge_range_ok(begin, end, nnzb);
  for (int k = begin; !bad && k < end; ++k) {
    const int c = col[k];
    if (uint(c) >= in_features / B) {  // the same k, so the same c, for every lane
      bad = true;
      break;
    }
    threadgroup_barrier(mem_flags::mem_threadgroup);  // the last block's fragments are read
    tsm_stage_rows<B * B / 32, B * B>(ws, values + uint(k) * B * B, B * B, 1, lane);
    tsm_stage_rows<TSM_BLOCK_TASK_ROWS * B / 32, B>(xs, input + b0 * in_features + uint(c) * B,
                                                    in_features, batch - b0, lane);
    threadgroup_barrier(mem_flags::mem_threadgroup);
    for (uint j = 0; j < F; ++j) {
      // x fragments (p, q) = input[b0 + 8 t + p, c B + 8 j + q]
      simdgroup_matrix<Acc, 8, 8> xf[BT];
      for (uint t = 0; t < BT; ++t) {
        threadgroup const Acc* x = xs + (8 * t + at.row) * B + 8 * j + at.col;
        xf[t].thread_elements()[0] = x[0];
        xf[t].thread_elements()[1] = x[1];
      }
      for (uint i = 0; i < F; ++i) {
        // W^T fragment (p, q) = W[r B + 8 i + q, c B + 8 j + p] = block[8 i + q][8 j + p],
        // read once for the task's BT batch fragments.
        simdgroup_matrix<Acc, 8, 8> wf;
        wf.thread_elements()[0] = ws[(8 * i + at.col) * B + 8 * j + at.row];
        wf.thread_elements()[1] = ws[(8 * i + at.col + 1) * B + 8 * j + at.row];
        for (uint t = 0; t < BT; ++t) {
          simdgroup_multiply_accumulate(acc[t][i], xf[t], wf, acc[t][i]);
        }
      }
    }
  }
  if (bad) {
    tsm_flag_error(errors, TSM_ERROR_BAD_PATTERN_INDEX);
  }
  const T nan = T(numeric_limits<Acc>::quiet_NaN());
  for (uint t = 0; t < BT; ++t) {
    const uint row = b0 + 8 * t + at.row;
    if (row < batch) {
      for (uint i = 0; i < F; ++i) {
        device T* y = output + row * out_features + r * B + 8 * i + at.col;
        y[0] = bad ? nan : T(acc[t][i].thread_elements()[0]);
        y[1] = bad ? nan : T(acc[t][i].thread_elements()[1]);
      }
    }
  }
}

// The by-source block at position p: its block row and block id, false when either lies
// outside the pattern.
inline bool tsm_source_block(device const int* src_rows, device const int* src_perm, int p,
                             uint block_rows, uint nnzb, thread uint& r, thread uint& k) {
  r = uint(src_rows[p]);
  k = uint(src_perm[p]);
  return r < block_rows && k < nnzb;
}

// The block column of by-source position p: the last c with src_ptr[c] <= p (valid when
// src_ptr[c] <= p < src_ptr[c + 1] holds, which the caller checks).
inline uint tsm_source_column(device const int* src_ptr, int p, uint block_cols) {
  uint lo = 0, hi = block_cols;
  while (hi - lo > 1) {
    const uint mid = (lo + hi) / 2;
    if (src_ptr[mid] <= p) {
      lo = mid;
    } else {
      hi = mid;
    }
  }
  return lo;
}

// The three task ranges of a backward dispatch (see the top of this file).
struct TsmBackwardTasks {
  uint input, values, bias;
  TsmBackwardTasks(uint batch, uint in_features, uint out_features, uint nnzb, uint block,
                   uint need_input, uint need_values, uint need_bias, uint task_rows)
      : input(need_input != 0 ? (in_features / block) * ((batch + task_rows - 1) / task_rows)
                              : 0u),
        values(need_values != 0 ? nnzb : 0u),
        bias(need_bias != 0 ? (out_features + 31) / 32 : 0u) {}
};

// grad_bias[o] = sum over the batch of grad_output[:, o], a lane per feature, in order.
template <typename T>
inline void tsm_block_grad_bias(device const T* grad_output, device T* grad_bias, uint task,
                                uint lane, uint batch, uint out_features) {
  using Acc = typename tsm_acc<T>::type;
  const uint o = task * 32 + lane;
  if (o < out_features) {
    Acc acc = Acc(0);
    for (uint b = 0; b < batch; ++b) {
      acc += Acc(grad_output[b * out_features + o]);
    }
    grad_bias[o] = T(acc);
  }
}

#define TSM_BLOCK_BACKWARD_PARAMS                                                            \
  device const T* grad_output [[buffer(0)]],  /* (batch, out_features) */                    \
  device const T* input [[buffer(1)]],        /* (batch, in_features), if need_values */     \
  device const T* values [[buffer(2)]],       /* (nnzb, B, B), if need_input */              \
  device const int* src_ptr [[buffer(3)]],    /* (in_features / B + 1) */                    \
  device const int* src_rows [[buffer(4)]],   /* (nnzb) block row, by-source order */        \
  device const int* src_perm [[buffer(5)]],   /* (nnzb) block id, by-source order */         \
  device T* grad_input [[buffer(6)]],         /* (batch, in_features) */                     \
  device T* grad_values [[buffer(7)]],        /* (nnzb, B, B) */                             \
  device T* grad_bias [[buffer(8)]],          /* (out_features) */                           \
  constant uint& batch [[buffer(9)]], constant uint& in_features [[buffer(10)]],             \
  constant uint& out_features [[buffer(11)]], constant uint& nnzb [[buffer(12)]],            \
  constant uint& need_input [[buffer(13)]], constant uint& need_values [[buffer(14)]],       \
  constant uint& need_bias [[buffer(15)]],                                                   \
  device atomic_uint* errors [[buffer(16)]],                                                 \
  uint gid [[thread_position_in_grid]], uint lane [[thread_index_in_simdgroup]]

template <typename T, uint B>
[[kernel]] void block_sparse_linear_backward_simdgroup(
    TSM_BLOCK_BACKWARD_PARAMS, uint group [[threadgroup_position_in_grid]]) {
  using Acc = typename tsm_acc<T>::type;
  constexpr uint F = B / 8;
  constexpr uint BT = TSM_BLOCK_TASK_ROWS / 8;
  const TsmBackwardTasks tasks(batch, in_features, out_features, nnzb, B, need_input,
                               need_values, need_bias, TSM_BLOCK_TASK_ROWS);
  const uint block_rows = out_features / B, block_cols = in_features / B;
  const T nan = T(numeric_limits<Acc>::quiet_NaN());
  const TsmFragmentLane at(lane);
  // Staged tiles (one task per threadgroup): grad_output's rows and the block for
  // grad_input; grad_output's and input's rows for grad_values. B <= 32, so B x B fits tb.
  threadgroup Acc ta[TSM_BLOCK_TASK_ROWS * B];
  threadgroup Acc tb[TSM_BLOCK_TASK_ROWS * B];
  uint task = group;  // threadgroups of one SIMD-group: the barriers below are uniform

  if (task < tasks.input) {
    // grad_input[b0 .. + 32, c B .. + B] = sum over the column's blocks (r, k) of
    // grad_output[b0 .. + 32, r B .. + B] @ W block k.
    const uint tiles = (batch + TSM_BLOCK_TASK_ROWS - 1) / TSM_BLOCK_TASK_ROWS;
    const uint c = task / tiles, b0 = (task % tiles) * TSM_BLOCK_TASK_ROWS;
    simdgroup_matrix<Acc, 8, 8> acc[BT][F];
    for (uint t = 0; t < BT; ++t) {
      for (uint j = 0; j < F; ++j) {
        acc[t][j] = make_filled_simdgroup_matrix<Acc, 8, 8>(Acc(0));
      }
    }
    const int begin = src_ptr[c], end = src_ptr[c + 1];
    bool bad = !tsm_edge_range_ok(begin, end, nnzb);
    for (int p = begin; !bad && p < end; ++p) {
      uint r, k;
      if (!tsm_source_block(src_rows, src_perm, p, block_rows, nnzb, r, k)) {
        bad = true;
        break;
      }
      threadgroup_barrier(mem_flags::mem_threadgroup);
      tsm_stage_rows<TSM_BLOCK_TASK_ROWS * B / 32, B>(
          ta, grad_output + b0 * out_features + r * B, out_features, batch - b0, lane);
      tsm_stage_rows<B * B / 32, B * B>(tb, values + k * B * B, B * B, 1, lane);
      threadgroup_barrier(mem_flags::mem_threadgroup);
      for (uint i = 0; i < F; ++i) {
        simdgroup_matrix<Acc, 8, 8> gf[BT];  // (p, q) = grad_output[b0 + 8 t + p, r B + 8 i + q]
        for (uint t = 0; t < BT; ++t) {
          threadgroup const Acc* g = ta + (8 * t + at.row) * B + 8 * i + at.col;
          gf[t].thread_elements()[0] = g[0];
          gf[t].thread_elements()[1] = g[1];
        }
        for (uint j = 0; j < F; ++j) {
          simdgroup_matrix<Acc, 8, 8> wf;  // (p, q) = block[8 i + p][8 j + q]
          threadgroup const Acc* w = tb + (8 * i + at.row) * B + 8 * j + at.col;
          wf.thread_elements()[0] = w[0];
          wf.thread_elements()[1] = w[1];
          for (uint t = 0; t < BT; ++t) {
            simdgroup_multiply_accumulate(acc[t][j], gf[t], wf, acc[t][j]);
          }
        }
      }
    }
    if (bad) {
      tsm_flag_error(errors, TSM_ERROR_BAD_PATTERN_INDEX);
    }
    for (uint t = 0; t < BT; ++t) {
      const uint row = b0 + 8 * t + at.row;
      if (row < batch) {
        for (uint j = 0; j < F; ++j) {
          device T* out = grad_input + row * in_features + c * B + 8 * j + at.col;
          out[0] = bad ? nan : T(acc[t][j].thread_elements()[0]);
          out[1] = bad ? nan : T(acc[t][j].thread_elements()[1]);
        }
      }
    }
    return;
  }
  task -= tasks.input;

  if (task < tasks.values) {
    // grad_values[k] = grad_output[:, r B .. + B]^T @ input[:, c B .. + B], summed over the
    // batch 8 rows at a time: F x F fragments of the block.
    const int p = int(task);
    uint r, k;
    if (!tsm_source_block(src_rows, src_perm, p, block_rows, nnzb, r, k)) {
      tsm_flag_error(errors, TSM_ERROR_BAD_PATTERN_INDEX);
      return;  // no block to write to
    }
    const uint c = tsm_source_column(src_ptr, p, block_cols);
    device T* out = grad_values + k * B * B;
    if (!(src_ptr[c] <= p && p < src_ptr[c + 1])) {
      for (uint e = lane; e < B * B; e += 32) {
        out[e] = nan;
      }
      tsm_flag_error(errors, TSM_ERROR_BAD_PATTERN_INDEX);
      return;
    }
    simdgroup_matrix<Acc, 8, 8> acc[F][F];
    for (uint i = 0; i < F; ++i) {
      for (uint j = 0; j < F; ++j) {
        acc[i][j] = make_filled_simdgroup_matrix<Acc, 8, 8>(Acc(0));
      }
    }
    for (uint b0 = 0; b0 < batch; b0 += TSM_BLOCK_TASK_ROWS) {
      threadgroup_barrier(mem_flags::mem_threadgroup);
      tsm_stage_rows<TSM_BLOCK_TASK_ROWS * B / 32, B>(
          ta, grad_output + b0 * out_features + r * B, out_features, batch - b0, lane);
      tsm_stage_rows<TSM_BLOCK_TASK_ROWS * B / 32, B>(
          tb, input + b0 * in_features + c * B, in_features, batch - b0, lane);
      threadgroup_barrier(mem_flags::mem_threadgroup);
      for (uint s = 0; s < TSM_BLOCK_TASK_ROWS; s += 8) {
        // grad_output^T fragment (p, q) = grad_output[b0 + s + q, r B + 8 i + p]: this
        // lane's two elements are rows s + col, s + col + 1 of the tile, feature 8 i + row.
        simdgroup_matrix<Acc, 8, 8> gf[F], xf[F];
        for (uint i = 0; i < F; ++i) {
          gf[i].thread_elements()[0] = ta[(s + at.col) * B + 8 * i + at.row];
          gf[i].thread_elements()[1] = ta[(s + at.col + 1) * B + 8 * i + at.row];
        }
        for (uint j = 0; j < F; ++j) {  // input fragment (p, q) = input[b0 + s + p, c B + 8 j + q]
          threadgroup const Acc* x = tb + (s + at.row) * B + 8 * j + at.col;
          xf[j].thread_elements()[0] = x[0];
          xf[j].thread_elements()[1] = x[1];
        }
        for (uint i = 0; i < F; ++i) {
          for (uint j = 0; j < F; ++j) {
            simdgroup_multiply_accumulate(acc[i][j], gf[i], xf[j], acc[i][j]);
          }
        }
      }
    }
    for (uint i = 0; i < F; ++i) {
      for (uint j = 0; j < F; ++j) {
        device T* o = out + (8 * i + at.row) * B + 8 * j + at.col;
        o[0] = T(acc[i][j].thread_elements()[0]);
        o[1] = T(acc[i][j].thread_elements()[1]);
      }
    }
    return;
  }
  task -= tasks.values;

  if (task < tasks.bias) {
    tsm_block_grad_bias(grad_output, grad_bias, task, lane, batch, out_features);
  }
}

// The fallback without simdgroup_matrix. The forward's tile is 8 batch rows x B
// outputs; lane l owns output o = l % B of batch rows l / B + s (32 / B), s < 8 B / 32.
// A row of x restricted to block column c is loaded a lane per element (lane l: element
// l % B of its row) and simd_shuffle brings element j to every lane of the row's group.
template <typename T, uint B>
[[kernel]] void block_sparse_linear_forward_shuffle(
    device const T* input          [[buffer(0)]],
    device const int* crow         [[buffer(1)]],
    device const int* col          [[buffer(2)]],
    device const T* values         [[buffer(3)]],
    device const T* bias           [[buffer(4)]],
    device T* output               [[buffer(5)]],
    constant uint& batch           [[buffer(6)]],
    constant uint& in_features     [[buffer(7)]],
    constant uint& out_features    [[buffer(8)]],
    constant uint& has_bias        [[buffer(9)]],
    constant uint& nnzb            [[buffer(10)]],
    device atomic_uint* errors     [[buffer(11)]],
    uint gid                       [[thread_position_in_grid]],
    uint lane                      [[thread_index_in_simdgroup]]) {
  using Acc = typename tsm_acc<T>::type;
  constexpr uint ROWS = 8 * B / 32, STEP = 32 / B;  // this lane's rows, their spacing
  const uint tiles = (batch + 7) / 8, task = gid / 32;
  const uint r = task / tiles, b0 = (task % tiles) * 8;
  if (r >= out_features / B) {
    return;
  }
  const uint o = lane % B, first = lane / B, group = first * B;
  Acc acc[ROWS];
  for (uint s = 0; s < ROWS; ++s) {
    acc[s] = has_bias != 0 ? Acc(bias[r * B + o]) : Acc(0);
  }
  const int begin = crow[r], end = crow[r + 1];
  bool bad = !tsm_edge_range_ok(begin, end, nnzb);
  for (int k = begin; !bad && k < end; ++k) {
    const int c = col[k];
    if (uint(c) >= in_features / B) {
      bad = true;
      break;
    }
    device const T* w = values + uint(k) * B * B + o * B;  // W[r B + o, c B ..]
    for (uint s = 0; s < ROWS; ++s) {
      const uint row = b0 + first + s * STEP;
      const Acc mine = row < batch ? Acc(input[row * in_features + uint(c) * B + o]) : Acc(0);
      for (uint j = 0; j < B; ++j) {
        const Acc xj = simd_shuffle(mine, ushort(group + j));
        acc[s] = fma(Acc(w[j]), xj, acc[s]);
      }
    }
  }
  if (bad) {
    tsm_flag_error(errors, TSM_ERROR_BAD_PATTERN_INDEX);
  }
  for (uint s = 0; s < ROWS; ++s) {
    const uint row = b0 + first + s * STEP;
    if (row < batch) {
      output[row * out_features + r * B + o] =
          bad ? T(numeric_limits<Acc>::quiet_NaN()) : T(acc[s]);
    }
  }
}

template <typename T, uint B>
[[kernel]] void block_sparse_linear_backward_shuffle(TSM_BLOCK_BACKWARD_PARAMS) {
  using Acc = typename tsm_acc<T>::type;
  constexpr uint ROWS = 8 * B / 32, STEP = 32 / B, CELLS = B * B / 32;
  const TsmBackwardTasks tasks(batch, in_features, out_features, nnzb, B, need_input,
                               need_values, need_bias, 8);
  const uint block_rows = out_features / B, block_cols = in_features / B;
  const T nan = T(numeric_limits<Acc>::quiet_NaN());
  const uint o = lane % B, first = lane / B, group = first * B;
  uint task = gid / 32;

  if (task < tasks.input) {
    // Lane l: grad_input[b0 + l / B + s (32 / B), c B + l % B]; grad_output's row restricted
    // to the block row is shuffled as the forward shuffles x.
    const uint tiles = (batch + 7) / 8;
    const uint c = task / tiles, b0 = (task % tiles) * 8;
    Acc acc[ROWS];
    for (uint s = 0; s < ROWS; ++s) {
      acc[s] = Acc(0);
    }
    const int begin = src_ptr[c], end = src_ptr[c + 1];
    bool bad = !tsm_edge_range_ok(begin, end, nnzb);
    for (int p = begin; !bad && p < end; ++p) {
      uint r, k;
      if (!tsm_source_block(src_rows, src_perm, p, block_rows, nnzb, r, k)) {
        bad = true;
        break;
      }
      device const T* block = values + k * B * B;  // column o: block[i * B + o]
      for (uint s = 0; s < ROWS; ++s) {
        const uint row = b0 + first + s * STEP;
        const Acc mine = row < batch ? Acc(grad_output[row * out_features + r * B + o]) : Acc(0);
        for (uint i = 0; i < B; ++i) {
          const Acc gi = simd_shuffle(mine, ushort(group + i));
          acc[s] = fma(gi, Acc(block[i * B + o]), acc[s]);
        }
      }
    }
    if (bad) {
      tsm_flag_error(errors, TSM_ERROR_BAD_PATTERN_INDEX);
    }
    for (uint s = 0; s < ROWS; ++s) {
      const uint row = b0 + first + s * STEP;
      if (row < batch) {
        grad_input[row * in_features + c * B + o] = bad ? nan : T(acc[s]);
      }
    }
    return;
  }
  task -= tasks.input;

  if (task < tasks.values) {
    // Lane l: cells (i, j) = (l / B + s (32 / B), l % B) of the block, s < B^2 / 32. Per
    // batch row, lane i loads grad_output[b, r B + i] (i < B) and x[b, c B + l % B] is the
    // lane's own: cell (i, j) takes the first from lane i by simd_shuffle.
    const int p = int(task);
    uint r, k;
    if (!tsm_source_block(src_rows, src_perm, p, block_rows, nnzb, r, k)) {
      tsm_flag_error(errors, TSM_ERROR_BAD_PATTERN_INDEX);
      return;
    }
    const uint c = tsm_source_column(src_ptr, p, block_cols);
    device T* out = grad_values + k * B * B;
    if (!(src_ptr[c] <= p && p < src_ptr[c + 1])) {
      for (uint e = lane; e < B * B; e += 32) {
        out[e] = nan;
      }
      tsm_flag_error(errors, TSM_ERROR_BAD_PATTERN_INDEX);
      return;
    }
    Acc acc[CELLS];
    for (uint s = 0; s < CELLS; ++s) {
      acc[s] = Acc(0);
    }
    for (uint b = 0; b < batch; ++b) {
      const Acc g = Acc(grad_output[b * out_features + r * B + o]);  // lane i < B: feature i
      const Acc x = Acc(input[b * in_features + c * B + o]);
      for (uint s = 0; s < CELLS; ++s) {
        const Acc gi = simd_shuffle(g, ushort(first + s * STEP));
        acc[s] = fma(gi, x, acc[s]);
      }
    }
    for (uint s = 0; s < CELLS; ++s) {
      out[(first + s * STEP) * B + o] = T(acc[s]);
    }
    return;
  }
  task -= tasks.values;

  if (task < tasks.bias) {
    tsm_block_grad_bias(grad_output, grad_bias, task, lane, batch, out_features);
  }
}

// Host names: block_sparse_linear_<forward|backward>_<simdgroup|shuffle>_b<B>_<dtype>.
#define TSM_BLOCK_SPARSE_NAME(direction, kind, B, dtype) \
  "block_sparse_linear_" #direction "_" #kind "_b" #B "_" dtype
#define TSM_BLOCK_SPARSE_FOR_B(kind, direction, B)                                         \
  TSM_FOR_FLOAT(TSM_INSTANTIATE_KERNEL(TSM_BLOCK_SPARSE_NAME(direction, kind, B, "float"), \
                                       block_sparse_linear_##direction##_##kind, float, B)) \
  TSM_FOR_HALF(TSM_INSTANTIATE_KERNEL(TSM_BLOCK_SPARSE_NAME(direction, kind, B, "half"),   \
                                      block_sparse_linear_##direction##_##kind, half, B))   \
  TSM_FOR_BFLOAT(TSM_INSTANTIATE_KERNEL(                                                     \
      TSM_BLOCK_SPARSE_NAME(direction, kind, B, "bfloat"),                                   \
      block_sparse_linear_##direction##_##kind, bfloat, B))                                  \
  TSM_EMULATOR_ONLY(TSM_INSTANTIATE_KERNEL(                                                  \
      TSM_BLOCK_SPARSE_NAME(direction, kind, B, "double"),                                   \
      block_sparse_linear_##direction##_##kind, double, B))

#define TSM_BLOCK_SPARSE_ALL(kind, direction) \
  TSM_BLOCK_SPARSE_FOR_B(kind, direction, 8)  \
  TSM_BLOCK_SPARSE_FOR_B(kind, direction, 16) \
  TSM_BLOCK_SPARSE_FOR_B(kind, direction, 32)

TSM_BLOCK_SPARSE_ALL(simdgroup, forward)
TSM_BLOCK_SPARSE_ALL(simdgroup, backward)
TSM_BLOCK_SPARSE_ALL(shuffle, forward)
TSM_BLOCK_SPARSE_ALL(shuffle, backward)
