"""nn.functional.cross_entropy: the fused kernel (emulator) against torch's cross_entropy."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import torch_sparse_metal as tsm
from torch_sparse_metal.nn import functional as tsmF

TOL = {torch.float64: dict(rtol=1e-12, atol=1e-14), torch.float32: dict(rtol=1e-5, atol=1e-6)}


@pytest.fixture
def emulator():
    with tsm.use_backend("emulator"):
        yield


def loss_and_grad(fn, logits, labels):
    x = logits.clone().requires_grad_()
    loss = fn(x, labels)
    loss.backward()
    return loss.detach(), x.grad


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("batch,classes,scale", [
    (1, 1, 1.0),
    (5, 3, 1.0),
    (64, 10, 3.0),
    (2500, 7, 1.0),       # more rows than the 1024 threads: each thread walks several
    (9, 4, 1e4),          # exp(1e4) overflows: only a shifted log-sum-exp survives
])
def test_matches_torch(emulator, dtype, batch, classes, scale):
    g = torch.Generator().manual_seed(batch)
    logits = torch.randn(batch, classes, generator=g, dtype=dtype) * scale
    labels = torch.randint(0, classes, (batch,), generator=g)
    got = loss_and_grad(tsmF.cross_entropy, logits, labels)
    want = loss_and_grad(F.cross_entropy, logits, labels)
    assert torch.isfinite(got[0])
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, **TOL[dtype])


def test_ignore_index_and_int32_labels(emulator):
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(40, 6, generator=g, dtype=torch.float64)
    labels = torch.randint(0, 6, (40,), generator=g)
    labels[::3] = -100
    for lab in (labels, labels.to(torch.int32)):
        got = loss_and_grad(tsmF.cross_entropy, logits, lab)
        want = loss_and_grad(F.cross_entropy, logits, labels)
        for a, b in zip(got, want):
            torch.testing.assert_close(a, b, **TOL[torch.float64])
    got = loss_and_grad(lambda x, y: tsmF.cross_entropy(x, y, ignore_index=2), logits,
                        labels.clamp(min=0))
    want = loss_and_grad(lambda x, y: F.cross_entropy(x, y, ignore_index=2), logits,
                         labels.clamp(min=0))
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, **TOL[torch.float64])


@pytest.mark.parametrize("batch", [0, 3])
def test_no_counted_rows_is_nan_like_torch(emulator, batch):
    logits = torch.randn(batch, 4, dtype=torch.float64)
    labels = torch.full((batch,), -100)
    loss, grad = loss_and_grad(tsmF.cross_entropy, logits, labels)
    assert torch.isnan(loss) and torch.isnan(F.cross_entropy(logits, labels))
    torch.testing.assert_close(grad, torch.zeros_like(logits))


def test_gradcheck_float64(emulator):
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(7, 5, generator=g, dtype=torch.float64, requires_grad=True)
    labels = torch.tensor([0, 4, 2, -100, 1, 1, 3])
    assert torch.autograd.gradcheck(lambda x: tsmF.cross_entropy(x, labels), (logits,))


def test_one_dispatch_loss_and_gradient(emulator):
    logits = torch.randn(70, 10, requires_grad=True)
    labels = torch.randint(0, 10, (70,))
    with tsm.record() as forward:
        loss = tsmF.cross_entropy(logits, labels)
    with tsm.record() as backward:
        (loss * 3).backward()   # any upstream gradient: scaled by a torch multiply
    assert [(l.kernel, l.threads, l.group_size) for l in forward] == [
        ("cross_entropy_forward_float", (96, 1, 1), (96, 1, 1))]
    assert backward == []
    torch.testing.assert_close(logits.grad, 3 * torch.autograd.grad(
        F.cross_entropy(logits, labels), logits)[0])


def test_no_grad_skips_the_gradient(emulator):
    logits = torch.randn(5, 3)
    labels = torch.tensor([0, 1, 2, 1, 0])
    torch.testing.assert_close(tsmF.cross_entropy(logits, labels), F.cross_entropy(logits, labels))


BAD_LABELS = [(torch.tensor([0, 3, 1]), r"labels must lie in \[0, classes\) = \[0, 3\) or "
                                        r"equal ignore_index = -100; found 3"),
              (torch.tensor([0, -1, 1]), "found -1")]


@pytest.mark.parametrize("labels,match", BAD_LABELS, ids=["3", "-1"])
def test_bad_labels_are_nan_and_flagged_without_a_read_back(emulator, labels, match):
    """The kernel checks the labels: that row's gradient and the loss are NaN, no other
    row's gradient changes, and check_errors() names the problem; the call itself reads
    nothing back."""
    logits = torch.randn(3, 3, dtype=torch.float64)
    with tsm.syncs.watch() as syncs:
        loss, grad = loss_and_grad(tsmF.cross_entropy, logits, labels)
    assert not syncs.events, syncs.report()
    assert torch.isnan(loss) and torch.isnan(grad[1]).all()
    good = torch.tensor([0, 2])   # the mean still counts the bad row: 3 rows
    x = logits[good].clone().requires_grad_()
    F.cross_entropy(x, labels[good], reduction="sum").div(3).backward()
    torch.testing.assert_close(grad[good], x.grad, **TOL[torch.float64])
    with pytest.raises(tsm.InvalidInputError, match="cross_entropy met a label outside"):
        tsm.check_errors()
    tsm.check_errors()   # the flag is cleared


@pytest.mark.parametrize("labels,match", BAD_LABELS, ids=["3", "-1"])
def test_bad_labels_raise_before_the_kernel_in_strict_mode(emulator, labels, match):
    with tsm.check_invariants(), tsm.record() as launches, \
            pytest.raises(ValueError, match="^cross_entropy: .*" + match):
        tsmF.cross_entropy(torch.randn(3, 3), labels)
    assert launches == []


BAD = [
    (dict(labels=torch.tensor([0.0, 1.0, 1.0])), "labels must be an int64"),
    (dict(labels=torch.tensor([0, 1])), r"labels has 2 elements but batch = logits.shape\[0\] is 3"),
    (dict(logits=torch.randn(3)), "logits must be 2-D"),
    (dict(logits=torch.randn(3, 0)), "logits has 0 classes"),
    (dict(logits=torch.ones(3, 3, dtype=torch.int64)), "logits must be a floating-point"),
    (dict(logits=torch.randn(3, 3).to(torch.float8_e5m2)),
     "dtype torch.float8_e5m2 is not supported by backend"),
]


@pytest.mark.parametrize("change,match", BAD, ids=[m[:20] for _, m in BAD])
def test_bad_input(emulator, change, match):
    args = dict(logits=torch.randn(3, 3), labels=torch.tensor([0, 2, 1]))
    args.update(change)
    with tsm.record() as launches, pytest.raises(ValueError,
                                                       match="^cross_entropy: .*" + match):
        tsmF.cross_entropy(**args)
    assert launches == []


def test_reference_backend_is_torch():
    logits = torch.randn(5, 3, dtype=torch.float16)
    labels = torch.tensor([0, 1, 2, 1, 0])
    with tsm.use_backend("reference"), tsm.record() as launches:
        loss = tsmF.cross_entropy(logits, labels)
    assert launches == []
    torch.testing.assert_close(loss, F.cross_entropy(logits, labels))


def test_every_kernel_name_exists_in_the_library():
    names = set(tsm.emulator.load_shader_file("cross_entropy.metal").kernel_names)
    assert set(tsmF.kernel_names("emulator")) | set(tsmF.kernel_names("metal")) <= names


UNSUPPORTED = [
    (dict(weight=torch.ones(3)), "class weights are not supported"),
    (dict(reduction="sum"), "reduction='sum' is not supported: mean reduction only"),
    (dict(reduction="none"), "reduction='none' is not supported: mean reduction only"),
    (dict(label_smoothing=0.1), "label_smoothing=0.1 is not supported"),
    (dict(size_average=False), "size_average and reduce .* mean reduction only"),
    (dict(reduce=False), "size_average and reduce .* mean reduction only"),
]


@pytest.mark.parametrize("backend", ["emulator", "reference"])
@pytest.mark.parametrize("kwargs,match", UNSUPPORTED, ids=[m[:24] for _, m in UNSUPPORTED])
def test_torch_options_other_than_the_defaults_raise(backend, kwargs, match):
    # torch's keywords are accepted (not a bare TypeError) and name the op and the limit.
    logits, labels = torch.randn(3, 3), torch.tensor([0, 2, 1])
    with tsm.use_backend(backend), tsm.record() as launches, \
            pytest.raises(ValueError, match="^cross_entropy: " + match):
        tsmF.cross_entropy(logits, labels, **kwargs)
    assert launches == []


@pytest.mark.parametrize("backend", ["emulator", "reference"])
def test_torch_options_at_their_defaults_are_accepted(backend):
    logits, labels = torch.randn(4, 3), torch.tensor([0, 2, -100, 1])
    with tsm.use_backend(backend):
        loss = tsmF.cross_entropy(logits, labels, weight=None, size_average=None, reduce=None,
                                  ignore_index=-100, reduction="mean", label_smoothing=0.0)
    torch.testing.assert_close(loss, F.cross_entropy(logits, labels))
