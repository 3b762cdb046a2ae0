// The matmul ladder: what every rung shares. Compiled by Metal and by the emulator.
//
//   C = act(alpha * op(A) @ op(B) + beta * bias)         C: M x N, op(A): M x K, op(B): K x N
//
// Host code: torch_sparse_metal/ops/matmul.py. Every rung has the same signature, so the
// host binds all of them the same way:
//
//   buffer(0)  A       op(A)(i, k) = TA ? A[k * lda + i] : A[i * lda + k]
//   buffer(1)  B       op(B)(k, j) = TB ? B[j * ldb + k] : B[k * ldb + j]
//   buffer(2)  bias    bias(i, j)  = bias[i * bias_rs + j * bias_cs]; strides of 0 broadcast
//                      (a Linear bias is bias_rs = 0, bias_cs = 1); read only with has_bias
//   buffer(3)  C       C[i * ldc + j]
//   buffer(4)  preact  alpha * op(A) @ op(B) + beta * bias before the activation, written
//                      only with save_preact (GELU under autograd: backward needs it)
//   buffer(5..) M, N, K, lda, ldb, ldc, bias_rs, bias_cs (uint), alpha, beta (in the
//               accumulator type tsm_acc<T>::type: float, double for double),
//               epilogue (uint: TSM_MM_* bits below), vec_ok (uint: TSM_MM_VEC_* bits)
//
// Transposes are template parameters (TA, TB), i.e. kernel variants chosen by the host
// from the operands' strides: a transposed view is read in place, never copied. Each
// variant loads its tiles with the memory-contiguous dimension fastest.
//
// T is the element type of A, B, bias, C; products accumulate in tsm_acc<T>::type
// (float for float, half and bfloat; double in the emulator-only double build, so that
// gradcheck runs through the kernels). The host guarantees every flat offset fits a uint.
#pragma once

#include <metal_stdlib>
#include "activations.h"
#include "tsm_common.h"
using namespace metal;

// Epilogue bits (host: EPILOGUE_* in torch_sparse_metal/ops/matmul.py), the activation
// code (TsmActivation, shaders/activations.h) in bits 4..7, and vec_ok
// bits: the operand may be read with 4-wide vector loads (the host checked that its base
// is aligned to 4 elements and its leading dimension is a multiple of 4).
enum TsmMmFlags : uint {
  TSM_MM_HAS_BIAS = 1u,
  TSM_MM_SAVE_PREACT = 2u,
  TSM_MM_ACT_SHIFT = 4u,
  TSM_MM_VEC_A = 1u,
  TSM_MM_VEC_B = 2u,
};

// The epilogue's uniform arguments, gathered once per thread.
template <typename T>
struct TsmMmEpilogue {
  using Acc = typename tsm_acc<T>::type;
  device const T* bias;
  device T* C;
  device T* preact;
  uint M, N, ldc, bias_rs, bias_cs;
  Acc alpha, beta;
  uint flags;

  // Finishes and stores element (i, j) of C from its accumulated dot product. Elements
  // outside M x N (edge tiles) are skipped here, the only place C is written.
  inline void store(uint i, uint j, Acc dot) const {
    if (i >= M || j >= N) {
      return;
    }
    Acc v = alpha * dot;
    if ((flags & TSM_MM_HAS_BIAS) != 0) {
      v = fma(beta, Acc(bias[i * bias_rs + j * bias_cs]), v);
    }
    if ((flags & TSM_MM_SAVE_PREACT) != 0) {
      preact[i * ldc + j] = T(v);
    }
    C[i * ldc + j] = T(tsm_activate(v, (flags >> TSM_MM_ACT_SHIFT) & 15u));
  }
};

// op(A)(i, k) and op(B)(k, j) for the rungs that read device memory element by element.
template <bool TA, typename T>
inline T tsm_mm_a(device const T* A, uint lda, uint i, uint k) {
  return TA ? A[k * lda + i] : A[i * lda + k];
}
template <bool TB, typename T>
inline T tsm_mm_b(device const T* B, uint ldb, uint k, uint j) {
  return TB ? B[j * ldb + k] : B[k * ldb + j];
}

// Cooperative copy of a ROWS x COLS block of a row-major device matrix (leading dimension
// ld, rows_left x cols_left of it valid; the rest reads as zero) into threadgroup memory,
// element (r, c) going to dst[r * DR + c * DC]. NT threads sweep the block row by row,
// consecutive threads on consecutive columns, so a SIMD-group reads 32 neighbours along
// memory rows (one row when COLS >= 32). The kernels pick the padding of dst so that, for
// their layout, the 32 lanes of every store land on 32 different banks: that is what the
// bank-conflict tests check. Every thread stores the same number of elements, zeros
// included, so no threadgroup element is left unwritten.
template <uint ROWS, uint COLS, uint NT, uint DR, uint DC, typename T>
inline void tsm_mm_copy_block(threadgroup T* dst, device const T* src, uint ld, uint rows_left,
                              uint cols_left, uint t) {
  static_assert((ROWS * COLS) % NT == 0, "threads must divide the block");
  for (uint n = 0; n < ROWS * COLS / NT; ++n) {
    const uint idx = t + n * NT, r = idx / COLS, c = idx % COLS;
    dst[r * DR + c * DC] = (r < rows_left && c < cols_left) ? src[r * ld + c] : T(0);
  }
}

// Instantiates kernel template `matmul_<rung>` for one dtype in its four transpose
// variants, under the host names kernel_name() builds: "matmul_<rung>_<nn|nt|tn|tt>_<dtype>".
#define TSM_MM_INSTANTIATE(rung, T, dtype)                                                   \
  TSM_INSTANTIATE_KERNEL("matmul_" #rung "_nn_" dtype, matmul_##rung, T, false, false)       \
  TSM_INSTANTIATE_KERNEL("matmul_" #rung "_nt_" dtype, matmul_##rung, T, false, true)        \
  TSM_INSTANTIATE_KERNEL("matmul_" #rung "_tn_" dtype, matmul_##rung, T, true, false)        \
  TSM_INSTANTIATE_KERNEL("matmul_" #rung "_tt_" dtype, matmul_##rung, T, true, true)

// float, half and bfloat everywhere (bfloat needs MSL 3.1, macOS 14), each in its own
// library on Metal (TSM_FOR_* in tsm_common.h), double in the emulator only (Metal has no
// double).
#define TSM_MM_INSTANTIATE_GPU_DTYPES(rung)                \
  TSM_FOR_FLOAT(TSM_MM_INSTANTIATE(rung, float, "float")) \
  TSM_FOR_HALF(TSM_MM_INSTANTIATE(rung, half, "half"))    \
  TSM_FOR_BFLOAT(TSM_MM_INSTANTIATE(rung, bfloat, "bfloat"))
#define TSM_MM_INSTANTIATE_ALL(rung)   \
  TSM_MM_INSTANTIATE_GPU_DTYPES(rung) \
  TSM_EMULATOR_ONLY(TSM_MM_INSTANTIATE(rung, double, "double"))

// The parameters every rung takes, in buffer order (see the top of this file).
#define TSM_MM_PARAMS                                              \
  device const T* A [[buffer(0)]], device const T* B [[buffer(1)]], \
  device const T* bias [[buffer(2)]], device T* C [[buffer(3)]],    \
  device T* preact [[buffer(4)]], constant uint& M [[buffer(5)]],   \
  constant uint& N [[buffer(6)]], constant uint& K [[buffer(7)]],   \
  constant uint& lda [[buffer(8)]], constant uint& ldb [[buffer(9)]], \
  constant uint& ldc [[buffer(10)]], constant uint& bias_rs [[buffer(11)]], \
  constant uint& bias_cs [[buffer(12)]],                            \
  constant typename tsm_acc<T>::type& alpha [[buffer(13)]],      \
  constant typename tsm_acc<T>::type& beta [[buffer(14)]],       \
  constant uint& epilogue [[buffer(15)]],                           \
  constant uint& vec_ok [[buffer(16)]]

#define TSM_MM_EPILOGUE(name)                                                              \
  using Acc = typename tsm_acc<T>::type;                                                \
  const TsmMmEpilogue<T> name{bias, C, preact, M, N, ldc, bias_rs, bias_cs, alpha, beta, \
                              epilogue}
