"""Ways past the barrier-region translation that a second review found, each run against
fibers: every one of these kernels ran as regions and gave another answer than its fibers
(the oracle), silently. Each must now agree, by running right as regions or by falling
back to fibers. Grouped by the part of the translation each got past:

- a SIMD-group function's arguments run twice (the statement posts the lane's value, then
  runs whole): a Metal function writing through a reference (`modf`), a temporary's
  destructor, a default member initialiser, a typedef of a reference in a const method, a
  user's operator left unresolved in a template;
- the statement around that call, whose posting run evaluates the call alone: an
  assignment sequenced before it, an earlier declarator of the same declaration, a read
  through a reference member;
- slots: the address of a member of a local, or of a local through a helper, kept across
  a barrier;
- hoisting: a const initialised from a threadgroup variable;
- parameters a thread modifies unseen (then one copy for the group): bound to a reference
  through a template's explicit argument, a reference member, a typedef of a reference;
- uniformity: a const object whose `mutable` member a const method sets, a default member
  initialiser calling an atomic.
"""
from __future__ import annotations

import re

import pytest
import torch

from _schedules import both_ways
from test_barrier_regions import HEADER, outcome, same

HOLES = HEADER + r"""
struct Slot { float x; };
struct Pair2 { float a; float b; };
struct Box { mutable uint v; void set(uint x) const { v = x; } };
struct Bump { thread uint* p; float v; ~Bump() { *p += 1; } };
struct Tick { thread uint* p; uint v = (*p)++; };
typedef thread uint& uref;
typedef device const float* thread& pref;
struct Counted { thread uint* p; float get(float x) const { uref r = *p; r += 1; return x; } };
struct Drawn { device atomic_uint* c; uint v = atomic_fetch_add_explicit(c, 1u, memory_order_relaxed); };
struct RefHolder { device float& r; };
struct Cursor { device const float* thread& p; };
template <typename T> void bump(T x) { x += 1; }
thread float* addr(thread float& x) { return &x; }
constant float w = 1.0f;
#define KERNEL(name) \
  kernel void name(device float* out [[buffer(0)]], device const float* in [[buffer(1)]], \
                   device atomic_uint* c [[buffer(2)]], device Slot* sp [[buffer(3)]], \
                   uint lid [[thread_position_in_threadgroup]])

KERNEL(modf_argument) { float ip = 0.0f; float s = simd_sum(modf(1.5f + ip, ip)); out[lid] = s + ip; }
KERNEL(destructor_argument) { uint n = 0; float s = simd_sum(Bump{&n, 1.0f}.v); out[lid] = s + float(n); }
KERNEL(default_member_initialiser_argument) {
  uint n = 0; float s = simd_sum(float(Tick{&n}.v)); out[lid] = s + float(n);
}
KERNEL(typedef_reference_in_method) { uint n = 0; float s = simd_sum(Counted{&n}.get(1.0f)); out[lid] = s + float(n); }
KERNEL(assignment_before_call) { float v = 1.0f; float s = ((v = float(lid)), simd_sum(v)); out[lid] = s; }
KERNEL(earlier_declarator) { float w = float(lid), s = simd_sum(w); out[lid] = s; }
KERNEL(read_through_reference_member) {
  sp[lid].x = float(lid);
  threadgroup_barrier(mem_flags::mem_threadgroup);
  float got = 0.0f;
  { RefHolder h{sp[lid].x}; float s = ((got = h.r), simd_sum(1.0f)); sp[(lid + 1) % 32].x = 100.0f; out[lid] = got + s; }
}
KERNEL(address_of_member) {
  Pair2 p = {0.0f, 0.0f};
  thread float* q = &p.a;
  threadgroup_barrier(mem_flags::mem_threadgroup);
  *q = float(lid) + 1.0f;
  threadgroup_barrier(mem_flags::mem_threadgroup);
  out[lid] = p.a;
}
KERNEL(address_through_helper) {
  float v = 0.0f;
  thread float* q = addr(v);
  threadgroup_barrier(mem_flags::mem_threadgroup);
  *q = float(lid) + 1.0f;
  threadgroup_barrier(mem_flags::mem_threadgroup);
  out[lid] = v;
}
KERNEL(const_from_threadgroup) {
  threadgroup uint tg;
  if (lid == 0) tg = 5;
  threadgroup_barrier(mem_flags::mem_threadgroup);
  const uint v = tg;
  threadgroup_barrier(mem_flags::mem_threadgroup);
  out[lid] = float(v);
}
KERNEL(parameter_through_template_reference) {
  bump<device const float* thread&>(in); threadgroup_barrier(mem_flags::mem_threadgroup); out[lid] = in[0];
}
KERNEL(parameter_through_reference_member) {
  Cursor k{in}; k.p += 1; threadgroup_barrier(mem_flags::mem_threadgroup); out[lid] = in[0];
}
KERNEL(parameter_through_typedef_reference) {
  { pref r = in; r += 1; } threadgroup_barrier(mem_flags::mem_threadgroup); out[lid] = in[0];
}
KERNEL(const_object_mutable_member) {
  const Box b{0}; b.set(lid); uint n = b.v; threadgroup_barrier(mem_flags::mem_threadgroup); out[lid] = float(n);
}
KERNEL(default_member_initialiser_atomic) {
  Drawn d{c}; uint n = d.v; threadgroup_barrier(mem_flags::mem_threadgroup); out[lid] = float(n);
}

struct Effect { thread uint* p; float v; };
float operator+(Effect e, float x) { *e.p += 1; return e.v + x; }
template <typename T>
kernel void dependent_operator(device float* out [[buffer(0)]], uint lid [[thread_position_in_threadgroup]]) {
  uint n = 0; T e{&n, 1.0f}; float s = simd_sum(e + 0.0f); out[lid] = s + float(n);
}
template [[host_name("dependent_user_operator")]] kernel void dependent_operator<Effect>(device float*, uint);
"""

KERNELS = re.findall(r"^KERNEL\((\w+)\)", HOLES, re.M) + ["dependent_user_operator"]


def arguments(kernel: str):
    if kernel == "dependent_user_operator":
        return [torch.zeros(32)]
    return [torch.zeros(32), torch.arange(64, dtype=torch.float32), torch.zeros(1, dtype=torch.int32),
            torch.zeros(32)]


@pytest.fixture(scope="module")
def libraries():
    with pytest.MonkeyPatch.context() as mp:
        yield both_ways(HOLES, mp, sanitize=False)


@pytest.mark.parametrize("kernel", KERNELS)
def test_each_way_past_the_translation_agrees_with_fibers(libraries, kernel):
    regions, fibers = libraries
    r = outcome(regions, kernel, lambda: arguments(kernel), 32, 32)
    f = outcome(fibers, kernel, lambda: arguments(kernel), 32, 32)
    assert r[0] == f[0] == "ran", (r, f)
    assert same(r, f), (r, f)
