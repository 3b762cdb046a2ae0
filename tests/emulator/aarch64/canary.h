// The canary kernel's arithmetic (kernels.metal), shared with the driver that checks it
// (driver.cpp): float, double and 32-bit unsigned arithmetic that gives the same bits in
// both, as they are compiled with the same flags. Ten integer and eight floating-point
// values, different in every thread, stay live across every barrier: as many as AArch64
// has callee-saved registers (x19-x28, d8-d15), where a compiler keeps values across a call.
#pragma once

#define CANARY_INIT(seed)                                                                     \
  uint u0 = uint(seed), u1 = u0 * 3u + 1u, u2 = u0 ^ 0x5555u, u3 = ~u0, u4 = u0 + 7u,        \
       u5 = u0 * u0, u6 = u0 << 3, u7 = u0 | 0x100u, u8 = 12345u - u0, u9 = u0 * 2654435761u; \
  float f0 = float(seed), f1 = f0 + 1.0f, f2 = f0 * 0.5f, f3 = 3.0f - f0;                    \
  double d0 = double(seed), d1 = d0 * 0.25, d2 = d0 + 0.125, d3 = -d0

#define CANARY_STEP(step)                                  \
  u0 = u0 * 1664525u + 1013904223u;                        \
  u1 = (u1 ^ (u0 >> 13)) * 2246822519u;                    \
  u2 += u1 >> 5;                                           \
  u3 = ((u3 << 1) | (u3 >> 31)) ^ u2;                      \
  u4 = u4 * 3u + uint(step);                               \
  u5 ^= u4 + u0;                                           \
  u6 += (u5 >> 3) + 1u;                                    \
  u7 = (u7 * 5u) ^ u6;                                     \
  u8 -= u7 >> 2;                                           \
  u9 ^= u8 * 31u + u3;                                     \
  f0 = f0 * 0.5f + float(u0 >> 16);                        \
  f1 = f1 * 0.75f - f0 * 0.125f + float(step);             \
  f2 = f2 * 0.5f + float(u9 & 0xFFFu) * 0.001f;            \
  f3 = f3 * 0.25f - f2 + 1.0f;                             \
  d0 = d0 * 0.5 + double(u1 >> 8);                         \
  d1 = d1 * 0.75 - d0 * 0.125 + double(u5 & 0xFFu);        \
  d2 = d2 * 0.5 + d3 * 0.25 + 1.0;                         \
  d3 = d3 * 0.25 - double(u7 >> 24)

// Where thread `i` leaves its values: 10 uints, 4 floats, 4 doubles.
#define CANARY_STORE(u, f, d, i)                                                               \
  u[10 * (i) + 0] = u0, u[10 * (i) + 1] = u1, u[10 * (i) + 2] = u2, u[10 * (i) + 3] = u3,        \
  u[10 * (i) + 4] = u4, u[10 * (i) + 5] = u5, u[10 * (i) + 6] = u6, u[10 * (i) + 7] = u7,        \
  u[10 * (i) + 8] = u8, u[10 * (i) + 9] = u9, f[4 * (i) + 0] = f0, f[4 * (i) + 1] = f1,          \
  f[4 * (i) + 2] = f2, f[4 * (i) + 3] = f3, d[4 * (i) + 0] = d0, d[4 * (i) + 1] = d1,            \
  d[4 * (i) + 2] = d2, d[4 * (i) + 3] = d3

#define CANARY_STEPS 100
