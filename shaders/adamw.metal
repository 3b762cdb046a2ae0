// AdamW for every parameter of a model in ONE dispatch, plus per-tensor gradient norms.
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
// the host in double as torch does and passed in float32 (float64 on the emulator):
//   param  *= 1 - lr * weight_decay
//   m       = lerp(m, g, 1 - beta1)
//   v       = v * beta2 + (1 - beta2) * g * g
//   v_max   = max(v_max, v)                         (amsgrad, per tensor from its group)
//   denom   = sqrt(v or v_max) / sqrt(1 - beta2^t) + eps
//   param  += -(lr / (1 - beta1^t)) * m / denom
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
    device T* exp_avg               [[buffer(2)]],   // (total)
    device T* exp_avg_sq            [[buffer(3)]],   // (total)
    device T* max_exp_avg_sq        [[buffer(4)]],   // (total) if any group has amsgrad,
                                                     // else 1 element, never read
    device const int* chunk_tensor  [[buffer(5)]],   // (total / 32) tensor of each chunk
    device const T* hyper           [[buffer(6)]],   // (n_tensors, TSM_ADAMW_COLUMNS)
    device atomic<T>* grad_sq       [[buffer(7)]],   // (2, n_tensors) sum of g^2 per tensor
    constant uint& total            [[buffer(8)]],   // a multiple of 32
    constant uint& n_tensors        [[buffer(9)]],
    constant uint& parity           [[buffer(10)]],  // 0 or 1: the grad_sq row of this step
    uint gid                        [[thread_position_in_grid]],
    uint lane                       [[thread_index_in_simdgroup]]) {
  // The grid is exactly `total` threads, a multiple of 32, and the threadgroup size a
  // multiple of 32: every SIMD-group is full and lies in one chunk, so no lane returns
  // before simd_sum and the chunk's tensor is uniform over the SIMD-group.
  const int t = chunk_tensor[gid / TSM_ADAMW_CHUNK];
  device const T* h = hyper + uint(t) * TSM_ADAMW_COLUMNS;
  const bool active = h[TSM_ADAMW_ACTIVE] != T(0);

  T g = T(0);
  if (active) {
    g = grads[gid] * h[TSM_ADAMW_SIGN];
    T p = params[gid] * h[TSM_ADAMW_DECAY];
    // torch's lerp: the formula depends on which side of 0.5 the weight lies.
    const T w = h[TSM_ADAMW_ONE_MINUS_BETA1];
    const T m0 = exp_avg[gid];
    const T m = w < T(0.5) ? m0 + w * (g - m0) : g - (g - m0) * (T(1) - w);
    exp_avg[gid] = m;
    T v = exp_avg_sq[gid] * h[TSM_ADAMW_BETA2];
    v = v + h[TSM_ADAMW_ONE_MINUS_BETA2] * g * g;
    exp_avg_sq[gid] = v;
    if (h[TSM_ADAMW_AMSGRAD] != T(0)) {  // per tensor: amsgrad is a param-group option
      v = max(max_exp_avg_sq[gid], v);
      max_exp_avg_sq[gid] = v;
    }
    const T denom = sqrt(v) / h[TSM_ADAMW_BC2_SQRT] + h[TSM_ADAMW_EPS];
    p = p + (-h[TSM_ADAMW_STEP_SIZE]) * m / denom;
    params[gid] = p;
  }

  const T chunk_sq = simd_sum(g * g);
  if (lane == 0 && active) {
    atomic_fetch_add_explicit(&grad_sq[parity * n_tensors + uint(t)], chunk_sq,
                              memory_order_relaxed);
  }
  if (gid < n_tensors) {
    atomic_store_explicit(&grad_sq[(1 - parity) * n_tensors + gid], T(0), memory_order_relaxed);
  }
}

TSM_INSTANTIATE_KERNEL("adamw_step_float", adamw_step, float)
TSM_EMULATOR_ONLY(TSM_INSTANTIATE_KERNEL("adamw_step_double", adamw_step, double))
