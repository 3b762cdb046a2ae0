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
// Covered reads of one thread between two stops logged as such (6 MB); later ones are
// logged as Touches, which merge repeats and find a spin-wait over several words.
constexpr size_t kMaxCoveredReads = size_t(1) << 18;
// Log entries past which a thread's earlier accesses are looked up in an index.
constexpr size_t kIndexFrom = 4096;
// Accesses of one SIMD-group between two stops past which they are paired into
// instructions before the stop (about 24 MB): a thread that runs millions of accesses
// without stopping (a long loop, a spin-wait) must not grow the log without bound.
constexpr size_t kMaxInstructionLog = size_t(1) << 20;

// The cell of a word of threadgroup memory, or of a buffer (its shadow's, under the lock of
// its page while in scope).
template <bool kThreadgroup>
class CellOf;
template <>
class CellOf<true> {
 public:
  CellOf(Region& r, size_t word) : cell_(r.group_shadow[word]) {}
  Cell& operator*() { return cell_; }

 private:
  Cell& cell_;
};
template <>
class CellOf<false> {
 public:
  CellOf(Region& r, size_t word) : page_(*r.shadow, word), word_(word) {}
  Cell& operator*() { return page_[word_]; }

 private:
  Shadow::PageLock page_;
  size_t word_;
};

// Whether a read of a word adds nothing to its cell: every write to come that would conflict
// with it conflicts with one of the two reads the cell holds, which cover its bytes, and no
// write the cell holds needs checking against it. Leaving the cell untouched saves the update
// and, for a buffer, keeps the cell in every worker's cache (a matmul's operands: words that
// every threadgroup of a row reads).
//   device memory: the two are of two other threadgroups and nothing wrote the bytes: threads
//     of different threadgroups are never ordered.
//   threadgroup memory: the two are of this interval (epoch), of two threads, and nothing
//     wrote the bytes in it; and they are of two SIMD-groups (a simdgroup_barrier orders at
//     most one of them before a write), or of the reader's SIMD-group and its current
//     SIMD-group interval (what orders them before a write orders the read too).
template <bool kThreadgroup>
[[gnu::always_inline]] inline bool covered_read(const Cell& c, Access now) {
  const unsigned mask = now.mask();
  const Access &a = c.reads[0], &b = c.reads[1];
  if (c.n_reads != 2 || (a.mask() & b.mask() & mask) != mask) return false;
  if constexpr (!kThreadgroup) {
    return !(mask & c.write_mask) && a.group != b.group && now.group != a.group && now.group != b.group;
  } else {
    if ((mask & c.write_mask) && c.write_epoch == now.epoch) return false;
    if (a.epoch != now.epoch || b.epoch != now.epoch) return false;
    return a.simdgroup != b.simdgroup || (a.simdgroup == now.simdgroup && b.simdgroup == now.simdgroup &&
                                          a.sg_epoch == now.sg_epoch && b.sg_epoch == now.sg_epoch);
  }
}

inline AccessLog::Key key_of(const Touch& t) {
  return {t.address, t.bytes, t.element_bytes, t.element_offset, t.atomic};
}

// memcpy / memcmp of the common element sizes without a library call: the sanitizer's hot
// path runs these once per access.
template <class F>
inline void with_size(size_t bytes, F f) {
  if (bytes == 4) return f(std::integral_constant<size_t, 4>());  // most: no jump through a table
  switch (bytes) {
    case 1: f(std::integral_constant<size_t, 1>()); break;
    case 2: f(std::integral_constant<size_t, 2>()); break;
    case 4: f(std::integral_constant<size_t, 4>()); break;
    case 8: f(std::integral_constant<size_t, 8>()); break;
    case 16: f(std::integral_constant<size_t, 16>()); break;
    default: f(bytes);
  }
}

// The same for the 1 to 4 bytes of an access within one word (a CoveredRead's).
template <class F>
inline void with_word_size(size_t bytes, F f) {
  switch (bytes) {
    case 4: f(std::integral_constant<size_t, 4>()); break;
    case 3: f(std::integral_constant<size_t, 3>()); break;
    case 2: f(std::integral_constant<size_t, 2>()); break;
    default: f(std::integral_constant<size_t, 1>());
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
  const char* a = static_cast<const char*>(address);
  flush_pending(who, log);  // the accesses before this one (a spin-wait among them: a hang)
  if (!region || e < region->base || e + element_bytes > region->base + region->bytes)
    out_of_bounds(region, e, element_bytes, who);
  if (region->kind == R_PROGRAM_CONSTANT) return;  // read-only: no race, no device transaction
  if (atomic) {  // an instruction of its own, logged by note_atomic
    log_access(log, region, e, element_bytes, a, bytes, true, who, a);
    return;
  }
  if (e == a && element_bytes == bytes)
    log_plain_access(log, const_cast<Region&>(*region), a, bytes, who, now_of(who), a);
  else  // a field
    log_access(log, region, e, element_bytes, a, bytes, false, who, a);
  if (region->kind != R_BUFFER) ++counters_.threadgroup_accesses;
  if (count_instructions_) log_instruction(who, site, region, address, bytes, false);
}

[[gnu::always_inline]] inline Sanitizer::Now Sanitizer::now_of(const ThreadId& who) const {
  return {{who.group, tg_epoch_, sg_tg_epoch_[who.simdgroup], uint16_t(who.thread), uint8_t(who.simdgroup), 0},
          {who.group, dev_epoch_, sg_dev_epoch_[who.simdgroup], uint16_t(who.thread), uint8_t(who.simdgroup), 0}};
}

[[gnu::always_inline]] inline void Sanitizer::log_plain_access(AccessLog& log, Region& r, const char* a, size_t bytes,
                                                               const ThreadId& who, const Now& now,
                                                               const void* before) {
  if (!log_covered_read(log, r, a, bytes, who, now, before))
    log_access(log, &r, a, bytes, a, bytes, false, who, before);
}

inline void Sanitizer::flush_pending(const ThreadId& who, AccessLog& log) {
  PendingAccess* const first = pending_buffer_.get();
  const PendingAccess* const last = pending.next;
  if (first == last) return;
  pending.next = first;
  const Now now = now_of(who);  // a thread's epochs do not change before it stops
  uint64_t threadgroup_accesses = 0;
  for (const PendingAccess* p = first; p != last; ++p) {
    Region& r = *static_cast<Region*>(const_cast<Bounds*>(p->region));
    log_plain_access(log, r, p->address, p->bytes, who, now, p->before);
    threadgroup_accesses += r.kind != R_BUFFER;
  }
  counters_.threadgroup_accesses += threadgroup_accesses;
}

inline Touch covered_touch(const AccessLog::CoveredRead& c) {
  Touch t;
  t.address = const_cast<char*>(c.address);
  t.region = c.region;
  t.count = 1;
  t.bytes = t.element_bytes = c.bytes;
  t.element_offset = 0;
  t.atomic = t.stored = false;
  t.first = USE_UNKNOWN;
  std::memcpy(t.before, &c.before, sizeof c.before);
  return t;
}

// Taken before the access is logged as a Touch, for a read of a whole element within one
// word (a scalar): what most reads of threadgroup memory are. If its word's cell already
// holds what the read would add (covered_read), the read is a CoveredRead. A store through
// its reference later in the segment (the rewriter's stored(), an atomic through its
// address, or bytes found changed at the stop) makes it a write as well, and a write there
// is always a race: the cell's two reads are of other threads (or one of them the thread's
// own earlier one) and in this interval, so one of them is unordered with it.
[[gnu::always_inline]] inline bool Sanitizer::log_covered_read(AccessLog& log, Region& r, const char* a, size_t bytes,
                                                               const ThreadId& who, const Now& now,
                                                               const void* before) {
  const size_t offset = size_t(a - r.base);
  std::vector<AccessLog::CoveredRead>& covered = log.covered;
  if ((offset & 3) + bytes > 4 || covered.size() >= kMaxCoveredReads) return false;
  const uint8_t mask = uint8_t(((1u << bytes) - 1) << (offset & 3));
  const bool device = r.kind == R_BUFFER;
  if (device) {
    Access reader = now.device;
    reader.bits = mask;
    CellOf<false> c(r, offset / 4);
    if (!covered_read<false>(*c, reader)) return false;
    counters_.device_bytes_read += bytes;
  } else {
    Access reader = now.threadgroup;
    reader.bits = mask;
    const Cell& c = r.group_shadow[offset / 4];
    // A read of bytes nobody has written is recorded: it is reported when the interval ends.
    if ((mask & ~c.written) || !covered_read<true>(c, reader)) return false;
  }
  log.latest_covered = true;
  log.repeats_before_latest = log.repeats;
  if (!covered.empty() && covered.back().address == a && covered.back().bytes == bytes) {
    // A loop re-reading it (a spin-wait, maybe).
    if (++log.repeats >= kMaxRepeats) hang(log, covered_touch(covered.back()), who);
    return true;
  }
  log.repeats = 0;
  // Built in place, field by field (as log_access builds a Touch): one assembled on the
  // stack and copied whole stalls on the store buffer.
  AccessLog::CoveredRead& read = covered.emplace_back();
  read.address = a;
  read.region = &r;
  read.bytes = uint32_t(bytes);
  read.before = 0;
  with_word_size(bytes, [&](auto n) { std::memcpy(&read.before, before, n); });
  return true;
}

[[gnu::always_inline]] inline void Sanitizer::log_access(AccessLog& log, const Region* region,
                                                        const char* element, size_t element_bytes,
                                                        const char* a, size_t bytes, bool atomic,
                                                        const ThreadId& who, const void* before) {
  const AccessLog::Key key{a, uint32_t(bytes), uint32_t(element_bytes), uint32_t(a - element), atomic};
  Touch* seen = nullptr;
  if (log.latest < log.touches.size() && key_of(log.touches[log.latest]) == key)
    seen = &log.touches[log.latest];  // a loop re-reading one element: no lookup
  else if (!log.index.empty() || log.touches.size() >= kIndexFrom)
    seen = look_up(log, key);
  log.repeats_before_latest = log.repeats;
  log.latest_covered = false;
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
    with_size(bytes, [&](auto n) { std::memcpy(t.before, before, n); });
  } else {
    t.big = log.big_snapshots.size();
    const unsigned char* b = static_cast<const unsigned char*>(before);
    log.big_snapshots.insert(log.big_snapshots.end(), b, b + bytes);
  }
}

}  // namespace tsm_emu
