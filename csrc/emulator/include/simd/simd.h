// <simd/simd.h> as Metal provides it: the vector and matrix type names that host code and
// shaders share (simd_float4, vector_float4, matrix_float4x4, simd::float4x4, ...), each the
// Metal type of the same shape. Written from Apple's documentation of the simd library and
// its use in Metal code shared with the host; the front-end check reads this file too
// (frontend/include/simd/simd.h).
#pragma once

#ifdef __TSM_EMU_PARSE__
// The parse pass keeps the user's code alone; this marks where the header was included, and
// the check and the build include it there again (_msl_text.restore_marked_includes).
#pragma tsm_msl_include <simd/simd.h>
#else

#define TSM_SIMD_VECTOR_NAMES(T)                                                        \
  typedef T simd_##T##1;                                                                 \
  typedef ::metal::T##2 simd_##T##2;                                                     \
  typedef ::metal::T##3 simd_##T##3;                                                     \
  typedef ::metal::T##4 simd_##T##4;                                                     \
  typedef ::metal::packed_##T##2 simd_packed_##T##2;                                     \
  typedef ::metal::packed_##T##4 simd_packed_##T##4;                                     \
  typedef simd_##T##1 vector_##T##1;                                                     \
  typedef simd_##T##2 vector_##T##2;                                                     \
  typedef simd_##T##3 vector_##T##3;                                                     \
  typedef simd_##T##4 vector_##T##4;                                                     \
  namespace simd {                                                                       \
  typedef ::metal::T##2 T##2;                                                            \
  typedef ::metal::T##3 T##3;                                                            \
  typedef ::metal::T##4 T##4;                                                            \
  namespace packed {                                                                     \
  typedef ::metal::packed_##T##2 T##2;                                                   \
  typedef ::metal::packed_##T##4 T##4;                                                   \
  }                                                                                      \
  }
#define TSM_SIMD_MATRIX_NAMES(M)                                                        \
  typedef ::metal::M simd_##M;                                                           \
  typedef simd_##M matrix_##M;                                                           \
  namespace simd {                                                                       \
  typedef ::metal::M M;                                                                  \
  }
// (names pasted here, before `half` could expand: the check spells it _Float16)
#define TSM_SIMD_MATRICES(T)                                                            \
  TSM_SIMD_MATRIX_NAMES(T##2x2) TSM_SIMD_MATRIX_NAMES(T##2x3) TSM_SIMD_MATRIX_NAMES(T##2x4) \
  TSM_SIMD_MATRIX_NAMES(T##3x2) TSM_SIMD_MATRIX_NAMES(T##3x3) TSM_SIMD_MATRIX_NAMES(T##3x4) \
  TSM_SIMD_MATRIX_NAMES(T##4x2) TSM_SIMD_MATRIX_NAMES(T##4x3) TSM_SIMD_MATRIX_NAMES(T##4x4)

TSM_SIMD_VECTOR_NAMES(char)
TSM_SIMD_VECTOR_NAMES(uchar)
TSM_SIMD_VECTOR_NAMES(short)
TSM_SIMD_VECTOR_NAMES(ushort)
TSM_SIMD_VECTOR_NAMES(int)
TSM_SIMD_VECTOR_NAMES(uint)
TSM_SIMD_VECTOR_NAMES(long)
TSM_SIMD_VECTOR_NAMES(ulong)
TSM_SIMD_VECTOR_NAMES(half)
TSM_SIMD_VECTOR_NAMES(float)
TSM_SIMD_MATRICES(half)
TSM_SIMD_MATRICES(float)

#undef TSM_SIMD_VECTOR_NAMES
#undef TSM_SIMD_MATRIX_NAMES
#undef TSM_SIMD_MATRICES
#endif
