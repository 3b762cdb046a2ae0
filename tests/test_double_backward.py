"""Second derivatives through the kernels, or a clear refusal (issue 43).

Every differentiable op is twice differentiable through the package's own ops:
``gradgradcheck`` in float64 on the emulator (sanitized), for ``sparse_linear`` in each
activation and kernel family, ``spmm``, ``mm`` / ``addmm`` / ``nn.Linear`` and the fused
``cross_entropy``; third derivatives against dense torch; the gradient penalty of the issue
against a dense ``torch.nn.Linear`` holding the same weights. The ops without a derivative
(k-means, the optimizer step) raise, naming the op, rather than leave a gradient out.
"""
from __future__ import annotations

import pytest
import torch
from test_custom_ops import adamw_cases

import torch_sparse_metal as tsm
from torch_sparse_metal.nn import SparseLinear
from torch_sparse_metal.nn.functional import cross_entropy
from torch_sparse_metal.ops import kmeans as K
from torch_sparse_metal.reference import csr_row_ids
from torch_sparse_metal.reference.activations import apply_activation

F64 = torch.float64
ACTIVATIONS = (None, "relu", "gelu", "tanh")
# The three kernel families: lane per element (batch < 3), batch lanes (features-major
# activations), and the deterministic backward: (batch, deterministic).
FAMILIES = {"lane_per_element": (2, False), "batch_lanes": (4, False),
            "deterministic": (4, True)}
# The atomic kernels add in any order: two backward runs may differ by round-off.
NONDET_TOL = 1e-12

# A 5 -> 4 layer with an empty row and a repeated cell (row 3 holds column 0 twice).
INDPTR = torch.tensor([0, 2, 2, 5, 7], dtype=torch.int32)
INDICES = torch.tensor([0, 3, 1, 2, 4, 0, 0], dtype=torch.int32)


@pytest.fixture(autouse=True)
def emulator():
    with tsm.use_backend("emulator"):
        yield


def leaf(*shape, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g, dtype=F64).requires_grad_()


def dense_weight(values):
    rows = csr_row_ids(INDPTR, INDICES.shape[0])
    return values.new_zeros(4, 5).index_put((rows, INDICES.long()), values, accumulate=True)


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("activation", ACTIVATIONS)
def test_sparse_linear_gradgradcheck(activation, family):
    batch, deterministic = FAMILIES[family]

    def layer(x, values, bias):
        return tsm.sparse_linear(x, INDPTR, INDICES, values, bias, activation=activation,
                                 deterministic=deterministic)
    assert torch.autograd.gradgradcheck(layer, (leaf(batch, 5), leaf(7, seed=1),
                                                leaf(4, seed=2)), nondet_tol=NONDET_TOL)


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("activation", ["gelu", "tanh"])
def test_sparse_linear_third_derivatives_match_dense_torch(activation, family):
    """tanh saves its output, which the loss reads too: a derivative in the saved tensor
    must not count that path again (it did, in a first version of this change)."""
    batch, deterministic = FAMILIES[family]
    inputs = (leaf(batch, 5), leaf(7, seed=1), leaf(4, seed=2))

    def third(layer):
        y = layer(*inputs)
        gx, gv = torch.autograd.grad((y ** 3).sum(), inputs[:2], create_graph=True)
        second = torch.autograd.grad(gx.sin().sum() + (gv ** 2).sum(), inputs,
                                     create_graph=True)
        return second + torch.autograd.grad(sum((g ** 2).sum() for g in second), inputs)

    got = third(lambda x, v, b: tsm.sparse_linear(x, INDPTR, INDICES, v, b,
                                                  activation=activation,
                                                  deterministic=deterministic))
    want = third(lambda x, v, b: apply_activation(x @ dense_weight(v).T + b, activation))
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=1e-10, atol=1e-10)


def test_spmm_gradgradcheck():
    crow, col = INDPTR.long(), torch.tensor([0, 3, 1, 2, 4, 0, 1])  # torch's CSR: no repeats

    def product(values, dense):
        return tsm.spmm(torch.sparse_csr_tensor(crow, col, values, (4, 5),
                                                check_invariants=True), dense)
    assert torch.autograd.gradgradcheck(product, (leaf(7, seed=1), leaf(5, 3)),
                                        nondet_tol=NONDET_TOL)


def test_mm_gradgradcheck():
    assert torch.autograd.gradgradcheck(tsm.mm, (leaf(3, 4), leaf(4, 2, seed=1)))


@pytest.mark.parametrize("activation", ACTIVATIONS)
def test_addmm_gradgradcheck(activation):
    def product(bias, a, b):
        return tsm.addmm(bias, a, b, alpha=1.5, beta=0.5, activation=activation)
    assert torch.autograd.gradgradcheck(product, (leaf(2, seed=2), leaf(3, 4),
                                                  leaf(4, 2, seed=1)))


def test_linear_gradgradcheck():
    layer = tsm.nn.Linear(4, 2, dtype=F64)

    def forward(x, weight, bias):
        return torch.func.functional_call(layer, {"weight": weight, "bias": bias}, (x,))
    assert torch.autograd.gradgradcheck(forward, (leaf(3, 4), leaf(2, 4, seed=1),
                                                  leaf(2, seed=2)))


@pytest.mark.parametrize("labels, ignore_index", [
    (torch.tensor([2, 0, -100, 1, 2]), -100),
    (torch.tensor([2, 0, 0, 1, 2], dtype=torch.int32), 0),
    (torch.full((5,), 7), 7),  # no row counts: the loss NaN, every gradient 0
], ids=["ignored_row", "int32", "all_ignored"])
def test_cross_entropy_gradgradcheck(labels, ignore_index):
    def loss(logits):
        out = cross_entropy(logits, labels, ignore_index=ignore_index)
        return out.nan_to_num() if ignore_index == 7 else out
    assert torch.autograd.gradgradcheck(loss, (leaf(5, 3),))


def gradient_penalty(layer, x):
    """WGAN-GP's: the gradient's norm in the input pushed towards 1."""
    (g,) = torch.autograd.grad(layer(x).tanh().sum(), x, create_graph=True)
    ((g.norm(dim=1) - 1) ** 2).mean().backward()


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("activation", [None, "gelu"])
def test_gradient_penalty_matches_a_dense_linear(activation, family):
    """The issue's report: layer.weight.grad came out all zeros, and the bias's too."""
    batch, deterministic = FAMILIES[family]
    layer = SparseLinear(6, 5, density=0.5, activation=activation, dtype=F64,
                         deterministic=deterministic,
                         generator=torch.Generator().manual_seed(0))
    dense = torch.nn.Linear(6, 5, dtype=F64)
    with torch.no_grad():
        dense.weight.copy_(layer.to_dense())
        dense.bias.copy_(layer.bias)
    x = leaf(batch, 6, seed=3)
    x_dense = x.detach().clone().requires_grad_()
    gradient_penalty(layer, x)
    gradient_penalty(lambda t: apply_activation(dense(t), activation), x_dense)
    pattern = layer.pattern()
    want_weight = dense.weight.grad[pattern.row_ids(), pattern.indices.long()]
    assert want_weight.abs().min() > 0
    torch.testing.assert_close(layer.weight.grad, want_weight, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(layer.bias.grad, dense.bias.grad, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(x.grad, x_dense.grad, rtol=1e-12, atol=1e-12)


def test_a_gradient_through_a_k_means_step_is_refused_not_left_out():
    x, centroids = leaf(10, 3), leaf(4, 3, seed=1)
    distances = K.distances(x, centroids, backend="emulator")
    # The centroids' own term alone would give a gradient: a partial one.
    loss = distances.sum() + (centroids ** 2).sum()
    with pytest.raises(RuntimeError, match=r"^torch_sparse_metal::kmeans_distances has no "
                                           r"derivative: a gradient was asked through it"):
        torch.autograd.grad(loss, centroids)
    with torch.no_grad():  # without a graph the step runs as before
        torch.testing.assert_close(K.distances(x, centroids, backend="emulator"),
                                   distances.detach())


def test_the_optimizer_step_refuses_tensors_that_require_grad():
    param, *rest = next(adamw_cases())
    param.requires_grad_()
    with pytest.raises(RuntimeError, match=r"^torch_sparse_metal::adamw_step writes param, "
                                           r".* in place and has no derivative.*torch\.no_grad"):
        torch.ops.torch_sparse_metal.adamw_step(param, *rest)
    before = param.detach().clone()
    with torch.no_grad():
        torch.ops.torch_sparse_metal.adamw_step(param, *rest)
    assert not torch.equal(param.detach(), before)
