"""Known-bad Metal kernels and their corrected twins, under the emulator's sanitizer.

Every ``kernels/<case>_bad.metal`` holds a kernel with one bug the GPU runs silently (an
out-of-bounds access, a race, a divergent barrier); ``kernels/<case>_fixed.metal`` holds the
same kernel, same name and signature, corrected. The table ``CASES`` says how to launch
each: the arguments (built with NumPy, with the answer the corrected kernel must give), the
grid, the threadgroup, the threadgroup memory, and what the sanitizer must report for the
bad one: the fault kind, the memory (buffer index and name, or threadgroup variable), the
element, and the grid positions of the threads involved.

* each bad kernel raises ``KernelFault`` of exactly its kind, and the message names the
  kernel, the memory, the element and the thread(s);
* each fixed twin runs clean under the sanitizer, gives the NumPy answer, and gives the
  same answer unsanitized;
* every ``*_bad.metal`` has a ``*_fixed.metal`` twin and a row in the table.

The sanitizer runs one Metal thread at a time, threadgroups in order and the threads of a
threadgroup in index order until each stops (barrier, SIMD-group function, return): which
thread meets a bug first is deterministic, so the reports' threads are exact. The kernels
of all files are compiled together (one library of bad kernels, one of fixed ones; each
file is #included, so line numbers in reports are the file's own).
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import numpy as np
import pytest
import torch

from torch_sparse_metal.emulator import KernelFault

from _hang_guard import call_with_timeout
from _sanitizer_support import KERNELS_DIR, library_of_files, line_of, thread

# Arguments of one launch, and the answer of the corrected kernel: {argument index: array}.
Built = Tuple[Tuple[object, ...], Dict[int, np.ndarray]]


@dataclass(frozen=True)
class Case:
    name: str                 # the test id
    file: str                 # kernels/<file>_bad.metal and kernels/<file>_fixed.metal
    kernel: str               # the kernel's name in both files
    build: Callable[[np.random.Generator], Built]
    threads: object           # grid, in threads
    group: object             # threadgroup size
    kind: str                 # the bad kernel's fault
    where: str                # how the report names the memory (or barrier) involved
    element: Optional[int]    # the element reported (None: a barrier fault)
    culprits: Tuple[str, ...]  # the threads the report names
    threadgroup_memory: Sequence[int] = ()
    extra: Tuple[str, ...] = field(default=())  # more text the report must hold


def ints(rng, shape, lo=-4, hi=5, dtype=np.float32):
    """Small integers (as floats by default): sums of products are exact in float32, in any
    order, so the kernels must match NumPy exactly."""
    return rng.integers(lo, hi, size=shape).astype(dtype)


def nonzero_ints(rng, shape, dtype=np.float32):
    v = rng.integers(1, 10, size=shape) * rng.choice([-1, 1], size=shape)
    return v.astype(dtype)


# ---- builders: arguments and the corrected kernel's answer ------------------------------
def build_seed002(rng) -> Built:
    n = 1000
    x = rng.integers(-1000, 1001, size=n).astype(np.int32)
    out = torch.zeros(1, dtype=torch.int32)
    return (torch.from_numpy(x), out, n), {1: np.array([x.astype(np.int64).sum()], np.int32)}


def build_matmul(rng) -> Built:
    M, N, K = 32, 32, 48
    a, b = ints(rng, (M, K)), ints(rng, (K, N))
    c = torch.full((M, N), -1.0)
    return (torch.from_numpy(a), torch.from_numpy(b), c, M, N, K), {2: a @ b}


def build_tree(rng) -> Built:
    n, group = 1000, 256
    x = ints(rng, n, 1, 10)
    padded = np.zeros(1024, np.float32)
    padded[:n] = x
    out = torch.full((4,), -1.0)
    return (torch.from_numpy(x), out, n), {1: padded.reshape(4, group).sum(axis=1)}


def build_guarded(rng) -> Built:
    n, group = 100, 64
    x = ints(rng, n)
    padded = np.zeros(128, np.float32)
    padded[:n] = x
    gid = np.arange(n)
    neighbour = gid // group * group + (gid % group + 1) % group
    want = np.float32(0.5) * (padded[gid] + padded[neighbour])
    return (torch.from_numpy(x), torch.full((n,), -1.0), n), {1: want}


def build_ragged(rng) -> Built:
    n, max_len = 64, 4
    w = ints(rng, (max_len, 32))
    length = (1 + np.arange(n) % max_len).astype(np.uint32)  # 1, 2, 3, 4, 1, 2, ...
    want = np.zeros(n, np.float32)
    for g in range(n):
        lid = g % 32
        for c in range(length[g]):
            want[g] += w[c, (lid + c) % 32]
    args = (torch.from_numpy(w), torch.from_numpy(length.view(np.int32)), torch.full((n,), -1.0),
            max_len)
    return args, {2: want}


def build_gradient(rng) -> Built:
    rows, cols = 8, 64
    dy = nonzero_ints(rng, (rows, cols))  # every += changes grad: each write is seen
    return (torch.from_numpy(dy), torch.zeros(cols), cols), {1: dy.sum(axis=0)}


def build_stencil(rng) -> Built:
    n = 256
    a = rng.standard_normal(n).astype(np.float32)
    want = a.copy()
    want[1:-1] = (a[:-2] + a[1:-1] + a[2:]) / np.float32(3.0)
    return (torch.from_numpy(a.copy()), torch.full((n,), -1.0), n), {0: a, 1: want}


def build_seed000(rng) -> Built:
    B, H, D = 4, 32, 16
    x, w1, w2 = ints(rng, (B, D)), ints(rng, (H, D)), ints(rng, (H, H))
    hidden = torch.full((B, H), -1.0)  # relu never gives -1: every store is a seen write
    want_hidden = np.maximum(x @ w1.T, 0).astype(np.float32)
    want = want_hidden @ w2.T
    args = (torch.from_numpy(x), torch.from_numpy(w1), torch.from_numpy(w2), hidden,
            torch.full((B, H), -1.0), D)
    return args, {3: want_hidden, 4: want}


def build_simd_partials(rng) -> Built:
    x = ints(rng, 1024)
    return (torch.from_numpy(x), torch.full((4,), -1.0)), {1: x.reshape(4, 256).sum(axis=1)}


def neighbour_difference(x, offset, group):
    """y[i] = x[i] - x[i + offset] within each group of `group` elements (0 at its edges)."""
    y = np.zeros_like(x)
    for i in range(len(x)):
        j = i + offset
        if 0 <= j < len(x) and j // group == i // group:
            y[i] = x[i] - x[j]
    return y


def build_neighbour(n, group, offset, with_n):
    def build(rng) -> Built:
        x = ints(rng, n)
        args = (torch.from_numpy(x), torch.full((n,), -1.0), offset) + ((n,) if with_n else ())
        return args, {1: neighbour_difference(x, offset, group)}
    return build


def barrier_line(file: str, occurrence: int = 1) -> str:
    line = line_of(KERNELS_DIR / f"{file}_bad.metal", "threadgroup_barrier(", occurrence)
    return f"threadgroup_barrier at line {line}"


CROSS_GROUP = "threads of different threadgroups are never ordered"

CASES: List[Case] = [
    # Seed 002: thread 744 = 512 + 232 is the first (groups run in order) with
    # gid + lsize = 1000 = n.
    Case("seed002_reduce_reads_past_the_end", "seed002_reduce", "seed002_reduce", build_seed002,
         threads=1024, group=256, threadgroup_memory=[1024], kind="out_of_bounds",
         where="[[buffer(0)]] `input`", element=1000, culprits=(thread(744, 232, 2),),
         extra=("holds 1000 elements",)),
    # Thread 0 finishes tile 0 and loads tile 1 into As[0][0]; thread 1 then reads As[0][0]
    # for its tile-0 dot product.
    Case("tiled_matmul_missing_barrier_after_multiply", "tiled_matmul", "tiled_matmul",
         build_matmul, threads=(32, 32), group=(16, 16), kind="threadgroup_race",
         where="threadgroup variable `As`", element=0,
         culprits=(thread((0, 0), 0, (0, 0)), thread((1, 0), 1, (0, 0)))),
    # Thread 0 runs every stage at once and reads buf[1] in the last one; thread 1 then
    # writes buf[1] in the first.
    Case("tree_reduce_missing_stage_barrier", "tree_reduce", "tree_reduce", build_tree,
         threads=1024, group=256, kind="threadgroup_race", where="threadgroup variable `buf`",
         element=1, culprits=(thread(0, 0, 0), thread(1, 1, 0))),
    # The last threadgroup (gid 64..127) has threads past n = 100: thread 100 (index 36)
    # returns while thread 64 (index 0) waits.
    Case("barrier_inside_bounds_check", "guarded_barrier", "guarded_barrier", build_guarded,
         threads=128, group=64, kind="barrier_divergence", where=barrier_line("guarded_barrier"),
         element=None, culprits=(thread(100, 36, 1), thread(64, 0, 1)),
         extra=("returned before", "TSM_EMU_EXITED_THREADS_ARRIVE")),
    # Thread 0 (1 chunk) returns while thread 1 (2 chunks) waits at the loop's first barrier:
    # a deadlock on hardware, a report here.
    Case("barrier_in_loop_with_per_thread_trip_count", "ragged_loop_barrier", "ragged_loop_barrier",
         build_ragged, threads=64, group=32, kind="barrier_divergence",
         where=barrier_line("ragged_loop_barrier"), element=None,
         culprits=(thread(0, 0, 0), thread(1, 1, 0)), extra=("returned before",)),
    # Row 0 (threadgroup 0) adds into grad[0] first; row 1's thread 0 does it again.
    Case("shared_gradient_non_atomic_add", "shared_gradient", "shared_gradient", build_gradient,
         threads=512, group=64, kind="device_race", where="[[buffer(1)]] `grad`", element=0,
         culprits=(thread(0, 0, 0), thread(64, 0, 1)), extra=(CROSS_GROUP,)),
    # Threadgroup 0's last thread writes a[63]; threadgroup 1's first thread reads it.
    Case("inplace_stencil_across_threadgroups", "inplace_stencil", "inplace_stencil", build_stencil,
         threads=256, group=64, kind="device_race", where="[[buffer(0)]] `a`", element=63,
         culprits=(thread(63, 63, 0), thread(64, 0, 1)), extra=(CROSS_GROUP,)),
    # Thread 1 stores hidden[1]; thread 0 reads it after a barrier that orders threadgroup
    # memory only.
    Case("seed000_threadgroup_scope_barrier_on_device_memory", "seed000_barrier_scope",
         "seed000_barrier_scope", build_seed000, threads=128, group=32, kind="device_race",
         where="[[buffer(3)]] `hidden`", element=1, culprits=(thread(1, 1, 0), thread(0, 0, 0)),
         extra=("threadgroup_barrier(mem_flags::mem_device)",)),
    # Lane 0 of SIMD-group 1 (thread 32) stores partial[1]; lane 1 of SIMD-group 0 reads it
    # after a simdgroup_barrier, which does not order different SIMD-groups.
    Case("simd_partials_with_simdgroup_barrier", "simd_partials", "simd_partials",
         build_simd_partials, threads=1024, group=256, kind="threadgroup_race",
         where="threadgroup variable `partial`", element=1,
         culprits=(thread(32, 32, 0), thread(1, 1, 0))),
    Case("device_buffer_index_minus_1", "neighbour_device", "neighbour_device",
         build_neighbour(100, 100, -1, True), threads=100, group=32, kind="out_of_bounds",
         where="[[buffer(0)]] `x`", element=-1, culprits=(thread(0, 0, 0),),
         extra=("holds 100 elements",)),
    Case("device_buffer_index_n", "neighbour_device", "neighbour_device",
         build_neighbour(100, 100, +1, True), threads=100, group=32, kind="out_of_bounds",
         where="[[buffer(0)]] `x`", element=100, culprits=(thread(99, 3, 3),),
         extra=("holds 100 elements",)),
    Case("threadgroup_argument_index_minus_1", "neighbour_tg_arg", "neighbour_tg_arg",
         build_neighbour(128, 64, -1, False), threads=128, group=64, threadgroup_memory=[256],
         kind="out_of_bounds", where="[[threadgroup(0)]]", element=-1,
         culprits=(thread(0, 0, 0),), extra=("holds 64 elements",)),
    Case("threadgroup_argument_index_n", "neighbour_tg_arg", "neighbour_tg_arg",
         build_neighbour(128, 64, +1, False), threads=128, group=64, threadgroup_memory=[256],
         kind="out_of_bounds", where="[[threadgroup(0)]]", element=64,
         culprits=(thread(63, 63, 0),), extra=("holds 64 elements",)),
    Case("threadgroup_array_index_minus_1", "neighbour_tg_static", "neighbour_tg_static",
         build_neighbour(128, 64, -1, False), threads=128, group=64, kind="out_of_bounds",
         where="threadgroup variable `t`", element=-1, culprits=(thread(0, 0, 0),),
         extra=("holds 64 elements",)),
    Case("threadgroup_array_index_n", "neighbour_tg_static", "neighbour_tg_static",
         build_neighbour(128, 64, +1, False), threads=128, group=64, kind="out_of_bounds",
         where="threadgroup variable `t`", element=64, culprits=(thread(63, 63, 0),),
         extra=("holds 64 elements",)),
]

CASE_IDS = [c.name for c in CASES]


def kernel_files(variant: str) -> List[str]:
    return sorted(p.name for p in KERNELS_DIR.glob(f"*_{variant}.metal"))


@pytest.fixture(scope="module")
def bad_lib():
    return library_of_files(kernel_files("bad"), sanitize=True)


@pytest.fixture(scope="module")
def fixed_lib():
    return library_of_files(kernel_files("fixed"), sanitize=True)


@pytest.fixture(scope="module")
def fixed_lib_unsanitized():
    return library_of_files(kernel_files("fixed"), sanitize=False)


def launch(lib, case: Case, args):
    call_with_timeout(lib[case.kernel], *args, threads=case.threads, group_size=case.group,
                      threadgroup_memory=list(case.threadgroup_memory))


def outputs(args, indices):
    return {i: args[i].numpy().copy() for i in indices}


# ---- the bad kernels ----------------------------------------------------------------------
@pytest.mark.parametrize("case", CASES, ids=CASE_IDS)
def test_bad_kernel_raises_its_fault(bad_lib, case):
    args, _ = case.build(np.random.default_rng(1))
    with pytest.raises(KernelFault) as info:
        launch(bad_lib, case, args)
    fault = info.value
    message = str(fault)
    assert fault.kind == case.kind, message
    assert isinstance(fault, RuntimeError)
    assert message.startswith(f"{case.kind}: kernel {case.kernel}: "), message
    assert case.where in message, message
    if case.element is not None:
        assert re.search(rf"\belement {case.element}\b", message), message
    for culprit in case.culprits:
        assert culprit in message, message
    for text in case.extra:
        assert text in message, message


@pytest.mark.parametrize("case", [c for c in CASES if len(c.culprits) == 2], ids=lambda c: c.name)
def test_race_and_divergence_reports_name_two_different_threads(bad_lib, case):
    """Both threads involved, in the order the report gives them: the first one named is
    the one that acted first (the earlier access, or the thread that returned)."""
    args, _ = case.build(np.random.default_rng(2))
    with pytest.raises(KernelFault) as info:
        launch(bad_lib, case, args)
    message = str(info.value)
    first, second = (message.index(c) for c in case.culprits)
    assert first < second, message
    assert case.culprits[0] != case.culprits[1]


# ---- the fixed twins ----------------------------------------------------------------------
@pytest.mark.parametrize("case", CASES, ids=CASE_IDS)
def test_fixed_twin_is_clean_and_right(fixed_lib, fixed_lib_unsanitized, case):
    args, want = case.build(np.random.default_rng(3))
    launch(fixed_lib, case, args)  # raises KernelFault if the sanitizer objects
    sanitized = outputs(args, want)
    for i, expected in want.items():
        np.testing.assert_array_equal(sanitized[i], expected.reshape(sanitized[i].shape),
                                      err_msg=f"{case.kernel} argument {i} (sanitized)")

    args, _ = case.build(np.random.default_rng(3))
    launch(fixed_lib_unsanitized, case, args)
    plain = outputs(args, want)
    for i in want:
        np.testing.assert_array_equal(plain[i], sanitized[i],
                                      err_msg=f"{case.kernel} argument {i}: unsanitized differs")


# ---- the corpus ---------------------------------------------------------------------------
def _kernel_names(path) -> List[str]:
    return re.findall(r"\bkernel\s+void\s+(\w+)", path.read_text())


def test_every_bad_kernel_has_a_fixed_twin_and_a_table_entry():
    bad = {name[:-len("_bad.metal")] for name in kernel_files("bad")}
    fixed = {name[:-len("_fixed.metal")] for name in kernel_files("fixed")}
    in_table = {c.file for c in CASES}
    assert bad, f"no *_bad.metal under {KERNELS_DIR}"
    assert bad - fixed == set(), f"bad kernels without a *_fixed.metal twin: {sorted(bad - fixed)}"
    assert fixed - bad == set(), f"fixed kernels without a *_bad.metal twin: {sorted(fixed - bad)}"
    assert bad - in_table == set(), f"kernel files with no row in CASES: {sorted(bad - in_table)}"
    assert in_table - bad == set(), f"CASES rows naming missing files: {sorted(in_table - bad)}"
    others = sorted(p.name for p in KERNELS_DIR.iterdir()
                    if not re.search(r"_(bad|fixed)\.metal$", p.name))
    assert not others, f"files in kernels/ that are neither *_bad.metal nor *_fixed.metal: {others}"


@pytest.mark.parametrize("stem", sorted({c.file for c in CASES}))
def test_twins_are_real_msl_with_the_same_kernel(stem):
    bad_path, fixed_path = KERNELS_DIR / f"{stem}_bad.metal", KERNELS_DIR / f"{stem}_fixed.metal"
    for path in (bad_path, fixed_path):
        assert path.read_text().startswith("#include <metal_stdlib>"), path.name
    assert _kernel_names(bad_path) == _kernel_names(fixed_path), stem
    assert bad_path.read_text() != fixed_path.read_text(), stem
    for case in CASES:
        if case.file == stem:
            assert _kernel_names(bad_path) == [case.kernel], stem


def test_table_covers_every_fault_kind_and_memory():
    kinds = {c.kind for c in CASES}
    assert kinds == {"out_of_bounds", "threadgroup_race", "device_race", "barrier_divergence"}
    oob = {(c.where.split("`")[0].strip(), c.element) for c in CASES if c.kind == "out_of_bounds"}
    for where in ("[[buffer(0)]]", "[[threadgroup(0)]]", "threadgroup variable"):
        assert (where, -1) in oob, f"no index -1 case on {where}"
        assert any(w == where and e is not None and e > 0 for w, e in oob), \
            f"no index n case on {where}"
