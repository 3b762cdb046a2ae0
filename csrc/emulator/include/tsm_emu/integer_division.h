// Integer division in kernel code. Metal leaves x / 0, x % 0 and INT_MIN / -1 undefined;
// compiled as plain C++ they would trap on x86-64 (SIGFPE) and give 0 on AArch64. The
// front end (torch_sparse_metal/metal/_frontend.py) turns every integer or type-dependent
// `/`, `%`, `/=` and `%=` of a kernel into these functions, so the emulator behaves the same
// on every architecture:
//   * sanitized builds report KernelFault(kind="integer_division");
//   * unsanitized builds give AArch64's answers: x / 0 = 0, x % 0 = x, INT_MIN / -1 = INT_MIN,
//     INT_MIN % -1 = 0 (what an Apple CPU computes; an Apple GPU's answer is undocumented).
// Floating-point and vector operands keep their own operators (vectors use these per element).
#pragma once

#include <limits>
#include <string>
#include <type_traits>

#include "tsm_emu/runtime.h"

namespace tsm_emu {
namespace division_detail {

// `op` is "/" or "%"; `result` is what the unsanitized emulator returns.
template <class R>
R undefined(R x, R y, const char* op, R result) {
#ifdef __TSM_SANITIZE__
  const std::string message =
      std::string(*op == '/' ? "integer division " : "integer remainder ") + std::to_string(x) + " " +
      op + " " + std::to_string(y) + (y == R(0) ? " by zero" : " overflows") + " in " +
      where_info(current_thread()) + " (undefined in Metal; the unsanitized emulator gives " +
      std::to_string(result) + ")";
  fault("integer_division", message.c_str());
#else
  (void)x, (void)y, (void)op;
  return result;
#endif
}

}  // namespace division_detail

template <class A, class B>
constexpr auto div(A a, B b) -> decltype(a / b) {
  using R = decltype(a / b);
  if constexpr (std::is_integral<R>::value) {
    const R x = static_cast<R>(a), y = static_cast<R>(b);
    if (y == R(0)) return division_detail::undefined<R>(x, y, "/", R(0));
    if constexpr (std::is_signed<R>::value) {
      if (y == R(-1) && x == std::numeric_limits<R>::min()) return division_detail::undefined<R>(x, y, "/", x);
    }
    return x / y;
  } else {
    return a / b;
  }
}

template <class A, class B>
constexpr auto rem(A a, B b) -> decltype(a % b) {
  using R = decltype(a % b);
  if constexpr (std::is_integral<R>::value) {
    const R x = static_cast<R>(a), y = static_cast<R>(b);
    if (y == R(0)) return division_detail::undefined<R>(x, y, "%", x);
    if constexpr (std::is_signed<R>::value) {
      if (y == R(-1) && x == std::numeric_limits<R>::min()) return division_detail::undefined<R>(x, y, "%", R(0));
    }
    return x % y;
  } else {
    return a % b;
  }
}

template <class A, class B>
constexpr A& div_assign(A& a, const B& b) {
  if constexpr (std::is_integral<std::remove_cv_t<A>>::value) {
    a = static_cast<std::remove_cv_t<A>>(div(a, b));
  } else {
    a /= b;
  }
  return a;
}

template <class A, class B>
constexpr A& rem_assign(A& a, const B& b) {
  if constexpr (std::is_integral<std::remove_cv_t<A>>::value) {
    a = static_cast<std::remove_cv_t<A>>(rem(a, b));
  } else {
    a %= b;
  }
  return a;
}

}  // namespace tsm_emu
