// The emulated Metal standard library, included by every <metal_*> stand-in.
//
// Kernel source reaches the compiler after torch_sparse_metal/metal/_rewrite.py has removed
// `kernel` and the [[attributes]] and turned threadgroup variables into storage shared by
// one threadgroup; the address-space qualifiers that remain mean nothing to the C++
// compiler and are defined away at the end of this file.
#pragma once

#include "tsm_emu/types.h"
#include "tsm_emu/math.h"
#include "tsm_emu/runtime.h"
#include "tsm_emu/bind.h"
#include "tsm_emu/sync.h"
#include "tsm_emu/simd.h"
#include "tsm_emu/atomic.h"
#include "tsm_emu/simdgroup_matrix.h"
#include "tsm_emu/tensor_ops.h"
#include "tsm_emu/texture.h"
#include "tsm_emu/logging.h"
#include "tsm_emu/array.h"
#include "tsm_emu/thread_array.h"
#include "tsm_emu/matrix.h"
#include "tsm_emu/pack.h"
#include "tsm_emu/builtins.h"
#include "tsm_emu/regions.h"
#include "tsm_emu/lanes.h"

// Metal's scalar, fixed-width integer and vector type names are visible without `using
// namespace metal`: ggml-common.h declares its blocks with half2 and uint8_t before any
// using-directive, and MLX's fence.metal uses uint so.
#define TSM_GLOBAL(name) typedef metal::name name;
TSM_GLOBAL(size_t) TSM_GLOBAL(ptrdiff_t)  // ggml-metal-impl.h uses size_t so
TSM_GLOBAL(half) TSM_GLOBAL(bfloat)  // ggml-common.h: `typedef half ggml_half;`
TSM_GLOBAL(uchar) TSM_GLOBAL(ushort) TSM_GLOBAL(uint) TSM_GLOBAL(ulong) TSM_GLOBAL(int8_t) TSM_GLOBAL(uint8_t) TSM_GLOBAL(int16_t) TSM_GLOBAL(uint16_t)
TSM_GLOBAL(int32_t) TSM_GLOBAL(uint32_t) TSM_GLOBAL(int64_t) TSM_GLOBAL(uint64_t) TSM_GLOBAL(char2) TSM_GLOBAL(packed_char2) TSM_GLOBAL(char3) TSM_GLOBAL(packed_char3)
TSM_GLOBAL(char4) TSM_GLOBAL(packed_char4) TSM_GLOBAL(uchar2) TSM_GLOBAL(packed_uchar2) TSM_GLOBAL(uchar3) TSM_GLOBAL(packed_uchar3) TSM_GLOBAL(uchar4) TSM_GLOBAL(packed_uchar4)
TSM_GLOBAL(short2) TSM_GLOBAL(packed_short2) TSM_GLOBAL(short3) TSM_GLOBAL(packed_short3) TSM_GLOBAL(short4) TSM_GLOBAL(packed_short4) TSM_GLOBAL(ushort2) TSM_GLOBAL(packed_ushort2)
TSM_GLOBAL(ushort3) TSM_GLOBAL(packed_ushort3) TSM_GLOBAL(ushort4) TSM_GLOBAL(packed_ushort4) TSM_GLOBAL(int2) TSM_GLOBAL(packed_int2) TSM_GLOBAL(int3) TSM_GLOBAL(packed_int3)
TSM_GLOBAL(int4) TSM_GLOBAL(packed_int4) TSM_GLOBAL(uint2) TSM_GLOBAL(packed_uint2) TSM_GLOBAL(uint3) TSM_GLOBAL(packed_uint3) TSM_GLOBAL(uint4) TSM_GLOBAL(packed_uint4)
TSM_GLOBAL(long2) TSM_GLOBAL(packed_long2) TSM_GLOBAL(long3) TSM_GLOBAL(packed_long3) TSM_GLOBAL(long4) TSM_GLOBAL(packed_long4) TSM_GLOBAL(ulong2) TSM_GLOBAL(packed_ulong2)
TSM_GLOBAL(ulong3) TSM_GLOBAL(packed_ulong3) TSM_GLOBAL(ulong4) TSM_GLOBAL(packed_ulong4) TSM_GLOBAL(half2) TSM_GLOBAL(packed_half2) TSM_GLOBAL(half3) TSM_GLOBAL(packed_half3)
TSM_GLOBAL(half4) TSM_GLOBAL(packed_half4) TSM_GLOBAL(float2) TSM_GLOBAL(packed_float2) TSM_GLOBAL(float3) TSM_GLOBAL(packed_float3) TSM_GLOBAL(float4) TSM_GLOBAL(packed_float4)
TSM_GLOBAL(bool2) TSM_GLOBAL(bool3) TSM_GLOBAL(bool4)
TSM_GLOBAL(bfloat2) TSM_GLOBAL(bfloat3) TSM_GLOBAL(bfloat4)
TSM_GLOBAL(packed_bfloat2) TSM_GLOBAL(packed_bfloat3) TSM_GLOBAL(packed_bfloat4)
#undef TSM_GLOBAL
namespace metal {
using std::initializer_list;  // Metal's name for the type of a braced list argument
}
using metal::as_type;  // an operator of the language, named anywhere (see the check's metal_stdlib)

#define METAL_FUNC inline __attribute__((always_inline))

#define device
#define constant
#define thread
#define threadgroup
// Metal 3.2: `volatile coherent(device) device T*`; device memory is coherent here.
#define coherent(scope)
