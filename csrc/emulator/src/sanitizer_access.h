// The sanitizer's per-access half (sanitizer.h): what every checked access of a kernel runs.
// A header, so that the runtime's entry point for kernel code (runtime.cpp, sanitizer_access)
// has it inlined: a call from one object file into another, with the running thread's
// ThreadId passed through memory, was a fifth of the per-access time (perf, tiled matmul).
#pragma once

#include <cstring>
#include <type_traits>

#include "sanitizer.h"

namespace tsm_emu {

// A spin-wait repeats accesses to memory it has already accessed since it last stopped; a
// thread this far into doing nothing else is not coming back.
constexpr uint64_t kMaxRepeats = uint64_t(1) << 22;
// Distinct accesses of one thread between two stops, as a memory bound (about 1.5 GB).
constexpr size_t kMaxLoggedAccesses = size_t(1) << 24;
// Log entries past which a thread's earlier accesses are looked up in an index.
constexpr size_t kIndexFrom = 4096;
// Accesses of one SIMD-group between two stops past which they are paired into
// instructions before the stop (about 24 MB): a thread that runs millions of accesses
// without stopping (a long loop, a spin-wait) must not grow the log without bound.
constexpr size_t kMaxInstructionLog = size_t(1) << 20;

inline AccessLog::Key key_of(const Touch& t) {
  return {t.address, t.bytes, t.element_bytes, t.element_offset, t.atomic};
}

// memcpy / memcmp of the common element sizes without a library call: the sanitizer's hot
// path runs these once per access.
template <class F>
inline void with_size(size_t bytes, F f) {
  switch (bytes) {
    case 1: f(std::integral_constant<size_t, 1>()); break;
    case 2: f(std::integral_constant<size_t, 2>()); break;
    case 4: f(std::integral_constant<size_t, 4>()); break;
    case 8: f(std::integral_constant<size_t, 8>()); break;
    case 16: f(std::integral_constant<size_t, 16>()); break;
    default: f(bytes);
  }
}

// Inline: called once per access (and once per atomic operation).
[[gnu::always_inline]] inline void Sanitizer::log_instruction(const ThreadId& who, uintptr_t site,
                                                              const Region* region, const void* address,
                                                              size_t bytes, bool atomic) {
  InstructionLog& log = instruction_log_[who.simdgroup];
  if (log.accesses >= kMaxInstructionLog) {
    pair_instructions(log);
    log.clear();
  }
  const bool device = !region || region->kind == R_BUFFER;
  // A GPU buffer starts at a segment boundary (as bound: a tensor's storage offset aside),
  // a host allocation need not: segments are counted from the buffer's start.
  const uintptr_t shift = device && region ? uintptr_t(region->base) & (segment_bytes_ - 1) : 0;
  const uintptr_t key = site << 1 | uintptr_t(device);
  size_t p = log.latest;
  if (p >= log.used || log.places[p].key != key) {
    p = log.previous;
    // A kernel has few places between two stops: a linear search.
    if (p >= log.used || log.places[p].key != key)
      for (p = 0; p < log.used && log.places[p].key != key;) ++p;
    if (p == log.used) {
      if (log.used == log.places.size()) log.places.emplace_back();
      log.places[log.used++].key = key;
    }
    log.previous = log.latest;
  }
  log.latest = p;
  ++log.accesses;
  // Built in place, field by field: a LaneAccess assembled on the stack and copied whole
  // stalls on the store buffer (half of this function's time, perf).
  LaneAccess& a = log.places[p].accesses.emplace_back();
  a.address = uintptr_t(address) - shift;
  a.bytes = uint32_t(bytes);
  a.lane = uint8_t(who.thread % kSimdLanes);
  a.atomic = atomic;
}

// Inline into the runtime's per-access entry point (runtime.cpp, sanitizer_access).
[[gnu::always_inline]] inline void Sanitizer::access(const Region* region, const void* element, size_t element_bytes,
                       const void* address, size_t bytes, bool atomic, const ThreadId& who,
                       AccessLog& log, uintptr_t site) {
  const char* e = static_cast<const char*>(element);
  if (!region || e < region->base || e + element_bytes > region->base + region->bytes)
    out_of_bounds(region, e, element_bytes, who);
  if (region->kind == R_PROGRAM_CONSTANT) return;  // read-only: no race, no device transaction
  log_access(log, region, e, element_bytes, static_cast<const char*>(address), bytes, atomic, who);
  if (atomic) return;  // an instruction of its own, logged by note_atomic
  const bool device = region->kind == R_BUFFER;
  if (!device) ++counters_.threadgroup_accesses;
  if (count_instructions_) log_instruction(who, site, region, address, bytes, false);
}

[[gnu::always_inline]] inline void Sanitizer::log_access(AccessLog& log, const Region* region,
                                                        const char* element, size_t element_bytes,
                                                        const char* a, size_t bytes, bool atomic,
                                                        const ThreadId& who) {
  const AccessLog::Key key{a, uint32_t(bytes), uint32_t(element_bytes), uint32_t(a - element), atomic};
  Touch* seen = nullptr;
  if (log.latest < log.touches.size() && key_of(log.touches[log.latest]) == key)
    seen = &log.touches[log.latest];  // a loop re-reading one element: no lookup
  else if (!log.index.empty() || log.touches.size() >= kIndexFrom)
    seen = look_up(log, key);
  log.repeats_before_latest = log.repeats;
  if (seen) {
    ++seen->count;
    // Metal promises no forward progress between threads: a thread spinning on memory
    // another thread sets never yields to it here (threads run one at a time). Report the
    // spin instead of hanging the process.
    if (++log.repeats >= kMaxRepeats) hang(log, *seen, who);
    return;
  }
  log.repeats = 0;
  if (log.touches.size() >= kMaxLoggedAccesses)
    fault("launch", "the sanitizer's log of one thread's accesses between two barriers is full "
                    "(16M distinct accesses): run this kernel unsanitized, or on smaller data");
  log.latest = log.touches.size();
  if (!log.index.empty()) log.index.emplace(key, uint32_t(log.latest));
  log.touches.emplace_back();
  Touch& t = log.touches.back();
  t.address = const_cast<char*>(a);
  t.region = const_cast<Region*>(region);
  t.count = 1;
  t.bytes = key.bytes;
  t.element_bytes = key.element_bytes;
  t.element_offset = key.element_offset;
  t.atomic = atomic;
  t.stored = false;
  t.first = USE_UNKNOWN;
  if (atomic) return;
  if (bytes <= sizeof t.before) {
    with_size(bytes, [&](auto n) { std::memcpy(t.before, a, n); });
  } else {
    t.big = log.big_snapshots.size();
    log.big_snapshots.insert(log.big_snapshots.end(), a, a + bytes);
  }
}

}  // namespace tsm_emu
