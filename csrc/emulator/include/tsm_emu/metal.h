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

#define METAL_FUNC inline __attribute__((always_inline))

#define device
#define constant
#define thread
#define threadgroup
