// The check reads the emulator's <simd/simd.h>: one declaration of the names for both.
#pragma once
#include "../../../include/simd/simd.h"
