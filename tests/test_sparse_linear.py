"""sparse_linear: the kernels (on the emulator) against the plain-torch reference and scipy.

Oracles: ``torch_sparse_metal.reference.sparse_linear_reference`` (autograd through plain
torch ops) and scipy.sparse CSR products, for the forward and every gradient.
"""
from __future__ import annotations

import math
import sys

import numpy as np
import pytest
import scipy.sparse
import torch
from hypothesis import given, settings, strategies as st

import torch_sparse_metal as tsm
from torch_sparse_metal import _validation
from torch_sparse_metal.ops import CSRPattern, sparse_linear_pattern
from torch_sparse_metal.reference import csr_row_ids, sparse_linear_reference

# The ops package re-exports the function under the module's name; fetch the module.
sl_module = sys.modules["torch_sparse_metal.ops.sparse_linear"]

# Tolerances are data: float64 results differ from the oracles only by summation order
# (fma in the kernels, atomics in any order); float32 by that times float32's epsilon.
TOL = {torch.float64: dict(rtol=1e-12, atol=1e-12),
       torch.float32: dict(rtol=1e-5, atol=1e-5)}
# gradcheck compares two backward runs; the grad_values / grad_bias atomics may add in a
# different order each run, so the runs can differ by float64 round-off.
NONDET_TOL = 1e-12


@pytest.fixture
def emulator():
    with tsm.use_backend("emulator"):
        yield


# ---------------------------------------------------------------------------------------
# Problems


def make_pattern(rows, index_dtype=torch.int32):
    """``rows``: a list of column lists, one per target neuron (may be empty or repeat)."""
    counts = torch.tensor([len(r) for r in rows], dtype=torch.long)
    indptr = torch.cat([torch.zeros(1, dtype=torch.long), counts.cumsum(0)])
    indices = torch.tensor([c for r in rows for c in r], dtype=torch.long)
    return indptr.to(index_dtype), indices.to(index_dtype)


def make_tensors(lead, in_f, indptr, indices, has_bias, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    out_f = indptr.shape[0] - 1
    x = torch.randn(*lead, in_f, generator=g, dtype=dtype)
    values = torch.randn(indices.shape[0], generator=g, dtype=dtype)
    bias = torch.randn(out_f, generator=g, dtype=dtype) if has_bias else None
    grad = torch.randn(*lead, out_f, generator=g, dtype=dtype)
    return x, values, bias, grad


@st.composite
def problems(draw):
    in_f = draw(st.integers(0, 6))
    out_f = draw(st.sampled_from([0, 1, 1, 2, 3, 5]))
    # Rows are drawn independently: empty rows, unsorted and repeated columns all occur,
    # and with in_features = 0 or all rows empty, nnz = 0.
    row = st.lists(st.integers(0, in_f - 1), max_size=4) if in_f else st.just([])
    rows = [draw(row) for _ in range(out_f)]
    lead = tuple(draw(st.lists(st.sampled_from([0, 1, 2, 3]), max_size=2)))
    return dict(rows=rows, in_f=in_f, lead=lead, has_bias=draw(st.booleans()),
                index_dtype=draw(st.sampled_from([torch.int32, torch.int64])),
                seed=draw(st.integers(0, 2**16)))


def leaves(x, values, bias):
    return [t.clone().requires_grad_() if t is not None else None for t in (x, values, bias)]


def grads_of(y, inputs, grad):
    wanted = [t for t in inputs if t is not None]
    got = iter(torch.autograd.grad(y, wanted, grad, allow_unused=True))
    return [next(got) if t is not None else None for t in inputs]


def scipy_oracle(x, indptr, indices, values, bias, grad):
    """Forward and gradients from scipy.sparse / numpy, in float64."""
    in_f, out_f = x.shape[-1], indptr.shape[0] - 1
    batch = math.prod(x.shape[:-1])
    x2 = x.reshape(batch, in_f).double().numpy()
    g2 = grad.reshape(batch, out_f).double().numpy()
    v = values.double().numpy()
    ip, ix = indptr.long().numpy(), indices.long().numpy()
    W = scipy.sparse.csr_matrix((v, ix, ip), shape=(out_f, in_f))
    y = np.asarray(W @ x2.T).T
    if bias is not None:
        y = y + bias.double().numpy()
    grad_x = np.asarray(W.T @ g2.T).T
    rows = np.repeat(np.arange(out_f), np.diff(ip))
    grad_v = (g2[:, rows] * x2[:, ix]).sum(0)
    grad_b = g2.sum(0) if bias is not None else None
    as_t = lambda a, like: torch.from_numpy(np.ascontiguousarray(a)).reshape(like.shape)
    return (as_t(y, grad), as_t(grad_x, x), as_t(grad_v, values),
            None if bias is None else as_t(grad_b, bias))


def assert_close(a, b, dtype):
    if a is None or b is None:
        assert a is None and b is None
        return
    torch.testing.assert_close(a.double(), b.double(), **TOL[dtype])


def check_against_oracles(p, dtype):
    indptr, indices = make_pattern(p["rows"], p["index_dtype"])
    x, values, bias, grad = make_tensors(p["lead"], p["in_f"], indptr, indices,
                                         p["has_bias"], dtype, p["seed"])
    inputs = leaves(x, values, bias)
    y = tsm.sparse_linear(inputs[0], indptr, indices, inputs[1], inputs[2])
    got = [y.detach()] + grads_of(y, inputs, grad)

    ref_inputs = leaves(x, values, bias)
    y_ref = sparse_linear_reference(ref_inputs[0], indptr, indices, ref_inputs[1], ref_inputs[2])
    expected = [y_ref.detach()] + grads_of(y_ref, ref_inputs, grad)
    for a, b in zip(got, expected):
        assert_close(a, b, dtype)
    for a, b in zip(got, scipy_oracle(x, indptr, indices, values, bias, grad)):
        assert_close(a, b, dtype)
    assert y.shape == (*p["lead"], len(p["rows"]))
    assert y.dtype == dtype


# ---------------------------------------------------------------------------------------
# Forward and gradients against the oracles


@settings(max_examples=60, deadline=None)
@given(p=problems())
def test_matches_reference_and_scipy_float64(p):
    with tsm.use_backend("emulator"):
        check_against_oracles(p, torch.float64)


@settings(max_examples=25, deadline=None)
@given(p=problems())
def test_matches_reference_and_scipy_float32(p):
    with tsm.use_backend("emulator"):
        check_against_oracles(p, torch.float32)


@pytest.mark.parametrize("case", [
    dict(rows=[[0, 2], [], [1, 1, 3], [3]], in_f=4, lead=(5,)),          # empty row, repeat
    dict(rows=[[], [], []], in_f=4, lead=(2,)),                            # nnz = 0
    dict(rows=[[0, 1]], in_f=3, lead=(0,)),                                # batch 0
    dict(rows=[[2, 0, 1]], in_f=3, lead=(4,)),                             # out_features 1
    dict(rows=[], in_f=3, lead=(2,)),                                      # out_features 0
    dict(rows=[[0], [1, 2]], in_f=3, lead=(2, 3)),                         # (*, in) input
    dict(rows=[[0], [1, 2]], in_f=3, lead=()),                             # 1-D input
    dict(rows=[[j for j in range(40) if (i + j) % 3] for i in range(70)], in_f=40,
         lead=(300,)),                                                     # many threadgroups
])
@pytest.mark.parametrize("has_bias", [True, False])
def test_named_cases(emulator, case, has_bias):
    check_against_oracles(dict(case, has_bias=has_bias, index_dtype=torch.int32, seed=1),
                          torch.float64)


@pytest.mark.parametrize("needs", [(1, 0, 0), (0, 1, 0), (0, 0, 1), (1, 1, 0), (0, 1, 1),
                                   (1, 0, 1), (1, 1, 1)])
def test_only_needed_gradients(emulator, needs):
    indptr, indices = make_pattern([[0, 2], [], [1, 2, 2]])
    x, values, bias, grad = make_tensors((4,), 3, indptr, indices, True, torch.float64, 3)
    inputs = [t.clone().requires_grad_(bool(n)) for t, n in zip((x, values, bias), needs)]
    with tsm.record() as launches:
        y = tsm.sparse_linear(inputs[0], indptr, indices, inputs[1], inputs[2])
        y.backward(grad)
    assert [l.kernel for l in launches] == ["sparse_linear_forward_batch_lanes_double",
                                            "sparse_linear_backward_batch_lanes_double"]
    ref_inputs = leaves(x, values, bias)
    sparse_linear_reference(ref_inputs[0], indptr, indices, ref_inputs[1],
                            ref_inputs[2]).backward(grad)
    for t, r, n in zip(inputs, ref_inputs, needs):
        if n:
            assert_close(t.grad, r.grad, torch.float64)
        else:
            assert t.grad is None


# ---------------------------------------------------------------------------------------
# gradcheck through the kernels


@pytest.mark.parametrize("rows,lead", [
    ([[0, 2], [], [1, 1, 3], [3, 0, 2]], (3,)),
    ([[1], [0, 1]], (2, 2)),
])
def test_gradcheck_float64(emulator, rows, lead):
    indptr, indices = make_pattern(rows)
    x, values, bias, _ = make_tensors(lead, 4, indptr, indices, True, torch.float64, 7)
    inputs = tuple(t.requires_grad_() for t in (x, values, bias))
    assert torch.autograd.gradcheck(
        lambda x, v, b: tsm.sparse_linear(x, indptr, indices, v, b), inputs,
        nondet_tol=NONDET_TOL)


# ---------------------------------------------------------------------------------------
# Dispatches


def test_one_dispatch_forward_and_backward(emulator):
    rows = [[0, 3], [1], [], [2, 3, 4], [4], [0]]  # out_features 6 > in_features 5
    indptr, indices = make_pattern(rows)
    x, values, bias, grad = make_tensors((7,), 5, indptr, indices, True, torch.float32, 0)
    x, values, bias = leaves(x, values, bias)
    with tsm.record() as forward:
        y = tsm.sparse_linear(x, indptr, indices, values, bias)
    with tsm.record() as backward:
        y.backward(grad)
    # A batch of 7 runs the batch-lanes kernels: a SIMD-group of 32 per row (per slot).
    assert [(l.kernel, l.threads, l.group_size, l.backend) for l in forward] == [
        ("sparse_linear_forward_batch_lanes_float", (6 * 32, 1, 1), (256, 1, 1), "emulator")]
    # grad_bias needs a slot per target neuron: the grid is max(in, out) SIMD-groups.
    assert [(l.kernel, l.threads, l.group_size, l.backend) for l in backward] == [
        ("sparse_linear_backward_batch_lanes_float", (6 * 32, 1, 1), (256, 1, 1), "emulator")]


def test_backward_without_bias_grid_covers_sources(emulator):
    indptr, indices = make_pattern([[0, 3], [1, 4]])
    x, values, _, grad = make_tensors((3,), 5, indptr, indices, False, torch.float32, 0)
    x, values, _ = leaves(x, values, None)
    y = tsm.sparse_linear(x, indptr, indices, values)
    with tsm.record() as backward:
        y.backward(grad)
    assert [l.threads for l in backward] == [(5 * 32, 1, 1)]  # a SIMD-group per source


@pytest.mark.parametrize("rows,in_f,batch", [
    ([[0], [1]], 2, 0),     # batch 0
    ([[], []], 2, 3),       # nnz 0
    ([], 2, 3),             # out_features 0
    ([[], []], 0, 3),       # in_features 0
])
def test_empty_problems_launch_nothing(emulator, rows, in_f, batch):
    indptr, indices = make_pattern(rows)
    x, values, bias, grad = make_tensors((batch,), in_f, indptr, indices, True,
                                         torch.float32, 0)
    x, values, bias = leaves(x, values, bias)
    with tsm.record() as launches:
        y = tsm.sparse_linear(x, indptr, indices, values, bias)
        y.backward(grad)
    assert launches == []
    assert y.shape == (batch, len(rows))
    torch.testing.assert_close(y.detach(), bias.detach().expand(batch, -1))
    torch.testing.assert_close(bias.grad, grad.sum(0))
    torch.testing.assert_close(x.grad, torch.zeros_like(x))
    torch.testing.assert_close(values.grad, torch.zeros_like(values))


def test_backward_uses_the_forward_backend():
    indptr, indices = make_pattern([[0, 1], [1]])
    x, values, bias, grad = make_tensors((1,), 2, indptr, indices, True, torch.float64, 0)
    x, values, bias = leaves(x, values, bias)
    with tsm.use_backend("emulator"):
        y = tsm.sparse_linear(x, indptr, indices, values, bias)
    with tsm.use_backend("reference"), tsm.record() as launches:
        y.backward(grad)
    assert [l.kernel for l in launches] == ["sparse_linear_backward_double"]


def test_reference_backend_runs_no_kernel():
    indptr, indices = make_pattern([[0, 1], [1]])
    x, values, bias, _ = make_tensors((2,), 2, indptr, indices, True, torch.float16, 0)
    with tsm.use_backend("reference"), tsm.record() as launches:
        y = tsm.sparse_linear(x, indptr, indices, values, bias)  # any floating dtype
    assert launches == []
    expected = sparse_linear_reference(x.float(), indptr, indices, values.float(), bias.float())
    torch.testing.assert_close(y.float(), expected, rtol=1e-2, atol=1e-2)


def test_non_contiguous_input(emulator):
    indptr, indices = make_pattern([[0, 2], [1], [2, 0]])
    x = torch.randn(3, 6, dtype=torch.float64).t()  # (6, 3), strides (1, 6)
    values = torch.randn(5, dtype=torch.float64)
    assert not x.is_contiguous()
    y = tsm.sparse_linear(x, indptr, indices, values)
    torch.testing.assert_close(y, sparse_linear_reference(x.contiguous(), indptr, indices,
                                                          values))


# ---------------------------------------------------------------------------------------
# The pattern and its by-source CSR


def test_by_source_matches_scipy_csc():
    rows = [[3, 0], [], [1, 3, 3], [0, 2]]
    indptr, indices = make_pattern(rows)
    pattern = CSRPattern(indptr, indices, 5)
    src = pattern.by_source()
    assert all(t.dtype == torch.int32 for t in src)
    edge_ids = np.arange(indices.shape[0], dtype=np.float64) + 1  # edge id + 1 as the value
    csc = scipy.sparse.csr_matrix((edge_ids, indices.numpy(), indptr.numpy()),
                                  shape=(4, 5)).tocsc()
    np.testing.assert_array_equal(src.indptr.numpy(), csc.indptr)
    # Within a source, edges keep target-row order (stable sort).
    np.testing.assert_array_equal(src.rows.numpy(), csc.indices)
    np.testing.assert_array_equal(src.perm.numpy() + 1, csc.data.astype(np.int64))
    np.testing.assert_array_equal(src.rows.long().numpy(),
                                  csr_row_ids(indptr)[src.perm.long()].numpy())
    assert pattern.by_source() is src  # built once


def test_pattern_object_is_reused(emulator):
    indptr, indices = make_pattern([[0, 1], [1]])
    pattern = CSRPattern(indptr, indices, 2)
    values = torch.randn(3, requires_grad=True)
    for _ in range(2):
        sparse_linear_pattern(torch.randn(4, 2), pattern, values).sum().backward()
    src = pattern.by_source()
    sparse_linear_pattern(torch.randn(4, 2), pattern, values).sum().backward()
    assert pattern.by_source() is src
    assert pattern.nnz == 3 and pattern.out_features == 2 and pattern.density == 0.75


def test_int64_pattern_is_converted():
    indptr, indices = make_pattern([[0, 1], [1]], torch.int64)
    pattern = CSRPattern(indptr, indices, 2)
    assert pattern.indptr.dtype == pattern.indices.dtype == torch.int32
    assert indptr.dtype == torch.int64  # the caller's tensors are left alone


# ---------------------------------------------------------------------------------------
# Validation: every error is a ValueError naming the op, raised before any kernel runs


def _good():
    indptr, indices = make_pattern([[0, 2], [], [1]])
    return dict(input=torch.randn(4, 3), indptr=indptr, indices=indices,
                values=torch.randn(3), bias=torch.randn(3))


def _with(**changes):
    args = _good()
    args.update(changes)
    return args


BAD_CALLS = [
    (_with(indptr=torch.tensor([], dtype=torch.int32)), "indptr is empty"),
    (_with(indptr=torch.tensor([1, 2, 2, 3], dtype=torch.int32)), "indptr must start at 0"),
    (_with(indptr=torch.tensor([0, 2, 1, 3], dtype=torch.int32)), "indptr must not decrease"),
    (_with(indptr=torch.tensor([0, 2, 2, 2], dtype=torch.int32)),
     r"indptr must end at nnz = len\(indices\) = 3, got 2"),
    (_with(indptr=torch.tensor([[0, 2, 2, 3]], dtype=torch.int32)), "indptr must be 1-D"),
    (_with(indices=torch.tensor([0, 3, 1], dtype=torch.int32)),
     r"indices must lie in \[0, in_features\) = \[0, 3\), found 3"),
    (_with(indices=torch.tensor([0, -1, 1], dtype=torch.int32)), "found -1"),
    (_with(indices=torch.tensor([0, 2**31, 1], dtype=torch.int64)), "past the int32 range"),
    (_with(indptr=torch.tensor([0, 2, 2, 2**31], dtype=torch.int64)), "past the int32 range"),
    (_with(indices=torch.tensor([0.0, 2.0, 1.0])), "indices must be an int32"),
    (_with(indices=torch.tensor([0, 2, 1], dtype=torch.int16)), "indices must be an int32"),
    (_with(values=torch.randn(4)), r"values has 4 elements but nnz = len\(indices\) is 3"),
    (_with(values=torch.randn(3, 1)), "values must be 1-D"),
    (_with(bias=torch.randn(2)), r"bias has 2 elements but out_features = len\(indptr\) - 1 is 3"),
    (_with(values=torch.randn(3, dtype=torch.float64)),
     "values has dtype torch.float64 but input has dtype torch.float32"),
    (_with(bias=torch.randn(3, dtype=torch.float64)), "bias has dtype torch.float64"),
    (_with(input=torch.ones(4, 3, dtype=torch.int64)), "input must be a floating-point tensor"),
    (_with(values=torch.ones(3, dtype=torch.int64)), "values must be a floating-point tensor"),
    (_with(input=torch.tensor(1.0)), "input must have at least 1 dimension"),
    (_with(values=torch.randn(3, device="meta")), "values is on meta but input is on cpu"),
    (_with(indices=torch.tensor([0, 2, 1], dtype=torch.int32, device="meta")),
     "indices is on meta but input is on cpu"),
    (_with(input=torch.randn(4, 3).to(torch.float8_e5m2),
           values=torch.randn(3).to(torch.float8_e5m2), bias=torch.randn(3).to(torch.float8_e5m2)),
     "dtype torch.float8_e5m2 is not supported by backend 'emulator'; supported: "
     "torch.float32, torch.float16, torch.bfloat16, torch.float64"),
]


@pytest.mark.parametrize("args,match", BAD_CALLS,
                         ids=[m.split(" ")[0] + f"-{i}" for i, (_, m) in enumerate(BAD_CALLS)])
def test_validation_errors(emulator, args, match):
    with tsm.record() as launches:
        with pytest.raises(ValueError, match=r"^sparse_linear: .*" + match):
            tsm.sparse_linear(**args)
    assert launches == []


def test_good_call_passes_validation(emulator):
    # The control for the bad calls above: the same call, unchanged, runs the kernel.
    args = _good()
    with tsm.record() as launches:
        y = tsm.sparse_linear(**args)
    assert [l.kernel for l in launches] == ["sparse_linear_forward_batch_lanes_float"]
    v = args["values"]
    dense = torch.zeros(3, 3)
    dense[0, 0], dense[0, 2], dense[2, 1] = v[0], v[1], v[2]   # rows [[0, 2], [], [1]]
    torch.testing.assert_close(y, args["input"] @ dense.T + args["bias"], **TOL[torch.float32])


def test_pattern_input_width_mismatch(emulator):
    indptr, indices = make_pattern([[0, 2], [1]])
    pattern = CSRPattern(indptr, indices, 3)
    with pytest.raises(ValueError, match="input has 4 features .* but in_features is 3"):
        sparse_linear_pattern(torch.randn(2, 4), pattern, torch.randn(3))


def test_pattern_wrong_indptr_length():
    indptr, indices = make_pattern([[0, 2], [1]])
    with pytest.raises(ValueError, match=r"indptr has 3 elements but out_features \+ 1 is 4"):
        CSRPattern(indptr, indices, 3, out_features=3)


def test_float64_is_emulator_only():
    with pytest.raises(ValueError, match="sparse_linear: dtype torch.float64 is not supported "
                                         "by backend 'metal'.*Metal has no double"):
        _validation.check_kernel_dtype("sparse_linear", torch.float64, "metal")
    _validation.check_kernel_dtype("sparse_linear", torch.float64, "emulator")
    _validation.check_kernel_dtype("sparse_linear", torch.bfloat16, "reference")


def test_grid_past_32_bits_is_refused(emulator):
    # A zero-width input costs no memory but makes batch * out_features overflow uint32.
    indptr, indices = make_pattern([[], []])
    x = torch.empty(2**31 + 1, 0)
    with pytest.raises(ValueError, match="batch \\* out_features is .* past the 32-bit limit"):
        tsm.sparse_linear(x, indptr, indices, torch.empty(0))


# ---------------------------------------------------------------------------------------
# Kernel names and the MPS path


def test_every_kernel_name_exists_in_the_library():
    library = tsm.emulator.load_shader_file("sparse_linear.metal")
    names = set(library.kernel_names)
    assert set(sl_module.kernel_names("emulator")) <= names
    assert set(sl_module.kernel_names("metal")) <= names
    assert "sparse_linear_forward_batch_lanes_double" in names  # the emulator's float64 instantiations


@pytest.mark.mac
@pytest.mark.skipif(not tsm.metal_available(), reason="needs an Apple GPU (MPS) and the built "
                                                    "Metal launcher")
def test_gradcheck_float32_on_mps():
    indptr, indices = make_pattern([[0, 2], [], [1, 1, 3], [3, 0, 2]])
    x, values, bias, grad = make_tensors((3,), 4, indptr, indices, True, torch.float32, 7)
    mps = [t.to("mps").requires_grad_() for t in (x, values, bias)]
    ip, ix = indptr.to("mps"), indices.to("mps")
    with tsm.use_backend("metal"):
        y = tsm.sparse_linear(mps[0], ip, ix, mps[1], mps[2])
        torch.testing.assert_close(y.cpu(), sparse_linear_reference(x, indptr, indices, values,
                                                                    bias), rtol=1e-5, atol=1e-5)
        # float32 finite differences: eps 1e-3 leaves ~1e-3 of truncation and round-off
        # error in the numerical Jacobian; atomics reorder float32 sums (nondet_tol 1e-5).
        assert torch.autograd.gradcheck(
            lambda x, v, b: tsm.sparse_linear(x, ip, ix, v, b), tuple(mps),
            eps=1e-3, atol=1e-3, rtol=1e-2, nondet_tol=1e-5)
