// AdamW for up to ~100 parameters of a model in ONE dispatch, plus per-tensor gradient norms.
//
// Host code: torch_sparse_metal/optim/adamw.py, which explains the layout: parameters,
// gradients and optimizer states are views of flat buffers (one per role), each tensor a
// segment padded to a whole number of SIMD-groups (at least one). chunk_tensor maps each
// 32-element chunk to its tensor, so a thread finds its hyper-parameters with one read and
// every SIMD-group lies inside one tensor. Padding elements hold zeros in every buffer and
// stay zero under the update (zero gradient, zero moments: the step adds 0 / eps).
//
// The math is torch.optim.AdamW's single-tensor path, operation by operation, with the
// per-tensor scalars (which change every step through the bias corrections) computed on
// the host in double as torch does and passed in float32 (float64 on the emulator) BY
// VALUE, as the bytes of the dispatch (setBytes, at most 4 KB), as torch passes its
// optimizers' scalars to its kernels: a table in a device buffer would need a copy from the
// host every step, which on MPS either waits for the GPU or must outlive it. A model with
// more tensors than one table holds takes one dispatch per table's worth of tensors
// (first_tensor, first_element say where this one starts):
//   param  *= 1 - lr * weight_decay
//   m       = lerp(m, g, 1 - beta1)
//   v       = v * beta2 + (1 - beta2) * g * g
//   v_max   = maximum(v_max, v)                     (amsgrad, per tensor; NaN wins, as torch's)
//   denom   = sqrt(v or v_max) / sqrt(1 - beta2^t) + eps
//   param  += -(lr / (1 - beta1^t)) * m / denom
//
// T is the parameters' and gradients' type. The moments, the hyper-parameters, the norms and
// the arithmetic are in Acc = tsm_acc<T>::type: float for half and bfloat parameters, whose
// 2-byte moments would lose the update (v of a gradient of 1e-4 is 1e-8, under half's
// smallest normal), and the parameter is rounded to T once per step.
//
// Gradient norms: each SIMD-group sums g*g with simd_sum and its lane 0 adds that to the
// tensor's slot of grad_sq with one relaxed atomic (a few adds per tensor per threadgroup,
// not one per element: Apple GPUs slow down under contention on one address). The slots
// are double-buffered by step parity: this step adds into row `parity` and zeroes row
// 1 - parity (which the next step adds into), so no separate zero-fill op is needed.
// Nothing else in the dispatch reads grad_sq; the host reads row `parity` after the step.
#include <metal_stdlib>
#include "tsm_common.h"
using namespace metal;

// Columns of the per-tensor hyper-parameter table; host: HYPER_COLUMNS in adamw.py.
enum TsmAdamwColumn : uint {
  TSM_ADAMW_ACTIVE = 0,          // 1 when the tensor has a gradient this step, else 0
  TSM_ADAMW_DECAY = 1,           // 1 - lr * weight_decay
  TSM_ADAMW_ONE_MINUS_BETA1 = 2, // lerp weight
  TSM_ADAMW_BETA2 = 3,
  TSM_ADAMW_ONE_MINUS_BETA2 = 4,
  TSM_ADAMW_STEP_SIZE = 5,       // lr / (1 - beta1^t)
  TSM_ADAMW_BC2_SQRT = 6,        // sqrt(1 - beta2^t)
  TSM_ADAMW_EPS = 7,
  TSM_ADAMW_SIGN = 8,            // -1 to maximize, else 1
  TSM_ADAMW_AMSGRAD = 9,         // 1 when the tensor's group has amsgrad, else 0
  TSM_ADAMW_COLUMNS = 10,
};

#define TSM_ADAMW_CHUNK 32

template <typename T>
[[kernel]] void adamw_step(
    device T* params                [[buffer(0)]],   // (total) flat, padded segments
    device const T* grads           [[buffer(1)]],   // (total)
    device typename tsm_acc<T>::type* exp_avg        [[buffer(2)]],  // (total)
    device typename tsm_acc<T>::type* exp_avg_sq     [[buffer(3)]],  // (total)
    device typename tsm_acc<T>::type* max_exp_avg_sq [[buffer(4)]],  // (total) if any group
                                                     // has amsgrad, else 1 element, never read
    device const int* chunk_tensor  [[buffer(5)]],   // (total / 32) tensor of each chunk
    constant typename tsm_acc<T>::type* hyper [[buffer(6)]],  // (tensors, TSM_ADAMW_COLUMNS), by value
    device atomic<typename tsm_acc<T>::type>* grad_sq [[buffer(7)]],  // (2, n_tensors) sum of g^2
    constant uint& elements         [[buffer(8)]],   // of this dispatch: a multiple of 32
    constant uint& n_tensors        [[buffer(9)]],   // of the model: grad_sq's row length
    constant uint& parity           [[buffer(10)]],  // 0 or 1: the grad_sq row of this step
    constant uint& first_tensor     [[buffer(11)]],  // the tensor of hyper's first row
    constant uint& tensors          [[buffer(12)]],  // hyper's rows: this dispatch's tensors
    constant uint& first_element    [[buffer(13)]],  // where the first tensor's segment starts
    uint gid                        [[thread_position_in_grid]],
    uint lane                       [[thread_index_in_simdgroup]]) {
  // The grid is exactly `elements` threads, a multiple of 32, starting at a segment's start
  // (a multiple of 32), and the threadgroup size a multiple of 32: every SIMD-group is full
  // and lies in one chunk, so no lane returns before simd_sum and the chunk's tensor is
  // uniform over the SIMD-group.
  using Acc = typename tsm_acc<T>::type;
  const uint e = first_element + gid;
  const uint t = uint(chunk_tensor[e / TSM_ADAMW_CHUNK]);
  constant Acc* h = hyper + (t - first_tensor) * TSM_ADAMW_COLUMNS;
  const bool active = h[TSM_ADAMW_ACTIVE] != Acc(0);

  Acc g = Acc(0);
  if (active) {
    g = Acc(grads[e]) * h[TSM_ADAMW_SIGN];
    Acc p = Acc(params[e]) * h[TSM_ADAMW_DECAY];
    // torch's lerp: the formula depends on which side of 0.5 the weight lies.
    const Acc w = h[TSM_ADAMW_ONE_MINUS_BETA1];
    const Acc m0 = exp_avg[e];
    const Acc m = w < Acc(0.5) ? m0 + w * (g - m0) : g - (g - m0) * (Acc(1) - w);
    exp_avg[e] = m;
    Acc v = exp_avg_sq[e] * h[TSM_ADAMW_BETA2];
    v = v + h[TSM_ADAMW_ONE_MINUS_BETA2] * g * g;
    exp_avg_sq[e] = v;
    if (h[TSM_ADAMW_AMSGRAD] != Acc(0)) {  // per tensor: amsgrad is a param-group option
      // torch.maximum: a NaN in either wins (Metal's max returns the other operand).
      const Acc v_max = max_exp_avg_sq[e];
      v = isnan(v_max) || isnan(v) ? numeric_limits<Acc>::quiet_NaN() : max(v_max, v);
      max_exp_avg_sq[e] = v;
    }
    const Acc denom = sqrt(v) / h[TSM_ADAMW_BC2_SQRT] + h[TSM_ADAMW_EPS];
    p = p + (-h[TSM_ADAMW_STEP_SIZE]) * m / denom;
    params[e] = T(p);
  }

  const Acc chunk_sq = simd_sum(g * g);
  if (lane == 0 && active) {
    atomic_fetch_add_explicit(&grad_sq[parity * n_tensors + t], chunk_sq, memory_order_relaxed);
  }
  // Every tensor has at least one chunk, so the dispatch has a thread for each of its rows.
  if (gid < tensors) {
    atomic_store_explicit(&grad_sq[(1 - parity) * n_tensors + first_tensor + gid], Acc(0),
                          memory_order_relaxed);
  }
}

TSM_INSTANTIATE_ALL_DTYPES("adamw_step", adamw_step)
