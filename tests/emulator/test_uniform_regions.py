"""Uniform kernels: threads that all take the same way from barrier to barrier.

The translation (torch_sparse_metal/emulator/_uniformity.py) says of a barrier-region kernel
whether every decision about where a thread goes next has one value in the whole
threadgroup; run_regions (regions.h) then records where a round's threads wait once for
all of them. A wrong "uniform" would hide barrier divergence, so the verdicts are
checked here kernel by kernel (each "not uniform" one a way a value can differ between
threads, or a way a thread can leave the others), uniform kernels must agree with fibers
bit for bit, and a sanitized run of a kernel falsely said to be uniform must stop with the
emulator's own fault, not run on.
"""
from __future__ import annotations

import re

import numpy as np
import pytest
import torch

from torch_sparse_metal._paths import SHADERS_DIR
from torch_sparse_metal.emulator import KernelFault, _compiler, _regions, compile_shader
from torch_sparse_metal.emulator._uniformity import Uniformity

from _hang_guard import call_with_timeout
from _schedules import both_ways

HEADER = "#include <metal_stdlib>\nusing namespace metal;\n"

# Each kernel: a loop of barriers whose trip count is the value under test.
VERDICTS = HEADER + r"""
constant constexpr uint STEPS = 3;
void bump(thread uint& x, uint by) { x += by; }
uint twice(uint x) { return 2 * x; }

#define LOOP(bound) \
  for (uint k = 0; k < (bound); ++k) { t[lid] += 1.0f; threadgroup_barrier(mem_flags::mem_threadgroup); }

kernel void halving(device float* out [[buffer(0)]], threadgroup float* t [[threadgroup(0)]],
                    uint lid [[thread_position_in_threadgroup]], uint size [[threads_per_threadgroup]]) {
  t[lid] = float(lid);
  threadgroup_barrier(mem_flags::mem_threadgroup);
  for (uint stride = size / 2; stride > 0; stride /= 2) {
    if (lid < stride) t[lid] += t[lid + stride];  // not uniform, but rejoins: fine
    threadgroup_barrier(mem_flags::mem_threadgroup);
  }
  if (lid == 0) out[0] = t[0];
}

kernel void constant_bound(device float* out [[buffer(0)]], constant uint& n [[buffer(1)]],
                           threadgroup float* t [[threadgroup(0)]], uint lid [[thread_position_in_threadgroup]],
                           uint2 group [[threadgroup_position_in_grid]]) {
  constexpr uint extra = STEPS + 1;
  uint m = n + group.x;
  m = max(m, extra);
  t[lid] = 0.0f;
  LOOP(m)
  out[lid] = t[lid];
}

template <uint N>
kernel void template_bound(device float* out [[buffer(0)]], threadgroup float* t [[threadgroup(0)]],
                           uint lid [[thread_position_in_threadgroup]]) {
  t[lid] = 0.0f;
  LOOP(N)
  out[lid] = t[lid];
}
template [[host_name("template_bound")]] kernel void template_bound<2>(device float*, threadgroup float*, uint);

kernel void memory_bound(device float* out [[buffer(0)]], device const uint* n [[buffer(1)]],
                         threadgroup float* t [[threadgroup(0)]], uint lid [[thread_position_in_threadgroup]]) {
  t[lid] = 0.0f;
  LOOP(n[0])
  out[lid] = t[lid];
}

kernel void device_reference_bound(device float* out [[buffer(0)]], device const uint& n [[buffer(1)]],
                                   threadgroup float* t [[threadgroup(0)]],
                                   uint lid [[thread_position_in_threadgroup]]) {
  t[lid] = 0.0f;
  LOOP(n)
  out[lid] = t[lid];
}

kernel void thread_bound(device float* out [[buffer(0)]], threadgroup float* t [[threadgroup(0)]],
                         uint lid [[thread_position_in_threadgroup]]) {
  t[lid] = 0.0f;
  LOOP(lid / 64)
  out[lid] = t[lid];
}

kernel void simdgroup_bound(device float* out [[buffer(0)]], threadgroup float* t [[threadgroup(0)]],
                            uint lid [[thread_position_in_threadgroup]],
                            uint sg [[simdgroup_index_in_threadgroup]]) {
  t[lid] = 0.0f;
  LOOP(sg)
  out[lid] = t[lid];
}

kernel void assigned_under_a_thread_condition(device float* out [[buffer(0)]],
                                              threadgroup float* t [[threadgroup(0)]],
                                              uint lid [[thread_position_in_threadgroup]]) {
  uint m = 2;
  if (lid == 5) m = 3;
  t[lid] = 0.0f;
  LOOP(m)
  out[lid] = t[lid];
}

kernel void changed_through_a_reference(device float* out [[buffer(0)]], threadgroup float* t [[threadgroup(0)]],
                                        uint lid [[thread_position_in_threadgroup]]) {
  uint m = 2;
  bump(m, lid % 2);
  t[lid] = 0.0f;
  LOOP(m)
  out[lid] = t[lid];
}

kernel void changed_through_a_pointer(device float* out [[buffer(0)]], threadgroup float* t [[threadgroup(0)]],
                                      uint lid [[thread_position_in_threadgroup]]) {
  uint m = 2;
  thread uint* p = &m;
  *p += lid % 2;
  t[lid] = 0.0f;
  LOOP(m)
  out[lid] = t[lid];
}

kernel void a_built_in_changed_by_the_thread(device float* out [[buffer(0)]],
                                             threadgroup float* t [[threadgroup(0)]],
                                             uint lid [[thread_position_in_threadgroup]],
                                             uint group [[threadgroup_position_in_grid]]) {
  group += lid % 2;  // a parameter is a variable: no longer the same in every thread
  t[lid] = 0.0f;
  LOOP(group + 1)
  out[lid] = t[lid];
}

kernel void from_a_user_function(device float* out [[buffer(0)]], threadgroup float* t [[threadgroup(0)]],
                                 uint lid [[thread_position_in_threadgroup]]) {
  t[lid] = 0.0f;
  LOOP(twice(1))  // uniform in fact, but a user's function is not looked into
  out[lid] = t[lid];
}

kernel void counted_in_a_loop_condition(device float* out [[buffer(0)]], device const uint* keys [[buffer(1)]],
                                        constant uint& n [[buffer(2)]], threadgroup float* t [[threadgroup(0)]],
                                        uint lid [[thread_position_in_threadgroup]]) {
  uint pos = 0;
  while (pos < n && keys[pos++] != lid) {}  // the condition runs as often as the loop
  t[lid] = 0.0f;
  LOOP(pos)
  out[lid] = t[lid];
}

kernel void a_threadgroup_variable(device float* out [[buffer(0)]], uint lid [[thread_position_in_threadgroup]]) {
  threadgroup uint c;
  threadgroup float t[64];
  if (lid == 0) c = 2;
  threadgroup_barrier(mem_flags::mem_threadgroup);
  const uint m = c;  // memory, though here every thread reads the same
  LOOP(m)
  out[lid] = t[lid];
}

struct Pair {
  uint a, b;
  thread uint& operator[](uint i) thread { return i ? b : a; }
};

kernel void written_through_an_operator(device float* out [[buffer(0)]], threadgroup float* t [[threadgroup(0)]],
                                        uint lid [[thread_position_in_threadgroup]]) {
  Pair p = {1, 1};
  uint k = 0;
  p[k] = lid % 3;  // p is written; its index k only read (k stays uniform, p does not)
  t[lid] = 0.0f;
  LOOP(p.a + k)
  out[lid] = t[lid];
}

kernel void an_index_is_read(device float* out [[buffer(0)]], threadgroup float* t [[threadgroup(0)]],
                             uint lid [[thread_position_in_threadgroup]]) {
  Pair p = {1, 1};
  uint k = 1;
  p[k] = lid % 3;
  t[lid] = 0.0f;
  LOOP(k + 1)
  out[lid] = t[lid] + float(p.b);
}

kernel void assigned_through_a_conditional(device float* out [[buffer(0)]], threadgroup float* t [[threadgroup(0)]],
                                           uint lid [[thread_position_in_threadgroup]]) {
  uint a = 1, b = 1;
  ((lid & 1) ? a : b) = 2;
  t[lid] = 0.0f;
  LOOP(a)
  out[lid] = t[lid];
}

kernel void assigned_through_a_cast(device float* out [[buffer(0)]], threadgroup float* t [[threadgroup(0)]],
                                    uint lid [[thread_position_in_threadgroup]]) {
  uint m = 1;
  static_cast<thread uint&>(m) = lid % 2 + 1;
  t[lid] = 0.0f;
  LOOP(m)
  out[lid] = t[lid];
}

kernel void early_return(device float* out [[buffer(0)]], constant uint& n [[buffer(1)]],
                         threadgroup float* t [[threadgroup(0)]], uint lid [[thread_position_in_threadgroup]]) {
  if (lid >= n) return;
  t[lid] = 0.0f;
  LOOP(2)
  out[lid] = t[lid];
}

kernel void break_by_thread(device float* out [[buffer(0)]], threadgroup float* t [[threadgroup(0)]],
                            uint lid [[thread_position_in_threadgroup]]) {
  t[lid] = 0.0f;
  for (uint k = 0; k < 4; ++k) {
    if (lid == 3 && k == 2) break;
    threadgroup_barrier(mem_flags::mem_threadgroup);
  }
  out[lid] = t[lid];
}

kernel void break_in_its_own_loop(device float* out [[buffer(0)]], threadgroup float* t [[threadgroup(0)]],
                                  uint lid [[thread_position_in_threadgroup]]) {
  t[lid] = 0.0f;
  for (uint k = 0; k < 4; ++k) {
    for (uint j = 0; j < lid; ++j) {  // not uniform; its break leaves only itself
      if (j == 3) break;
      t[lid] += 1.0f;
    }
    threadgroup_barrier(mem_flags::mem_threadgroup);
  }
  out[lid] = t[lid];
}
"""

UNIFORM = {"halving", "constant_bound", "template_bound", "break_in_its_own_loop", "an_index_is_read"}
NOT_UNIFORM = {"memory_bound", "device_reference_bound", "thread_bound", "simdgroup_bound",
               "assigned_under_a_thread_condition", "changed_through_a_reference",
               "changed_through_a_pointer", "a_built_in_changed_by_the_thread", "from_a_user_function",
               "counted_in_a_loop_condition", "a_threadgroup_variable", "written_through_an_operator",
               "assigned_through_a_conditional", "assigned_through_a_cast", "early_return", "break_by_thread"}

ORIGINAL_ANALYSE = _regions.analyse
_VERDICT = re.compile(r"inline void (\w+?)__tsm_group.*?run_regions<\d+, (true|false),", re.S)


def verdicts(cxx: str) -> dict:
    """Kernel name -> whether the translation calls it uniform."""
    return {name: flag == "true" for name, flag in _VERDICT.findall(cxx)}


def test_each_way_a_value_differs_between_threads_is_not_uniform(tmp_path):
    path = tmp_path / "verdicts.metal"
    path.write_text(VERDICTS)
    said = verdicts(_compiler.generated_cxx(path).text)
    assert set(said) == UNIFORM | NOT_UNIFORM
    assert {k for k, v in said.items() if v} == UNIFORM


# Ways a review found a thread's own value past the analysis (each once judged uniform; in
# the plain build a variable of one value in every thread would then be one copy, and read
# the last thread's value): through a typedef of a reference, an alias of one, a `mutable`
# member a const method sets, a user's operator taking a reference, a reference member of
# an aggregate, a structured binding, a user's conversion or constructor with an atomic.
HOLES = HEADER + r"""
#define LOOP(bound) \
  for (uint k = 0; k < (bound); ++k) { t[lid] += 1.0f; threadgroup_barrier(mem_flags::mem_threadgroup); }
#define KERNEL(name) \
  kernel void name(device float* out [[buffer(0)]], device atomic_uint* c [[buffer(1)]], \
                   threadgroup float* t [[threadgroup(0)]], uint lid [[thread_position_in_threadgroup]])

typedef thread uint& uref;
void set_through(uref v, uint x) { v = x; }
struct Box { mutable uint v; void set(uint x) const { v = x; } };
enum class Phase : uint { A = 1 };
uint operator*(thread Phase& p, uint d) { p = Phase(d); return d; }
struct Ref { thread uint& r; };
struct Pair { uint a, b; };
struct Next {
  device atomic_uint* c;
  operator uint() const { return atomic_fetch_add_explicit(c, 1u, memory_order_relaxed) % 2 + 1; }
};
struct Counter { device atomic_uint* c; };
struct Ticket {
  uint v;
  Ticket(Counter k) : v(atomic_fetch_add_explicit(k.c, 1u, memory_order_relaxed) % 2 + 1) {}
};

KERNEL(typedef_of_a_reference) { uint n = 1; set_through(n, lid % 2 + 1); t[lid] = 0.0f; LOOP(n) out[lid] = t[lid]; }
KERNEL(alias_of_a_reference) {
  uint n = 1;
  { uref r = n; r = lid % 2 + 1; }
  t[lid] = 0.0f; LOOP(n) out[lid] = t[lid];
}
KERNEL(a_mutable_member) { Box b{1}; b.set(lid % 2 + 1); uint n = b.v; t[lid] = 0.0f; LOOP(n) out[lid] = t[lid]; }
KERNEL(an_operator_taking_a_reference) {
  Phase ph = Phase::A;
  (void)(ph * (lid % 2 + 1));
  t[lid] = 0.0f; LOOP(uint(ph)) out[lid] = t[lid];
}
KERNEL(a_reference_member) { uint n = 1; Ref w{n}; w.r = lid % 2 + 1; t[lid] = 0.0f; LOOP(n) out[lid] = t[lid]; }
KERNEL(a_structured_binding) {
  Pair p{1, 1};
  { auto& [x, y] = p; x = lid % 2 + 1; }
  t[lid] = 0.0f; LOOP(p.a) out[lid] = t[lid];
}
KERNEL(a_conversion_with_an_atomic) { const Next next{c}; uint n = next; t[lid] = 0.0f; LOOP(n) out[lid] = t[lid]; }
KERNEL(a_constructor_with_an_atomic) {
  const uint n = Ticket(Counter{c}).v;
  t[lid] = 0.0f; LOOP(n) out[lid] = t[lid];
}
"""


def test_each_way_past_the_analysis_a_review_found_is_closed(tmp_path):
    path = tmp_path / "holes.metal"
    path.write_text(HOLES)
    said = verdicts(_compiler.generated_cxx(path).text)
    assert said == dict.fromkeys([
        "typedef_of_a_reference", "alias_of_a_reference", "a_mutable_member", "an_operator_taking_a_reference",
        "a_reference_member", "a_structured_binding", "a_conversion_with_an_atomic",
        "a_constructor_with_an_atomic"], False)


def test_the_project_kernels_verdicts():
    """The project's kernels with barriers: uniform, but those whose threads leave early by
    their own position (a SIMD-group's tile past the matrix, a neuron past the layer)."""
    said = {}
    for path in sorted(SHADERS_DIR.glob("*.metal")) + [SHADERS_DIR / "bench" / "barrier_heavy.metal"]:
        said.update(verdicts(_compiler.generated_cxx(path).text))
    assert {k for k, v in said.items() if not v} == {
        "matmul_shuffle", "sparse_linear_forward_batch_lanes", "sparse_linear_backward_batch_lanes",
        *(f"block_sparse_linear_{d}_{f}" for d in ("forward", "backward")
          for f in ("simdgroup", "shuffle"))}
    assert {"tree_reduce", "tiled_matmul", "matmul_tiled", "matmul_simdgroup", "kmeans_assign"} <= set(said)


# A uniform kernel through every kind of round: the start, a loop of barriers, a
# SIMD-group function (whose stop is recorded per thread), a return.
RUNS = HEADER + r"""
kernel void sums(device float* out [[buffer(0)]], device const float* x [[buffer(1)]],
                 uint lid [[thread_position_in_threadgroup]], uint gid [[thread_position_in_grid]],
                 uint group [[threadgroup_position_in_grid]], uint size [[threads_per_threadgroup]],
                 uint lane [[thread_index_in_simdgroup]]) {
  threadgroup float t[128];
  t[lid] = x[gid];
  const uint rounds = 2 * size;  // one value in every thread, across every stop
  uint done = 0;
  threadgroup_barrier(mem_flags::mem_threadgroup);
  for (uint stride = size / 2; stride >= 32; stride /= 2) {
    if (lid < stride) t[lid] += t[lid + stride];
    done += stride;
    threadgroup_barrier(mem_flags::mem_threadgroup);
  }
  const float v = lid < 32 ? t[lid] : 0.0f;
  const float s = simd_sum(v);
  if (lid == 0) out[group] = s;
  out[64 + gid] = float(lane) + s + float(rounds + done);
}
"""


@pytest.mark.parametrize("sanitize", [False, True], ids=["plain", "sanitized"])
def test_a_uniform_kernel_agrees_with_fibers_bit_for_bit(monkeypatch, tmp_path, sanitize):
    path = tmp_path / "runs.metal"
    path.write_text(RUNS)
    assert verdicts(_compiler.generated_cxx(path).text) == {"sums": True}
    regions, fibers = both_ways(RUNS, monkeypatch, sanitize)
    x = torch.randn(256, generator=torch.Generator().manual_seed(3))
    outs = []
    for lib in (regions, fibers):
        out = torch.zeros(64 + 256)
        call_with_timeout(lib.sums, out, x, threads=256, group_size=128)
        outs.append(out)
    assert torch.equal(outs[0].view(torch.int32), outs[1].view(torch.int32))
    want = x.double().view(2, 128).sum(1).numpy()
    np.testing.assert_allclose(outs[0][:2].numpy(), want, rtol=1e-5, atol=1e-5)


# Which variables live across a barrier as one copy for the threadgroup: those with one
# value in every thread, and the loop's counter.
VARIABLES = HEADER + r"""
kernel void variables(device float* out [[buffer(0)]], device const uint* n [[buffer(1)]],
                      threadgroup float* t [[threadgroup(0)]],
                      uint lid [[thread_position_in_threadgroup]], uint gid [[thread_position_in_grid]],
                      uint size [[threads_per_threadgroup]]) {
  const uint half_size = size / 2;
  uint mine = lid * 2;     // a thread's position
  uint loaded = n[0];      // memory
  uint picked = 0;
  if (lid < 3) picked = 1; // under a thread's condition
  float acc = 0.0f;
  for (uint k = 0; k < half_size; k += 32) {
    t[lid] = float(k + mine + loaded + picked);
    threadgroup_barrier(mem_flags::mem_threadgroup);
    acc += t[(lid + 1) % size];
    threadgroup_barrier(mem_flags::mem_threadgroup);
  }
  out[gid] = acc + float(half_size);
}
"""
_SLOTS = re.compile(r"::tsm_emu::Slots<.*?, (true|false)> __tsm_([sc])(\d+)\(")  # (true: if a scalar)


def shared_variables(cxx: str) -> dict:
    """Variable (a loop counter: "counter k") -> whether its slots are one for the threadgroup."""
    names = dict((index, name) for name, index in re.findall(r"\b(\w+?)__tsm(\d+)\b", cxx))
    return {names[i] if kind == "s" else f"counter {i}": shared == "true"
            for shared, kind, i in _SLOTS.findall(cxx)}


@pytest.mark.parametrize("sanitize", [False, True], ids=["plain", "sanitized"])
def test_variables_with_one_value_in_every_thread_are_one_copy(monkeypatch, tmp_path, sanitize):
    path = tmp_path / "variables.metal"
    path.write_text(VARIABLES)
    cxx = _compiler.generated_cxx(path).text
    assert verdicts(cxx) == {"variables": True}
    assert shared_variables(cxx) == {"half_size": True, "k": True, "counter 0": True, "mine": False,
                                     "loaded": False, "picked": False, "acc": False}
    regions, fibers = both_ways(VARIABLES, monkeypatch, sanitize)
    outs = []
    for lib in (regions, fibers):
        out = torch.zeros(256)
        call_with_timeout(lib.variables, out, torch.tensor([5], dtype=torch.int32), threads=256, group_size=128,
                          threadgroup_memory=[128 * 4])
        outs.append(out)
    assert torch.equal(outs[0].view(torch.int32), outs[1].view(torch.int32))
    neighbour = (np.arange(256) + 1) % 128  # whose value each thread adds
    want = sum(k + 2 * neighbour + 5 + (neighbour < 3) for k in range(0, 64, 32)) + 64
    np.testing.assert_array_equal(outs[0].numpy(), want)


def test_a_kernel_that_is_not_uniform_keeps_every_variable_per_thread(tmp_path):
    path = tmp_path / "diverges.metal"
    path.write_text(DIVERGES)
    cxx = _compiler.generated_cxx(path).text
    assert verdicts(cxx) == {"diverges": False}
    assert shared_variables(cxx) == {"k": False, "counter 0": False}


DIVERGES = HEADER + r"""
kernel void diverges(device float* out [[buffer(0)]], uint lid [[thread_position_in_threadgroup]]) {
  threadgroup float t[64];
  t[lid] = 1.0f;
  for (uint k = 0; k < lid % 2 + 1; ++k) threadgroup_barrier(mem_flags::mem_threadgroup);
  out[lid] = t[lid];
}
"""


def test_a_false_promise_is_caught_by_the_sanitizer(monkeypatch, tmp_path):
    """A kernel said to be uniform that is not (the analysis mocked): its sanitized run
    stops with the emulator's fault, where a plain one would take every thread where the
    first goes. (A kernel of its own name and cache: the translation is cached by the
    code's text, and no other test may load the mocked build.)"""
    monkeypatch.setenv("TSM_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("TSM_EMU_REGIONS", "1")
    monkeypatch.setattr(_regions, "analyse", lambda *args: Uniformity(True, frozenset()))
    lib = compile_shader(DIVERGES.replace("diverges", "said_to_be_uniform"), sanitize=True)
    # (Not a KernelFault: the kernel is not at fault.)
    with pytest.raises(RuntimeError, match="internal: the emulator's translation said this kernel's threads"):
        call_with_timeout(lib.said_to_be_uniform, torch.zeros(64), threads=64, group_size=64)
    monkeypatch.setattr(_regions, "analyse", ORIGINAL_ANALYSE)
    honest = compile_shader(DIVERGES, sanitize=True)
    with pytest.raises(KernelFault) as e:
        call_with_timeout(honest.diverges, torch.zeros(64), threads=64, group_size=64)
    assert e.value.kind == "barrier_divergence"


def test_a_false_uniform_variable_is_caught_by_the_sanitizer(monkeypatch, tmp_path):
    """A uniform kernel whose every variable is said to have one value in all threads (the
    analysis mocked): the sanitized run compares each thread's value of `mine` (its own
    position) at the barrier with the first thread's, and stops with the emulator's fault
    naming it; the plain build of the honest analysis gives the right answer."""
    monkeypatch.setenv("TSM_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("TSM_EMU_REGIONS", "1")

    def everything_uniform(body, *args):
        said = ORIGINAL_ANALYSE(body, *args)
        assert said.control
        return Uniformity(True, frozenset(c.canonical.hash for c in body.walk_preorder()
                                          if c.kind.name == "VAR_DECL"))

    monkeypatch.setattr(_regions, "analyse", everything_uniform)
    source = VARIABLES.replace("variables(", "said_to_share(")
    lib = compile_shader(source, sanitize=True)
    with pytest.raises(RuntimeError, match="internal: the emulator's translation said the variable `mine`"):
        call_with_timeout(lib.said_to_share, torch.zeros(256), torch.tensor([5], dtype=torch.int32),
                          threads=256, group_size=128, threadgroup_memory=[128 * 4])
