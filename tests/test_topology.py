"""prune_and_regrow on devices without float64 (MPS), and with a generator on another device."""
from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

import torch_sparse_metal as tsm
from torch_sparse_metal.nn import SparseLinear, prune_and_regrow
from torch_sparse_metal.nn import topology


class RecordOps(TorchDispatchMode):
    """Records (op, dtype, device) of every tensor an aten op returns."""

    def __init__(self):
        super().__init__()
        self.outputs = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor):
                self.outputs.append((str(func), t.dtype, t.device))
        return out


def float32_layer_and_optimizer():
    g = torch.Generator().manual_seed(0)
    layer = SparseLinear(12, 9, density=0.25, generator=g)
    opt = tsm.optim.AdamW(layer.parameters(), lr=1e-2)
    opt.zero_grad()
    layer(torch.randn(5, 12, generator=g)).square().sum().backward()
    opt.step()
    return layer, opt


@pytest.mark.parametrize("mode", ["magnitude", "random", "gradient"])
@pytest.mark.parametrize("with_generator", [True, False], ids=["generator", "default-rng"])
def test_float32_layer_creates_no_float64_tensor(mode, with_generator):
    # MPS has no float64: every tensor the op makes for a float32 layer must fit on it.
    with tsm.use_backend("emulator"):
        layer, opt = float32_layer_and_optimizer()
        dense_grad = torch.randn(9, 12, generator=torch.Generator().manual_seed(3))
        gen = torch.Generator().manual_seed(4) if with_generator else None
        with RecordOps() as rec:
            k = prune_and_regrow(layer, 0.3, mode, optimizer=opt, dense_grad=dense_grad,
                                 generator=gen)
    assert k > 0 and rec.outputs
    wide = [(op, dtype) for op, dtype, _ in rec.outputs if dtype == torch.float64]
    assert wide == []


def test_gradient_scores_pick_the_strongest_empty_cells_in_float32():
    # float32 scores: occupied cells (-1) are never picked, even when every empty cell's
    # gradient is 0 (score 0 > -1) and the occupied cells' gradients are large.
    layer = SparseLinear(6, 5, density=0.5, generator=torch.Generator().manual_seed(1))
    cells = set((layer.pattern().row_ids() * 6 + layer.indices.long()).tolist())
    dense_grad = torch.zeros(5, 6)
    dense_grad.view(-1)[list(cells)] = 1e30
    k = prune_and_regrow(layer, 0.4, "gradient", dense_grad=dense_grad)
    after = set((layer.pattern().row_ids() * 6 + layer.indices.long()).tolist())
    assert len(after) == layer.nnz and len(after - cells) == k


def test_random_draws_run_where_the_generator_lives(monkeypatch):
    # Only CPU here, so a CPU generator with a layer on MPS/CUDA cannot run (see the
    # device test below). What can be checked: the draws ask torch.rand for the generator's
    # device, not the layer's, and the result lands on the layer's device. `meta` stands in
    # for the other device (torch.rand accepts a CPU generator there, so record the call).
    calls = []
    real_rand = torch.rand

    def rand(*size, generator=None, device=None, **kw):
        calls.append((None if generator is None else generator.device, torch.device(device)))
        return real_rand(*size, generator=generator, device=device, **kw)

    monkeypatch.setattr(topology.torch, "rand", rand)
    out = topology._uniform(7, torch.Generator().manual_seed(0), torch.device("meta"))
    assert out.device.type == "meta" and out.dtype == torch.float32 and out.shape == (7,)
    assert calls == [(torch.device("cpu"), torch.device("cpu"))]
    calls.clear()
    topology._uniform(3, None, torch.device("meta"))   # no generator: the device's own
    assert calls == [(None, torch.device("meta"))]


def other_devices():
    devices = []
    if tsm.metal_available():  # MPS tensors run the kernels only with the launcher built
        devices.append("mps")
    if torch.cuda.is_available():
        devices.append("cuda")
    return devices or [pytest.param("mps", marks=pytest.mark.skip(
        reason="needs a non-CPU device (MPS or CUDA)"))]


@pytest.mark.parametrize("device", other_devices())
@pytest.mark.parametrize("mode", ["magnitude", "random", "gradient"])
def test_cpu_generator_with_a_layer_on_another_device(device, mode):
    backend = "auto" if device == "mps" else "reference"
    with tsm.use_backend(backend):
        layer = SparseLinear(12, 9, density=0.25,
                             generator=torch.Generator().manual_seed(0)).to(device)
        nnz = layer.nnz
        k = prune_and_regrow(layer, 0.3, mode, dense_grad=torch.randn(9, 12, device=device),
                             generator=torch.Generator().manual_seed(4))
    assert k > 0 and layer.nnz == nnz and layer.indices.device.type == device
