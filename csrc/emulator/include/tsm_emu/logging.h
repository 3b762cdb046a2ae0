// <metal_logging> (MSL 3.2): os_log. Apple's GPU sends messages to the unified log only when
// the library is compiled with logging enabled (-fmetal-enable-logging); the emulator
// compiles without it, so messages are accepted and dropped.
#pragma once

namespace metal {

struct os_log {
  constexpr os_log(const char*, const char*) {}
  template <class... Args> void log(const char*, Args...) const {}
  template <class... Args> void log_debug(const char*, Args...) const {}
  template <class... Args> void log_info(const char*, Args...) const {}
  template <class... Args> void log_error(const char*, Args...) const {}
  template <class... Args> void log_fault(const char*, Args...) const {}
};
constexpr os_log os_log_default(nullptr, nullptr);

}  // namespace metal
