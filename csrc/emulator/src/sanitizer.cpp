// The sanitizer: bounds checks and race detection for sanitized dispatches (sanitizer.h).
#include "sanitizer.h"

#include <algorithm>
#include <cstring>

namespace tsm_emu {

namespace {
constexpr unsigned kMemDevice = 1, kMemThreadgroup = 2;  // metal::mem_flags
constexpr unsigned char kPoison = 0xA5;
// A spin-wait repeats one access; a thread this far into repeating it is not coming back.
constexpr uint64_t kMaxRepeats = uint64_t(1) << 22;
// The per-thread access log between two stops, as a memory bound (about 1 GB).
constexpr size_t kMaxLoggedAccesses = size_t(1) << 24;

std::unique_ptr<Region> make_region(void* base, size_t bytes, RegionKind kind, int index,
                                    std::string name) {
  std::unique_ptr<Region> r(new Region);
  r->base = static_cast<char*>(base);
  r->bytes = bytes;
  r->kind = kind;
  r->index = index;
  r->name = std::move(name);
  return r;
}
}  // namespace

Sanitizer::Sanitizer(u3 grid, u3 group_size, void* const* buffers, const uint64_t* bytes,
                     const char* const* names, int num_buffers)
    : grid_(grid), group_size_(group_size), groups_(ceil_div(grid, group_size)) {
  for (int i = 0; i < num_buffers; ++i)
    buffers_.push_back(make_region(buffers[i], size_t(bytes[i]), R_BUFFER, i,
                                   names && names[i] ? names[i] : ""));
}

const Region* Sanitizer::buffer(int index) const {
  return index >= 0 && size_t(index) < buffers_.size() ? buffers_[size_t(index)].get() : nullptr;
}

const Region* Sanitizer::threadgroup_arg(int index) const {
  return index >= 0 && size_t(index) < threadgroup_args_.size() ? threadgroup_args_[size_t(index)].get()
                                                                 : nullptr;
}

const Region* Sanitizer::find(const void* address) const {
  const char* a = static_cast<const char*>(address);
  for (const auto* list : {&buffers_, &threadgroup_args_, &threadgroup_vars_})
    for (const auto& r : *list)
      if (a >= r->base && a < r->base + r->bytes) return r.get();
  return nullptr;
}

void Sanitizer::begin_group(uint32_t simdgroups, void* const* args, const uint64_t* bytes,
                            int num_args, const char* const* names) {
  tg_epoch_ = dev_epoch_ = 0;
  sg_tg_epoch_.assign(simdgroups, 0);
  sg_dev_epoch_.assign(simdgroups, 0);
  bank_log_.assign(simdgroups, std::vector<std::vector<std::pair<uintptr_t, uint32_t>>>(32));
  // A new threadgroup's memory is a new instance: nothing of the last group's carries over.
  threadgroup_args_.clear();
  for (int i = 0; i < num_args; ++i) {
    threadgroup_args_.push_back(make_region(args[i], size_t(bytes[i]), R_THREADGROUP_ARG, i,
                                            names && names[i] ? names[i] : ""));
    std::memset(args[i], kPoison, size_t(bytes[i]));
  }
}

void Sanitizer::static_variable(const void* address, size_t bytes, const char* name) {
  // Called by the first thread of each threadgroup that reaches the declaration (the
  // runtime remembers which it saw), before any touches the variable: it starts afresh.
  Region* region = nullptr;
  for (auto& r : threadgroup_vars_)
    if (r->base == address) region = r.get();
  if (!region) {
    threadgroup_vars_.push_back(make_region(const_cast<void*>(address), bytes, R_THREADGROUP_VAR,
                                            int(threadgroup_vars_.size()), name ? name : ""));
    region = threadgroup_vars_.back().get();
  }
  region->shadow.clear();
  std::memset(region->base, kPoison, region->bytes);
}

std::string Sanitizer::describe(const Region& r) const {
  switch (r.kind) {
    case R_BUFFER:
      return "[[buffer(" + std::to_string(r.index) + ")]]" + (r.name.empty() ? "" : " `" + r.name + "`");
    case R_THREADGROUP_ARG:
      return "[[threadgroup(" + std::to_string(r.index) + ")]]" + (r.name.empty() ? " memory" : " `" + r.name + "`");
    case R_THREADGROUP_VAR:
      return "threadgroup variable `" + r.name + "`";
  }
  return "memory";
}

std::string Sanitizer::thread_name(uint32_t group, uint32_t thread) const {
  u3 pos{group % groups_.x, (group / groups_.x) % groups_.y, group / (groups_.x * groups_.y)};
  return where_info(thread_info(grid_, group_size_, groups_, pos, thread));
}

void Sanitizer::access(const Region* region, const void* address, size_t bytes, bool atomic,
                       const ThreadId& who, std::vector<Touch>& touches) {
  const char* a = static_cast<const char*>(address);
  if (!region) {
    std::string msg = thread_name(who.group, who.thread) +
                      " accesses memory through a pointer that points into no buffer or "
                      "threadgroup variable of this dispatch";
    fault("out_of_bounds", msg.c_str());
  }
  if (a < region->base || a + bytes > region->base + region->bytes) {
    long long offset = (long long)(a - region->base);
    long long element = offset >= 0 ? offset / (long long)bytes : -((-offset + (long long)bytes - 1) / (long long)bytes);
    std::string msg = thread_name(who.group, who.thread) + " accesses " + describe(*region) +
                      " at element " + std::to_string(element) + " (byte offset " +
                      std::to_string(offset) + ", " + std::to_string(bytes) + " bytes) but it holds " +
                      std::to_string(region->bytes / bytes) + " elements (" +
                      std::to_string(region->bytes) + " bytes)";
    fault("out_of_bounds", msg.c_str());
  }
  // An atomic through a checked pointer: recorded (it races plain accesses), counted by
  // note_atomic when the operation runs.
  // The same access again (a loop re-reading one element, a spin-wait): counted on the
  // logged one, whose first snapshot is all a write check needs.
  if (!touches.empty()) {
    Touch& last = touches.back();
    if (last.address == a && last.bytes == bytes && last.region == region && last.atomic == atomic) {
      // Metal promises no forward progress between threads: a thread spinning on memory
      // another thread sets never yields to it here (threads run one at a time). Report the
      // spin instead of hanging the process.
      if (++last.count >= kMaxRepeats) {
        std::string msg = thread_name(who.group, who.thread) + " accessed " + describe(*region) +
                          " element " + std::to_string((a - region->base) / bytes) + " " +
                          std::to_string(last.count) + " times in a row without reaching a "
                          "barrier, a SIMD-group function or its end: a spin-wait on another "
                          "thread? Metal guarantees no forward progress between threads, so such "
                          "a kernel can hang on the GPU too";
        fault("hang", msg.c_str());
      }
      return;
    }
  }
  if (touches.size() >= kMaxLoggedAccesses)
    fault("launch", "the sanitizer's log of one thread's accesses between two barriers is full "
                    "(16M accesses): run this kernel unsanitized, or on smaller data");
  touches.emplace_back();
  Touch& t = touches.back();
  t.address = const_cast<char*>(a);
  t.bytes = bytes;
  t.region = const_cast<Region*>(region);
  t.atomic = atomic;
  t.count = 1;
  if (atomic) return;
  if (bytes <= sizeof t.before)
    std::memcpy(t.before, a, bytes);
  else
    t.before_big.assign(a, a + bytes);
}

void Sanitizer::note_atomic(const void* address, size_t bytes, std::vector<Touch>& touches) {
  const char* a = static_cast<const char*>(address);
  ++counters_.atomics;
  // The latest access to these bytes made the pointer this operation uses (the p[i] in
  // atomic_...(&p[i], ...)): it was the atomic access, not a plain one. Earlier plain
  // accesses to the same bytes stay plain.
  for (auto t = touches.rbegin(); t != touches.rend(); ++t)
    if (t->address < a + bytes && a < t->address + t->bytes) {
      t->atomic = true;
      break;
    }
}

bool Sanitizer::ordered(const Region& r, const Access& a, const Access& b) const {
  if (a.group == b.group && a.thread == b.thread) return true;
  if (r.kind == R_BUFFER && a.group != b.group) return false;
  if (a.epoch != b.epoch) return true;
  return a.simdgroup == b.simdgroup && a.sg_epoch != b.sg_epoch;
}

bool Sanitizer::conflict(const Region& r, const Access& a, const Access& b) const {
  return (a.write || b.write) && !(a.atomic && b.atomic) && !ordered(r, a, b);
}

void Sanitizer::race(const Region& r, size_t offset, size_t element_bytes, const Access& earlier,
                     const Access& now) {
  const bool device = r.kind == R_BUFFER;
  auto how = [](const Access& a) {
    return a.atomic ? " updated it atomically"
                    : (a.write ? " wrote it" : " read it (or stored the value already there)");
  };
  std::string msg = describe(r) + " element " + std::to_string(offset / element_bytes) + " (byte offset " +
                    std::to_string(offset) + "): " + thread_name(earlier.group, earlier.thread) +
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

void Sanitizer::record(Region& r, size_t offset, size_t bytes, const Access& base, bool write) {
  for (size_t word = offset / 4, end = (offset + bytes + 3) / 4; word < end; ++word) {
    uint8_t mask = 0;
    for (size_t b = 0; b < 4; ++b) {
      size_t byte = word * 4 + b;
      if (byte >= offset && byte < offset + bytes) mask |= uint8_t(1u << b);
    }
    Access now = base;
    now.mask = mask;
    now.write = write;
    Cell& c = r.shadow[word];
    if (r.kind != R_BUFFER) {
      if (write) {
        c.written |= mask;  // atomic stores initialize memory too
      } else if (mask & ~c.written) {
        std::string msg = thread_name(now.group, now.thread) + " reads " + describe(r) + " element " +
                          std::to_string(offset / bytes) + " (byte offset " + std::to_string(offset) +
                          ") before any thread of its threadgroup wrote it (threadgroup memory "
                          "starts undefined)";
        fault("uninitialized_read", msg.c_str());
      }
    }
    for (unsigned b = 0; b < 4; ++b)
      if ((mask & c.write_mask) >> b & 1 && conflict(r, c.writes[b], now)) race(r, offset, bytes, c.writes[b], now);
    for (uint8_t i = 0; i < c.n_reads; ++i)
      if ((c.reads[i].mask & mask) && conflict(r, c.reads[i], now)) race(r, offset, bytes, c.reads[i], now);
    if (write) {
      for (unsigned b = 0; b < 4; ++b) {
        if (!(mask >> b & 1)) continue;
        const Access& last = c.writes[b];
        // A thread's plain write followed by its own atomic one in the same epoch: the plain
        // write is what other threads' atomics race with, so it stays the one remembered.
        const bool keep_plain = (c.write_mask >> b & 1) && now.atomic && !last.atomic &&
                                last.group == now.group && last.thread == now.thread &&
                                last.epoch == now.epoch && last.sg_epoch == now.sg_epoch;
        if (!keep_plain) c.writes[b] = now;
      }
      c.write_mask |= mask;
    }
    // Reads ordered before this access are ordered before every later one too (epochs only
    // grow, and a later access of another threadgroup conflicts with this one as well).
    uint8_t kept = 0;
    for (uint8_t i = 0; i < c.n_reads; ++i)
      if (!ordered(r, c.reads[i], now)) c.reads[kept++] = c.reads[i];
    c.n_reads = kept;
    if (write) continue;
    uint8_t slot = c.n_reads;
    for (uint8_t i = 0; i < c.n_reads; ++i)
      if (c.reads[i].group == now.group && c.reads[i].thread == now.thread) slot = i;
    if (slot == 2) slot = 1;  // two unordered readers already: keep the first and the latest
    c.reads[slot] = now;
    if (slot == c.n_reads) ++c.n_reads;
  }
}

void Sanitizer::end_segment(const ThreadId& who, std::vector<Touch>& touches) {
  for (const Touch& t : touches) {
    const bool device = t.region->kind == R_BUFFER;
    Access base{who.group, device ? dev_epoch_ : tg_epoch_,
                device ? sg_dev_epoch_[who.simdgroup] : sg_tg_epoch_[who.simdgroup],
                uint16_t(who.thread), uint8_t(who.simdgroup), 0, false, t.atomic};
    if (t.atomic) {  // a read-modify-write, whatever it stored
      record(*t.region, size_t(t.address - t.region->base), t.bytes, base, true);
      continue;
    }
    const bool write = std::memcmp(t.snapshot(), t.address, t.bytes) != 0;
    if (device) {
      (write ? counters_.device_bytes_written : counters_.device_bytes_read) += t.bytes * t.count;
    } else {
      counters_.threadgroup_accesses += t.count;
      const uintptr_t first = uintptr_t(t.address) / 4, last = (uintptr_t(t.address) + t.bytes - 1) / 4;
      for (uint64_t r = 0; r < t.count; ++r)
        bank_log_[who.simdgroup][who.thread % 32].emplace_back(first, uint32_t(last - first + 1));
    }
    record(*t.region, size_t(t.address - t.region->base), t.bytes, base, write);
  }
  touches.clear();
}

void Sanitizer::flush_bank_log() {
  constexpr unsigned kBanks = 32;
  for (auto& lanes : bank_log_) {
    size_t steps = 0;
    for (const auto& log : lanes) steps = std::max(steps, log.size());
    for (size_t k = 0; k < steps; ++k) {
      // Distinct words per bank among the lanes' k-th accesses: same word = broadcast.
      std::vector<uintptr_t> words[kBanks];
      for (const auto& log : lanes) {
        if (k >= log.size()) continue;
        for (uint32_t w = 0; w < log[k].second; ++w) {
          const uintptr_t word = log[k].first + w;
          auto& bank = words[word % kBanks];
          if (std::find(bank.begin(), bank.end(), word) == bank.end()) bank.push_back(word);
        }
      }
      size_t worst = 1;
      for (const auto& bank : words) worst = std::max(worst, bank.size());
      counters_.bank_conflicts += worst - 1;
    }
    for (auto& log : lanes) log.clear();
  }
}

void Sanitizer::threadgroup_barrier(unsigned flags) {
  ++counters_.barriers;
  if (flags & kMemThreadgroup) ++tg_epoch_;
  if (flags & kMemDevice) ++dev_epoch_;
}

void Sanitizer::simdgroup_barrier(uint32_t simdgroup, unsigned flags) {
  if (flags & kMemThreadgroup) ++sg_tg_epoch_[simdgroup];
  if (flags & kMemDevice) ++sg_dev_epoch_[simdgroup];
}

}  // namespace tsm_emu
