// The emulator's execution model, as seen from kernel code.
//
// A dispatch runs its threadgroups on CPU worker threads. Inside a threadgroup, when the
// library uses barriers or SIMD-group functions, each Metal thread is a cooperative fiber:
// a barrier or a SIMD collective suspends the fiber until every thread it waits for has
// arrived, so synchronisation really blocks and a missing barrier is observable. Kernels
// without any of those run as a plain loop over the threads.
//
// Nothing here may include C math headers: see types.h.
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <string>
#include <type_traits>
#include <utility>

#include "tsm_emu/sanitize.h"

namespace tsm_emu {

struct u3 {
  uint32_t x, y, z;
};

// Everything a thread can ask about its place in the dispatch.
struct ThreadInfo {
  u3 thread_position_in_grid;
  u3 thread_position_in_threadgroup;
  u3 threadgroup_position_in_grid;
  u3 threads_per_threadgroup;           // actual size: smaller at the grid's edges
  u3 dispatch_threads_per_threadgroup;  // requested size
  u3 threadgroups_per_grid;
  u3 threads_per_grid;
  uint32_t thread_index_in_threadgroup;
  uint32_t thread_index_in_simdgroup;
  uint32_t simdgroup_index_in_threadgroup;
  uint32_t simdgroups_per_threadgroup;
  uint32_t dispatch_simdgroups_per_threadgroup;
};

// P_ABSENT: a parameter whose [[function_constant(b)]] is false (or has no value): it takes
// no argument, and the kernel sees a null pointer (or a zeroed value).
// P_TEXTURE, P_SAMPLER: a [[texture(n)]] or [[sampler(n)]] (texture.h).
enum ParamKind : int { P_BUFFER = 0, P_THREADGROUP = 1, P_BUILTIN = 2, P_ABSENT = 3, P_TEXTURE = 4, P_SAMPLER = 5 };

enum Builtin : int {
  B_THREAD_POSITION_IN_GRID,
  B_THREAD_POSITION_IN_THREADGROUP,
  B_THREADGROUP_POSITION_IN_GRID,
  B_THREADS_PER_THREADGROUP,
  B_DISPATCH_THREADS_PER_THREADGROUP,
  B_THREADGROUPS_PER_GRID,
  B_THREADS_PER_GRID,
  B_THREAD_INDEX_IN_THREADGROUP,
  B_THREAD_INDEX_IN_SIMDGROUP,
  B_SIMDGROUP_INDEX_IN_THREADGROUP,
  B_THREADS_PER_SIMDGROUP,
  B_THREAD_EXECUTION_WIDTH,
  B_SIMDGROUPS_PER_THREADGROUP,
  B_DISPATCH_SIMDGROUPS_PER_THREADGROUP,
  B_THREAD_INDEX_IN_QUADGROUP,
  B_QUADGROUP_INDEX_IN_THREADGROUP,
  B_QUADGROUPS_PER_THREADGROUP,
  B_DISPATCH_QUADGROUPS_PER_THREADGROUP,
  B_GRID_ORIGIN,
  B_GRID_SIZE,
};

struct ParamSpec {
  int kind;   // ParamKind
  int index;  // buffer / threadgroup index, or Builtin
};

struct TextureDesc;  // texture.h
struct SamplerDesc;

struct DispatchArgs {
  void* const* buffers;
  const uint64_t* buffer_bytes;
  void* const* threadgroup;  // this threadgroup's dynamic [[threadgroup(n)]] blocks
  const TextureDesc* const* textures;
  const SamplerDesc* const* samplers;
};

// Described to Python so it can convert scalars and check argument widths.
struct TypeInfo {
  int passing;       // 0 pointer, 1 reference, 2 value, 3 texture, 4 sampler
                     // (a texture's size is its TextureKind | its access << 8)
  int size;          // sizeof the pointee / referee / value
  char scalar;       // f float, h half, b bfloat, d double, i signed, u unsigned, o bool, s other
  int is_const;
};

using InvokeFn = void (*)(const DispatchArgs&, const ThreadInfo&);
struct Group;  // regions.h
using GroupFn = void (*)(const DispatchArgs&, Group&);

// How the runtime runs a kernel's threadgroups: with `group` when the translation made one
// (barrier regions, or a loop over the threads of a kernel that does not synchronise:
// regions.h); else as fibers when the kernel synchronises (barriers, SIMD-group
// functions); else as a loop calling `invoke` per thread (TSM_EMU_REGIONS=0).
struct KernelEntry {
  const char* name;
  InvokeFn invoke;
  int num_params;
  const ParamSpec* params;
  const TypeInfo* types;
  GroupFn group;
  int synchronises;
};

// ---- runtime services (runtime.cpp) -------------------------------------------------
[[noreturn]] void fault(const char* kind, const char* message);
const ThreadInfo& current_thread();
std::string where_info(const ThreadInfo& t);  // "thread (x, y, z) (index i in threadgroup (...))"

// A value exchanged by the active lanes of one SIMD-group at one collective.
// The widest value one lane contributes to a collective: a double4, or the three 2-element
// operands of a double simdgroup_matrix product.
constexpr size_t kSimdValueBytes = 64;

// What the first lane to read an exchange computed for every lane (a simdgroup_matrix
// product's whole 8x8 result), for the others to read instead of computing it again. It
// holds that exchange's result while its `serial` equals the exchange's.
constexpr size_t kSimdMemoBytes = 8 * 8 * sizeof(double);
struct SimdMemo {
  uint64_t serial = ~uint64_t(0);  // none yet: no exchange has this serial
  alignas(64) unsigned char bytes[kSimdMemoBytes];
};

struct SimdExchange {
  uint64_t active;                       // bit i: lane i took part
  const unsigned char (*values)[kSimdValueBytes];  // values[lane], valid for active lanes
  uint32_t lane;                         // the calling lane
  // Barrier regions (regions.h) call a collective twice: first only to hand over the
  // lane's value (pending: the exchange holds just the caller, its result is discarded,
  // and the function must have no other effect), then, once the lanes met, for the result.
  // The caller's own operands (its value: values[lane]; a shuffle's lane or delta:
  // own_operand) are the first call's, as a fiber's are those it suspended with.
  bool pending = false;
  uint32_t* operands = nullptr;          // barrier regions: the caller's scalar operands
  // Not pending: the exchange's memo, and what identifies this exchange's values in it
  // (every exchange of a worker has its own serial, from 1).
  SimdMemo* memo = nullptr;
  uint64_t serial = 0;
};
// What every lane of a collective computes alike from its exchange (not pending), as a T in
// the exchange's memo: `compute(T&)` runs for the first lane to ask, the others read it.
template <class T, class Compute>
inline const T& memoised(const SimdExchange& x, Compute compute) {
  static_assert(sizeof(T) <= kSimdMemoBytes && alignof(T) <= 64, "a value the memo cannot hold");
  T& value = *reinterpret_cast<T*>(x.memo->bytes);
  if (x.memo->serial != x.serial) {
    compute(value);
    x.memo->serial = x.serial;
  }
  return value;
}
// A collective's scalar operand k (0 or 1) of the calling lane, as it handed it over.
inline uint32_t own_operand(const SimdExchange& x, uint32_t v, unsigned k) {
  if (!x.operands) return v;
  if (x.pending) x.operands[k] = v;
  return x.operands[k];
}
// A collective's or barrier's call site in the kernel source: line << 12 | k, where k is
// the call's position among the collectives on that line (from the rewriter; 0 when a call
// was not rewritten). Lanes waiting at one site form one collective; threads waiting at
// different barrier sites diverge. Source positions survive optimisation, which may
// duplicate or merge the calls themselves.
// A region-compiled threadgroup's SIMD-group functions (regions.h's Group holds one): what
// a lane's call hands over and reads, inline, where the runtime's path looks the group up
// through thread-locals at every call (a fifth of a shuffle matmul's time).
struct RegionLanes {
  uint8_t mode = kOrdinary;  // the running thread's CollectiveMode
  unsigned char (*slots)[kSimdValueBytes] = nullptr;  // per thread: the value it hands over
  const SimdExchange* met = nullptr;  // per SIMD-group: what its lanes met with, once released
  uint32_t (*operands)[2] = nullptr;  // per thread: its call's own_operand()s
};
// The thread of a region body that calls a collective (no lanes outside region bodies), and
// the call's mode: lanes at once know it where the call is (kPosting, kReplaying), a
// constant the compiler folds into the call; the regions' rounds leave it to `lanes->mode`,
// which their bodies set (kModeOfLanes). Set through the group at each call, the mode was
// two stores and a load a lane (4% of tsm.mm[shuffle]'s instructions lanes at once).
constexpr uint8_t kModeOfLanes = 0xFF;
struct LaneRef {
  RegionLanes* lanes;
  uint32_t thread;
  uint8_t mode = kModeOfLanes;
};
// (16 bytes, so a call passes it in two registers: at 24, through the stack, each call's
// store and reload of it stalled on store forwarding, a seventh of a shuffle matmul's time.
// So the calling thread, of at most 1024 in its threadgroup, has 16 bits beside the mode.)
struct Site {
  uint32_t value;
  uint16_t thread = 0;           // with `lanes`: the calling thread, and its LaneRef's mode
  uint8_t mode = kModeOfLanes;
  RegionLanes* lanes = nullptr;  // a region body's collective: its threadgroup's lanes
  constexpr Site(uint32_t v) : value(v) {}
  constexpr Site(uint32_t v, LaneRef lane) : value(v), thread(uint16_t(lane.thread)), mode(lane.mode), lanes(lane.lanes) {}
  constexpr LaneRef lane() const { return LaneRef{lanes, thread, mode}; }
};
static_assert(sizeof(Site) == 16, "a Site in two registers");
#define TSM_EMU_SITE_HERE (::tsm_emu::Site{uint32_t(__builtin_LINE()) << 12})

// The rewriter opens a CallFrame at the top of every helper function that (directly or
// not) reaches a barrier or a SIMD-group function, with the site it was called from: the
// same collective reached through two different calls is two different sites, and sites
// order by where the kernel made the call.
void enter_call(uint32_t caller_site);
void leave_call();
struct CallFrame {
  explicit CallFrame(Site caller) { enter_call(caller.value); }
  ~CallFrame() { leave_call(); }
  CallFrame(const CallFrame&) = delete;
  CallFrame& operator=(const CallFrame&) = delete;
};

// Likewise one per iteration of a loop whose body reaches a collective: the loop's site and
// the iteration's number, so a lane that skipped an iteration (`continue`) does not meet
// the others at the next iteration's collective, and a barrier in different iterations is
// divergence.
struct LoopFrame {
  LoopFrame(Site loop, uint32_t iteration) {
    enter_call(loop.value);
    enter_call(iteration);
  }
  ~LoopFrame() {
    leave_call();
    leave_call();
  }
  LoopFrame(const LoopFrame&) = delete;
  LoopFrame& operator=(const LoopFrame&) = delete;
};
SimdExchange simd_exchange(const void* value, size_t size, uint32_t site);
[[noreturn]] void collective_outside_stop();  // (runtime.cpp) raises: an emulator bug
// A SIMD-group function and its exchange go inline into the loops over threads: out of
// line, a lane's call cost ~90 instructions, most of them passing the exchange around (a
// half of tsm.mm[shuffle]'s instructions lanes at once; 0.58x of them inline).
#define TSM_EMU_COLLECTIVE __attribute__((always_inline)) inline
// A lane of a region-compiled threadgroup at a SIMD-group function: hand over its value
// (kPosting: the exchange holds just the caller), or read what its SIMD-group's lanes met
// with (kReplaying).
TSM_EMU_COLLECTIVE SimdExchange lane_exchange(const void* value, size_t size, LaneRef ref) {
  RegionLanes& l = *ref.lanes;
  const uint32_t t = ref.thread, sg = t / 32, lane = t % 32;
  if (size > kSimdValueBytes) fault("launch", "SIMD-group function on a value wider than 64 bytes");
  const uint8_t mode = ref.mode == kModeOfLanes ? l.mode : ref.mode;
  SimdExchange out;
  if (mode == kPosting) {
    std::memcpy(l.slots[t], value, size);
    out.active = uint64_t(1) << lane;
    out.values = l.slots + size_t(sg) * 32;
    out.pending = true;
  } else if (mode == kReplaying) {
    out = l.met[sg];
    if (ref.mode == kModeOfLanes) l.mode = kOrdinary;
  } else {
    collective_outside_stop();
  }
  out.lane = lane;
  out.operands = l.operands[t];
  return out;
}
TSM_EMU_COLLECTIVE SimdExchange simd_exchange(const void* value, size_t size, Site site) {
  if (site.lanes) return lane_exchange(value, size, site.lane());
  return simd_exchange(value, size, site.value);
}
// `flags` are the barrier's mem_flags: in a sanitized dispatch, mem_threadgroup orders
// threadgroup memory and mem_device orders device memory between the threads it joins.
void simdgroup_barrier_wait(uint32_t site, unsigned flags);
void threadgroup_barrier_wait(uint32_t site, unsigned flags);
// A threadgroup array declared in a kernel body: counted towards the 32 KB, and in a
// sanitized dispatch a region of its own, named for reports.
void register_static_threadgroup_memory(const void* address, size_t bytes, const char* name = "");
// The regions of the current dispatch's [[buffer(i)]] and [[threadgroup(i)]] arguments
// (nullptr unless the dispatch is sanitized).
const Bounds* buffer_region(int index);
const Bounds* threadgroup_region(int index);

// Sanitized dispatches only (no-ops otherwise): a shuffle read a lane that is not active;
// whether a weak compare-and-swap should fail spuriously now, to exercise retry loops.
void inactive_lane_read(uint32_t lane);
bool inject_spurious_cas_failure();
// Instrumented (sanitized) dispatches count explicit fused multiply-adds: fma(), mad() and
// simdgroup_matrix products, for the benchmarks' FMA counter. Only the dispatch inside
// metal.record() counts (counting_fmas, set before its workers start): a call per fma was
// 3% of a sanitized tiled matmul, and a plain build's, per lane and simdgroup_matrix
// product, 5% of kmeans_iteration's instructions.
void count_fmas(unsigned n);
extern bool counting_fmas;
inline void counted_fmas(unsigned n) {
#ifdef __TSM_SANITIZE__
  if (counting_fmas) count_fmas(n);
#else
  (void)n;
#endif
}

// ---- argument binding ---------------------------------------------------------------
template <class T>
struct scalar_code {
  static constexpr char value =
      std::is_same<T, bool>::value ? 'o'
      : std::is_same<T, double>::value ? 'd'
      : std::is_floating_point<T>::value ? 'f'
      : std::is_integral<T>::value ? (std::is_signed<T>::value ? 'i' : 'u')
                                   : 's';
};
template <>
struct scalar_code<_Float16> {
  static constexpr char value = 'h';
};

template <class T>
struct builtin_traits {
  static constexpr bool ok = std::is_integral<T>::value;
  static T make(u3 v) { return static_cast<T>(v.x); }
};

template <class A>
struct pointee {  // what a pointer parameter points to (raw, or checked in sanitized builds)
  using type = std::remove_pointer_t<A>;
};
template <class T>
struct pointee<ptr<T>> {
  using type = T;
};

template <class A>
constexpr TypeInfo plain_type_info() {
  using NoRef = std::remove_cv_t<std::remove_reference_t<A>>;
  constexpr bool is_pointer = std::is_pointer<NoRef>::value || is_checked_ptr<NoRef>::value;
  using Pointee = std::conditional_t<is_pointer, typename pointee<NoRef>::type, std::remove_reference_t<A>>;
  using Bare = std::remove_cv_t<Pointee>;
  return TypeInfo{is_pointer ? 0 : (std::is_reference<A>::value ? 1 : 2), int(sizeof(Bare)),
                  scalar_code<Bare>::value, int(std::is_const<Pointee>::value)};
}

// Texture and sampler types (texture.h) are told by these members.
template <class X, class = void>
struct is_texture : std::false_type {};
template <class X>
struct is_texture<X, std::void_t<decltype(X::tsm_kind)>> : std::true_type {};
template <class X, class = void>
struct is_sampler : std::false_type {};
template <class X>
struct is_sampler<X, std::void_t<decltype(&X::tsm_sampler_state)>> : std::true_type {};

template <class A>
constexpr TypeInfo type_info() {
  using V = std::remove_cv_t<std::remove_reference_t<A>>;
  if constexpr (is_texture<V>::value) {
    using T = typename V::tsm_texel_type;
    return TypeInfo{3, int(V::tsm_kind) | (int(V::tsm_access) << 8),
                    std::is_same<T, float>::value ? 'f' : std::is_same<T, _Float16>::value ? 'h' : std::is_signed<T>::value ? 'i' : 'u',
                    0};
  } else if constexpr (is_sampler<V>::value) {
    return TypeInfo{4, 0, 's', 0};
  } else {
    return plain_type_info<A>();
  }
}


// Inline: a kernel's built-in arguments are each a constant `which`, so the switch folds.
inline u3 builtin_value(int which, const ThreadInfo& t) {
  auto s = [](uint32_t v) { return u3{v, 0, 0}; };
  switch (which) {
    case B_THREAD_POSITION_IN_GRID: return t.thread_position_in_grid;
    case B_THREAD_POSITION_IN_THREADGROUP: return t.thread_position_in_threadgroup;
    case B_THREADGROUP_POSITION_IN_GRID: return t.threadgroup_position_in_grid;
    case B_THREADS_PER_THREADGROUP: return t.threads_per_threadgroup;
    case B_DISPATCH_THREADS_PER_THREADGROUP: return t.dispatch_threads_per_threadgroup;
    case B_THREADGROUPS_PER_GRID: return t.threadgroups_per_grid;
    case B_THREADS_PER_GRID: return t.threads_per_grid;
    case B_THREAD_INDEX_IN_THREADGROUP: return s(t.thread_index_in_threadgroup);
    case B_THREAD_INDEX_IN_SIMDGROUP: return s(t.thread_index_in_simdgroup);
    case B_SIMDGROUP_INDEX_IN_THREADGROUP: return s(t.simdgroup_index_in_threadgroup);
    case B_THREADS_PER_SIMDGROUP:
    case B_THREAD_EXECUTION_WIDTH: return s(32);  // Apple GPUs' SIMD-group width
    case B_SIMDGROUPS_PER_THREADGROUP: return s(t.simdgroups_per_threadgroup);
    case B_DISPATCH_SIMDGROUPS_PER_THREADGROUP: return s(t.dispatch_simdgroups_per_threadgroup);
    case B_THREAD_INDEX_IN_QUADGROUP: return s(t.thread_index_in_threadgroup % 4);
    case B_QUADGROUP_INDEX_IN_THREADGROUP: return s(t.thread_index_in_threadgroup / 4);
    case B_QUADGROUPS_PER_THREADGROUP: {
      u3 a = t.threads_per_threadgroup;
      return s((a.x * a.y * a.z + 3) / 4);
    }
    case B_DISPATCH_QUADGROUPS_PER_THREADGROUP: {
      u3 a = t.dispatch_threads_per_threadgroup;
      return s((a.x * a.y * a.z + 3) / 4);
    }
    case B_GRID_ORIGIN: return u3{0, 0, 0};
    case B_GRID_SIZE: return t.threads_per_grid;
  }
  fault("launch", "unknown built-in");
}


template <class A>
inline A make_arg(const ParamSpec& p, const DispatchArgs& d, const ThreadInfo& t) {
  if (p.kind == P_ABSENT) {
    using V = std::remove_cv_t<std::remove_reference_t<A>>;
    if constexpr (std::is_reference<A>::value) {
      alignas(16) static const unsigned char zeros[sizeof(V)] = {};
      return *reinterpret_cast<std::remove_reference_t<A>*>(const_cast<unsigned char*>(zeros));
    } else {
      return V{};
    }
  }
  if constexpr (std::is_pointer<A>::value) {
    void* base = p.kind == P_THREADGROUP ? d.threadgroup[p.index] : d.buffers[p.index];
    return static_cast<A>(base);
  } else if constexpr (is_checked_ptr<std::remove_cv_t<A>>::value) {
    using E = typename std::remove_cv_t<A>::element_type;
    if (p.kind == P_THREADGROUP)
      return std::remove_cv_t<A>(static_cast<E*>(d.threadgroup[p.index]), threadgroup_region(p.index));
    return std::remove_cv_t<A>(static_cast<E*>(d.buffers[p.index]), buffer_region(p.index));
  } else if constexpr (std::is_reference<A>::value) {
    void* base = p.kind == P_THREADGROUP ? d.threadgroup[p.index] : d.buffers[p.index];
    return *static_cast<std::remove_reference_t<A>*>(base);
  } else if constexpr (is_texture<std::remove_cv_t<A>>::value) {
    if (p.kind != P_TEXTURE) fault("launch", "a texture parameter without [[texture(n)]]");
    return std::remove_cv_t<A>(d.textures[p.index]);
  } else if constexpr (is_sampler<std::remove_cv_t<A>>::value) {
    if (p.kind != P_SAMPLER) fault("launch", "a sampler parameter without [[sampler(n)]]");
    return std::remove_cv_t<A>(d.samplers[p.index]);
  } else {
    using V = std::remove_cv_t<A>;
    if constexpr (builtin_traits<V>::ok) {
      if (p.kind == P_BUILTIN) return builtin_traits<V>::make(builtin_value(p.index, t));
    }
    if (p.kind != P_BUFFER) fault("launch", "built-in parameter of an unsupported type");
    V v;
    __builtin_memcpy(static_cast<void*>(&v), d.buffers[p.index], sizeof(V));
    return v;
  }
}

template <class... A, size_t... I>
inline void invoke_with(void (*f)(A...), const ParamSpec* p, const DispatchArgs& d,
                        const ThreadInfo& t, std::index_sequence<I...>) {
  f(make_arg<A>(p[I], d, t)...);
}

template <class... A>
inline void invoke(void (*f)(A...), const ParamSpec* p, const DispatchArgs& d, const ThreadInfo& t) {
  invoke_with(f, p, d, t, std::index_sequence_for<A...>{});
}

template <class F>
struct fn_params;
template <class... A>
struct fn_params<void (*)(A...)> {
  static constexpr int count = sizeof...(A);
  static constexpr TypeInfo types[sizeof...(A) > 0 ? sizeof...(A) : 1] = {type_info<A>()...};
};

}  // namespace tsm_emu

// The lane the rewriter passes with every collective's site (tsm_emu::Site): none here, so
// the runtime finds the caller; a region body declares its own `__tsm_lane` (the
// translation's, torch_sparse_metal/metal/_regions.py), which shadows this one there.
constexpr ::tsm_emu::LaneRef __tsm_lane{nullptr, 0};
