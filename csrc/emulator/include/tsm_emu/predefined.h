// Macros Apple's <metal_*> headers define, which shaders test (candle's
// `#if defined(__HAVE_BFLOAT__)`): seen in the parse pass, where the user's code is
// preprocessed, as after including any of Apple's headers.
#pragma once
#if defined(__METAL_VERSION__) && __METAL_VERSION__ >= 310
#define __HAVE_BFLOAT__ 1
#endif
