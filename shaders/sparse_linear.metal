// Sparse linear layer: out = x @ W.T + bias, W stored as CSR with one row per target neuron.
//
// Host code: torch_sparse_metal/ops/sparse_linear.py. Every index is int32 and every
// scalar a separate 32-bit `constant uint&`; the host rejects shapes whose flat offsets or
// grids would not fit in 32 bits, so `uint` arithmetic below cannot wrap.
#include <metal_stdlib>
#include "activations.h"
#include "tsm_common.h"
using namespace metal;

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
    uint gid                       [[thread_position_in_grid]]) {
  // The grid may be rounded up to whole threadgroups by the launcher.
  if (gid >= batch * out_features) {
    return;
  }
  const uint row = gid % out_features;
  const uint b = gid / out_features;
  device const T* x = input + b * in_features;

  // Starting from the bias saves a second pass (and a second dispatch) over the output.
  T acc = has_bias != 0 ? bias[row] : T(0);
  const int end = indptr[row + 1];
  for (int e = indptr[row]; e < end; ++e) {
    acc = fma(values[e], x[indices[e]], acc);
  }
  if (save_preact != 0) {
    preact[gid] = acc;
  }
  output[gid] = tsm_activate(acc, activation);
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
// The host zero-fills grad_values and grad_bias.
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
    device atomic<T>* grad_values    [[buffer(7)]],   // (nnz), zero-filled
    device atomic<T>* grad_bias      [[buffer(8)]],   // (out_features), zero-filled
    constant uint& batch             [[buffer(9)]],
    constant uint& in_features       [[buffer(10)]],
    constant uint& out_features      [[buffer(11)]],
    constant uint& neurons           [[buffer(12)]],  // grid width: slots per batch element
    constant uint& need_grad_input   [[buffer(13)]],
    constant uint& need_grad_values  [[buffer(14)]],
    constant uint& need_grad_bias    [[buffer(15)]],
    device const T* act_saved        [[buffer(16)]],  // (batch, out_features): y or z, if activation
    constant uint& activation        [[buffer(17)]],  // TSM_ACT_*
    uint gid                         [[thread_position_in_grid]]) {
  if (gid >= batch * neurons) {
    return;
  }
  const uint i = gid % neurons;
  const uint b = gid / neurons;
  device const T* g = grad_output + b * out_features;
  device const T* saved = act_saved + b * out_features;

  if (i < in_features && (need_grad_input != 0 || need_grad_values != 0)) {
    const T x_bi = need_grad_values != 0 ? input[b * in_features + i] : T(0);
    T acc = T(0);
    const int end = src_indptr[i + 1];
    for (int p = src_indptr[i]; p < end; ++p) {
      const int row = src_rows[p];
      const T g_row = activation == TSM_ACT_NONE
                          ? g[row] : g[row] * tsm_activation_grad(saved[row], activation);
      const int edge = src_perm[p];
      if (need_grad_input != 0) {
        acc = fma(g_row, values[edge], acc);
      }
      if (need_grad_values != 0) {
        atomic_fetch_add_explicit(&grad_values[edge], g_row * x_bi, memory_order_relaxed);
      }
    }
    if (need_grad_input != 0) {
      grad_input[b * in_features + i] = acc;
    }
  }

  if (need_grad_bias != 0 && i < out_features) {
    const T g_i = activation == TSM_ACT_NONE ? g[i] : g[i] * tsm_activation_grad(saved[i], activation);
    atomic_fetch_add_explicit(&grad_bias[i], g_i, memory_order_relaxed);
  }
}

TSM_INSTANTIATE_KERNEL("sparse_linear_forward_float", sparse_linear_forward, float)
TSM_INSTANTIATE_KERNEL("sparse_linear_backward_float", sparse_linear_backward, float)
TSM_EMULATOR_ONLY(TSM_INSTANTIATE_KERNEL("sparse_linear_forward_double", sparse_linear_forward, double))
TSM_EMULATOR_ONLY(TSM_INSTANTIATE_KERNEL("sparse_linear_backward_double", sparse_linear_backward, double))
