"""The matmul ladder (``shaders/matmul_*.metal``) through ``mm`` / ``addmm`` on the emulator.

Every kernel runs sanitized (tests/conftest.py): bounds, races and uninitialised
threadgroup reads fail the test even when the numbers come out right. Shapes are small and
odd (1, 7, 33, 65...) so every rung meets partial edge tiles.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch

import torch_sparse_metal as tsm
from torch_sparse_metal.emulator import instrumented, load_shader_file, record
from torch_sparse_metal.ops import matmul as mmops
from torch_sparse_metal.reference.matmul import addmm_reference

RUNGS = mmops.KERNELS
PADDED_RUNGS = ("tiled", "register", "simdgroup")  # the ones with threadgroup tiles
# Tolerances by dtype: float32 accumulation everywhere, rounding of the output (and the
# inputs' own precision) for half and bfloat.
TOL = {torch.float32: dict(rtol=1e-5, atol=1e-5), torch.float64: dict(rtol=1e-12, atol=1e-12),
       torch.float16: dict(rtol=2e-3, atol=2e-3), torch.bfloat16: dict(rtol=1.6e-2, atol=1.6e-2)}


@pytest.fixture(autouse=True)
def emulator():
    with tsm.use_backend("emulator"):
        yield


def _matrix(rows, cols, transposed, dtype=torch.float32, seed=0):
    """A ``rows x cols`` matrix, as a transposed view of a ``cols x rows`` one if asked."""
    g = torch.Generator().manual_seed(seed)
    if transposed:
        return torch.randn(cols, rows, generator=g).to(dtype).t()
    return torch.randn(rows, cols, generator=g).to(dtype)


def _variant(ta, tb):
    return ("t" if ta else "n") + ("t" if tb else "n")


# --------------------------------------------------------------------------------------
# Names


def test_every_kernel_name_the_host_asks_for_exists():
    names = set(mmops.kernel_names("emulator"))
    assert len(names) == len(RUNGS) * 4 * 4  # rungs x variants x {float, half, bfloat, double}
    found = set()
    for rung in mmops.RUNGS.values():
        found |= set(load_shader_file(rung.shader).kernel_names)
    assert names <= found
    assert mmops.matmul_kernel_name("simdgroup", False, True, torch.float16) == \
        "matmul_simdgroup_nt_half"


# --------------------------------------------------------------------------------------
# Every rung, every transpose variant, odd shapes


@pytest.mark.parametrize("rung", RUNGS)
@pytest.mark.parametrize("m, n, k", [(1, 1, 1), (7, 33, 65), (65, 7, 33), (33, 65, 1)])
@pytest.mark.parametrize("ta, tb", [(0, 0), (0, 1), (1, 0), (1, 1)])
def test_rung_against_numpy_and_torch(rung, m, n, k, ta, tb):
    a, b = _matrix(m, k, ta, seed=m + k), _matrix(k, n, tb, seed=n + 2 * k)
    with record() as launches:
        c = tsm.mm(a, b, kernel=rung)
    # The transposed views were read in place, by the variant matching their strides (a
    # matrix with a dimension of 1 is both layouts at once: the host reads it row-major).
    ta, tb = ta and min(m, k) > 1, tb and min(k, n) > 1
    assert [l.kernel for l in launches] == [f"matmul_{rung}_{_variant(ta, tb)}_float"]
    np.testing.assert_allclose(c.numpy(), a.double().numpy() @ b.double().numpy(),
                               rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(c, torch.mm(a, b), **TOL[torch.float32])


@pytest.mark.parametrize("rung", RUNGS)
def test_sliced_operands_are_read_in_place(rung):
    # Row-major with a leading dimension larger than the row, at a storage offset; and a
    # column slice of a transposed matrix.
    big_a = torch.randn(40, 80)
    a = big_a[3:36, 5:70]            # 33 x 65, ld 80, offset 245
    big_b = torch.randn(50, 70)
    b = big_b[2:47, 1:66].t()        # 65 x 45, transposed, ld 70
    assert mmops.as_operand("t", "a", a).ld == 80 and not mmops.as_operand("t", "a", a).transposed
    assert mmops.as_operand("t", "b", b).transposed
    with record() as launches:
        c = tsm.mm(a, b, kernel=rung)
    assert launches[0].kernel == f"matmul_{rung}_nt_float"
    torch.testing.assert_close(c, torch.mm(a, b), **TOL[torch.float32])


def test_operands_that_are_neither_layout_are_copied():
    a = torch.randn(8, 8)[::2, ::2]  # both strides > 1
    op = mmops.as_operand("t", "a", a)
    assert not op.transposed and op.ld == 4 and op.flat.numel() == 16
    torch.testing.assert_close(tsm.mm(a, torch.eye(4), kernel="naive"), a)


@pytest.mark.parametrize("rung", RUNGS)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_and_bfloat_inputs_accumulate_in_float(rung, dtype):
    m, n, k = 33, 20, 70
    a, b = _matrix(m, k, False, dtype, 1), _matrix(k, n, True, dtype, 2)
    with record() as launches:
        c = tsm.mm(a, b, kernel=rung)
    assert c.dtype == dtype
    assert launches[0].kernel.endswith("_half" if dtype == torch.float16 else "_bfloat")
    # Float accumulation, one rounding at the end: as close as torch's float product.
    expected = (a.float() @ b.float()).to(dtype)
    torch.testing.assert_close(c, expected, **TOL[dtype])


# --------------------------------------------------------------------------------------
# addmm: alpha, beta, bias broadcasting, fused activation


BIAS_SHAPES = {"row": lambda m, n: torch.randn(n), "row2d": lambda m, n: torch.randn(1, n),
               "column": lambda m, n: torch.randn(m, 1), "full": lambda m, n: torch.randn(m, n),
               "full_t": lambda m, n: torch.randn(n, m).t(), "scalar": lambda m, n: torch.tensor(0.7)}


@pytest.mark.parametrize("rung", RUNGS)
@pytest.mark.parametrize("activation", [None, "relu", "gelu", "tanh"])
def test_addmm_epilogue(rung, activation):
    m, n, k = 33, 17, 9
    a, b = _matrix(m, k, False, seed=3), _matrix(k, n, True, seed=4)
    for name, make in BIAS_SHAPES.items():
        bias = make(m, n)
        out = tsm.addmm(bias, a, b, alpha=0.5, beta=-1.5, activation=activation, kernel=rung)
        expected = addmm_reference(bias, a, b, alpha=0.5, beta=-1.5, activation=activation)
        torch.testing.assert_close(out, expected, **TOL[torch.float32], msg=name)


def test_addmm_matches_torch_addmm_and_bias_is_read_in_place():
    a, b, bias = torch.randn(9, 5), torch.randn(5, 7), torch.randn(7)
    with record() as launches:
        out = tsm.addmm(bias, a, b, beta=2.0, alpha=3.0, kernel="register")
    assert len(launches) == 1  # bias fused, not a second pass
    torch.testing.assert_close(out, torch.addmm(bias, a, b, beta=2.0, alpha=3.0))
    flat, rs, cs = mmops.bias_operand("t", bias, 9, 7)
    assert (rs, cs) == (0, 1) and flat.data_ptr() == bias.data_ptr()


def test_beta_zero_ignores_the_bias_like_torch():
    a, b = torch.randn(4, 3), torch.randn(3, 5)
    bias = torch.full((5,), float("nan"))
    out = tsm.addmm(bias, a, b, beta=0.0, kernel="tiled")
    torch.testing.assert_close(out, torch.addmm(bias, a, b, beta=0.0))


# --------------------------------------------------------------------------------------
# Autograd: gradcheck in float64 through the kernels (backward = same kernels, transposed)


@pytest.mark.parametrize("rung", ["naive", "tiled", "register", "simdgroup", "shuffle"])
@pytest.mark.parametrize("activation", [None, "gelu"])
def test_gradcheck_float64_through_the_kernels(rung, activation):
    g = torch.Generator().manual_seed(5)
    a = torch.randn(5, 3, dtype=torch.float64, generator=g, requires_grad=True)
    b = torch.randn(4, 3, dtype=torch.float64, generator=g).t().requires_grad_(False)
    b = b.detach().requires_grad_(True)  # a transposed leaf: backward reads it as such
    bias = torch.randn(4, dtype=torch.float64, generator=g, requires_grad=True)

    def f(a, b, bias):
        return tsm.addmm(bias, a, b, alpha=0.7, beta=1.3, activation=activation, kernel=rung)

    with record() as launches:
        assert torch.autograd.gradcheck(f, (a, b, bias), eps=1e-6, atol=1e-8)
    kernels = {l.kernel for l in launches}
    assert kernels and all(name.startswith(f"matmul_{rung}_") and name.endswith("_double")
                           for name in kernels)
    # forward (nt), grad_a = g @ b^T (b^T of a transposed view: nn), grad_b = a^T @ g (tn)
    assert {f"matmul_{rung}_nt_double", f"matmul_{rung}_nn_double",
            f"matmul_{rung}_tn_double"} <= kernels


@pytest.mark.parametrize("activation", [None, "relu", "tanh", "gelu"])
def test_simdgroup_gradients_float32(activation):
    # The float32 kernel is the one a Mac runs: its gradients against torch's autograd on
    # the same inputs (gradcheck above covers the float64 instantiation).
    g = torch.Generator().manual_seed(6)
    a0, b0, bias0 = (torch.randn(19, 11, generator=g), torch.randn(11, 70, generator=g),
                     torch.randn(70, generator=g))
    grads = []
    for fn in (lambda a, b, bias: tsm.addmm(bias, a, b, alpha=0.5, activation=activation,
                                            kernel="simdgroup"),
               lambda a, b, bias: addmm_reference(bias, a, b, alpha=0.5, activation=activation)):
        a, b, bias = (t.clone().requires_grad_(True) for t in (a0, b0, bias0))
        out = fn(a, b, bias)
        out.backward(torch.cos(torch.arange(out.numel(), dtype=torch.float32)).view_as(out))
        grads.append((out.detach(), a.grad, b.grad, bias.grad))
    for got, want in zip(*grads):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_backward_launches_only_what_is_needed():
    a = torch.randn(6, 4, requires_grad=True)
    b = torch.randn(4, 5)  # no grad
    out = tsm.mm(a, b, kernel="register")
    with record() as launches:
        out.sum().backward()
    assert [l.kernel for l in launches] == ["matmul_register_nt_float"]  # g @ b^T only
    torch.testing.assert_close(a.grad, torch.ones(6, 5) @ b.t())


# --------------------------------------------------------------------------------------
# Counters: padded tiles are conflict-free, and the traffic each rung saves


@pytest.mark.parametrize("rung", PADDED_RUNGS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_padded_kernels_have_no_bank_conflicts(rung, dtype):
    m, n, k = 70, 65, 40  # partial tiles in every dimension
    for ta in (0, 1):
        for tb in (0, 1):
            a, b = _matrix(m, k, ta, dtype, 7), _matrix(k, n, tb, dtype, 8)
            with instrumented(), record() as launches:
                tsm.mm(a, b, kernel=rung)
            c = launches[0].counters
            assert c["threadgroup_accesses"] > 0
            assert c["bank_conflicts"] == 0, (rung, dtype, _variant(ta, tb), c)


def _counters(rung, size):
    a, b = _matrix(size, size, False, seed=9), _matrix(size, size, False, seed=10)
    with instrumented(), record() as launches:
        c = tsm.mm(a, b, kernel=rung)
    torch.testing.assert_close(c, a @ b, rtol=1e-4, atol=1e-4)
    return launches[0].counters


def _traffic(c):
    # The emulator counts a store of the value already in memory as a read (its documented
    # limit), and torch may hand the output a recycled buffer holding the same product:
    # compare reads + writes, which is exact.
    return c["device_bytes_read"] + c["device_bytes_written"]


def test_simdgroup_traffic_is_at_most_an_eighth_of_naive():
    # The issue asks for the ratio at 512^3; the emulator's sanitized naive kernel would
    # check 2 * 512^3 = 268M loads there (minutes). Device reads are set by tile reuse
    # alone: naive reads 2 * M * N * K elements (both operands per FMA); a BM x BN tile
    # reads each A row once per column tile and each B column once per row tile,
    # M * N * K * (1 / BN + 1 / BM) elements, whenever the tiles divide the matrix. So the
    # ratio is (1 / BM + 1 / BN) / 2 = 1/64 at every size that 64 divides: measured at
    # 128^3 (4 tiles, so cross-tile reuse is exercised), it is the 512^3 ratio.
    size, s = 128, 4
    naive, simd = _counters("naive", size), _counters("simdgroup", size)
    written = size * size * s
    assert _traffic(naive) == 2 * size ** 3 * s + written
    assert _traffic(simd) == size ** 3 * s * (1 / 64 + 1 / 64) + written
    assert naive["fmas"] == simd["fmas"] == size ** 3
    assert _traffic(simd) <= _traffic(naive) / 8
    # At 512^3 the same formulas give 512^3 * 4 / 32 + 1 MiB for simdgroup against
    # 2 * 512^3 * 4 + 1 MiB for naive: a ratio of 0.016, far below the 1/8 asked for.


def test_counters_follow_the_ladder():
    size, s = 64, 4
    rows = {r: _counters(r, size) for r in RUNGS}
    written = size * size * s
    reads = {r: _traffic(c) - written for r, c in rows.items()}
    assert reads["naive"] == 2 * size ** 3 * s
    assert reads["tiled"] == size ** 3 * s * 2 / 32       # 32 x 32 tiles
    assert reads["register"] == size ** 3 * s * 2 / 64    # 64 x 64 tiles
    assert reads["simdgroup"] == size ** 3 * s * 2 / 64
    assert reads["shuffle"] == size ** 3 * s * 2 / 32     # 32 x 32 per SIMD-group
    for c in rows.values():
        assert c["fmas"] == size ** 3
    assert rows["naive"]["barriers"] == rows["shuffle"]["barriers"] == 0
    assert rows["shuffle"]["threadgroup_accesses"] == 0
    assert rows["tiled"]["barriers"] == 2 * 2 * 4        # 2 per K step, 2 steps, 4 groups
    # 2 per K step (BK = 32: 2 steps), 1 before the staged epilogue writes C, 1 group
    assert rows["simdgroup"]["barriers"] == 2 * 2 + 1


# --------------------------------------------------------------------------------------
# Choosing the rung


@pytest.mark.parametrize("shape, dtype, simd, expected", [
    ((8, 8, 8), torch.float32, True, "naive"),            # tiny: all overhead
    ((1, 4096, 4096), torch.float32, True, "naive"),      # matrix-vector
    ((4096, 1, 4096), torch.float16, True, "naive"),
    ((256, 256, 256), torch.float32, True, "simdgroup"),
    ((2048, 512, 64), torch.bfloat16, True, "simdgroup"),
    ((256, 256, 256), torch.float32, False, "shuffle"),   # no simdgroup_matrix
    ((256, 256, 256), torch.float64, True, "register"),   # emulator-only double
])
def test_choose_kernel(shape, dtype, simd, expected):
    assert mmops.choose_kernel(*shape, dtype, supports_simdgroup_matrix=simd) == expected


def test_default_kernel_follows_the_capability_override(monkeypatch):
    a, b = torch.randn(40, 33), torch.randn(33, 50)
    monkeypatch.delenv("TSM_FORCE_NO_SIMDGROUP_MATRIX", raising=False)
    with record() as launches:
        c1 = tsm.mm(a, b)
    monkeypatch.setenv("TSM_FORCE_NO_SIMDGROUP_MATRIX", "1")
    with record() as launches2:
        c2 = tsm.mm(a, b)
    assert launches[0].kernel == "matmul_simdgroup_nn_float"
    assert launches2[0].kernel == "matmul_shuffle_nn_float"
    with pytest.raises(ValueError, match="simdgroup_matrix"):
        tsm.mm(a, b, kernel="simdgroup")
    torch.testing.assert_close(c1, c2)


def test_metal_capabilities_come_from_the_device_probe(monkeypatch):
    import torch_sparse_metal._metal_backend as mb
    monkeypatch.setattr(mb, "device_capabilities", lambda: {"supports_apple7": False})
    assert mmops.capabilities("metal") == {"supports_simdgroup_matrix": False}


# --------------------------------------------------------------------------------------
# Edges and errors


def test_empty_products():
    assert tsm.mm(torch.randn(0, 3), torch.randn(3, 4)).shape == (0, 4)
    a = torch.randn(5, 0, requires_grad=True)
    out = tsm.addmm(torch.ones(2), a, torch.randn(0, 2), beta=3.0, activation="tanh")
    torch.testing.assert_close(out, torch.full((5, 2), 3.0).tanh())
    out.sum().backward()
    assert a.grad.shape == (5, 0)


def test_reference_backend_is_plain_torch():
    a, b, bias = torch.randn(3, 4), torch.randn(4, 2), torch.randn(2)
    with tsm.use_backend("reference"), record() as launches:
        out = tsm.addmm(bias, a, b, activation="relu")
    assert launches == []
    torch.testing.assert_close(out, torch.relu(torch.addmm(bias, a, b)))


@pytest.mark.parametrize("call, match", [
    (lambda: tsm.mm(torch.randn(3, 4), torch.randn(5, 2)), "a's columns must equal b's rows"),
    (lambda: tsm.mm(torch.randn(3), torch.randn(3, 2)), "must be 2-D"),
    (lambda: tsm.mm(torch.randn(3, 4), torch.randn(4, 2).double()), "dtype"),
    (lambda: tsm.mm(torch.randn(3, 4), torch.randn(4, 2), kernel="fast"), "kernel must be"),
    (lambda: tsm.addmm(torch.randn(3), torch.randn(2, 4), torch.randn(4, 5)), "does not broadcast"),
    (lambda: tsm.addmm(None, torch.randn(2, 4), torch.randn(4, 5), activation="swish"), "activation"),
    (lambda: tsm.mm(torch.zeros(2, 2, dtype=torch.int32), torch.zeros(2, 2, dtype=torch.int32)),
     "floating-point"),
])
def test_bad_input_is_rejected_with_the_op_name(call, match):
    with pytest.raises(ValueError, match=match) as info:
        call()
    assert str(info.value).startswith(("mm:", "addmm:"))


# --------------------------------------------------------------------------------------
# nn.Linear


def test_linear_is_a_drop_in_for_torch_linear():
    torch.manual_seed(0)
    ours = tsm.nn.Linear(20, 7)
    theirs = torch.nn.Linear(20, 7)
    theirs.load_state_dict(ours.state_dict())
    assert isinstance(ours, torch.nn.Linear)
    assert set(ours.state_dict()) == {"weight", "bias"}
    ours2 = tsm.nn.Linear(20, 7, kernel="register")
    ours2.load_state_dict(theirs.state_dict())
    x = torch.randn(3, 5, 20)
    for layer in (ours, ours2):
        with record() as launches:
            y = layer(x)
        assert y.shape == (3, 5, 7) and launches, "the product ran through a kernel"
        assert launches[0].kernel.split("_")[2] == "nt"  # weight.T read in place
        torch.testing.assert_close(y, theirs(x), rtol=1e-5, atol=1e-5)
    y = ours2(x)
    y.square().sum().backward()
    theirs(x).square().sum().backward()
    torch.testing.assert_close(ours2.weight.grad, theirs.weight.grad, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(ours2.bias.grad, theirs.bias.grad, rtol=1e-4, atol=1e-4)


def test_linear_without_bias_and_1d_input():
    layer = tsm.nn.Linear(6, 3, bias=False, dtype=torch.float64)
    x = torch.randn(6, dtype=torch.float64)
    torch.testing.assert_close(layer(x), layer.weight @ x)
    with pytest.raises(ValueError, match="kernel must be"):
        tsm.nn.Linear(2, 2, kernel="nope")
    assert "kernel='tiled'" in repr(tsm.nn.Linear(2, 2, kernel="tiled"))


# --------------------------------------------------------------------------------------
# Review fixes


@pytest.mark.parametrize("rung", list(RUNGS))
@pytest.mark.parametrize("bias_shape", [None, (7,)])
def test_float64_addmm_keeps_alpha_and_beta_in_double(rung, bias_shape):
    # alpha and beta reach the kernel in the accumulator type: 1/3 and 0.7 in float32
    # would be off by ~1e-8 relative, far past float64's tolerance.
    g = torch.Generator().manual_seed(11)
    a = torch.randn(9, 5, dtype=torch.float64, generator=g)
    b = torch.randn(5, 7, dtype=torch.float64, generator=g)
    bias = None if bias_shape is None else torch.randn(bias_shape, dtype=torch.float64,
                                                       generator=g)
    got = tsm.addmm(bias, a, b, alpha=1 / 3, beta=0.7, kernel=rung)
    want = (a @ b) / 3 if bias is None else torch.addmm(bias, a, b, alpha=1 / 3, beta=0.7)
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("rung", ["register", None])
@pytest.mark.parametrize("which", ["all", "bias_only"])
@pytest.mark.parametrize("bias_shape", [(5,), (1, 5), (4, 1), ()])
def test_beta_zero_bias_still_gets_a_zero_gradient(rung, which, bias_shape):
    g = torch.Generator().manual_seed(12)
    a0, b0 = torch.randn(4, 3, generator=g), torch.randn(3, 5, generator=g)
    bias0 = torch.randn(bias_shape, generator=g)
    grads = []
    for fn in (lambda bias, a, b: tsm.addmm(bias, a, b, beta=0.0, kernel=rung),
               lambda bias, a, b: torch.addmm(bias, a, b, beta=0.0)):
        bias = bias0.clone().requires_grad_(True)
        a, b = (t.clone().requires_grad_(which == "all") for t in (a0, b0))
        fn(bias, a, b).sum().backward()
        grads.append((bias.grad, a.grad, b.grad))
    (got_bias, got_a, got_b), (want_bias, want_a, want_b) = grads
    assert got_bias is not None and got_bias.shape == bias0.shape
    torch.testing.assert_close(got_bias, want_bias)
    torch.testing.assert_close(got_bias, torch.zeros(bias_shape))
    if which == "all":
        torch.testing.assert_close(got_a, want_a)
        torch.testing.assert_close(got_b, want_b)


def test_beta_zero_bias_gradient_on_the_reference_backend():
    bias = torch.randn(5, requires_grad=True)
    with tsm.use_backend("reference"):
        tsm.addmm(bias, torch.randn(4, 3), torch.randn(3, 5), beta=0.0).sum().backward()
    torch.testing.assert_close(bias.grad, torch.zeros(5))


@pytest.mark.filterwarnings("ignore:Initializing zero-element tensors")
@pytest.mark.parametrize("batch", [(3,), (2, 4), ()])
def test_linear_with_zero_in_features_matches_torch(batch):
    ours = tsm.nn.Linear(0, 4)
    theirs = torch.nn.Linear(0, 4)
    theirs.load_state_dict(ours.state_dict())
    x = torch.randn(*batch, 0)
    y = ours(x)
    assert y.shape == (*batch, 4)
    torch.testing.assert_close(y, theirs(x))
    with pytest.raises(ValueError, match="^Linear: input has 3 features"):
        ours(torch.randn(2, 3))
    with pytest.raises(ValueError, match="^Linear: input must have at least 1 dimension"):
        ours(torch.tensor(1.0))


@pytest.mark.parametrize("bias_shape, m, n, k", [
    ((0,), 3, 0, 4), ((1, 0), 3, 0, 4), ((3, 0), 3, 0, 4), ((3, 1), 3, 0, 4), ((), 3, 0, 4),
    ((5,), 0, 5, 4), ((0, 5), 0, 5, 4), ((0, 1), 0, 5, 4), ((0,), 0, 0, 2)])
@pytest.mark.parametrize("backend", ["emulator", "reference"])
def test_addmm_with_an_empty_output_and_a_bias_matches_torch(bias_shape, m, n, k, backend):
    """An empty output with a bias that broadcasts to it (even a bias with no elements):
    the empty result and zero gradients of torch.addmm, not an internal error."""
    ours = [torch.randn(s, dtype=torch.float64, requires_grad=True)
            for s in (bias_shape, (m, k), (k, n))]
    theirs = [t.detach().clone().requires_grad_() for t in ours]
    with tsm.use_backend(backend):
        out = tsm.addmm(*ours, beta=2.0, activation="relu")
    expected = torch.relu(torch.addmm(*theirs, beta=2.0))
    assert out.shape == expected.shape == (m, n)
    out.sum().backward()
    expected.sum().backward()
    for a, b in zip(ours, theirs):
        torch.testing.assert_close(a.grad, b.grad)


def test_empty_output_bias_that_does_not_broadcast_is_still_rejected():
    with pytest.raises(ValueError, match=r"^addmm: bias of shape \(2,\) does not broadcast to "
                                         r"the output shape \(3, 0\)$"):
        tsm.addmm(torch.randn(2), torch.randn(3, 4), torch.randn(4, 0))


@pytest.mark.filterwarnings("ignore:Initializing zero-element tensors")
@pytest.mark.parametrize("batch", [(3,), (2, 4), (0,)])
def test_linear_with_zero_out_features_matches_torch(batch):
    ours = tsm.nn.Linear(4, 0)
    theirs = torch.nn.Linear(4, 0)
    theirs.load_state_dict(ours.state_dict())
    x = torch.randn(*batch, 4, requires_grad=True)
    y = ours(x)
    assert y.shape == theirs(x).shape == (*batch, 0)
    y.sum().backward()
    assert ours.bias.grad.shape == (0,)
    torch.testing.assert_close(x.grad, torch.zeros_like(x))


@pytest.mark.parametrize("swap", ["a", "b"])
def test_an_operand_swapped_through_data_before_backward_is_an_error(swap):
    """``t.data = other`` bumps no version counter; the backward kernel used to read the
    new, smaller operand with the forward's sizes."""
    a, b = (torch.randn(64, 64, requires_grad=True) for _ in range(2))
    y = tsm.mm(a, b)
    dict(a=a, b=b)[swap].data = torch.randn(2, 2)
    with pytest.raises(ValueError, match=r"^mm: a is .* and b is .*; a's columns must equal b's "
                                         r"rows and the dtypes match \(was a tensor saved for "
                                         r"backward replaced through \.data\?\)$"):
        y.sum().backward()


def test_backward_and_operand_errors_name_the_public_op():
    # Errors raised inside launch_matmul (here: an operand too large for 32-bit offsets,
    # faked by lowering the limit) carry the op the user called, also from backward.
    import torch_sparse_metal._validation as V
    a = torch.randn(8, 8, requires_grad=True)
    b = torch.randn(8, 8)
    out = tsm.addmm(None, a, b, kernel="naive")
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(V, "UINT32_MAX", 10)
        with pytest.raises(ValueError, match="^addmm: "):
            out.sum().backward()
        with pytest.raises(ValueError, match="^mm: "):
            tsm.mm(torch.randn(2, 8), torch.randn(8, 2), kernel="naive")  # a: 16 elements


def test_unsupported_dtype_uses_the_shared_check_with_the_matmul_table():
    import torch_sparse_metal._validation as V
    with pytest.raises(ValueError, match="^mm: dtype torch.float64 is not supported by "
                                         "backend 'metal'.*Metal has no double"):
        V.check_kernel_dtype("mm", torch.float64, "metal", table=mmops.MATMUL_DTYPES)
    V.check_kernel_dtype("mm", torch.bfloat16, "emulator", table=mmops.MATMUL_DTYPES)
    V.check_kernel_dtype("mm", torch.float16, "metal", table=mmops.MATMUL_DTYPES)
    with pytest.raises(ValueError, match="not supported"):  # the default table is unchanged
        V.check_kernel_dtype("mm", torch.float16, "metal")
