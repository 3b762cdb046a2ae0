"""``torch.compile(fullgraph=True)`` of models built from the package's modules and ops.

The kernel backends' ops are opaque nodes of the graph (fake implementations give their
shapes; the kernels run when the compiled code calls them), so a compiled model launches
exactly the kernels the eager one does and computes the same numbers. Here on the emulator
backend; on MPS the same code dispatches to the Metal kernels.

The two models of the issue compile with the default backend (inductor, which needs g++:
6.6 s and 2.6 s on two cores with an empty inductor cache). The other tests use
``backend="aot_eager"``: the same dynamo trace and AOT autograd graphs (forward and
backward), which is what they check, without inductor's C++ compile of the plain torch
ops around ours.
"""
from __future__ import annotations

import copy

import pytest
import torch

import torch_sparse_metal as tsm
from torch_sparse_metal.nn import SparseLinear, prune_and_regrow
from torch_sparse_metal.nn.functional import cross_entropy


@pytest.fixture(autouse=True)
def fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


class WithLoss(torch.nn.Module):
    """A model and the fused cross-entropy, compiled as one graph."""

    def __init__(self, model: torch.nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, x: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return cross_entropy(self.model(x), labels)


def sparse_mlp(widths=(12, 24, 16, 5), seed=0, dtype=torch.float32, deterministic=None):
    g = torch.Generator().manual_seed(seed)
    activations = ["relu", "gelu"] + [None] * len(widths)
    layers = [SparseLinear(a, b, density=0.3, generator=g, activation=act,
                           deterministic=deterministic)
              for a, b, act in zip(widths[:-1], widths[1:], activations[:len(widths) - 2] + [None])]
    return torch.nn.Sequential(*layers).to(dtype)


def dense_model(seed=0, dtype=torch.float32):
    torch.manual_seed(seed)
    return torch.nn.Sequential(tsm.nn.Linear(12, 32), torch.nn.Tanh(),
                               tsm.nn.Linear(32, 16, kernel="tiled"), torch.nn.ReLU(),
                               tsm.nn.Linear(16, 5)).to(dtype)


def data(batch=9, features=12, classes=5, seed=1, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(batch, features, generator=g, dtype=dtype),
            torch.randint(0, classes, (batch,), generator=g))


def run(module, x, labels):
    """Loss, gradients of the parameters, and the kernels launched (forward and backward)."""
    module.zero_grad()
    with tsm.record() as launches:
        loss = module(x, labels)
        loss.backward()
    grads = [p.grad.clone() for p in module.parameters()]
    return loss.detach(), grads, sorted(l.kernel for l in launches)


def assert_compiled_matches_eager(make_model, backend, dtype=torch.float64):
    eager = WithLoss(make_model(dtype=dtype))
    compiled_module = copy.deepcopy(eager)
    compiled = torch.compile(compiled_module, fullgraph=True, backend=backend)
    x, labels = data(dtype=dtype)
    with tsm.use_backend("emulator"):
        want_loss, want_grads, want_kernels = run(eager, x, labels)
        for _ in range(2):  # the second call runs the cached graph
            loss, grads, kernels = run(compiled, x, labels)
            torch.testing.assert_close(loss, want_loss, rtol=1e-12, atol=1e-12)
            for got, want in zip(grads, want_grads):
                torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
            assert kernels == want_kernels
    return want_kernels


def test_sparse_mlp_compiles_fullgraph_with_inductor():
    kernels = assert_compiled_matches_eager(sparse_mlp, "inductor")
    assert kernels == sorted(["sparse_linear_forward_batch_lanes_double"] * 3 + ["cross_entropy_forward_double"]
                             + ["sparse_linear_backward_batch_lanes_double"] * 3)


def test_linear_model_compiles_fullgraph_with_inductor():
    kernels = assert_compiled_matches_eager(dense_model, "inductor")
    # Forward: 3 products; backward: grad_input for the last two layers and grad_weight
    # for all three (the first layer's input needs no gradient).
    assert len(kernels) == 3 + 1 + 5
    assert kernels.count("cross_entropy_forward_double") == 1


@pytest.mark.parametrize("make_model", [sparse_mlp, dense_model], ids=["sparse", "dense"])
def test_float32_and_the_reference_backend_compile_too(make_model):
    eager = WithLoss(make_model(dtype=torch.float32))
    compiled = torch.compile(copy.deepcopy(eager), fullgraph=True, backend="aot_eager")
    x, labels = data()
    for backend in ("emulator", "reference"):
        with tsm.use_backend(backend):  # a new backend is a new graph (dynamo guards on it)
            want_loss, want_grads, _ = run(eager, x, labels)
            loss, grads, kernels = run(compiled, x, labels)
        torch.testing.assert_close(loss, want_loss)
        for got, want in zip(grads, want_grads):
            torch.testing.assert_close(got, want)
        assert (kernels == []) == (backend == "reference")


@pytest.mark.parametrize("widths", [(12, 16, 5), (12, 24, 16, 5)], ids=["L2", "L3"])
def test_compiled_training_step_takes_at_most_2L_plus_2_dispatches(widths):
    """Forward, loss and backward compiled; the AdamW step (its own op) eager. The same
    kernels in the same order as the eager step (tests/test_training_step.py)."""
    L = len(widths) - 1
    model = sparse_mlp(widths)
    eager_model = copy.deepcopy(model)
    compiled = torch.compile(WithLoss(model), fullgraph=True, backend="aot_eager")
    opt = tsm.optim.AdamW(model.parameters(), lr=1e-2)
    eager_opt = tsm.optim.AdamW(eager_model.parameters(), lr=1e-2)
    x, labels = data()
    with tsm.use_backend("emulator"):
        for _ in range(3):
            for module, optimizer in ((compiled, opt), (WithLoss(eager_model), eager_opt)):
                optimizer.zero_grad()
                with tsm.record() as launches:
                    module(x, labels).backward()
                    optimizer.step()
                assert [l.kernel for l in launches] == (
                    ["sparse_linear_forward_batch_lanes_float"] * L + ["cross_entropy_forward_float"]
                    + ["sparse_linear_backward_batch_lanes_float"] * L + ["adamw_step_float"])
    for p, q in zip(model.parameters(), eager_model.parameters()):
        torch.testing.assert_close(p, q)  # atomics: last bits may differ


def test_prune_and_regrow_between_compiled_steps():
    """The pattern changes in eager code (it validates and transposes it); the compiled
    graph reads the new buffers."""
    model = sparse_mlp((12, 16, 5), dtype=torch.float64, deterministic=True)
    compiled = torch.compile(WithLoss(model), fullgraph=True, backend="aot_eager")
    x, labels = data(dtype=torch.float64)
    with tsm.use_backend("emulator"):
        compiled(x, labels).backward()
        assert prune_and_regrow(model[0], 0.3, generator=torch.Generator().manual_seed(0)) > 0
        loss, grads, _ = run(compiled, x, labels)
        want_loss, want_grads, _ = run(WithLoss(model), x, labels)
    torch.testing.assert_close(loss, want_loss, rtol=0, atol=0)
    for got, want in zip(grads, want_grads):
        torch.testing.assert_close(got, want, rtol=0, atol=0)


@pytest.mark.parametrize("buffer", ["indices", "src_perm"])
def test_a_write_behind_torchs_back_is_refused_inside_the_graph(buffer):
    """In strict mode eager code would validate and transpose the edited pattern again; a
    graph cannot, so the op compares the buffers with their fingerprints and says so."""
    model = sparse_mlp((12, 16, 5))
    compiled = torch.compile(model, fullgraph=True, backend="aot_eager")
    x, _ = data()
    with tsm.use_backend("emulator"), tsm.check_invariants():
        compiled(x)
        getattr(model[0], buffer).data[0] = 3
        with pytest.raises(ValueError, match=r"^sparse_linear: the pattern's index arrays were "
                                             r"written .*under torch\.compile"):
            compiled(x)
        model[0].pattern()  # eager: validates and transposes the edit
        torch.testing.assert_close(compiled(x), model(x))


def test_a_write_behind_torchs_back_in_a_graph_is_flagged_without_a_read_back():
    """The default: the graph reads nothing back; the kernel meets the out-of-range index,
    writes NaN and flags it, and check_errors() says so."""
    model = sparse_mlp((12, 16, 5))
    compiled = torch.compile(model, fullgraph=True, backend="aot_eager")
    x, _ = data()
    with tsm.use_backend("emulator"):
        compiled(x)
        tsm.check_errors()
        model[0].indices.data[0] = 10**6
        assert torch.isnan(compiled(x)).any()
        with pytest.raises(tsm.InvalidInputError, match="outside its range"):
            tsm.check_errors()


def test_batch_sizes_share_a_graph():
    """Shapes are symbolic after the first recompile: no graph per batch size."""
    model = sparse_mlp((12, 16, 5))
    counter = torch._dynamo.testing.CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(model, fullgraph=True, backend=counter)
    with tsm.use_backend("emulator"):
        for batch in (3, 4, 7, 11):
            x, _ = data(batch=batch)
            torch.testing.assert_close(compiled(x), model(x))
    assert counter.frame_count == 2
