"""sparse_linear / SparseLinear with a fused activation: kernels (emulator) vs the reference.

The activation runs inside the forward kernel and its derivative inside the one backward
dispatch; "gelu" is the tanh approximation (torch's ``gelu(approximate="tanh")``).
"""
from __future__ import annotations

import pytest
import torch

import torch_sparse_metal as tsm
from torch_sparse_metal.reference.activations import apply_activation
from torch_sparse_metal.reference.sparse_linear import sparse_linear_reference

ACTIVATIONS = [None, "relu", "gelu", "tanh"]
TOL = {torch.float64: dict(rtol=1e-12, atol=1e-12), torch.float32: dict(rtol=1e-5, atol=1e-5)}


@pytest.fixture
def emulator():
    with tsm.use_backend("emulator"):
        yield


def pattern(rows):
    counts = torch.tensor([len(r) for r in rows], dtype=torch.long)
    indptr = torch.cat([torch.zeros(1, dtype=torch.long), counts.cumsum(0)]).to(torch.int32)
    return indptr, torch.tensor([c for r in rows for c in r], dtype=torch.int32)


ROWS = [[0, 2], [], [1, 1, 3], [3, 0, 2], [2]]  # an empty row (bias only) and a repeat


def problem(dtype, batch=6, in_f=4, rows=ROWS, seed=0):
    g = torch.Generator().manual_seed(seed)
    indptr, indices = pattern(rows)
    x = torch.randn(batch, in_f, generator=g, dtype=dtype)
    values = torch.randn(indices.shape[0], generator=g, dtype=dtype)
    bias = torch.randn(len(rows), generator=g, dtype=dtype)
    grad = torch.randn(batch, len(rows), generator=g, dtype=dtype)
    return indptr, indices, x, values, bias, grad


def run(fn, x, values, bias, grad):
    leaves = [t.clone().requires_grad_() for t in (x, values, bias)]
    y = fn(*leaves)
    y.backward(grad)
    return [y.detach()] + [t.grad for t in leaves]


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("activation", ACTIVATIONS)
def test_matches_reference(emulator, activation, dtype):
    indptr, indices, x, values, bias, grad = problem(dtype)
    got = run(lambda x, v, b: tsm.sparse_linear(x, indptr, indices, v, b,
                                                activation=activation), x, values, bias, grad)
    # The oracle: torch's own activation on the plain-torch layer.
    want = run(lambda x, v, b: apply_activation(
        sparse_linear_reference(x, indptr, indices, v, b), activation), x, values, bias, grad)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, **TOL[dtype])


def test_gelu_is_torchs_tanh_approximation(emulator):
    z = torch.linspace(-6, 6, 97, dtype=torch.float64)
    # An identity layer: out[:, r] = x[:, r], so the output is gelu(x) itself.
    indptr = torch.arange(98, dtype=torch.int32)
    indices = torch.arange(97, dtype=torch.int32)
    y = tsm.sparse_linear(z[None], indptr, indices, torch.ones(97, dtype=torch.float64),
                          activation="gelu")[0]
    torch.testing.assert_close(y, torch.nn.functional.gelu(z, approximate="tanh"),
                               rtol=1e-15, atol=1e-15)
    assert (y - torch.nn.functional.gelu(z)).abs().max() > 1e-5  # not the erf form


@pytest.mark.parametrize("activation", ACTIVATIONS)
def test_gradcheck_float64(emulator, activation):
    indptr, indices, x, values, bias, _ = problem(torch.float64, batch=3)
    # Random pre-activations lie far (>> eps = 1e-6) from relu's kink at 0.
    inputs = tuple(t.requires_grad_() for t in (x, values, bias))
    assert torch.autograd.gradcheck(
        lambda x, v, b: tsm.sparse_linear(x, indptr, indices, v, b, activation=activation),
        inputs, nondet_tol=1e-12)


@pytest.mark.parametrize("activation", ["relu", "gelu", "tanh"])
def test_one_dispatch_each_way(emulator, activation):
    indptr, indices, x, values, bias, grad = problem(torch.float32)
    leaves = [t.requires_grad_() for t in (x, values, bias)]
    with tsm.record() as launches:
        y = tsm.sparse_linear(*leaves[:1], indptr, indices, *leaves[1:], activation=activation)
        y.backward(grad)
    assert [l.kernel for l in launches] == ["sparse_linear_forward_batch_lanes_float",
                                            "sparse_linear_backward_batch_lanes_float"]


@pytest.mark.parametrize("activation", ["relu", "gelu", "tanh"])
@pytest.mark.parametrize("rows,batch", [([[], []], 3), ([[0], [1]], 0)])
def test_empty_problems_apply_the_activation(emulator, activation, rows, batch):
    indptr, indices, x, values, bias, grad = problem(torch.float64, batch=batch, in_f=2,
                                                     rows=rows)
    with tsm.record() as launches:
        got = run(lambda x, v, b: tsm.sparse_linear(x, indptr, indices, v, b,
                                                    activation=activation),
                  x, values, bias, grad)
    assert launches == []
    want = run(lambda x, v, b: sparse_linear_reference(x, indptr, indices, v, b,
                                                       activation=activation),
               x, values, bias, grad)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b)


def test_no_grad_forward_saves_nothing(emulator):
    indptr, indices, x, values, bias, _ = problem(torch.float32)
    with torch.no_grad():
        y = tsm.sparse_linear(x, indptr, indices, values, bias, activation="gelu")
    torch.testing.assert_close(y, sparse_linear_reference(x, indptr, indices, values, bias,
                                                          activation="gelu"))


def test_reference_backend(emulator):
    indptr, indices, x, values, bias, _ = problem(torch.float32)
    with tsm.use_backend("reference"), tsm.record() as launches:
        y = tsm.sparse_linear(x, indptr, indices, values, bias, activation="tanh")
    assert launches == []
    torch.testing.assert_close(y, torch.tanh(sparse_linear_reference(x, indptr, indices,
                                                                     values, bias)))


def test_bad_activation_is_rejected():
    indptr, indices, x, values, bias, _ = problem(torch.float32)
    with pytest.raises(ValueError, match=r"^sparse_linear: activation must be one of "
                                         r"\[None, 'relu', 'gelu', 'tanh'\], got 'sigmoid'"):
        tsm.sparse_linear(x, indptr, indices, values, bias, activation="sigmoid")
    with pytest.raises(ValueError, match="^SparseLinear: activation must be one of"):
        tsm.nn.SparseLinear(4, 3, density=0.5, activation="elu")


@pytest.mark.parametrize("activation", ACTIVATIONS)
def test_module(emulator, activation):
    g = torch.Generator().manual_seed(0)
    layer = tsm.nn.SparseLinear(6, 5, density=0.5, activation=activation, generator=g,
                                dtype=torch.float64)
    x = torch.randn(3, 2, 6, dtype=torch.float64)
    y = layer(x)
    expected = apply_activation(x @ layer.to_dense().T + layer.bias, activation)
    torch.testing.assert_close(y, expected)
    assert (f"activation={activation!r}" in repr(layer)) == (activation is not None)
