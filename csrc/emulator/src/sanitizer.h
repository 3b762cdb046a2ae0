// The sanitizer's bookkeeping (internal to the runtime object).
//
// A sanitized dispatch runs each threadgroup on one worker, one Metal thread at a time; its
// workers (one per 8K threads of the dispatch, as unsanitized, up to the core count) run
// different threadgroups, each with a Sanitizer of its own. They share the buffers' shadows
// only (Shadow, locked per page): threadgroup memory, the epochs and the counters are per
// threadgroup or summed at the end. Threads of different threadgroups are never ordered
// within a dispatch, so a race between two of them is found whichever runs first; with
// several workers which pair of the racing threads is named can vary between runs.
// Each access of a thread is checked against its region's bounds when it happens and
// logged with a snapshot of the bytes (a repeat of a logged access is counted on it, see
// AccessLog): most of them by kernel code inline, into PendingAccesses, which the next call
// into the runtime takes into the log. When the thread stops (barrier, SIMD-group
// function, end) its logged accesses are classified and compared with the other threads'
// accesses to the same bytes in the region's shadow; a read that could add nothing there
// (AccessLog::CoveredRead) is only compared with its snapshot. An access is a write if the rewriter marked it as an assignment's target
// (sanitize.h) or if it changed the bytes; otherwise a read. (With several workers, a read
// of bytes another threadgroup changes before the reader stops counts as a write too: a race
// either way, whose report says the bytes changed, by the thread or by another threadgroup,
// since which of the two it was cannot be told; Access::kChanged.)
// Two accesses of different threads, at least one a write, race unless ordered:
//   threadgroup memory: by a threadgroup_barrier with mem_threadgroup, or, for lanes of one
//                       SIMD-group, a simdgroup_barrier with mem_threadgroup;
//   device memory:      likewise with mem_device, and only within one threadgroup: threads
//                       of different threadgroups are never ordered within a dispatch.
// Two atomic accesses never race; an atomic and a plain access do. An access is to the bytes
// it touched: a field of a struct element (member_of in sanitize.h), but a vector whole (a
// write of one component of a float4 is a write of the float4).
// Threadgroup memory has a shadow of which bytes a thread of the threadgroup has written
// (per element: a write of one field counts for its element). A read of bytes nobody has
// written is reported as uninitialized_read only when the interval ends (the next barrier
// with mem_threadgroup, or the threadgroup's end) without a race: a thread that writes them
// later in the same interval is a threadgroup_race, the missing barrier being the cause.
#pragma once

#include <algorithm>
#include <atomic>
#include <csignal>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <thread>
#include <unordered_map>
#include <utility>
#include <vector>

#include "tsm_emu/runtime.h"

namespace tsm_emu {

enum RegionKind { R_BUFFER, R_THREADGROUP_ARG, R_THREADGROUP_VAR, R_PROGRAM_CONSTANT };

// Who accessed, and the ordering epochs in force for that memory when it did (16 bytes:
// a cell holds six).
struct Access {
  uint32_t group;      // linear threadgroup index in the grid
  uint32_t epoch;      // threadgroup barriers (with the region's memory flag) passed
  uint32_t sg_epoch;   // simdgroup barriers passed by its SIMD-group
  uint16_t thread;     // thread_index_in_threadgroup
  uint8_t simdgroup;
  // The bytes of the 4-byte word touched (bits 0-3), kWrite, kAtomic, kChanged. Not
  // bit-fields: an Access built of byte stores and read back whole stalls the store buffer.
  uint8_t bits;
  // kChanged (with kWrite): a write known only by the bytes having changed before the thread
  // stopped, in a buffer other workers' threadgroups write at the same time: the thread wrote
  // them through a reference the rewriter could not mark, or read them while another
  // threadgroup wrote them. A race either way; the report says it may be either.
  static constexpr uint8_t kWrite = 0x10, kAtomic = 0x20, kChanged = 0x40;
  unsigned mask() const { return bits & 0xFu; }
  bool write() const { return bits & kWrite; }
  bool atomic() const { return bits & kAtomic; }
  bool changed() const { return bits & kChanged; }
};
static_assert(sizeof(Access) == 16, "Access packs into 16 bytes");

// One 4-byte word of a region. The reads before the writes: a read mostly looks at the first
// 44 bytes only, which then span fewer cache lines (a sanitized tiled matmul, whose
// threadgroup memory's cells fill L1 many times over, ran about 2% faster; aligning each
// cell to a line as well gained 2% more there, but cost the tree reduction 6%, whose reads
// of a buffer of 1M floats then touch 20% more shadow).
struct Cell {
  uint8_t written = 0;     // threadgroup memory: bytes written since the threadgroup began
  uint8_t write_mask = 0;  // which bytes have a last write below
  uint8_t n_reads = 0;     // reads below that hold
  // The epoch of the latest write below, the newest of them: in threadgroup memory, whose
  // accesses all come from one threadgroup, none of them is a race once the epoch moved on.
  uint32_t write_epoch = 0;
  uint32_t generation = 0; // threadgroup memory: the threadgroup it is of (GroupShadow)
  Access reads[2];         // reads not yet ordered before later accesses, distinct threads
  Access writes[4];        // the last write of each byte
};

// The cells of the words of a buffer a dispatch touched: pages of them, allocated when
// first touched, found by index (a hash table's lookup was the sanitizer's main cost).
// Shared by a dispatch's workers, which run different threadgroups at the same time: a
// worker holds a page's lock (PageLock) while it reads or updates the page's cells. The
// locks are a fixed set, page p taking lock p % kLocks: their memory does not grow with the
// buffer (a lock per page was a 64-byte cache line per 1 KB of buffer, allocated and
// cleared by every dispatch), and neighbouring pages still take different ones.
class Shadow {
 public:
  // `workers`: how many use it at once (one: no locking).
  Shadow(size_t bytes, unsigned workers)
      : pages_(((bytes + 3) / 4 + kPageWords - 1) / kPageWords), locked_(workers > 1 ? kLocks : 0) {}
  // Whether several workers use it: another threadgroup may change a buffer's bytes while
  // a thread runs.
  bool shared() const { return !locked_.empty(); }

  // Holds the lock of the page of a word while in scope, with the page allocated.
  class PageLock {
   public:
    PageLock(Shadow& s, size_t word) : lock_(nullptr) {
      const size_t page = word / kPageWords;
      if (!s.locked_.empty()) {
        lock_ = &s.locked_[page % kLocks].held;
        while (lock_->exchange(true, std::memory_order_acquire))
          while (lock_->load(std::memory_order_relaxed)) std::this_thread::yield();
      }
      if (!s.pages_[page]) s.pages_[page].reset(new Cell[kPageWords]);
      cells_ = s.pages_[page].get();
    }
    ~PageLock() {
      if (lock_) lock_->store(false, std::memory_order_release);
    }
    PageLock(const PageLock&) = delete;
    PageLock& operator=(const PageLock&) = delete;
    Cell& operator[](size_t word) { return cells_[word % kPageWords]; }

   private:
    std::atomic<bool>* lock_;
    Cell* cells_;
  };

 private:
  static constexpr size_t kPageWords = 256, kLocks = 64;
  std::vector<std::unique_ptr<Cell[]>> pages_;
  struct alignas(64) Lock {  // a cache line each: workers on neighbouring pages do not share one
    std::atomic<bool> held{false};
  };
  std::vector<Lock> locked_;  // kLocks, when shared
};

// The cells of threadgroup memory (32 KB at most): one per word, found directly. Each
// threadgroup's memory is a new instance, whose cells are a new generation: a cell of an
// earlier one reads as new when first looked up, instead of every cell being cleared.
class GroupShadow {
 public:
  void restart(size_t bytes) {
    if (cells_.size() < (bytes + 3) / 4) cells_.resize((bytes + 3) / 4);
    ++generation_;
  }
  Cell& operator[](size_t word) {
    Cell& c = cells_[word];
    if (c.generation != generation_) {
      // What says which writes and reads hold: the others are read only where it says.
      c.written = c.write_mask = c.n_reads = 0;
      c.write_epoch = 0;
      c.generation = generation_;
    }
    return c;
  }

 private:
  std::vector<Cell> cells_;
  uint32_t generation_ = 0;
};

class Sanitizer;

// A buffer or threadgroup variable: its Bounds (what kernel code checks, sanitize.h), its
// name for reports, and (sanitized) the shadow of its accesses.
struct Region : Bounds {
  char* base = nullptr;
  size_t bytes = 0;
  RegionKind kind = R_BUFFER;
  int index = 0;
  std::string name;
  Shadow* shadow = nullptr;  // a buffer's: the dispatch's, shared by its workers
  GroupShadow group_shadow;  // threadgroup memory's
  // The sanitizer of the worker whose threads reach the region through this object (null:
  // unsanitized, or a program constant): what the per-access calls find the running thread
  // through, instead of a thread-local (whose look-up cost a fifth of an access, measured).
  Sanitizer* sanitizer = nullptr;
};

// "[[buffer(0)]] `out`", "threadgroup variable `tile`", ...
std::string describe_region(const Region& r);
// Why an access of the `element_bytes` at `element` is outside `region` (nullptr: in none).
std::string out_of_bounds_message(const Region* region, const char* element, size_t element_bytes);

// The regions of a dispatch as one worker sees them: the dispatch's buffers, and the
// threadgroup memory of the threadgroup it runs.
class Regions {
 public:
  void set_buffers(void* const* buffers, const uint64_t* bytes, const char* const* names, int num_buffers);
  void set_threadgroup_args(void* const* args, const uint64_t* bytes, int num_args,
                            const char* const* names);
  // A threadgroup variable's declaration ran: its region (the same one again for a variable
  // seen before, since each worker's storage for it stays where it is).
  Region* static_variable(const void* address, size_t bytes, const char* name);
  const Region* buffer(int index) const;
  const Region* threadgroup_arg(int index) const;
  const Region* find(const void* address) const;

 protected:
  std::vector<std::unique_ptr<Region>> buffers_, threadgroup_args_, threadgroup_vars_;
  Sanitizer* owner_ = nullptr;  // stamped on the regions made (Region::sanitizer)
};

// How the first access of a Touch used it, when the rewriter said (sanitize.h).
enum FirstUse : uint8_t { USE_UNKNOWN, USE_STORE, USE_UPDATE };

// A logged access: trivially copyable, so that logging one is a few stores and clearing the
// log costs nothing per entry.
struct Touch {
  Touch() {}  // uninitialized: the logger sets every field it reads (no zeroing per access)
  char* address;        // the bytes accessed: an element, or a field of a struct element
  Region* region;
  uint64_t count;       // accesses merged into this one
  uint32_t bytes;
  uint32_t element_bytes;   // the element they lie in, from element_offset bytes before them
  uint32_t element_offset;
  bool atomic;
  bool stored;          // the target of an assignment: a write, whatever it stored
  FirstUse first;
  // The bytes at first touch (nothing for atomics): here up to 16 bytes (a float4), larger
  // ones (structs) at this offset in their log's `big_snapshots`.
  union {
    unsigned char before[16];
    size_t big;
  };
  const char* element() const { return address - element_offset; }
};

// One thread's accesses since it last stopped. Short logs are searched only for the latest
// access (a loop re-reading one element); past kIndexFrom entries an index finds any earlier
// one, so a loop over a few elements (a spin-wait) does not grow the log.
struct AccessLog {
  struct Key {
    const char* address;
    uint32_t bytes, element_bytes, element_offset;
    bool atomic;
    bool operator==(const Key& o) const {
      return address == o.address && bytes == o.bytes && element_bytes == o.element_bytes &&
             element_offset == o.element_offset && atomic == o.atomic;
    }
  };
  struct KeyHash {
    size_t operator()(const Key& k) const {
      return std::hash<const void*>()(k.address) ^ (size_t(k.bytes) << 1) ^ size_t(k.atomic);
    }
  };

  // A read that added nothing to its word's cell when it was made (covered_read, which
  // the thread's later accesses cannot undo before it stops): its bytes, to tell at the
  // stop whether the thread changed them through the reference the read handed out (then
  // it was a write after all, and is recorded as one), and nothing else. Most reads of a
  // tiled matmul's threadgroup memory: a Touch, and recording it, cost twice as much.
  struct CoveredRead {
    CoveredRead() {}  // uninitialized: log_covered_read sets every field it reads
    const char* address;
    Region* region;
    uint32_t before;  // the bytes at the read (1, 2 or 4 of them)
    uint32_t bytes;
  };

  std::vector<Touch> touches;
  std::vector<unsigned char> big_snapshots;  // snapshots over 16 bytes (Touch::big)
  std::unordered_map<Key, uint32_t, KeyHash> index;  // once touches reached kIndexFrom
  std::vector<CoveredRead> covered;
  size_t latest = 0;      // the touch the latest access went to, unless latest_covered
  bool latest_covered = false;  // the latest access went to covered.back()
  uint64_t repeats = 0;   // accesses in a row to memory already in the log
  uint64_t repeats_before_latest = 0;

  const unsigned char* snapshot(const Touch& t) const {
    return t.bytes <= sizeof t.before ? t.before : big_snapshots.data() + t.big;
  }
  void clear() {
    touches.clear();
    big_snapshots.clear();
    if (!index.empty()) index = {};  // give back a long segment's buckets
    covered.clear();
    latest = 0;
    latest_covered = false;
    repeats = repeats_before_latest = 0;
  }
};

struct ThreadId {
  uint32_t group;
  uint32_t thread;
  uint32_t simdgroup;
};

// What an instrumented dispatch did, summed over all its threads. Bytes are what the
// kernel asked for (no cache model); an access that stored or changed memory counts as
// written, any other as read.
//
// SIMD-group instructions: the lanes of a SIMD-group run in lockstep on a GPU, so the k-th
// access every lane makes at one place in the kernel's code (a site), between two stops
// (barriers, SIMD-group functions, the thread's end), is taken as one instruction, executed
// by the lanes that made it (the active lanes). Pairing by site and not by position in the
// thread's stream of accesses is what reconverges the lanes after a branch or a loop of
// different trip counts, as the GPU does.
//   bank conflicts: per threadgroup instruction, its lanes' 4-byte words map to 32 banks, and
//     each bank serving n distinct words costs n - 1 extra cycles;
//   device transactions: per device instruction (loads, stores and atomics), the distinct
//     aligned segments of `segment_bytes` its lanes touch; the minimum is what the distinct
//     bytes it touches would need, ceil(bytes / segment_bytes);
//   atomic conflicts: per atomic instruction (device or threadgroup), the lanes on its
//     busiest address minus one: the steps the GPU serialises;
//   active lanes: summed over every memory instruction, against 32 per instruction.
struct Counters {
  uint64_t device_bytes_read = 0, device_bytes_written = 0;
  uint64_t threadgroup_accesses = 0, bank_conflicts = 0;
  uint64_t barriers = 0, fmas = 0, atomics = 0;
  uint64_t device_instructions = 0, device_transactions = 0, device_min_transactions = 0;
  uint64_t atomic_instructions = 0, atomic_conflicts = 0;
  uint64_t memory_instructions = 0, active_lanes = 0;

  // Every counter, in the order the launch reports them (tsm_launch.counters).
  static constexpr uint64_t Counters::*kFields[] = {
      &Counters::device_bytes_read,   &Counters::device_bytes_written,   &Counters::threadgroup_accesses,
      &Counters::bank_conflicts,      &Counters::barriers,               &Counters::fmas,
      &Counters::atomics,             &Counters::device_instructions,    &Counters::device_transactions,
      &Counters::device_min_transactions, &Counters::atomic_instructions, &Counters::atomic_conflicts,
      &Counters::memory_instructions, &Counters::active_lanes};
  // Another worker's, at the end of a dispatch.
  Counters& operator+=(const Counters& o) {
    for (auto field : kFields) this->*field += o.*field;
    return *this;
  }
};

// One lane's memory access, kept until the SIMD-group's lanes all stop and its accesses
// are paired into instructions (Counters).
struct LaneAccess {
  LaneAccess() {}  // uninitialized: log_instruction sets every field
  uintptr_t address;   // device memory: shifted so that its buffer starts on a segment
  uint32_t bytes;
  uint8_t lane;
  bool atomic;
};

// A place in the kernel's code: a site (the address the check returns to), device or
// threadgroup memory apart (a helper function may take either), with its lanes' accesses
// there, in program order.
struct Place {
  uintptr_t key;  // site << 1 | device (user-space addresses: the top bit is free)
  std::vector<LaneAccess> accesses;
  bool device() const { return key & 1; }
};

constexpr uint32_t kSimdLanes = 32;

// One SIMD-group instruction's lanes, an access each (a lane's accesses at a place are one
// run), in lane order.
struct InstructionLanes {
  const LaneAccess* at[kSimdLanes];
  uint32_t n = 0;
  const LaneAccess* const* begin() const { return at; }
  const LaneAccess* const* end() const { return at + n; }
};

// A SIMD-group's accesses since its lanes last stopped, by place as they are logged: pairing
// them needs no sort.
struct InstructionLog {
  static constexpr size_t kNone = ~size_t(0);
  std::vector<Place> places;  // the first `used` are this log's; the others keep their capacity
  size_t used = 0;
  size_t accesses = 0;
  size_t latest = kNone;  // the place of the latest access logged, if it still is there
  size_t previous = kNone;  // the place before it: a loop alternating two is not searched

  void clear() {
    for (size_t p = 0; p < used; ++p) places[p].accesses.clear();
    used = accesses = 0;
    latest = previous = kNone;
  }
};

class Sanitizer : public Regions {
 public:
  // `shadows`: the dispatch's, one per buffer, shared with its other workers' sanitizers.
  // `count_instructions`: pair the accesses into SIMD-group instructions (Counters); without
  // it the counters that count per instruction stay 0.
  Sanitizer(u3 grid, u3 group_size, void* const* buffers, const uint64_t* bytes,
            const char* const* names, int num_buffers, uint32_t segment_bytes, bool count_instructions,
            std::vector<std::unique_ptr<Shadow>>& shadows);

  // The Metal thread the worker runs, set by the schedulers (runtime.cpp, through
  // set_running), and its accesses since it last stopped.
  struct Running {
    const ThreadInfo* info = nullptr;  // null: none
    AccessLog* touches = nullptr;
  };
  Running running;
  // The running thread's accesses kernel code logged inline (sanitize.h), which every region
  // of this sanitizer points at, and (in barrier regions) its CollectiveMode: open while a
  // thread runs, unless the dispatch counts SIMD-group instructions; taken into its log by
  // every call from kernel code that reads or adds to the log (flush_pending), before it
  // does.
  PendingAccesses pending;
  // Thread `info` runs from now on, with its log and its CollectiveMode (`mode`, barrier
  // regions only); `info` null: none does, and what was pending is dropped (the thread
  // stopped, which took it, or faulted).
  void set_running(const ThreadInfo* info, AccessLog* touches, const uint8_t* mode);
  void flush_pending(const ThreadId& who, AccessLog& log);
  // A thread of the running threadgroup (whose linear index begin_group took).
  ThreadId who(const ThreadInfo& t) const {
    return {group_, t.thread_index_in_threadgroup, t.simdgroup_index_in_threadgroup};
  }
  // Nonzero while a call from kernel code edits this state: a stop request waits for it.
  volatile sig_atomic_t in_call = 0;

  // `group`: its linear index in the grid.
  void begin_group(uint32_t group, uint32_t simdgroups, void* const* args, const uint64_t* bytes, int num_args,
                   const char* const* names);
  // Also: its shadow starts afresh.
  void static_variable(const void* address, size_t bytes, const char* name);

  // An access to `bytes` at `address`, inside the element of `element_bytes` at `element`
  // (the same range unless the access is to a field), made at `site` in the kernel's code.
  // Defined in sanitizer_access.h, to be inlined into the runtime's per-access entry point.
  void access(const Region* region, const void* element, size_t element_bytes, const void* address,
              size_t bytes, bool atomic, const ThreadId& who, AccessLog& log, uintptr_t site);
  // An atomic operation at `site` (called once per operation, whichever way it was reached).
  void note_atomic(const void* address, size_t bytes, const ThreadId& who, AccessLog& log, uintptr_t site);
  void note_store(const void* address, size_t bytes, bool updates, const ThreadId& who, AccessLog& log);
  void end_segment(const ThreadId& who, AccessLog& log);

  void threadgroup_barrier(unsigned flags);
  void simdgroup_barrier(uint32_t simdgroup, unsigned flags);
  // Every thread of the threadgroup has returned.
  void end_group();

  // Every third weak compare-and-swap of a threadgroup fails spuriously, counted from a
  // start that depends on its index (a group's first may fail too): reproducible.
  bool spurious_cas_failure() { return ++cas_calls_ % 3 == 0; }

  void count_fmas(uint32_t n) { counters_.fmas += n; }
  // Pair the accesses logged since the SIMD-groups last stopped into instructions and count
  // them (Counters); call when every live thread of the threadgroup is stopped.
  void flush_instruction_log();
  // The same for one SIMD-group, whose live threads are all stopped.
  void flush_instruction_log(uint32_t simdgroup);
  const Counters& counters() const { return counters_; }

 private:
  [[noreturn]] void race(const Region& r, const Touch& t, Access earlier, Access now);
  [[noreturn]] void out_of_bounds(const Region* region, const char* element, size_t element_bytes,
                                  const ThreadId& who) const;
  std::string element_name(const Region& r, const Touch& t) const;
  std::string thread_name(uint32_t group, uint32_t thread) const;
  // By value: an Access in registers is not stored and read back whole. kThreadgroup: the
  // memory is threadgroup memory, whose accesses all come from one threadgroup.
  template <bool kThreadgroup>
  static bool ordered(Access a, Access b);
  template <bool kThreadgroup>
  static bool conflict(Access a, Access b);
  // `before`: the accessed bytes as they were at the access (the address itself, unless
  // the access was pending).
  void log_access(AccessLog& log, const Region* region, const char* element, size_t element_bytes,
                  const char* address, size_t bytes, bool atomic, const ThreadId& who, const void* before);
  // Who accesses, as each memory's ordering epochs stand (Access::bits left to set).
  struct Now {
    Access threadgroup, device;
  };
  Now now_of(const ThreadId& who) const;
  // A plain read of a whole element logged as a CoveredRead (false: log it as a Touch).
  bool log_covered_read(AccessLog& log, Region& region, const char* address, size_t bytes, const ThreadId& who,
                        const Now& now, const void* before);
  // A plain access of a whole element, in bounds and not of a program constant.
  void log_plain_access(AccessLog& log, Region& region, const char* address, size_t bytes, const ThreadId& who,
                        const Now& now, const void* before);
  Touch* look_up(AccessLog& log, const AccessLog::Key& key);  // in a long log
  [[noreturn]] void hang(const AccessLog& log, const Touch& t, const ThreadId& who) const;
  // `who`: the accessing thread with its memory's epochs (bits left to set). `changed`: the
  // write is known only by the bytes having changed (Access::kChanged).
  template <bool kThreadgroup>
  void record(const Touch& t, Access who, bool write, bool changed = false);
  // One word of it: `now` carries the word's byte mask.
  template <bool kThreadgroup>
  void record_word(Region& r, const Touch& t, Cell& c, Access now, bool write, bool reads_first,
                   bool whole_element);
  // Out of record's loop, which is the sanitizer's hot spot.
  [[gnu::noinline]] void remember_uninitialized_read(const Touch& t, Access reader);
  [[gnu::noinline]] void mark_written(const Touch& t);  // the element of a field written
  void report_uninitialized_read();

  u3 grid_, group_size_, groups_;
  uint32_t group_ = 0;  // the running threadgroup's linear index
  uint32_t tg_epoch_ = 0, dev_epoch_ = 0;
  std::vector<uint32_t> sg_tg_epoch_, sg_dev_epoch_;
  uint64_t cas_calls_ = 0;
  Counters counters_;
  // The first read of threadgroup memory nobody had written, in the current interval.
  struct UninitializedRead {
    Touch touch;
    Access reader;
  };
  std::unique_ptr<UninitializedRead> uninitialized_;
  // The latest access made the pointer an atomic operation uses (the p[i] in
  // atomic_...(&p[i], ...)): it was the atomic access, not a plain one.
  void unmark_plain_access(const void* address, size_t bytes, const ThreadId& who, AccessLog& log);
  void log_instruction(const ThreadId& who, uintptr_t site, const Region* region, const void* address,
                       size_t bytes, bool atomic);
  void pair_instructions(InstructionLog& log);
  void pair_place(Place& place);
  void count_instruction(const InstructionLanes& lanes, bool device);
  void count_bank_conflicts(const InstructionLanes& lanes);
  void count_transactions(const InstructionLanes& lanes);
  void count_atomic_conflicts(const InstructionLanes& lanes);

  // Logging every access for pairing, and pairing them, was a quarter of a sanitized tiled
  // matmul's time: done only for a dispatch whose counters someone records.
  const bool count_instructions_;
  static constexpr size_t kPendingAccesses = 256;  // 10 KB: they stay in L1 until taken
  std::unique_ptr<PendingAccess[]> pending_buffer_{new PendingAccess[kPendingAccesses]};
  uint32_t segment_bytes_;
  // Per SIMD-group: its lanes' memory accesses since the last flush.
  std::vector<InstructionLog> instruction_log_;
  // Scratch of the flush, reused.
  std::vector<std::pair<size_t, size_t>> lane_runs_;
  std::vector<uintptr_t> words_;
  std::vector<std::pair<uintptr_t, uintptr_t>> ranges_;
};

// From runtime.cpp.
u3 ceil_div(u3 a, u3 b);
ThreadInfo thread_info(u3 grid, u3 group_size, u3 groups, u3 group, uint32_t index);
std::string where_info(const ThreadInfo& t);

}  // namespace tsm_emu
