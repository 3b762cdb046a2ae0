"""sparse_linear(deterministic=True): the backward without atomics gives bit-identical
gradients run to run and whatever the number of worker threads, matches the atomic kernel
and the reference, and passes gradcheck in float64 through the kernel; it is still one
dispatch. ``torch.use_deterministic_algorithms(True)`` selects it when the argument is None.
"""
from __future__ import annotations

import pytest
import torch

import torch_sparse_metal as tsm
from torch_sparse_metal.nn import SparseLinear
from torch_sparse_metal.reference import sparse_linear_reference

DET_KERNEL = "sparse_linear_backward_deterministic"


@pytest.fixture(autouse=True)
def emulator():
    with tsm.use_backend("emulator"):
        yield


@pytest.fixture
def unsanitized(monkeypatch):
    """The plain build on four workers: threadgroups really run in parallel, so the atomic
    kernel's adds land in a different order from run to run (at these sizes its weight
    gradients differed in every one of a few runs tried, by up to 3e-5)."""
    monkeypatch.setenv("TSM_SANITIZE", "0")
    monkeypatch.setenv("TSM_EMU_WORKERS", "4")


def layer_problem(batch, in_f=200, out_f=150, density=0.3, seed=0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    layer = SparseLinear(in_f, out_f, density=density, generator=g, dtype=dtype)
    x = torch.randn(batch, in_f, generator=g, dtype=dtype)
    upstream = torch.randn(batch, out_f, generator=g, dtype=dtype)
    return layer, x, upstream


def gradients(layer, x, upstream, activation=None, deterministic=True):
    x = x.clone().requires_grad_()
    layer.weight.grad = layer.bias.grad = None
    y = tsm.sparse_linear(x, layer.indptr, layer.indices, layer.weight, layer.bias,
                          activation=activation, deterministic=deterministic)
    y.backward(upstream)
    return [t.detach().clone() for t in (y, x.grad, layer.weight.grad, layer.bias.grad)]


@pytest.mark.parametrize("activation", [None, "relu", "gelu"])
def test_bit_identical_run_to_run_and_across_worker_counts(unsanitized, monkeypatch, activation):
    layer, x, upstream = layer_problem(batch=256)
    runs = [gradients(layer, x, upstream, activation) for _ in range(4)]
    monkeypatch.setenv("TSM_EMU_WORKERS", "1")
    runs.append(gradients(layer, x, upstream, activation))
    for run in runs[1:]:
        for a, b in zip(runs[0], run):
            assert torch.equal(a, b)
    # ... and they are the right gradients.
    atomic = gradients(layer, x, upstream, activation, deterministic=False)
    for a, b in zip(runs[0], atomic):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-4)


def test_matches_the_float64_reference(unsanitized):
    layer, x, upstream = layer_problem(batch=64, dtype=torch.float64)
    got = gradients(layer, x, upstream, "tanh")
    leaves = [t.detach().clone().requires_grad_() for t in (x, layer.weight, layer.bias)]
    y = sparse_linear_reference(leaves[0], layer.indptr, layer.indices, leaves[1], leaves[2],
                                activation="tanh")
    y.backward(upstream)
    expected = [y.detach()] + [t.grad for t in leaves]
    for a, b in zip(got, expected):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("activation", [None, "relu", "gelu", "tanh"])
@pytest.mark.parametrize("needs", [(1, 1, 1), (1, 0, 0), (0, 1, 1)])
def test_gradcheck_float64_through_the_deterministic_kernel(activation, needs):
    g = torch.Generator().manual_seed(1)
    indptr = torch.tensor([0, 2, 2, 5, 7])
    indices = torch.tensor([0, 3, 1, 2, 4, 0, 0])
    x, values, bias = (torch.randn(n, generator=g, dtype=torch.float64)
                       for n in ((3, 5), (7,), (4,)))
    if activation == "relu":  # keep pre-activations away from the kink
        bias = bias + torch.sign(bias) * 2
    inputs = tuple(t.requires_grad_(bool(n)) for t, n in zip((x, values, bias), needs))

    def f(x, values, bias):
        return tsm.sparse_linear(x, indptr, indices, values, bias, activation=activation,
                                 deterministic=True)

    with tsm.record() as launches:
        assert torch.autograd.gradcheck(f, inputs)  # nondet_tol = 0: identical reruns
    assert any(l.kernel.startswith(DET_KERNEL) for l in launches)


def test_one_dispatch_each_way_and_no_zero_fills_needed():
    layer, x, upstream = layer_problem(batch=5, in_f=7, out_f=6, density=0.5)
    x.requires_grad_()
    with tsm.record() as forward:
        y = tsm.sparse_linear(x, layer.indptr, layer.indices, layer.weight, layer.bias,
                              deterministic=True)
    with tsm.record() as backward:
        y.backward(upstream)
    # The deterministic backward keeps a lane per element, and so the forward's layout.
    assert [l.kernel for l in forward] == ["sparse_linear_forward_float"]
    assert [l.kernel for l in backward] == [DET_KERNEL + "_float"]
    # grid: batch * in_features for grad_input, nnz for grad_values, out_features for grad_bias
    assert backward[0].threads == (5 * 7 + layer.nnz + 6, 1, 1)


def test_torch_deterministic_mode_selects_it_and_the_argument_overrides():
    layer, x, upstream = layer_problem(batch=3, in_f=7, out_f=6, density=0.5)
    x.requires_grad_()

    def backward_kernel(**kwargs):
        with tsm.record() as launches:
            tsm.sparse_linear(x, layer.indptr, layer.indices, layer.weight, layer.bias,
                              **kwargs).backward(upstream)
        return launches[-1].kernel

    assert backward_kernel() == "sparse_linear_backward_batch_lanes_float"
    previous = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    try:
        assert backward_kernel() == DET_KERNEL + "_float"
        assert backward_kernel(deterministic=False) == "sparse_linear_backward_batch_lanes_float"
    finally:
        torch.use_deterministic_algorithms(previous)
    assert backward_kernel(deterministic=True) == DET_KERNEL + "_float"
    with pytest.raises(TypeError, match="deterministic must be True, False or None, got 1"):
        tsm.sparse_linear(x, layer.indptr, layer.indices, layer.weight, deterministic=1)


def test_module_option(unsanitized):
    layer, x, upstream = layer_problem(batch=256)
    det = SparseLinear(200, 150, indptr=layer.indptr, indices=layer.indices,
                       deterministic=True, activation="relu")
    assert "deterministic=True" in repr(det)
    grads = []
    for _ in range(3):
        det.zero_grad()
        with tsm.record() as launches:
            det(x).backward(upstream)
        assert launches[-1].kernel == DET_KERNEL + "_float"
        grads.append((det.weight.grad.clone(), det.bias.grad.clone()))
    for w, b in grads[1:]:
        assert torch.equal(w, grads[0][0]) and torch.equal(b, grads[0][1])
    with pytest.raises(TypeError, match="^SparseLinear: deterministic must be True, False or None"):
        SparseLinear(3, 2, density=0.5, deterministic="yes")
