// Softmax cross-entropy with mean reduction: the loss and its gradient in ONE dispatch.
//
// Host code: torch_sparse_metal/nn/functional.py. The gradient of the mean loss with
// respect to the logits, (softmax(x) - onehot(label)) / count, is known as soon as the
// row's softmax is, so the forward writes it; autograd's backward then only scales it by
// the incoming gradient (1 for loss.backward()). That saves the second dispatch a separate
// backward kernel would cost, which in a training step of small sparse layers is worth more
// than the (batch, classes) buffer it keeps alive until backward.
//
// The loss is a mean over rows, i.e. a reduction over the whole dispatch. It runs as ONE
// threadgroup: each thread walks rows tid, tid + threads, ... and the group reduces
// through SIMD-group sums and threadgroup memory. No atomics, no zero-filled output
// (that would be another op), and the sum comes out in the same order every run, so the
// loss is deterministic. The cost: one threadgroup uses one GPU core, fine for a
// classifier's batch (hundreds of rows of tens of classes); a language-model vocabulary
// would want a threadgroup per row instead.
//
// T is the logits' type; the softmax, the loss and the sums run in Acc = tsm_acc<T>::type
// (float for half and bfloat logits), and the loss and each gradient are rounded to T once.
#include <metal_stdlib>
#include "tsm_common.h"
using namespace metal;

// 32 SIMD-groups of 32 = the 1024-thread maximum.
#define TSM_CE_MAX_SIMDGROUPS 32

// The labels are checked here, not on the host: a host check reads them back, which on MPS
// waits for the GPU once per step. A label outside [0, classes) that is not ignore_index
// makes the loss and its row's gradient NaN (no out-of-bounds read) and flags
// TSM_ERROR_BAD_LABEL. The rows that count (label != ignore_index) are counted here too,
// in a first pass, since the mean and every gradient divide by their number.
template <typename T>
[[kernel]] void cross_entropy_forward(
    device const T* logits        [[buffer(0)]],  // (batch, classes)
    device const int* labels      [[buffer(1)]],  // (batch), in [0, classes) or ignore_index
    device T* loss                [[buffer(2)]],  // (1): mean over rows not ignored
    device T* grad_logits         [[buffer(3)]],  // (batch, classes), if need_grad
    constant uint& batch          [[buffer(4)]],
    constant uint& classes        [[buffer(5)]],
    constant int& ignore_index    [[buffer(6)]],
    constant uint& need_grad      [[buffer(7)]],
    device atomic_uint* errors    [[buffer(8)]],  // the device's error word (TsmError bits)
    uint tid                      [[thread_index_in_threadgroup]],
    uint threads                  [[threads_per_threadgroup]],
    uint lane                     [[thread_index_in_simdgroup]],
    uint simd_id                  [[simdgroup_index_in_threadgroup]],
    uint n_simd                   [[simdgroups_per_threadgroup]]) {
  using Acc = typename tsm_acc<T>::type;
  threadgroup Acc partials[TSM_CE_MAX_SIMDGROUPS];
  threadgroup uint counts[TSM_CE_MAX_SIMDGROUPS];
  threadgroup uint counted_rows;

  uint mine = 0;
  bool bad = false;
  for (uint r = tid; r < batch; r += threads) {
    const int label = labels[r];
    if (label != ignore_index) {
      ++mine;
      bad = bad || label < 0 || uint(label) >= classes;
    }
  }
  if (bad) {
    tsm_flag_error(errors, TSM_ERROR_BAD_LABEL);
  }
  const uint simd_count = simd_sum(mine);
  if (lane == 0) {
    counts[simd_id] = simd_count;
  }
  threadgroup_barrier(mem_flags::mem_threadgroup);
  if (tid == 0) {
    uint total = 0;
    for (uint s = 0; s < n_simd; ++s) {
      total += counts[s];
    }
    counted_rows = total;
  }
  threadgroup_barrier(mem_flags::mem_threadgroup);
  // torch: the mean over no rows is NaN (0 / 0) and every gradient is 0.
  const Acc inv_count = Acc(1) / Acc(counted_rows);
  const Acc nan = numeric_limits<Acc>::quiet_NaN();

  Acc acc = Acc(0);
  for (uint r = tid; r < batch; r += threads) {
    device const T* x = logits + r * classes;
    const int label = labels[r];
    const bool counted = label != ignore_index;
    const bool valid = !counted || (label >= 0 && uint(label) < classes);
    // Stable log-sum-exp: shift by the row maximum so exp never overflows.
    Acc m = Acc(x[0]);
    for (uint c = 1; c < classes; ++c) {
      m = max(m, Acc(x[c]));
    }
    Acc sum = Acc(0);
    for (uint c = 0; c < classes; ++c) {
      sum += exp(Acc(x[c]) - m);
    }
    if (counted) {
      // -log softmax(x)[label] = log(sum) - (x[label] - m)
      acc += valid ? (log(sum) - (Acc(x[label]) - m)) * inv_count : nan;
    }
    if (need_grad != 0) {
      device T* g = grad_logits + r * classes;
      const Acc scale = !valid ? nan : counted ? inv_count : Acc(0);
      const Acc inv_sum = Acc(1) / sum;
      for (uint c = 0; c < classes; ++c) {
        const Acc p = exp(Acc(x[c]) - m) * inv_sum;
        g[c] = T((p - (int(c) == label ? Acc(1) : Acc(0))) * scale);
      }
    }
  }

  // Every thread reaches the reductions and barrier (no early return above).
  const Acc simd_total = simd_sum(acc);
  if (lane == 0) {
    partials[simd_id] = simd_total;
  }
  threadgroup_barrier(mem_flags::mem_threadgroup);
  if (tid == 0) {
    Acc total = Acc(0);
    for (uint s = 0; s < n_simd; ++s) {
      total += partials[s];
    }
    loss[0] = T(counted_rows == 0 ? nan : total);
  }
}

TSM_INSTANTIATE_ALL_DTYPES("cross_entropy_forward", cross_entropy_forward)
