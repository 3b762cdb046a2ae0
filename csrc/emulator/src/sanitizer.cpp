// The sanitizer: bounds checks and race detection for sanitized dispatches (sanitizer.h).
#include "sanitizer.h"
#include "sanitizer_access.h"

#include <algorithm>
#include <cstring>
#include <type_traits>

namespace tsm_emu {

namespace {
constexpr unsigned kMemDevice = 1, kMemThreadgroup = 2;  // metal::mem_flags

std::unique_ptr<Region> make_region(void* base, size_t bytes, RegionKind kind, int index,
                                    std::string name, Sanitizer* owner = nullptr) {
  std::unique_ptr<Region> r(new Region);
  r->sanitizer = owner;
  r->pending = owner ? &owner->pending : nullptr;
  r->base = static_cast<char*>(base);
  r->bytes = bytes;
  r->begin = r->base;
  r->end = r->base + bytes;
  r->kind = kind;
  r->index = index;
  r->name = std::move(name);
  return r;
}
}  // namespace

std::string describe_region(const Region& r) {
  switch (r.kind) {
    case R_BUFFER:
      return "[[buffer(" + std::to_string(r.index) + ")]]" + (r.name.empty() ? "" : " `" + r.name + "`");
    case R_THREADGROUP_ARG:
      return "[[threadgroup(" + std::to_string(r.index) + ")]]" + (r.name.empty() ? " memory" : " `" + r.name + "`");
    case R_THREADGROUP_VAR:
      return "threadgroup variable `" + r.name + "`";
    case R_PROGRAM_CONSTANT:
      return "constant `" + r.name + "`";
  }
  return "memory";
}

std::string out_of_bounds_message(const Region* region, const char* e, size_t element_bytes) {
  if (!region)
    return "accesses memory through a pointer that points into no buffer or threadgroup variable "
           "of this dispatch";
  const long long offset = (long long)(e - region->base), n = (long long)element_bytes;
  const long long index = offset >= 0 ? offset / n : -((-offset + n - 1) / n);
  return "accesses " + describe_region(*region) + " at element " + std::to_string(index) +
         " (byte offset " + std::to_string(offset) + ", " + std::to_string(element_bytes) +
         " bytes) but it holds " + std::to_string(region->bytes / element_bytes) + " elements (" +
         std::to_string(region->bytes) + " bytes)";
}

void Regions::set_buffers(void* const* buffers, const uint64_t* bytes, const char* const* names,
                          int num_buffers) {
  buffers_.clear();
  // A threadgroup variable lives in its worker thread's storage, and a dispatch's worker
  // threads are new (the first is the caller's): one the last dispatch saw may be another
  // variable's address now.
  threadgroup_vars_.clear();
  for (int i = 0; i < num_buffers; ++i)
    buffers_.push_back(make_region(buffers[i], size_t(bytes[i]), R_BUFFER, i,
                                   names && names[i] ? names[i] : "", owner_));
}

void Regions::set_threadgroup_args(void* const* args, const uint64_t* bytes, int num_args,
                                   const char* const* names) {
  // Usually the worker's memory of the last threadgroup: its regions stay, and their
  // shadows' storage.
  bool same = threadgroup_args_.size() == size_t(num_args);
  for (int i = 0; same && i < num_args; ++i) {
    const Region& r = *threadgroup_args_[size_t(i)];
    same = r.base == args[i] && r.bytes == size_t(bytes[i]) && r.name == (names && names[i] ? names[i] : "");
  }
  if (same) return;
  threadgroup_args_.clear();
  for (int i = 0; i < num_args; ++i)
    threadgroup_args_.push_back(make_region(args[i], size_t(bytes[i]), R_THREADGROUP_ARG, i,
                                            names && names[i] ? names[i] : "", owner_));
}

Region* Regions::static_variable(const void* address, size_t bytes, const char* name) {
  for (auto& r : threadgroup_vars_)
    if (r->base == address) return r.get();
  threadgroup_vars_.push_back(make_region(const_cast<void*>(address), bytes, R_THREADGROUP_VAR,
                                          int(threadgroup_vars_.size()), name ? name : "", owner_));
  return threadgroup_vars_.back().get();
}

const Region* Regions::buffer(int index) const {
  return index >= 0 && size_t(index) < buffers_.size() ? buffers_[size_t(index)].get() : nullptr;
}

const Region* Regions::threadgroup_arg(int index) const {
  return index >= 0 && size_t(index) < threadgroup_args_.size() ? threadgroup_args_[size_t(index)].get()
                                                                 : nullptr;
}

namespace {
// Program-scope `constant` variables: registered while the library loads, before any
// dispatch reads the list, and part of every dispatch's regions.
std::vector<std::unique_ptr<Region>>& program_constants() {
  static std::vector<std::unique_ptr<Region>> constants;
  return constants;
}
}  // namespace

void register_program_constant(const void* address, size_t bytes, const char* name) {
  program_constants().push_back(make_region(const_cast<void*>(address), bytes, R_PROGRAM_CONSTANT,
                                            int(program_constants().size()), name));
}

const Region* Regions::find(const void* address) const {
  const char* a = static_cast<const char*>(address);
  const auto& constants = program_constants();
  for (const auto* list : {&buffers_, &threadgroup_args_, &threadgroup_vars_, &constants})
    for (const auto& r : *list)
      if (a >= r->begin && a < r->end) return r.get();
  return nullptr;
}

Sanitizer::Sanitizer(u3 grid, u3 group_size, void* const* buffers, const uint64_t* bytes,
                     const char* const* names, int num_buffers, uint32_t segment_bytes,
                     bool count_instructions, std::vector<std::unique_ptr<Shadow>>& shadows)
    : grid_(grid), group_size_(group_size), groups_(ceil_div(grid, group_size)),
      count_instructions_(count_instructions), segment_bytes_(segment_bytes) {
  // Segments are found by masking, not dividing (metal.instrumented checks this too).
  if (segment_bytes == 0 || (segment_bytes & (segment_bytes - 1)) != 0)
    fault("launch", "the transaction counters' segment size must be a power of two");
  owner_ = this;
  set_buffers(buffers, bytes, names, num_buffers);
  for (size_t i = 0; i < buffers_.size(); ++i) buffers_[i]->shadow = shadows[i].get();
}

void Sanitizer::set_running(const ThreadInfo* info, AccessLog* touches, const uint8_t* mode) {
  running = {info, touches};
  pending.next = pending.end = pending_buffer_.get();
  // Counting instructions pairs each access by its place in the code: the return address
  // of its own call.
  if (info && !count_instructions_) pending.end += kPendingAccesses;
  pending.mode = mode;
}

void Sanitizer::begin_group(uint32_t group, uint32_t simdgroups, void* const* args, const uint64_t* bytes,
                            int num_args, const char* const* names) {
  // Which weak compare-and-swaps fail follows from the threadgroup and its own calls only,
  // whichever worker runs it and whatever ran before: reproducible.
  group_ = group;
  cas_calls_ = group % 3;
  tg_epoch_ = dev_epoch_ = 0;
  sg_tg_epoch_.assign(simdgroups, 0);
  sg_dev_epoch_.assign(simdgroups, 0);
  instruction_log_.resize(simdgroups);
  for (auto& log : instruction_log_) log.clear();
  // A new threadgroup's memory is a new instance: nothing of the last group's carries over.
  set_threadgroup_args(args, bytes, num_args, names);
  for (auto& r : threadgroup_args_) r->group_shadow.restart(r->bytes);
  uninitialized_.reset();
}

void Sanitizer::static_variable(const void* address, size_t bytes, const char* name) {
  // Called by the first thread of each threadgroup that reaches the declaration (the
  // runtime remembers which it saw), before any touches the variable: it starts afresh.
  Regions::static_variable(address, bytes, name)->group_shadow.restart(bytes);
}

std::string Sanitizer::element_name(const Region& r, const Touch& t) const {
  const size_t offset = size_t(t.address - r.base);
  return describe_region(r) + " element " + std::to_string(size_t(t.element() - r.base) / t.element_bytes) +
         " (byte offset " + std::to_string(offset) + ")";
}

std::string Sanitizer::thread_name(uint32_t group, uint32_t thread) const {
  u3 pos{group % groups_.x, (group / groups_.x) % groups_.y, group / (groups_.x * groups_.y)};
  return where_info(thread_info(grid_, group_size_, groups_, pos, thread));
}

void Sanitizer::out_of_bounds(const Region* region, const char* element, size_t element_bytes,
                              const ThreadId& who) const {
  const std::string msg = thread_name(who.group, who.thread) + " " +
                          out_of_bounds_message(region, element, element_bytes);
  fault("out_of_bounds", msg.c_str());
}

Touch* Sanitizer::look_up(AccessLog& log, const AccessLog::Key& key) {
  if (log.index.empty()) {  // from now on every access is looked up: merge the log's repeats
    size_t kept = 0;
    for (size_t i = 0; i < log.touches.size(); ++i) {
      auto slot = log.index.emplace(key_of(log.touches[i]), uint32_t(kept));
      Touch& into = log.touches[slot.first->second];
      if (log.latest == i) log.latest = slot.first->second;
      if (slot.second) {
        if (kept != i) into = std::move(log.touches[i]);
        ++kept;
      } else {
        into.count += log.touches[i].count;
        into.stored |= log.touches[i].stored;
      }
    }
    log.touches.erase(log.touches.begin() + ptrdiff_t(kept), log.touches.end());
  }
  const auto found = log.index.find(key);
  if (found == log.index.end()) return nullptr;
  log.latest = found->second;
  return &log.touches[log.latest];
}

void Sanitizer::hang(const AccessLog& log, const Touch& t, const ThreadId& who) const {
  std::string msg = thread_name(who.group, who.thread) + " made " + std::to_string(log.repeats) +
                    " accesses in a row, all to memory it had already accessed (the last: " +
                    element_name(*t.region, t) + "), without reaching a barrier, a SIMD-group "
                    "function or its end: a spin-wait on another thread? Metal guarantees no "
                    "forward progress between threads, so such a kernel can hang on the GPU too";
  fault("hang", msg.c_str());
}

void Sanitizer::note_atomic(const void* address, size_t bytes, const ThreadId& who, AccessLog& log,
                            uintptr_t site) {
  flush_pending(who, log);
  ++counters_.atomics;
  unmark_plain_access(address, bytes, who, log);
  if (count_instructions_) log_instruction(who, site, find(address), address, bytes, true);
}

void Sanitizer::unmark_plain_access(const void* address, size_t bytes, const ThreadId& who, AccessLog& log) {
  const char* a = static_cast<const char*>(address);
  Touch plain;
  if (log.latest_covered) {
    // The covered read stays: the atomic's write is a race with the reads covering it, and
    // so is the read if the operation changed its bytes (end_segment).
    plain = covered_touch(log.covered.back());
  } else if (log.latest < log.touches.size() && !log.touches[log.latest].atomic) {
    plain = log.touches[log.latest];
  } else {
    return;
  }
  if (!(plain.address < a + bytes && a < plain.address + plain.bytes)) return;
  // Counted and logged as a plain access: it was not.
  if (plain.region->kind != R_BUFFER) --counters_.threadgroup_accesses;
  InstructionLog& simd_log = instruction_log_[who.simdgroup];
  if (simd_log.latest < simd_log.used) {
    std::vector<LaneAccess>& accesses = simd_log.places[simd_log.latest].accesses;
    if (!accesses.back().atomic && accesses.back().lane == who.thread % kSimdLanes) {
      accesses.pop_back();
      --simd_log.accesses;
      simd_log.latest = InstructionLog::kNone;  // note_atomic logs the atomic one next
    }
  }
  if (!log.latest_covered) {
    Touch& t = log.touches[log.latest];
    if (t.count > 1) {
      --t.count;
    } else {  // the access made this entry, the last one
      if (!log.index.empty()) log.index.erase(key_of(t));
      log.touches.pop_back();
    }
  }
  log.repeats = log.repeats_before_latest;
  log_access(log, plain.region, plain.element(), plain.element_bytes, plain.address, plain.bytes, true, who,
             plain.address);
}

void Sanitizer::note_store(const void* address, size_t bytes, bool updates, const ThreadId& who, AccessLog& log) {
  flush_pending(who, log);
  const char* a = static_cast<const char*>(address);
  if (log.latest_covered) {
    const AccessLog::CoveredRead c = log.covered.back();
    if (a < c.address || a + bytes > c.address + c.bytes) return;  // not the access just made
    // A store through the read's reference: logged as a Touch too, to be marked (the
    // covered read stays; a store there is a race, which the stop reports). One access,
    // counted once towards a spin-wait.
    log.repeats = log.repeats_before_latest;
    log_access(log, c.region, c.address, c.bytes, c.address, c.bytes, false, who, &c.before);
  }
  if (log.latest >= log.touches.size()) return;
  Touch& t = log.touches[log.latest];
  if (a < t.address || a + bytes > t.address + t.bytes) return;  // not the access just made
  if (t.count == 1 && !t.stored) t.first = updates ? USE_UPDATE : USE_STORE;
  t.stored = true;
}

template <bool kThreadgroup>
bool Sanitizer::ordered(Access a, Access b) {
  if (a.group == b.group && a.thread == b.thread) return true;
  if (!kThreadgroup && a.group != b.group) return false;
  if (a.epoch != b.epoch) return true;
  return a.simdgroup == b.simdgroup && a.sg_epoch != b.sg_epoch;
}

template <bool kThreadgroup>
bool Sanitizer::conflict(Access a, Access b) {
  return (a.write() || b.write()) && !(a.atomic() && b.atomic()) && !ordered<kThreadgroup>(a, b);
}

void Sanitizer::race(const Region& r, const Touch& t, Access earlier, Access now) {
  const bool device = r.kind == R_BUFFER;
  auto how = [](const Access& a) {
    if (a.atomic()) return " updated it atomically";
    if (a.changed())
      return " changed it (its bytes differed when the thread next stopped: it wrote them through a "
             "reference, or read them while another threadgroup wrote them)";
    return a.write() ? " wrote it" : " read it (or stored the value already there)";
  };
  std::string msg = element_name(r, t) + ": " + thread_name(earlier.group, earlier.thread) +
                    how(earlier) + " and " + thread_name(now.group, now.thread) + how(now);
  if (device && earlier.group != now.group)
    msg += "; threads of different threadgroups are never ordered within a dispatch (use atomics, "
           "or split the work into two dispatches)";
  else
    msg += std::string(" with no ") + (device ? "threadgroup_barrier(mem_flags::mem_device)"
                                              : "threadgroup_barrier(mem_flags::mem_threadgroup)") +
           " between them (a simdgroup_barrier orders the lanes of one SIMD-group only)";
  fault(device ? "device_race" : "threadgroup_race", msg.c_str());
}

namespace {
// Bit b of the result: byte 4 * word + b lies in [offset, offset + bytes).
unsigned word_mask(size_t word, size_t offset, size_t bytes) {
  const size_t from = std::max(offset, word * 4) - word * 4;
  const size_t to = std::min(offset + bytes, word * 4 + 4) - word * 4;
  return (1u << to) - (1u << from);
}
}  // namespace

// Inline: record calls it once per word an access touched.
template <bool kThreadgroup>
[[gnu::always_inline]] inline void Sanitizer::record_word(Region& r, const Touch& t, Cell& c, Access now,
                                                          bool write, bool reads_first, bool whole_element) {
  const unsigned mask = now.mask();
  if (reads_first && (mask & ~c.written) && !uninitialized_) remember_uninitialized_read(t, now);
  if (!write && covered_read<kThreadgroup>(c, now)) return;
  if (kThreadgroup && write && whole_element) c.written |= mask;
  // Threadgroup memory's writes of an earlier interval are ordered before this access.
  const unsigned written_bytes = mask & c.write_mask;
  if (written_bytes && !(kThreadgroup && c.write_epoch != now.epoch))
    for (unsigned b = 0; b < 4; ++b)
      if (written_bytes >> b & 1 && conflict<kThreadgroup>(c.writes[b], now)) race(r, t, c.writes[b], now);
  if (write)  // two reads never race
    for (uint8_t i = 0; i < c.n_reads; ++i)
      if ((c.reads[i].mask() & mask) && conflict<kThreadgroup>(c.reads[i], now)) race(r, t, c.reads[i], now);
  if (write) {
    for (unsigned b = 0; b < 4; ++b) {
      if (!(mask >> b & 1)) continue;
      const Access& last = c.writes[b];
      // A thread's plain write followed by its own atomic one in the same epoch: the plain
      // write is what other threads' atomics race with, so it stays the one remembered.
      const bool keep_plain = (c.write_mask >> b & 1) && now.atomic() && !last.atomic() &&
                              last.group == now.group && last.thread == now.thread &&
                              last.epoch == now.epoch && last.sg_epoch == now.sg_epoch;
      if (!keep_plain) c.writes[b] = now;
    }
    c.write_mask |= mask;
    c.write_epoch = now.epoch;  // every write kept is of this epoch or an earlier one
  }
  // Reads ordered before this access are ordered before every later one too (epochs only
  // grow, and a later access of another threadgroup conflicts with this one as well). The
  // thread's own earlier read is one of them.
  uint8_t kept = 0;
  for (uint8_t i = 0; i < c.n_reads; ++i)
    if (!ordered<kThreadgroup>(c.reads[i], now)) c.reads[kept++] = c.reads[i];
  c.n_reads = kept;
  if (write) return;
  if (kept < 2) {
    c.reads[kept] = now;
    c.n_reads = uint8_t(kept + 1);
    return;
  }
  // Two unordered readers already. Of one threadgroup (threadgroup memory's always): keep the
  // first and the latest. Once two threadgroups read, keep one read of each, the latest (a
  // write of any threadgroup conflicts with the other's; a later read of a threadgroup is
  // ordered before fewer of its writes): threadgroups running at once on several workers
  // interleave their reads, and a threadgroup's later reads must not push the other's out.
  if (now.group == c.reads[1].group)
    c.reads[1] = now;
  else if (now.group == c.reads[0].group)
    c.reads[0] = now;
  else if (c.reads[0].group == c.reads[1].group || (c.reads[0].mask() & c.reads[1].mask() & mask) != mask)
    c.reads[1] = now;
  // else a third threadgroup's read of bytes both others read: any write conflicts with one
}

// Inline: end_segment calls it once per access it logged.
template <bool kThreadgroup>
[[gnu::always_inline]] inline void Sanitizer::record(const Touch& t, Access who, bool write, bool changed) {
  Region& r = *t.region;
  const size_t offset = size_t(t.address - r.base), bytes = t.bytes;
  who.bits = uint8_t((t.atomic ? Access::kAtomic : 0) | (write ? Access::kWrite : 0) |
                     (changed ? Access::kChanged : 0));
  // A read (or the read of a +=) of threadgroup bytes nobody has written: a race if another
  // thread writes them later in this interval, so reported when the interval ends.
  const bool reads_first = kThreadgroup && !t.atomic && (!write || t.first == USE_UPDATE);
  // Initialization is per element: a write of one field initializes its element.
  const bool whole_element = t.element_offset == 0 && t.element_bytes == t.bytes;
  if (bytes == 4 && offset % 4 == 0) {  // one whole word, most accesses: no mask to compute
    Access now = who;
    now.bits |= 0xF;
    CellOf<kThreadgroup> c(r, offset / 4);
    record_word<kThreadgroup>(r, t, *c, now, write, reads_first, whole_element);
  } else {
    for (size_t word = offset / 4, end = (offset + bytes + 3) / 4; word < end; ++word) {
      Access now = who;
      now.bits |= uint8_t(word_mask(word, offset, bytes));
      CellOf<kThreadgroup> c(r, word);
      record_word<kThreadgroup>(r, t, *c, now, write, reads_first, whole_element);
    }
  }
  if (kThreadgroup && write && !whole_element) mark_written(t);
}

void Sanitizer::remember_uninitialized_read(const Touch& t, Access reader) {
  uninitialized_.reset(new UninitializedRead{t, reader});
}

void Sanitizer::mark_written(const Touch& t) {
  Region& r = *t.region;
  const size_t element = size_t(t.element() - r.base);
  for (size_t word = element / 4, end = (element + t.element_bytes + 3) / 4; word < end; ++word)
    r.group_shadow[word].written |= word_mask(word, element, t.element_bytes);
}

void Sanitizer::report_uninitialized_read() {
  if (!uninitialized_) return;
  const UninitializedRead& u = *uninitialized_;
  std::string msg = thread_name(u.reader.group, u.reader.thread) + " reads " +
                    element_name(*u.touch.region, u.touch) + " before any thread of its threadgroup "
                    "wrote it (threadgroup memory starts undefined)";
  fault("uninitialized_read", msg.c_str());
}

void Sanitizer::end_segment(const ThreadId& who, AccessLog& log) {
  flush_pending(who, log);
  if (log.touches.empty() && log.covered.empty()) {  // most threads of a reduction's later stages
    log.clear();
    return;
  }
  const Now now = now_of(who);
  const Access tg_now = now.threadgroup, dev_now = now.device;
  for (const Touch& t : log.touches) {
    const bool device = t.region->kind == R_BUFFER;
    // An atomic is a read-modify-write, whatever it stored.
    bool write = t.atomic || t.stored;
    if (!write) with_size(t.bytes, [&](auto n) { write = std::memcmp(log.snapshot(t), t.address, n) != 0; });
    if (device) {
      if (!t.atomic) (write ? counters_.device_bytes_written : counters_.device_bytes_read) += t.bytes * t.count;
      const bool changed = write && !t.atomic && !t.stored && t.region->shadow->shared();
      record<false>(t, dev_now, write, changed);
    } else {
      record<true>(t, tg_now, write);
    }
  }
  for (const AccessLog::CoveredRead& c : log.covered) {
    bool changed = false;
    with_word_size(c.bytes, [&](auto n) { changed = std::memcmp(&c.before, c.address, n) != 0; });
    if (!changed) continue;  // a read, which its cell covered when made
    // Written through the reference the read handed out (or, on several workers, by another
    // threadgroup meanwhile): a race with the reads covering it.
    if (c.region->kind == R_BUFFER)
      record<false>(covered_touch(c), dev_now, true, c.region->shadow->shared());
    else
      record<true>(covered_touch(c), tg_now, true);
  }
  log.clear();
}

void Sanitizer::flush_instruction_log() {
  for (uint32_t sg = 0; sg < instruction_log_.size(); ++sg) flush_instruction_log(sg);
}

void Sanitizer::flush_instruction_log(uint32_t simdgroup) {
  InstructionLog& log = instruction_log_[simdgroup];
  pair_instructions(log);
  log.clear();
}

void Sanitizer::pair_instructions(InstructionLog& log) {
  for (size_t p = 0; p < log.used; ++p) pair_place(log.places[p]);
}

void Sanitizer::pair_place(Place& place) {
  // Instruction k of a place is the k-th access each lane made there: the lanes' runs of
  // accesses side by side.
  std::vector<LaneAccess>& log = place.accesses;
  auto find_runs = [&] {  // false if a lane has two
    lane_runs_.clear();
    uint32_t lanes = 0;
    for (size_t i = 0, j; i < log.size(); i = j) {
      const unsigned lane = log[i].lane;
      if (lanes >> lane & 1) return false;
      lanes |= uint32_t(1) << lane;
      for (j = i + 1; j < log.size() && log[j].lane == lane;) ++j;
      lane_runs_.emplace_back(i, j);
    }
    return true;
  };
  // Each lane's accesses are one run when its threads ran one after another; otherwise (a
  // lane back after another's) group them, keeping their order.
  if (!find_runs()) {
    std::stable_sort(log.begin(), log.end(), [](const LaneAccess& a, const LaneAccess& b) { return a.lane < b.lane; });
    find_runs();
  }
  InstructionLanes step;
  for (size_t k = 0;; ++k) {
    step.n = 0;
    for (const auto& run : lane_runs_)
      if (run.first + k < run.second) step.at[step.n++] = &log[run.first + k];
    if (step.n == 0) break;
    count_instruction(step, place.device());
  }
}

void Sanitizer::count_instruction(const InstructionLanes& lanes, bool device) {
  ++counters_.memory_instructions;
  counters_.active_lanes += lanes.n;
  if (lanes.at[0]->atomic) count_atomic_conflicts(lanes);
  if (device)
    count_transactions(lanes);
  else if (!lanes.at[0]->atomic)
    count_bank_conflicts(lanes);
}

namespace {
constexpr unsigned kBanks = 32;  // of 4-byte words

// Whether the lanes touch at most one word in each bank (the same word twice is a broadcast).
bool one_word_per_bank(const InstructionLanes& lanes) {
  uintptr_t bank_word[kBanks];
  uint32_t banks_used = 0;
  uintptr_t previous = ~uintptr_t(0);  // the word of the lane before, if it touched one
  for (const LaneAccess* a : lanes) {
    const uintptr_t first = a->address / 4, last = (a->address + a->bytes - 1) / 4;
    // The previous lane's one word again (a row read by a SIMD-group's lanes): a broadcast.
    if (first == last && first == previous) continue;
    previous = first == last ? first : ~uintptr_t(0);
    for (uintptr_t w = first; w <= last; ++w) {
      const unsigned bank = unsigned(w % kBanks);
      if (!(banks_used >> bank & 1)) {
        banks_used |= uint32_t(1) << bank;
        bank_word[bank] = w;
      } else if (bank_word[bank] != w) {
        return false;
      }
    }
  }
  return true;
}
}  // namespace

void Sanitizer::count_bank_conflicts(const InstructionLanes& lanes) {
  // Most instructions touch at most one word per bank: no conflict, told without sorting.
  if (one_word_per_bank(lanes)) return;
  // Distinct words per bank among the lanes' accesses: same word = broadcast.
  words_.clear();
  for (const LaneAccess* a : lanes)
    for (uintptr_t w = a->address / 4, last = (a->address + a->bytes - 1) / 4; w <= last; ++w) words_.push_back(w);
  std::sort(words_.begin(), words_.end());
  uint32_t per_bank[kBanks] = {};
  uint32_t worst = 1;
  for (size_t i = 0; i < words_.size(); ++i)
    if (i == 0 || words_[i] != words_[i - 1]) worst = std::max(worst, ++per_bank[words_[i] % kBanks]);
  counters_.bank_conflicts += worst - 1;
}

void Sanitizer::count_transactions(const InstructionLanes& lanes) {
  const uintptr_t segment = segment_bytes_;
  const unsigned shift = unsigned(__builtin_ctz(segment_bytes_));  // a power of two (constructor)
  ranges_.clear();  // the bytes touched, [begin, end) per lane
  for (const LaneAccess* a : lanes) ranges_.emplace_back(a->address, a->address + a->bytes);
  // Coalesced lanes come in address order already.
  if (!std::is_sorted(ranges_.begin(), ranges_.end())) std::sort(ranges_.begin(), ranges_.end());
  // One sweep in address order counts the union of the ranges, in bytes and in segments.
  uint64_t bytes = 0, touched = 0;
  uintptr_t covered = 0;        // the end of the bytes counted so far
  uintptr_t next_segment = 0;   // the first segment after those counted so far
  for (const auto& r : ranges_) {
    const uintptr_t from = std::max(r.first, covered);
    if (r.second > from) bytes += r.second - from;
    covered = std::max(covered, r.second);
    const uintptr_t first = std::max(r.first >> shift, next_segment), last = (r.second - 1) >> shift;
    if (last >= first) touched += last - first + 1;
    next_segment = std::max(next_segment, last + 1);
  }
  ++counters_.device_instructions;
  counters_.device_transactions += touched;
  counters_.device_min_transactions += (bytes + segment - 1) >> shift;
}

void Sanitizer::count_atomic_conflicts(const InstructionLanes& lanes) {
  words_.clear();  // the lanes' addresses
  for (const LaneAccess* a : lanes) words_.push_back(a->address);
  std::sort(words_.begin(), words_.end());
  size_t busiest = 1, run = 0;
  for (size_t i = 0; i < words_.size(); ++i) {
    run = (i > 0 && words_[i] == words_[i - 1]) ? run + 1 : 1;
    busiest = std::max(busiest, run);
  }
  ++counters_.atomic_instructions;
  counters_.atomic_conflicts += busiest - 1;
}

void Sanitizer::threadgroup_barrier(unsigned flags) {
  ++counters_.barriers;
  if (flags & kMemThreadgroup) {
    report_uninitialized_read();  // the interval ended with no thread writing it
    ++tg_epoch_;
  }
  if (flags & kMemDevice) ++dev_epoch_;
}

void Sanitizer::end_group() { report_uninitialized_read(); }

void Sanitizer::simdgroup_barrier(uint32_t simdgroup, unsigned flags) {
  if (flags & kMemThreadgroup) ++sg_tg_epoch_[simdgroup];
  if (flags & kMemDevice) ++sg_dev_epoch_[simdgroup];
}

}  // namespace tsm_emu
