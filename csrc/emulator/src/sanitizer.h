// The sanitizer's bookkeeping (internal to the runtime object).
//
// A sanitized dispatch runs on one worker, one Metal thread at a time, so nothing here
// needs locks. Each access of a thread is checked against its region's bounds when it
// happens and recorded with a snapshot of the bytes; when the thread stops (barrier, SIMD
// collective, end) its recorded accesses are classified (bytes changed: a write) and
// compared with the other threads' accesses to the same bytes in the region's shadow.
// Two accesses of different threads, at least one a write, race unless ordered:
//   threadgroup memory: by a threadgroup_barrier with mem_threadgroup, or, for lanes of one
//                       SIMD-group, a simdgroup_barrier with mem_threadgroup;
//   device memory:      likewise with mem_device, and only within one threadgroup: threads
//                       of different threadgroups are never ordered within a dispatch.
// Two atomic accesses never race; an atomic and a plain access do. A write that stores the
// value already there is not seen. An access to a vector or struct element counts for the
// whole element (a write of one component of a float4 is a write of the float4).
// Threadgroup memory starts each threadgroup filled with a poison byte pattern (0xA5), and
// a read of bytes no thread of the threadgroup has written is reported (uninitialized_read).
#pragma once

#include <cstdint>
#include <utility>
#include <memory>
#include <string>
#include <unordered_map>
#include <vector>

#include "tsm_emu/runtime.h"

namespace tsm_emu {

enum RegionKind { R_BUFFER, R_THREADGROUP_ARG, R_THREADGROUP_VAR };

// Who accessed, and the ordering epochs in force for that memory when it did.
struct Access {
  uint32_t group;      // linear threadgroup index in the grid
  uint32_t epoch;      // threadgroup barriers (with the region's memory flag) passed
  uint32_t sg_epoch;   // simdgroup barriers passed by its SIMD-group
  uint16_t thread;     // thread_index_in_threadgroup
  uint8_t simdgroup;
  uint8_t mask;        // bytes of the 4-byte word touched
  bool write;
  bool atomic;
};

struct Cell {  // one 4-byte word of a region
  uint8_t written = 0;     // threadgroup memory: bytes written since the threadgroup began
  uint8_t write_mask = 0;  // which bytes have a last write below
  uint8_t n_reads = 0;
  Access writes[4];        // the last write of each byte
  Access reads[2];         // reads not yet ordered before later accesses, distinct threads
};

struct Region {
  char* base = nullptr;
  size_t bytes = 0;
  RegionKind kind = R_BUFFER;
  int index = 0;
  std::string name;
  std::unordered_map<size_t, Cell> shadow;
};

struct Touch {
  char* address;
  size_t bytes;
  Region* region;
  bool atomic;
  uint64_t count;                       // the same access repeated back to back
  unsigned char before[32];            // the bytes at first touch (elements up to 32 bytes)
  std::vector<unsigned char> before_big;  // larger elements (structs)
  const unsigned char* snapshot() const { return bytes <= sizeof before ? before : before_big.data(); }
};

struct ThreadId {
  uint32_t group;
  uint32_t thread;
  uint32_t simdgroup;
};

// What an instrumented dispatch did, summed over all its threads. Bytes are what the
// kernel asked for (no cache model); an access that changed memory counts as written, one
// that did not as read. Bank conflicts: for each SIMD-group, the k-th threadgroup access of
// every lane between two stops is taken as one instruction; its lanes' 4-byte words map to
// 32 banks, and each bank serving n distinct words costs n - 1 extra cycles.
struct Counters {
  uint64_t device_bytes_read = 0, device_bytes_written = 0;
  uint64_t threadgroup_accesses = 0, bank_conflicts = 0;
  uint64_t barriers = 0, fmas = 0, atomics = 0;
};

class Sanitizer {
 public:
  Sanitizer(u3 grid, u3 group_size, void* const* buffers, const uint64_t* bytes,
            const char* const* names, int num_buffers);

  const Region* buffer(int index) const;
  const Region* threadgroup_arg(int index) const;
  const Region* find(const void* address) const;

  void begin_group(uint32_t simdgroups, void* const* args, const uint64_t* bytes, int num_args,
                   const char* const* names);
  void static_variable(const void* address, size_t bytes, const char* name);

  void access(const Region* region, const void* address, size_t bytes, bool atomic,
              const ThreadId& who, std::vector<Touch>& touches);
  void note_atomic(const void* address, size_t bytes, std::vector<Touch>& touches);
  void end_segment(const ThreadId& who, std::vector<Touch>& touches);

  void threadgroup_barrier(unsigned flags);
  void simdgroup_barrier(uint32_t simdgroup, unsigned flags);

  // Every third weak compare-and-swap fails spuriously (deterministic, so reproducible).
  bool spurious_cas_failure() { return ++cas_calls_ % 3 == 0; }

  void count_fmas(uint32_t n) { counters_.fmas += n; }
  // Turn the threadgroup accesses logged since the SIMD-groups last stopped into bank
  // conflicts; call when every live thread of the threadgroup is stopped.
  void flush_bank_log();
  const Counters& counters() const { return counters_; }

 private:
  [[noreturn]] void race(const Region& r, size_t element_offset, size_t element_bytes,
                         const Access& earlier, const Access& now);
  std::string describe(const Region& r) const;
  std::string thread_name(uint32_t group, uint32_t thread) const;
  bool ordered(const Region& r, const Access& a, const Access& b) const;
  bool conflict(const Region& r, const Access& a, const Access& b) const;
  void record(Region& r, size_t offset, size_t bytes, const Access& base, bool write);

  u3 grid_, group_size_, groups_;
  std::vector<std::unique_ptr<Region>> buffers_, threadgroup_args_, threadgroup_vars_;
  uint32_t tg_epoch_ = 0, dev_epoch_ = 0;
  std::vector<uint32_t> sg_tg_epoch_, sg_dev_epoch_;
  uint64_t cas_calls_ = 0;
  Counters counters_;
  // Per SIMD-group, per lane: the first 4-byte word and word count of each threadgroup
  // access, in program order, since the last flush.
  std::vector<std::vector<std::vector<std::pair<uintptr_t, uint32_t>>>> bank_log_;
};

// From runtime.cpp.
u3 ceil_div(u3 a, u3 b);
ThreadInfo thread_info(u3 grid, u3 group_size, u3 groups, u3 group, uint32_t index);
std::string where_info(const ThreadInfo& t);

}  // namespace tsm_emu
