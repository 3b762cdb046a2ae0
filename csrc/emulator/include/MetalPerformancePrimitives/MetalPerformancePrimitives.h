// Stand-in for the MetalPerformancePrimitives framework's header (MSL 4.0): what the emulator
// has of it, mpp::tensor_ops::matmul2d on cooperative tensors, is tsm_emu/tensor_ops.h, behind
// the one emulated standard library.
#pragma once
#ifndef __TSM_EMU_PARSE__  // the parse pass sees user code only
#include "tsm_emu/metal.h"
#endif
