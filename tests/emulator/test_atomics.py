"""Device atomics on the emulator under heavy contention, against exact expected values.

Every thread of many threadgroups hits one of 1-4 addresses. Threadgroups run on several CPU
worker threads at once (TSM_EMU_WORKERS: "2", the cores here; "8" oversubscribes them so
workers are also preempted mid-update), so a non-atomic read-modify-write would lose
updates. Semantics (../shared/notes/metal-semantics.md): atomic_fetch_* return the old value,
relaxed order only; atomic_compare_exchange_weak_explicit may fail spuriously and writes the
current value to `expected` when it fails; atomic_float (Metal 3) adds natively; before Metal
3 float addition is a CAS loop on atomic_uint (seed 001). atomic<double> exists only in the
emulator (float64 gradcheck through the kernels).
"""
from __future__ import annotations

import numpy as np
import pytest
import torch

from torch_sparse_metal.emulator import compile_shader

SOURCE = r"""
#include <metal_stdlib>
using namespace metal;

// Slots: 0 ticket (add 1), 1 add, 2 sub, 3 min, 4 max, 5 and, 6 or, 7 xor, 8 exchange,
// 9 CAS-loop add. Each slot has naddr addresses; thread gid uses address gid % naddr and
// repeats everything `reps` times (long enough for the worker threads to overlap).
template <typename T>
[[kernel]] void rmw(device atomic<T>* a [[buffer(0)]],
                    device const T* v [[buffer(1)]],
                    device const T* m [[buffer(2)]],
                    device T* ticket [[buffer(3)]],
                    device T* exchanged [[buffer(4)]],
                    constant uint& naddr [[buffer(5)]],
                    constant uint& reps [[buffer(6)]],
                    uint gid [[thread_position_in_grid]]) {
  const uint k = gid % naddr;
  const T x = v[gid];
  const T bits = m[gid];
  for (uint r = 0; r < reps; ++r) {
    const uint slot = gid * reps + r;
    ticket[slot] = atomic_fetch_add_explicit(&a[0 * naddr + k], T(1), memory_order_relaxed);
    atomic_fetch_add_explicit(&a[1 * naddr + k], x, memory_order_relaxed);
    atomic_fetch_sub_explicit(&a[2 * naddr + k], x, memory_order_relaxed);
    atomic_fetch_min_explicit(&a[3 * naddr + k], x, memory_order_relaxed);
    atomic_fetch_max_explicit(&a[4 * naddr + k], x, memory_order_relaxed);
    atomic_fetch_and_explicit(&a[5 * naddr + k], ~bits, memory_order_relaxed);
    atomic_fetch_or_explicit(&a[6 * naddr + k], bits, memory_order_relaxed);
    atomic_fetch_xor_explicit(&a[7 * naddr + k], x, memory_order_relaxed);
    exchanged[slot] = atomic_exchange_explicit(&a[8 * naddr + k], T(slot), memory_order_relaxed);
    T expected = atomic_load_explicit(&a[9 * naddr + k], memory_order_relaxed);
    while (!atomic_compare_exchange_weak_explicit(&a[9 * naddr + k], &expected, expected + x,
                                                  memory_order_relaxed, memory_order_relaxed)) {
    }
  }
}
template [[host_name("rmw_int")]] [[kernel]] decltype(rmw<int>) rmw<int>;
template [[host_name("rmw_uint")]] [[kernel]] decltype(rmw<uint>) rmw<uint>;

// Native atomic_float (Metal 3): add into slot 0, subtract in slot 1.
kernel void float_add_sub(device atomic_float* acc [[buffer(0)]],
                          device const float* x [[buffer(1)]],
                          constant uint& naddr [[buffer(2)]],
                          uint gid [[thread_position_in_grid]]) {
  const uint k = gid % naddr;
  atomic_fetch_add_explicit(&acc[k], x[gid], memory_order_relaxed);
  atomic_fetch_sub_explicit(&acc[naddr + k], x[gid], memory_order_relaxed);
}

// Seed 001, verbatim: float addition as a compare-exchange loop on the bits.
inline void atomicAddFloat(device atomic_uint* addr, float val) {
    uint expected = atomic_load_explicit(addr, memory_order_relaxed);
    uint desired;
    do {
        float current = as_type<float>(expected);
        float new_val = current + val;
        desired = as_type<uint>(new_val);
    } while (!atomic_compare_exchange_weak_explicit(
        addr, &expected, desired,
        memory_order_relaxed, memory_order_relaxed
    ));
}

kernel void cas_float_add(device atomic_uint* acc [[buffer(0)]],
                          device const float* x [[buffer(1)]],
                          constant uint& naddr [[buffer(2)]],
                          uint gid [[thread_position_in_grid]]) {
  atomicAddFloat(&acc[gid % naddr], x[gid]);
}

#ifdef __METAL_EMULATOR__
kernel void double_add(device atomic<double>* acc [[buffer(0)]],
                       device const double* x [[buffer(1)]],
                       constant uint& naddr [[buffer(2)]],
                       uint gid [[thread_position_in_grid]]) {
  atomic_fetch_add_explicit(&acc[gid % naddr], x[gid], memory_order_relaxed);
}
#endif

// Control: a plain read-modify-write, which concurrent workers must be able to break.
kernel void plain_increment(device int* a [[buffer(0)]],
                            constant uint& reps [[buffer(1)]],
                            uint gid [[thread_position_in_grid]]) {
  volatile device int* p = a;
  for (uint r = 0; r < reps; ++r) {
    p[0] = p[0] + 1;
  }
}

// atomic_ulong (Metal 2.4, Apple8+: min and max only, returning nothing).
kernel void ulong_min_max(device atomic_ulong* acc [[buffer(0)]],
                          device const ulong* x [[buffer(1)]],
                          constant uint& naddr [[buffer(2)]],
                          uint gid [[thread_position_in_grid]]) {
  const uint k = gid % naddr;
  atomic_max_explicit(&acc[k], x[gid], memory_order_relaxed);
  atomic_min_explicit(&acc[naddr + k], x[gid], memory_order_relaxed);
}
"""

N = 256 * 64      # 64 threadgroups of 256 threads
GROUP = 256


@pytest.fixture(scope="module")
def lib():
    return compile_shader(SOURCE)


# Explicit worker counts: by default a dispatch this small gets one worker (see
# THREADS_PER_WORKER in metal/_library.py), and these tests are about real overlap.
@pytest.fixture(params=["2", "8"], ids=["workers=2", "workers=8"])
def workers(request, monkeypatch):
    monkeypatch.setenv("TSM_EMU_WORKERS", request.param)
    return request.param


def _by_address(values, naddr):
    """values[gid] grouped by gid % naddr."""
    return [values[k::naddr] for k in range(naddr)]


REPS = 25  # odd, so that the xor of each value `REPS` times is the value once


@pytest.mark.parametrize("naddr", [1, 4])
@pytest.mark.parametrize("kind", ["int", "uint"])
def test_integer_atomics_under_contention(lib, workers, kind, naddr):
    rng = np.random.default_rng(naddr)
    if kind == "int":
        dt = np.int32
        v = rng.integers(-3000, 3001, size=N).astype(dt)          # sums stay in range
        init_min, init_max, all_ones = np.iinfo(dt).max, np.iinfo(dt).min, -1
    else:
        dt = np.uint32
        v = rng.integers(0, 2**32, size=N, dtype=np.uint64).astype(dt)  # sums wrap mod 2**32
        init_min, init_max, all_ones = np.iinfo(dt).max, 0, np.iinfo(dt).max
    bits = (np.uint32(1) << (np.arange(N, dtype=np.uint32) % 32)).astype(np.uint32).view(dt)
    exch_init = dt(1 << 30)   # distinct from every value written
    init = np.zeros((10, naddr), dtype=dt)
    init[3], init[4], init[5], init[8] = init_min, init_max, all_ones, exch_init
    init[1] = dt(7)
    a = torch.from_numpy(init.view(np.int32).copy())
    ticket = torch.full((N * REPS,), -1, dtype=torch.int32)
    exchanged = torch.full((N * REPS,), -1, dtype=torch.int32)
    getattr(lib, f"rmw_{kind}")(a, torch.from_numpy(v.view(np.int32)),
                                torch.from_numpy(bits.view(np.int32)), ticket, exchanged,
                                naddr, REPS, threads=N, group_size=GROUP)
    got = a.numpy().view(dt).reshape(10, naddr)
    tickets = ticket.numpy().view(dt).reshape(N, REPS)
    olds = exchanged.numpy().view(dt).reshape(N, REPS)
    slots = np.arange(N * REPS, dtype=np.int64).reshape(N, REPS)
    with np.errstate(over="ignore"):
        for k in range(naddr):
            vk = v[k::naddr]
            count = len(vk) * REPS
            # fetch_add(1) hands out each ticket 0..count-1 exactly once
            np.testing.assert_array_equal(np.sort(tickets[k::naddr].ravel()),
                                          np.arange(count, dtype=dt), err_msg="fetch_add tickets")
            assert got[0, k] == count
            total = (vk.sum(dtype=dt) * dt(REPS)).astype(dt)
            assert got[1, k] == dt(7) + total, "fetch_add"
            assert got[2, k] == dt(0) - total, "fetch_sub"
            assert got[3, k] == vk.min(), "fetch_min"
            assert got[4, k] == vk.max(), "fetch_max"
            assert got[5, k] == np.bitwise_and.reduce(~bits[k::naddr]), "fetch_and"
            assert got[6, k] == np.bitwise_or.reduce(bits[k::naddr]), "fetch_or"
            assert got[7, k] == np.bitwise_xor.reduce(vk), "fetch_xor"
            # exchange: the returned old values and the final value are the initial value
            # and every written value, each exactly once
            chain = np.sort(np.concatenate([olds[k::naddr].ravel().astype(np.int64),
                                            [int(got[8, k])]]))
            np.testing.assert_array_equal(
                chain, np.sort(np.concatenate([slots[k::naddr].ravel(), [int(exch_init)]])),
                err_msg="exchange")
            assert got[9, k] == total, "compare_exchange loop"


@pytest.mark.skipif((__import__("os").cpu_count() or 1) < 2, reason="needs 2 or more cores")
def test_control_plain_read_modify_write_loses_updates(lib, monkeypatch):
    """The contention tests mean something only if worker threads really overlap: the same
    load + store without an atomic must lose updates. The launch is long (~50 ms) so that
    the workers overlap even on a loaded machine (and are preempted mid-update on one)."""
    monkeypatch.setenv("TSM_EMU_WORKERS", "8")
    n, reps = 256 * 8, 20000
    lost = []
    for _ in range(3):
        a = torch.zeros(1, dtype=torch.int32)
        lib.plain_increment(a, reps, threads=n, group_size=256)
        lost.append(n * reps - a.item())
        if lost[-1] > 0:
            break
    assert max(lost) > 0, "no update lost: threadgroups did not run concurrently"


@pytest.mark.parametrize("naddr", [1, 4])
def test_atomic_float_add_and_sub_small_integers_exact(lib, workers, naddr):
    x = np.random.default_rng(1).integers(1, 17, size=N).astype(np.float32)
    acc = torch.zeros(2 * naddr)
    lib.float_add_sub(acc, torch.from_numpy(x), naddr, threads=N, group_size=GROUP)
    sums = np.array([s.sum(dtype=np.float64) for s in _by_address(x, naddr)])
    assert sums.max() < 2**24  # every partial sum is an exactly representable integer
    np.testing.assert_array_equal(acc.numpy()[:naddr], sums)
    np.testing.assert_array_equal(acc.numpy()[naddr:], -sums)


# Values in [0.5, 1): a lost or doubled update moves a sum by >= 0.5. The float32 rounding
# of ~4096-16384 sequential additions (sum <= 16384, half-ulp <= 2**-10) random-walks to
# ~0.01 in practice; atol 0.1 separates the two by an order of magnitude on each side.
FLOAT_ATOL = 0.1


@pytest.mark.parametrize("naddr", [1, 4])
def test_atomic_float_add_random_values_match_float64(lib, workers, naddr):
    x = np.random.default_rng(2).uniform(0.5, 1.0, size=N).astype(np.float32)
    acc = torch.zeros(2 * naddr)
    lib.float_add_sub(acc, torch.from_numpy(x), naddr, threads=N, group_size=GROUP)
    sums = np.array([s.sum(dtype=np.float64) for s in _by_address(x, naddr)])
    np.testing.assert_allclose(acc.numpy()[:naddr], sums, rtol=0, atol=FLOAT_ATOL)
    np.testing.assert_allclose(acc.numpy()[naddr:], -sums, rtol=0, atol=FLOAT_ATOL)


@pytest.mark.parametrize("naddr", [1, 4])
def test_seed001_cas_float_add_small_integers_exact(lib, workers, naddr):
    x = np.random.default_rng(3).integers(1, 17, size=N).astype(np.float32)
    acc = torch.zeros(naddr)  # float bits, viewed by the kernel as atomic_uint
    lib.cas_float_add(acc, torch.from_numpy(x), naddr, threads=N, group_size=GROUP)
    sums = np.array([s.sum(dtype=np.float64) for s in _by_address(x, naddr)])
    np.testing.assert_array_equal(acc.numpy(), sums)


@pytest.mark.parametrize("naddr", [1, 4])
def test_seed001_cas_float_add_random_values_match_float64(lib, workers, naddr):
    x = np.random.default_rng(4).uniform(0.5, 1.0, size=N).astype(np.float32)
    acc = torch.zeros(naddr)
    lib.cas_float_add(acc, torch.from_numpy(x), naddr, threads=N, group_size=GROUP)
    sums = np.array([s.sum(dtype=np.float64) for s in _by_address(x, naddr)])
    np.testing.assert_allclose(acc.numpy(), sums, rtol=0, atol=FLOAT_ATOL)


@pytest.mark.parametrize("naddr", [1, 3])
def test_atomic_double_add(lib, workers, naddr):
    rng = np.random.default_rng(5)
    ints = rng.integers(-1000, 1000, size=N).astype(np.float64)
    acc = torch.zeros(naddr, dtype=torch.float64)
    lib.double_add(acc, torch.from_numpy(ints), naddr, threads=N, group_size=GROUP)
    np.testing.assert_array_equal(acc.numpy(), [s.sum() for s in _by_address(ints, naddr)])
    x = rng.standard_normal(N)
    acc.zero_()
    lib.double_add(acc, torch.from_numpy(x), naddr, threads=N, group_size=GROUP)
    # float64 summation in any order: error <= N * eps * sum|x| ~ 16384 * 2.2e-16 * 1.3e4
    np.testing.assert_allclose(acc.numpy(), [s.sum() for s in _by_address(x, naddr)],
                               rtol=0, atol=1e-7)


def test_atomic_ulong_min_max(lib, workers):
    naddr = 2
    x = np.random.default_rng(6).integers(1 << 33, 1 << 62, size=N, dtype=np.uint64)
    init = np.array([0, 0, 2**64 - 1, 2**64 - 1], dtype=np.uint64)
    acc = torch.from_numpy(init.view(np.int64).copy())
    lib.ulong_min_max(acc, torch.from_numpy(x.view(np.int64)), naddr, threads=N,
                      group_size=GROUP)
    got = acc.numpy().view(np.uint64)
    parts = _by_address(x, naddr)
    np.testing.assert_array_equal(got[:naddr], [p.max() for p in parts])
    np.testing.assert_array_equal(got[naddr:], [p.min() for p in parts])
