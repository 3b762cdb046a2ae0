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
#include "tsm_emu/logging.h"
#include "tsm_emu/array.h"
#include "tsm_emu/matrix.h"
#include "tsm_emu/pack.h"
#include "tsm_emu/builtins.h"

#define METAL_FUNC inline __attribute__((always_inline))

#define device
#define constant
#define thread
#define threadgroup
// Metal 3.2: `volatile coherent(device) device T*`; device memory is coherent here.
#define coherent(scope)
