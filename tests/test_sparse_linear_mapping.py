"""The sparse layer's work mapping: lanes along the batch (a SIMD-group per row, the
activations in the (features, batch) layout) or a lane per row, chosen by batch size from
the emulator's transaction counters."""
from __future__ import annotations

import importlib

import pytest
import torch

import torch_sparse_metal as tsm
from torch_sparse_metal.emulator import coalescing_efficiency, instrumented, record

# The module: torch_sparse_metal.ops.sparse_linear, the attribute, is the function.
ops = importlib.import_module("torch_sparse_metal.ops.sparse_linear")


def _step(in_features, out_features, batch, density=0.05, seed=0):
    """Counters of one forward and one backward (every gradient), and the results."""
    g = torch.Generator().manual_seed(seed)
    layer = tsm.nn.SparseLinear(in_features, out_features, density=density, generator=g)
    x = torch.randn(batch, in_features, generator=g, requires_grad=True)
    grad = torch.randn(batch, out_features, generator=g)
    with tsm.use_backend("emulator"), instrumented(), record() as launches:
        y = layer(x)
        y.backward(grad)
    forward, backward = (l.counters for l in launches)
    return forward, backward, launches, (y, x.grad, layer.weight.grad, layer.bias.grad)


def _with_mapping(monkeypatch, batch_lanes: bool):
    monkeypatch.setattr(ops, "BATCH_LANES_FROM", 1 if batch_lanes else 2**31)


def test_chooser():
    assert not ops.lanes_along_batch(1)
    assert all(ops.lanes_along_batch(b) for b in (2, 3, 4, 31, 32, 64, 1000))


@pytest.mark.parametrize("shape", [(256, 192, 0.05), (1024, 512, 0.01)])
@pytest.mark.parametrize("batch", [1, 2, 3, 8, 64])
def test_chooser_picks_the_mapping_with_fewer_transactions(monkeypatch, shape, batch):
    counted = {}
    for batch_lanes in (False, True):
        _with_mapping(monkeypatch, batch_lanes)
        forward, backward, _, results = _step(*shape[:2], batch, density=shape[2])
        counted[batch_lanes] = (forward["device_transactions"] + backward["device_transactions"],
                                results)
    monkeypatch.undo()
    # Both mappings compute the same thing.
    for a, b in zip(counted[False][1], counted[True][1]):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    chosen = ops.lanes_along_batch(batch)
    assert counted[chosen][0] < counted[not chosen][0]


def test_batch_lanes_kernels_meet_the_coalescing_goal():
    # The goal (>= 80% of the minimum transactions, batch 64) at a size the
    # suite runs quickly; bench sparse gives 4096 x 4096 at 1%.
    forward, backward, launches, _ = _step(1024, 1024, 64, density=0.01)
    assert [l.kernel for l in launches] == ["sparse_linear_forward_batch_lanes_float",
                                            "sparse_linear_backward_batch_lanes_float"]
    assert coalescing_efficiency(forward) >= 0.8
    assert coalescing_efficiency(backward) >= 0.8
    # The batch sums are simd_sums: one atomic per edge and one per bias entry (the batch
    # fits one pass), none serialised; against one per edge and batch element before.
    nnz = forward["fmas"] // 64
    assert backward["atomics"] == nnz + 1024
    assert backward["atomic_conflicts"] == 0


def test_activations_stay_in_the_features_major_layout():
    g = torch.Generator().manual_seed(1)
    model = torch.nn.Sequential(
        tsm.nn.SparseLinear(40, 30, density=0.3, generator=g, activation="relu"),
        tsm.nn.SparseLinear(30, 20, density=0.3, generator=g))
    x = torch.randn(8, 40, generator=g, requires_grad=True)
    grads = []
    with tsm.use_backend("emulator"):
        hidden = model[0](x)
        hidden.register_hook(grads.append)
        out = model[1](hidden)
        out.sum().backward()
    # The kernels wrote (features, batch): the output, and the gradient the second layer's
    # backward passes to the first, are its transposed view, which the next kernel reads
    # without a copy.
    assert hidden.shape == (8, 30) and hidden.stride() == (1, 8)
    assert out.stride() == (1, 8)
    assert grads[0].shape == (8, 30) and grads[0].stride() == (1, 8)
    with tsm.use_backend("reference"):
        expected = model[1](model[0](x.detach()))
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)
