// Sparse linear layer: out = x @ W.T + bias, W stored as CSR with one row per target neuron.
//
// Host code: torch_sparse_metal/ops/sparse_linear.py. Every index is int32 and every
// scalar a separate 32-bit `constant uint&`; the host rejects shapes whose flat offsets or
// grids would not fit in 32 bits, so `uint` arithmetic below cannot wrap.
//
// T is the type of values, activations and their gradients: float, half or bfloat (double on
// the emulator). Every sum runs in Acc = tsm_acc<T>::type (float for the 2-byte types) and is
// rounded to T once, where it is stored. The fused activation takes the pre-activation
// rounded to T, as torch's linear followed by its activation would: the forward is then the
// function whose derivative the backward computes from what it saved (y, or z for GELU, in T). The atomic kernels' grad_values and grad_bias are
// sums over the batch that many threads add into, so they are Acc buffers (float32 on the
// host, rounded to T after the dispatch); Metal has no atomic half either.
#include <metal_stdlib>
#include "activations.h"
#include "tsm_common.h"
using namespace metal;

// The host validates every pattern when it is built or replaced, and sees no write that
// bypasses torch's version counter (through .data or .numpy()) without reading the arrays
// back, which the hot path does not do (checks.py). So the kernels check every index they
// follow against the buffers' sizes: such a write can only make the affected outputs NaN
// and flag TSM_ERROR_BAD_PATTERN_INDEX, never read or write outside a buffer. The checks are
// compares on values already loaded (tsm_edge_range_ok in tsm_common.h, and below).

// d loss / d z of target `row` in batch row `g` (and `saved`, what the forward saved for
// the activation's derivative), in the accumulator type.
template <typename T, typename Acc = typename tsm_acc<T>::type>
inline Acc tsm_grad_preact(device const T* g, device const T* saved, int row, uint activation) {
  return activation == TSM_ACT_NONE
             ? Acc(g[row])
             : tsm_activation_backward(Acc(g[row]), Acc(saved[row]), activation);
}

// One thread per (target neuron, batch element), flattened as gid = b * out_features + row
// (the seed engine's 1D layout). Neighbouring threads then write neighbouring outputs and
// gather from the same input row, which stays in cache. A 2D grid would give the same
// mapping with an extra edge to guard: no thread shares work with another, so there is
// nothing for a second dimension to organise. Threads of a SIMD-group walk rows of
// different lengths and wait for the longest; like the seed engine we accept that rather
// than split long rows across threads, which would need a reduction afterwards.
template <typename T>
[[kernel]] void sparse_linear_forward(
    device const T* input          [[buffer(0)]],  // (batch, in_features)
    device const int* indptr       [[buffer(1)]],  // (out_features + 1)
    device const int* indices      [[buffer(2)]],  // (nnz) source neuron of each edge
    device const T* values         [[buffer(3)]],  // (nnz)
    device const T* bias           [[buffer(4)]],  // (out_features), read only if has_bias
    device T* output               [[buffer(5)]],  // (batch, out_features)
    constant uint& batch           [[buffer(6)]],
    constant uint& in_features     [[buffer(7)]],
    constant uint& out_features    [[buffer(8)]],
    constant uint& has_bias        [[buffer(9)]],
    device T* preact               [[buffer(10)]],  // (batch, out_features), if save_preact
    constant uint& activation      [[buffer(11)]],  // TSM_ACT_*
    constant uint& save_preact     [[buffer(12)]],  // GELU under autograd: backward needs z
    constant uint& nnz             [[buffer(13)]],
    device atomic_uint* errors     [[buffer(14)]],  // the device's error word (TsmError bits)
    uint gid                       [[thread_position_in_grid]]) {
  // The grid may be rounded up to whole threadgroups by the launcher.
  if (gid >= batch * out_features) {
    return;
  }
  using Acc = typename tsm_acc<T>::type;
  const uint row = gid % out_features;
  const uint b = gid / out_features;
  device const T* x = input + b * in_features;

  // Starting from the bias saves a second pass (and a second dispatch) over the output.
  Acc acc = has_bias != 0 ? Acc(bias[row]) : Acc(0);
  const int begin = indptr[row], end = indptr[row + 1];
  bool bad = !tsm_edge_range_ok(begin, end, nnz);
  for (int e = begin; !bad && e < end; ++e) {
    const int col = indices[e];
    if (uint(col) >= in_features) {  // a negative index wraps past the end too
      bad = true;
      break;
    }
    acc = fma(Acc(values[e]), Acc(x[col]), acc);
  }
  if (bad) {
    acc = numeric_limits<Acc>::quiet_NaN();
    tsm_flag_error(errors, TSM_ERROR_BAD_PATTERN_INDEX);
  }
  const T z = T(acc);
  if (save_preact != 0) {
    preact[gid] = z;
  }
  output[gid] = T(tsm_activate(Acc(z), activation));
}

// The by-source edge at position p: its target row and by-target edge id, false when either
// lies outside [0, out_features) or [0, nnz).
inline bool tsm_source_edge(device const int* src_rows, device const int* src_perm, int p,
                            uint out_features, uint nnz, thread int& row, thread int& edge) {
  row = src_rows[p];
  edge = src_perm[p];
  return uint(row) < out_features && uint(edge) < nnz;
}

// The whole backward in one dispatch, as the seed engine found two dispatches slower than
// one with atomics. One thread per (neuron slot i, batch element b), gid = b * neurons + i,
// with neurons = max(in_features, out_features) when grad_bias is needed. Slot i is the
// source neuron i for grad_input / grad_values and the target neuron i for grad_bias.
//
// grad_input[b, i] = sum over edges leaving source i of grad_out[b, row] * W[row, i]. The
// by-target CSR cannot answer "which edges leave i" without a search, so the host builds
// the by-source CSR once per pattern: src_indptr, the target row of each edge in that order
// and src_perm, its by-target edge id (where its value and gradient live). Each thread owns
// grad_input[b, i], so that write is plain.
//
// grad_values[e] and grad_bias[row] sum over the batch: the `batch` threads that share an
// edge (or a row) add with relaxed atomics, as nothing else in this dispatch reads them
// and the order of a sum needs no synchronisation. Making i the fast index spreads the
// atomics of one SIMD-group over different edges (the edges of different sources) instead
// of piling `batch` of them onto one address, which is where Apple GPUs slow down.
// The host zero-fills grad_values and grad_bias. The order of the adds varies run to run,
// so these two gradients vary in their last bits: sparse_linear_backward_deterministic
// below is the reproducible variant.
//
// With an activation, grad_output is d loss / d y and the kernel works with
// d loss / d z = grad_output * act'(saved), recomputed wherever it is read (once per edge
// and batch element) instead of stored: a stored copy would need a pass over
// (batch, out_features) before this one, i.e. a second dispatch. act' is a few flops
// (a tanh for GELU) next to the edge's memory traffic.
//
// The need_* flags let autograd's needs_input_grad skip whole gradients; they are uniform
// over the dispatch, so the branches never diverge. Buffers of gradients not needed (and
// of inputs only they read) are placeholders never touched.
template <typename T>
[[kernel]] void sparse_linear_backward(
    device const T* grad_output      [[buffer(0)]],   // (batch, out_features)
    device const T* input            [[buffer(1)]],   // (batch, in_features), if need_grad_values
    device const T* values           [[buffer(2)]],   // (nnz), if need_grad_input
    device const int* src_indptr     [[buffer(3)]],   // (in_features + 1)
    device const int* src_rows       [[buffer(4)]],   // (nnz) target row, by-source order
    device const int* src_perm       [[buffer(5)]],   // (nnz) by-target edge id, by-source order
    device T* grad_input             [[buffer(6)]],   // (batch, in_features)
    device atomic<typename tsm_acc<T>::type>* grad_values [[buffer(7)]],  // (nnz), zero-filled
    device atomic<typename tsm_acc<T>::type>* grad_bias   [[buffer(8)]],  // (out_features), zero-filled
    constant uint& batch             [[buffer(9)]],
    constant uint& in_features       [[buffer(10)]],
    constant uint& out_features      [[buffer(11)]],
    constant uint& neurons           [[buffer(12)]],  // grid width: slots per batch element
    constant uint& need_grad_input   [[buffer(13)]],
    constant uint& need_grad_values  [[buffer(14)]],
    constant uint& need_grad_bias    [[buffer(15)]],
    device const T* act_saved        [[buffer(16)]],  // (batch, out_features): y or z, if activation
    constant uint& activation        [[buffer(17)]],  // TSM_ACT_*
    constant uint& nnz               [[buffer(18)]],
    device atomic_uint* errors       [[buffer(19)]],  // the device's error word (TsmError bits)
    uint gid                         [[thread_position_in_grid]]) {
  if (gid >= batch * neurons) {
    return;
  }
  using Acc = typename tsm_acc<T>::type;
  const uint i = gid % neurons;
  const uint b = gid / neurons;
  device const T* g = grad_output + b * out_features;
  device const T* saved = act_saved + b * out_features;

  if (i < in_features && (need_grad_input != 0 || need_grad_values != 0)) {
    const Acc x_bi = need_grad_values != 0 ? Acc(input[b * in_features + i]) : Acc(0);
    Acc acc = Acc(0);
    const int begin = src_indptr[i], end = src_indptr[i + 1];
    bool bad = !tsm_edge_range_ok(begin, end, nnz);
    for (int p = begin; !bad && p < end; ++p) {
      int row, edge;
      if (!tsm_source_edge(src_rows, src_perm, p, out_features, nnz, row, edge)) {
        bad = true;
        break;
      }
      const Acc dz = tsm_grad_preact(g, saved, row, activation);
      if (need_grad_input != 0) {
        acc = fma(dz, Acc(values[edge]), acc);
      }
      if (need_grad_values != 0) {
        atomic_fetch_add_explicit(&grad_values[edge], dz * x_bi, memory_order_relaxed);
      }
    }
    if (need_grad_input != 0) {
      grad_input[b * in_features + i] = bad ? T(numeric_limits<Acc>::quiet_NaN()) : T(acc);
    }
    if (bad) {
      tsm_flag_error(errors, TSM_ERROR_BAD_PATTERN_INDEX);
    }
  }

  if (need_grad_bias != 0 && i < out_features) {
    atomic_fetch_add_explicit(&grad_bias[i], tsm_grad_preact(g, saved, int(i), activation),
                              memory_order_relaxed);
  }
}

// The same gradients in one dispatch without atomics, so every run gives the same bits
// whatever the number and order of the threads (selected by deterministic=True, or by
// torch.use_deterministic_algorithms). The grid holds three ranges of threads, each
// range present only when its gradient is needed:
//
// * batch * in_features threads for grad_input[b, i], as in sparse_linear_backward;
// * nnz threads, one per by-source position p: the edge there owns grad_values[edge] and
//   sums dz[b, row] * x[b, i] over the batch in order. Its source i is found by a binary
//   search of src_indptr (log2(in_features) reads, next to the batch-long sum);
// * out_features threads, one per target row: grad_bias[row], summed over the batch in order.
//
// Each output has one writer, so the host need not zero-fill anything. The price against
// the atomic kernel: the edge and bias sums run over the batch in one thread each.
template <typename T>
[[kernel]] void sparse_linear_backward_deterministic(
    device const T* grad_output      [[buffer(0)]],   // (batch, out_features)
    device const T* input            [[buffer(1)]],   // (batch, in_features), if need_grad_values
    device const T* values           [[buffer(2)]],   // (nnz), if need_grad_input
    device const int* src_indptr     [[buffer(3)]],   // (in_features + 1)
    device const int* src_rows       [[buffer(4)]],   // (nnz) target row, by-source order
    device const int* src_perm       [[buffer(5)]],   // (nnz) by-target edge id, by-source order
    device T* grad_input             [[buffer(6)]],   // (batch, in_features)
    device T* grad_values            [[buffer(7)]],   // (nnz)
    device T* grad_bias              [[buffer(8)]],   // (out_features)
    constant uint& batch             [[buffer(9)]],
    constant uint& in_features       [[buffer(10)]],
    constant uint& out_features      [[buffer(11)]],
    constant uint& nnz               [[buffer(12)]],
    constant uint& need_grad_input   [[buffer(13)]],
    constant uint& need_grad_values  [[buffer(14)]],
    constant uint& need_grad_bias    [[buffer(15)]],
    device const T* act_saved        [[buffer(16)]],  // (batch, out_features): y or z, if activation
    constant uint& activation        [[buffer(17)]],  // TSM_ACT_*
    device atomic_uint* errors       [[buffer(18)]],  // the device's error word (TsmError bits)
    uint gid                         [[thread_position_in_grid]]) {
  using Acc = typename tsm_acc<T>::type;
  const uint input_threads = need_grad_input != 0 ? batch * in_features : 0u;
  const uint value_threads = need_grad_values != 0 ? nnz : 0u;
  const uint bias_threads = need_grad_bias != 0 ? out_features : 0u;
  const T nan = T(numeric_limits<Acc>::quiet_NaN());
  uint t = gid;  // the thread's index within its range

  if (t < input_threads) {
    const uint i = t % in_features;
    const uint b = t / in_features;
    device const T* g = grad_output + b * out_features;
    device const T* saved = act_saved + b * out_features;
    Acc acc = Acc(0);
    const int begin = src_indptr[i], end = src_indptr[i + 1];
    bool bad = !tsm_edge_range_ok(begin, end, nnz);
    for (int p = begin; !bad && p < end; ++p) {
      int row, edge;
      if (!tsm_source_edge(src_rows, src_perm, p, out_features, nnz, row, edge)) {
        bad = true;
        break;
      }
      acc = fma(tsm_grad_preact(g, saved, row, activation), Acc(values[edge]), acc);
    }
    grad_input[t] = bad ? nan : T(acc);
    if (bad) {
      tsm_flag_error(errors, TSM_ERROR_BAD_PATTERN_INDEX);
    }
    return;
  }
  t -= input_threads;

  if (t < value_threads) {
    const int p = int(t);
    int row, edge;
    if (!tsm_source_edge(src_rows, src_perm, p, out_features, nnz, row, edge)) {
      tsm_flag_error(errors, TSM_ERROR_BAD_PATTERN_INDEX);
      return;  // no edge to write to (see tsm_edge_range_ok)
    }
    // The source of position p: the last i with src_indptr[i] <= p.
    uint lo = 0, hi = in_features;
    while (hi - lo > 1) {
      const uint mid = (lo + hi) / 2;
      if (src_indptr[mid] <= p) {
        lo = mid;
      } else {
        hi = mid;
      }
    }
    if (!(src_indptr[lo] <= p && p < src_indptr[lo + 1])) {
      grad_values[edge] = nan;
      tsm_flag_error(errors, TSM_ERROR_BAD_PATTERN_INDEX);
      return;
    }
    Acc acc = Acc(0);
    for (uint b = 0; b < batch; ++b) {
      const Acc dz = tsm_grad_preact(grad_output + b * out_features,
                                     act_saved + b * out_features, row, activation);
      acc = fma(dz, Acc(input[b * in_features + lo]), acc);
    }
    grad_values[edge] = T(acc);
    return;
  }
  t -= value_threads;

  if (t < bias_threads) {
    Acc acc = Acc(0);
    for (uint b = 0; b < batch; ++b) {
      acc += tsm_grad_preact(grad_output + b * out_features, act_saved + b * out_features,
                             int(t), activation);
    }
    grad_bias[t] = T(acc);
  }
}

// Lanes along the batch. The kernels above give each lane of a SIMD-group its own target
// row (or source neuron): the lanes' loads of indices, values and x then touch up to 32
// separate 128-byte segments per instruction (the emulator's counters: under 5% of the
// minimum transactions at 4096 x 4096, 1%, batch 64). The two below give a SIMD-group one
// row (one source neuron) and its lanes 32 consecutive batch elements, with the
// activations in the (features, batch) layout: one instruction then reads an edge's index
// and value once for every lane (a broadcast), and x[:, col] or grad_output[:, row] as 128
// contiguous bytes. The host converts the activations once (a layer's output is already in
// that layout, as the transposed view of what the kernel wrote) and picks these kernels by
// batch size (sparse_linear.py, lanes_along_batch).

// Batch elements one lane handles per pass over a row's edges: the edge's index and value
// are loaded once per pass.
constant constexpr uint TSM_BATCH_PASS = 4;

// out_t[row, b] = act(bias[row] + sum over the row's edges e of values[e] * x_t[indices[e], b]).
// One SIMD-group per target row: gid = row * 32 + lane.
template <typename T>
[[kernel]] void sparse_linear_forward_batch_lanes(
    device const T* input_t        [[buffer(0)]],  // (in_features, batch)
    device const int* indptr       [[buffer(1)]],  // (out_features + 1)
    device const int* indices      [[buffer(2)]],  // (nnz)
    device const T* values         [[buffer(3)]],  // (nnz)
    device const T* bias           [[buffer(4)]],  // (out_features), read only if has_bias
    device T* output_t             [[buffer(5)]],  // (out_features, batch)
    constant uint& batch           [[buffer(6)]],
    constant uint& in_features     [[buffer(7)]],
    constant uint& out_features    [[buffer(8)]],
    constant uint& has_bias        [[buffer(9)]],
    device T* preact_t             [[buffer(10)]],  // (out_features, batch), if save_preact
    constant uint& activation      [[buffer(11)]],
    constant uint& save_preact     [[buffer(12)]],
    constant uint& nnz             [[buffer(13)]],
    device atomic_uint* errors     [[buffer(14)]],  // the device's error word (TsmError bits)
    uint gid                       [[thread_position_in_grid]]) {
  const uint row = gid / 32, lane = gid % 32;
  if (row >= out_features) {
    return;
  }
  using Acc = typename tsm_acc<T>::type;
  const int begin = indptr[row], end = indptr[row + 1];
  const Acc start = has_bias != 0 ? Acc(bias[row]) : Acc(0);
  for (uint b0 = 0; b0 < batch; b0 += 32 * TSM_BATCH_PASS) {
    Acc acc[TSM_BATCH_PASS];
    for (uint k = 0; k < TSM_BATCH_PASS; ++k) {
      acc[k] = start;
    }
    bool bad = !tsm_edge_range_ok(begin, end, nnz);
    // The row's edges 32 at a time: each lane loads one edge's index and value (one
    // coalesced load per array for 32 edges) and simd_shuffle hands them to every lane in
    // turn. A load per edge would have each of its 32 lanes fetch the same 4 + sizeof(T)
    // bytes, which for the 2-byte types is as much as the x values it feeds.
    for (int e0 = begin; !bad && e0 < end; e0 += 32) {
      const int e = e0 + int(lane);
      const uint my_col = e < end ? uint(indices[e]) : 0u;  // a negative index wraps too
      const Acc my_v = e < end ? Acc(values[e]) : Acc(0);
      bad = simd_any(my_col >= in_features);
      if (bad) {
        break;
      }
      const uint count = min(32u, uint(end - e0));
      for (uint j = 0; j < count; ++j) {
        const uint col = simd_shuffle(my_col, ushort(j));
        const Acc v = simd_shuffle(my_v, ushort(j));
        device const T* x = input_t + col * batch;
        for (uint k = 0; k < TSM_BATCH_PASS; ++k) {
          const uint b = b0 + 32 * k + lane;
          if (b < batch) {
            acc[k] = fma(v, Acc(x[b]), acc[k]);
          }
        }
      }
    }
    if (bad) {
      tsm_flag_error(errors, TSM_ERROR_BAD_PATTERN_INDEX);
    }
    for (uint k = 0; k < TSM_BATCH_PASS; ++k) {
      const uint b = b0 + 32 * k + lane;
      if (b < batch) {
        const T z = T(bad ? numeric_limits<Acc>::quiet_NaN() : acc[k]);
        if (save_preact != 0) {
          preact_t[row * batch + b] = z;
        }
        output_t[row * batch + b] = T(tsm_activate(Acc(z), activation));
      }
    }
  }
}

// The fused backward with a SIMD-group per neuron slot i (gid = i * 32 + lane, slots as
// in sparse_linear_backward) and lanes along the batch, activations in the (features,
// batch) layout. The SIMD-group owns grad_input[:, i], and also grad_values[edge] for
// every edge leaving source i and grad_bias[i]: their sums over the batch are a simd_sum
// of the lanes' parts, which lane 0 adds to the zero-filled gradient, once per pass of
// 32 * TSM_BATCH_PASS batch elements. One atomic per edge and pass instead of one per edge
// and batch element, on one lane; atomic only so that a corrupted by-source CSR (ranges
// that overlap, see tsm_edge_range_ok) cannot make two SIMD-groups race on an edge. With
// a valid one each edge has one writer, so the sum's order is the same every run.
template <typename T>
[[kernel]] void sparse_linear_backward_batch_lanes(
    device const T* grad_output_t    [[buffer(0)]],   // (out_features, batch)
    device const T* input_t          [[buffer(1)]],   // (in_features, batch), if need_grad_values
    device const T* values           [[buffer(2)]],   // (nnz), if need_grad_input
    device const int* src_indptr     [[buffer(3)]],   // (in_features + 1)
    device const int* src_rows       [[buffer(4)]],   // (nnz)
    device const int* src_perm       [[buffer(5)]],   // (nnz)
    device T* grad_input_t           [[buffer(6)]],   // (in_features, batch)
    device atomic<typename tsm_acc<T>::type>* grad_values [[buffer(7)]],  // (nnz), zero-filled
    device atomic<typename tsm_acc<T>::type>* grad_bias   [[buffer(8)]],  // (out_features), zero-filled
    constant uint& batch             [[buffer(9)]],
    constant uint& in_features       [[buffer(10)]],
    constant uint& out_features      [[buffer(11)]],
    constant uint& neurons           [[buffer(12)]],
    constant uint& need_grad_input   [[buffer(13)]],
    constant uint& need_grad_values  [[buffer(14)]],
    constant uint& need_grad_bias    [[buffer(15)]],
    device const T* act_saved_t      [[buffer(16)]],  // (out_features, batch), if activation
    constant uint& activation        [[buffer(17)]],
    constant uint& nnz               [[buffer(18)]],
    device atomic_uint* errors       [[buffer(19)]],  // the device's error word (TsmError bits)
    uint gid                         [[thread_position_in_grid]]) {
  const uint i = gid / 32, lane = gid % 32;
  if (i >= neurons) {
    return;  // whole SIMD-groups: the grid is neurons * 32
  }
  using Acc = typename tsm_acc<T>::type;
  const T nan = T(numeric_limits<Acc>::quiet_NaN());

  if (i < in_features && (need_grad_input != 0 || need_grad_values != 0)) {
    const int begin = src_indptr[i], end = src_indptr[i + 1];
    for (uint b0 = 0; b0 < batch; b0 += 32 * TSM_BATCH_PASS) {
      Acc x[TSM_BATCH_PASS], acc[TSM_BATCH_PASS];
      for (uint k = 0; k < TSM_BATCH_PASS; ++k) {
        const uint b = b0 + 32 * k + lane;
        x[k] = need_grad_values != 0 && b < batch ? Acc(input_t[i * batch + b]) : Acc(0);
        acc[k] = Acc(0);
      }
      bool bad = !tsm_edge_range_ok(begin, end, nnz);
      // The source's edges 32 at a time, as in the forward: lane j loads the j-th edge's
      // target row, edge id and value, simd_shuffle hands row and value to every lane,
      // and lane j adds the edge's batch sum to its gradient.
      for (int p0 = begin; !bad && p0 < end; p0 += 32) {
        const int p = p0 + int(lane);
        int my_row = 0, my_edge = 0;
        bool ok = true;
        Acc my_v = Acc(0);
        if (p < end) {
          ok = tsm_source_edge(src_rows, src_perm, p, out_features, nnz, my_row, my_edge);
          if (ok && need_grad_input != 0) {
            my_v = Acc(values[my_edge]);
          }
        }
        bad = simd_any(!ok);
        if (bad) {
          break;
        }
        const uint count = min(32u, uint(end - p0));
        for (uint j = 0; j < count; ++j) {
          const uint row = simd_shuffle(uint(my_row), ushort(j));
          const Acc v = simd_shuffle(my_v, ushort(j));
          device const T* g = grad_output_t + row * batch;
          device const T* saved = act_saved_t + row * batch;
          Acc part = Acc(0);  // this lane's share of the edge's grad_values
          for (uint k = 0; k < TSM_BATCH_PASS; ++k) {
            const uint b = b0 + 32 * k + lane;
            if (b < batch) {
              const Acc dz = tsm_grad_preact(g, saved, int(b), activation);
              acc[k] = fma(dz, v, acc[k]);
              part = fma(dz, x[k], part);
            }
          }
          if (need_grad_values != 0) {
            const Acc total = simd_sum(part);  // every lane is on the same edge
            if (lane == j) {
              atomic_fetch_add_explicit(&grad_values[my_edge], total, memory_order_relaxed);
            }
          }
        }
      }
      if (need_grad_input != 0) {
        for (uint k = 0; k < TSM_BATCH_PASS; ++k) {
          const uint b = b0 + 32 * k + lane;
          if (b < batch) {
            grad_input_t[i * batch + b] = bad ? nan : T(acc[k]);
          }
        }
      }
      if (bad) {
        tsm_flag_error(errors, TSM_ERROR_BAD_PATTERN_INDEX);
      }
    }
  }

  if (need_grad_bias != 0 && i < out_features) {
    Acc part = Acc(0);
    for (uint b = lane; b < batch; b += 32) {
      part += tsm_grad_preact(grad_output_t + i * batch, act_saved_t + i * batch, int(b), activation);
    }
    const Acc total = simd_sum(part);
    if (lane == 0) {
      atomic_fetch_add_explicit(&grad_bias[i], total, memory_order_relaxed);
    }
  }
}

TSM_INSTANTIATE_ALL_DTYPES("sparse_linear_forward", sparse_linear_forward)
TSM_INSTANTIATE_ALL_DTYPES("sparse_linear_backward", sparse_linear_backward)
TSM_INSTANTIATE_ALL_DTYPES("sparse_linear_backward_deterministic", sparse_linear_backward_deterministic)
TSM_INSTANTIATE_ALL_DTYPES("sparse_linear_forward_batch_lanes", sparse_linear_forward_batch_lanes)
TSM_INSTANTIATE_ALL_DTYPES("sparse_linear_backward_batch_lanes", sparse_linear_backward_batch_lanes)
