"""A training step reads nothing back from the device: on MPS each read drains the GPU.

On CPU tensors (the emulator) a read costs nothing, so these tests count reads instead of
timing them, with ``tsm.syncs.watch()``: every ``.item()``, ``bool()``, ``.tolist()``,
``.numpy()``, tensor made from host data and op whose output size comes from the data that
the host code makes. The second half shows the watcher sees each kind, in the step itself:
putting one back (strict mode, a hook that reads, the optimizer's old read of its step
count) fails the first half's assertion.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch

import torch_sparse_metal as tsm
from torch_sparse_metal.nn import SparseLinear, prune_and_regrow
from torch_sparse_metal.optim import AdamW


@pytest.fixture(autouse=True)
def emulator():
    with tsm.use_backend("emulator"):
        yield


def sparse_mlp(seed=0, deterministic=None):
    g = torch.Generator().manual_seed(seed)
    return torch.nn.Sequential(
        SparseLinear(10, 24, density=0.3, generator=g, activation="relu",
                     deterministic=deterministic),
        SparseLinear(24, 16, density=0.3, generator=g, activation="gelu",
                     deterministic=deterministic),
        SparseLinear(16, 4, density=0.3, generator=g, deterministic=deterministic))


def training_step(model, opt, x, y):
    opt.zero_grad()
    loss = tsm.nn.functional.cross_entropy(model(x), y)
    loss.backward()
    opt.step()
    return loss


def syncs_of_steps(model, opt, x, y, steps=3, warm_up=1):
    """The events of each step after ``warm_up`` steps (the first creates the optimizer's
    state, a one-off)."""
    for _ in range(warm_up):
        training_step(model, opt, x, y)
    watches = []
    for _ in range(steps):
        with tsm.syncs.watch() as syncs:
            training_step(model, opt, x, y)
        watches.append(syncs)
    return watches


# ---- the step ------------------------------------------------------------------------------
@pytest.mark.parametrize("batch, deterministic", [(32, None), (2, None), (5, True)],
                         ids=["batch-lanes", "lane-per-element", "deterministic"])
def test_a_steady_state_training_step_reads_nothing_back(batch, deterministic):
    """SparseLinear forward and backward (each kernel family), the fused loss and the
    one-dispatch AdamW: no read-back, no copy from the host, no data-sized op."""
    model = sparse_mlp(deterministic=deterministic)
    opt = AdamW(model.parameters(), lr=1e-2)
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(batch, 10, generator=g), torch.randint(0, 4, (batch,), generator=g)
    for syncs in syncs_of_steps(model, opt, x, y):
        assert not syncs.events, syncs.report()


def test_a_dense_step_reads_nothing_back():
    """tsm.nn.Linear (tsm.addmm), tsm.mm and the fused loss, with the one-dispatch AdamW."""
    g = torch.Generator().manual_seed(0)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = torch.nn.Sequential(tsm.nn.Linear(10, 16), torch.nn.ReLU(), tsm.nn.Linear(16, 4))
    opt = AdamW(model.parameters(), lr=1e-2)
    x, y = torch.randn(8, 10, generator=g), torch.randint(0, 4, (8,), generator=g)
    for syncs in syncs_of_steps(model, opt, x, y):
        assert not syncs.events, syncs.report()
    a, b = torch.randn(8, 6, requires_grad=True), torch.randn(6, 5, requires_grad=True)
    with tsm.syncs.watch() as syncs:
        tsm.mm(a, b).sum().backward()
        tsm.addmm(torch.randn(5), a, b, activation="relu").sum().backward()
    assert not syncs.events, syncs.report()


@pytest.mark.parametrize("mode", ["magnitude", "random", "gradient"])
def test_prune_and_regrow_reads_nothing_back(mode):
    model = sparse_mlp()
    opt = AdamW(model.parameters(), lr=1e-2)
    x, y = torch.randn(8, 10), torch.randint(0, 4, (8,))
    training_step(model, opt, x, y)
    layer = model[1]
    dense_grad = torch.randn(layer.out_features, layer.in_features)
    for _ in range(2):
        with tsm.syncs.watch() as syncs:
            replaced = prune_and_regrow(layer, 0.3, mode, optimizer=opt, dense_grad=dense_grad)
        assert replaced > 0 and not syncs.events, syncs.report()
        for syncs in syncs_of_steps(model, opt, x, y, steps=1, warm_up=0):
            assert not syncs.events, syncs.report()
    tsm.check_errors()   # the regrown patterns match their fingerprints


@pytest.mark.parametrize("indices, reads", [([0, 3, 1, 2, 4, 5], [1, 0]),
                                             ([0, 3, 1, 2, 2, 5], [1, 1])],
                         ids=["distinct", "duplicates"])
def test_prune_and_regrow_counts_a_given_patterns_cells(indices, reads):
    """A pattern given by its indices may hold duplicate cells: the first call counts its
    distinct cells (one read-back); after it, a pattern without duplicates (and its
    regrown successors) is known to have none, one with duplicates is counted again."""
    layer = SparseLinear(6, 5, indptr=torch.tensor([0, 2, 2, 3, 5, 6]),
                         indices=torch.tensor(indices))
    for expected in reads:
        with tsm.syncs.watch() as syncs:
            prune_and_regrow(layer, 0.5)
        assert len(syncs.events) == expected, syncs.report()
        assert all("in count_distinct" in e.where for e in syncs.events)


# ---- the watcher sees each kind of sync, in the step itself --------------------------------
def test_strict_mode_puts_the_checks_back_and_the_watcher_sees_each():
    """check_invariants() restores the read-backs the hot path dropped: each layer's
    fingerprint check in forward and in backward, and the label check."""
    model = sparse_mlp()
    opt = AdamW(model.parameters(), lr=1e-2)
    x, y = torch.randn(8, 10), torch.randint(0, 4, (8,))
    training_step(model, opt, x, y)
    with tsm.check_invariants():
        (syncs,) = syncs_of_steps(model, opt, x, y, steps=1, warm_up=0)
    where = [e.where.rsplit(" in ", 1)[1] for e in syncs.events]
    assert where.count("changed") == 2 * len(model), syncs.report()
    assert where.count("_check_labels") == 1, syncs.report()
    assert len(where) == 2 * len(model) + 1, syncs.report()


def test_a_read_added_to_the_step_is_seen_where_it_is_made():
    model = sparse_mlp()
    opt = AdamW(model.parameters(), lr=1e-2)
    x, y = torch.randn(8, 10), torch.randint(0, 4, (8,))
    def log_the_peak(module, args, out):
        module.peak = float(out.detach().abs().max())   # a read of the device, per step
    hook = model[1].register_forward_hook(log_the_peak)
    try:
        (syncs,) = syncs_of_steps(model, opt, x, y, steps=1)
    finally:
        hook.remove()
    assert [e.kind for e in syncs.events] == ["read"], syncs.report()
    assert "test_host_syncs.py" in syncs.events[0].where


def test_the_optimizers_old_step_count_read_is_seen(monkeypatch):
    """AdamW before: ``state["step"] += 1; step = state["step"].item()`` per parameter."""
    def advance_and_read(self, i, state):
        state["step"] += 1
        return state["step"].item()
    monkeypatch.setattr(AdamW, "_advance_step", advance_and_read)
    model = sparse_mlp()
    opt = AdamW(model.parameters(), lr=1e-2)
    (syncs,) = syncs_of_steps(model, opt, torch.randn(8, 10), torch.randint(0, 4, (8,)),
                              steps=1)
    assert len(syncs.events) == len(list(model.parameters())), syncs.report()
    assert {e.kind for e in syncs.events} == {"read"}


def test_an_upload_of_a_host_table_is_seen(monkeypatch):
    """The old hyper-parameter upload, ``torch.from_numpy(table).to(device)``."""
    original = AdamW._advance_step

    def advance_and_upload(self, i, state):
        torch.from_numpy(np.zeros(10, dtype=np.float32)).to(self._flat["param"].device)
        return original(self, i, state)
    monkeypatch.setattr(AdamW, "_advance_step", advance_and_upload)
    model = sparse_mlp()
    opt = AdamW(model.parameters(), lr=1e-2)
    (syncs,) = syncs_of_steps(model, opt, torch.randn(8, 10), torch.randint(0, 4, (8,)),
                              steps=1)
    assert {e.kind for e in syncs.events} == {"copy to device"}, syncs.report()


WATCHED = [
    ("read", lambda t: t.sum().item()),
    ("read", lambda t: bool(t.sum() > 0)),
    ("read", lambda t: int(t[0])),
    ("read", lambda t: torch.equal(t, t)),
    ("copy to host", lambda t: t.tolist()),
    ("copy to host", lambda t: t.numpy()),
    ("copy to host", lambda t: np.asarray(t)),
    ("copy to device", lambda t: torch.tensor([1.0, 2.0])),
    ("copy to device", lambda t: torch.from_numpy(np.ones(3))),
    ("copy to device", lambda t: torch.as_tensor([1, 2])),
    ("data-sized", lambda t: t.nonzero()),
    ("data-sized", lambda t: t[t > 0]),
    ("data-sized", lambda t: torch.bincount(t.abs().long())),
    ("data-sized", lambda t: torch.unique(t)),
    ("data-sized", lambda t: torch.masked_select(t, t > 0)),
    ("data-sized", lambda t: torch.repeat_interleave(t.abs().long())),
]


@pytest.mark.parametrize("kind, make", WATCHED, ids=[f"{k}-{i}" for i, (k, _) in enumerate(WATCHED)])
def test_each_kind_of_sync_is_seen(kind, make):
    t = torch.arange(-3, 5, dtype=torch.float32)
    with tsm.syncs.watch() as syncs:
        make(t)
    assert [e.kind for e in syncs.events][:1] == [kind], syncs.report()


def test_device_ops_whose_size_the_host_knows_are_not_syncs():
    t = torch.arange(-3, 5, dtype=torch.float32)
    where, counts = torch.arange(1, 3), torch.tensor([1, 0, 2])
    with tsm.syncs.watch() as syncs:
        torch.sort(t, stable=True)
        torch.topk(t, 3)
        torch.searchsorted(t, torch.arange(3.0))
        torch.zeros(8, dtype=torch.bool).index_fill_(0, where, True)
        t.masked_fill(t > 0, -1.0)
        torch.repeat_interleave(torch.arange(3), counts, output_size=3)
        t.to(torch.float64)
        t[where]
    assert not syncs.events, syncs.report()


def test_the_emulator_is_the_device_not_the_host():
    """The emulator binds a NumPy table through torch.from_numpy: that is the GPU's side."""
    lib = tsm.emulator.compile_shader("""
        #include <metal_stdlib>
        using namespace metal;
        kernel void twice(constant float* table [[buffer(0)]], device float* out [[buffer(1)]],
                          uint i [[thread_position_in_grid]]) { out[i] = 2 * table[i]; }""")
    out = torch.zeros(4)
    with tsm.syncs.watch() as syncs:
        lib.twice(np.arange(4, dtype=np.float32), out, threads=4)
    assert not syncs.events, syncs.report()
    assert out.tolist() == [0.0, 2.0, 4.0, 6.0]
