// The activations kernels fuse into their epilogues, and their derivatives.
// Host side: torch_sparse_metal/_activations.py (names and these codes).
#pragma once

#include <metal_stdlib>
using namespace metal;

// The code is a uniform kernel argument, so a switch on it never diverges in a dispatch.
enum TsmActivation : uint {
  TSM_ACT_NONE = 0,
  TSM_ACT_RELU = 1,
  TSM_ACT_GELU_TANH = 2,  // GELU, tanh approximation
  TSM_ACT_TANH = 3,
};

// GELU is the tanh approximation (torch's gelu(approximate="tanh")), not the erf form:
// MSL has tanh but no erf, and the approximation keeps every term a library function, so
// float64 results match torch's to round-off. Constants and operation order follow
// ATen's GeluKernel so float32 agrees to rounding as well.
template <typename T>
inline T tsm_gelu_tanh(T x) {
  const T k_beta = T(0.7978845608028654);   // sqrt(2 / pi)
  const T k_kappa = T(0.044715);
  const T inner = k_beta * (x + k_kappa * (x * x * x));
  return T(0.5) * x * (T(1) + tanh(inner));
}

template <typename T>
inline T tsm_gelu_tanh_grad(T x) {
  const T k_beta = T(0.7978845608028654);
  const T k_kappa = T(0.044715);
  const T x_sq = x * x;
  const T tanh_inner = tanh(k_beta * (x + k_kappa * (x_sq * x)));
  const T left_derivative = T(0.5) * (T(1) + tanh_inner);
  const T right_derivative = (T(0.5) * x) * (T(1) - tanh_inner * tanh_inner) *
                             (k_beta * (T(1) + T(3) * k_kappa * x_sq));
  return left_derivative + right_derivative;
}

template <typename T>
inline T tsm_activate(T z, uint activation) {
  switch (activation) {
    // torch.relu is clamp_min(z, 0): a NaN stays NaN (it is also what the sparse kernels
    // write for a corrupted pattern, which must not become 0) and -0.0 stays -0.0.
    case TSM_ACT_RELU: return z < T(0) ? T(0) : z;
    case TSM_ACT_GELU_TANH: return tsm_gelu_tanh(z);
    case TSM_ACT_TANH: return tanh(z);
    default: return z;
  }
}

// d loss / d z from g = d loss / d y and what the forward saved: the output y for relu
// and tanh (1 - y^2), which costs no extra memory; the pre-activation z for GELU, whose
// output does not determine its input. As torch's backward formulas: relu's selects
// (threshold_backward: g where y is not <= 0, NaN included, else 0), so an infinite or NaN
// g where y = 0 gives 0, not inf * 0 = NaN; the others multiply g by the derivative.
template <typename T>
inline T tsm_activation_backward(T g, T saved, uint activation) {
  switch (activation) {
    case TSM_ACT_RELU: return saved <= T(0) ? T(0) : g;
    case TSM_ACT_GELU_TANH: return g * tsm_gelu_tanh_grad(saved);
    case TSM_ACT_TANH: return g * (T(1) - saved * saved);
    default: return g;
  }
}
