"""The fused loss and AdamW with float16 and bfloat16 activations, gradients and parameters:
read in the 2-byte type, computed in float32, rounded once; and a training step under
torch.autocast whose parameters stay float32."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import torch_sparse_metal as tsm

from test_sparse_linear_half import HALF_TYPES, U32, rounded


def _assert_within(what, got, want, bound):
    err = (got.double() - want).abs()
    assert bool((err <= bound).all()), (what, float((err - bound).max()))


@pytest.mark.parametrize("dtype", HALF_TYPES, ids=str)
def test_cross_entropy_reads_2_byte_logits_and_sums_in_float32(dtype):
    g = torch.Generator().manual_seed(0)
    batch, classes = 300, 10
    logits = (3 * torch.randn(batch, classes, generator=g)).to(dtype).requires_grad_()
    labels = torch.randint(0, classes, (batch,), generator=g)
    with tsm.use_backend("emulator"):
        loss = tsm.nn.functional.cross_entropy(logits, labels)
        loss.backward()
    assert loss.dtype == logits.grad.dtype == dtype

    x = logits.detach().double().requires_grad_()
    want = F.cross_entropy(x, labels)
    want.backward()
    # float32 evaluation: the row's exp sum (classes terms, each exp within a few u32), its
    # log, the shift; then the mean over the batch (batch terms).
    lse = torch.logsumexp(x.detach(), 1)
    per_row = (classes + 8) * U32 * (lse.abs() + x.detach().abs().max(1).values + 1)
    off = (per_row.sum() + batch * U32 * (lse - x.detach()[range(batch), labels]).abs().sum()) / batch
    _assert_within("loss", loss, want.detach(), rounded(dtype, want.detach(), off))
    p = torch.softmax(x.detach(), 1)
    off = (classes + 8) * U32 * (p + 1) / batch
    _assert_within("grad_logits", logits.grad, x.grad, rounded(dtype, x.grad, off))


@pytest.mark.parametrize("dtype", HALF_TYPES, ids=str)
def test_cross_entropy_under_autocast_is_float32_as_torch_has_it(dtype):
    """torch's autocast casts cross_entropy's logits to float32 (its fp32 rule): so does the
    fused loss's op, registered for autocast."""
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(40, 7, generator=g).to(dtype)
    labels = torch.randint(0, 7, (40,), generator=g)
    with torch.autocast("cpu", dtype=dtype):
        assert F.cross_entropy(logits, labels).dtype == torch.float32
        with tsm.use_backend("emulator"):
            auto = tsm.nn.functional.cross_entropy(logits, labels)
    with tsm.use_backend("emulator"):
        by_hand = tsm.nn.functional.cross_entropy(logits.float(), labels)
    assert auto.dtype == torch.float32 and torch.equal(auto, by_hand)


def _model(dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.nn.Sequential(
        tsm.nn.SparseLinear(24, 32, density=0.4, generator=g, activation="relu"),
        tsm.nn.SparseLinear(32, 5, density=0.4, generator=g)).to(dtype)


@pytest.mark.parametrize("dtype", HALF_TYPES, ids=str)
@pytest.mark.parametrize("amsgrad", [False, True])
def test_adamw_on_2_byte_parameters_is_a_float32_step_rounded_once(dtype, amsgrad):
    """Two steps of the kernel and of the reference backend, each against
    torch.optim.AdamW in float32 on the same values: within float32 rounding before the
    parameter's one rounding per step. The moments stay float32."""
    g = torch.Generator().manual_seed(2)
    grads = [[torch.randn(p.shape, generator=g).to(dtype) for p in _model(dtype).parameters()]
             for _ in range(2)]
    for backend in ("emulator", "reference"):
        model = _model(dtype, seed=3)
        opt = tsm.optim.AdamW(model.parameters(), lr=1e-2, amsgrad=amsgrad)
        for step_grads in grads:
            twin = [p.detach().float().clone().requires_grad_() for p in model.parameters()]
            reference = torch.optim.AdamW(twin, lr=1e-2, amsgrad=amsgrad, foreach=False)
            reference.load_state_dict(_float_state(opt.state_dict()))
            for p, t, grad in zip(model.parameters(), twin, step_grads):
                p.grad, t.grad = grad, grad.float()
            with tsm.use_backend(backend):
                opt.step()
            reference.step()
            for p, t in zip(model.parameters(), twin):
                want = t.detach().double()
                # torch's float32 step and this one differ by float32 rounding, a few u32
                # of each operand (|p| and the update, at most lr per step).
                off = 16 * U32 * (want.abs() + 1e-2)
                _assert_within(f"AdamW step on {backend}", p.detach(), want,
                               rounded(dtype, want, off))
        assert all(opt.state[p]["exp_avg"].dtype == torch.float32 for p in model.parameters())
        want_norms = torch.stack([grad.double().norm() for grad in grads[-1]])
        _assert_within("grad norms", opt.grad_norms(), want_norms,
                       64 * U32 * want_norms + 1e-30)


def _float_state(state_dict):
    """A state dict for torch's optimizer on float32 twins: the same (float32) moments."""
    return {"state": {k: {n: (v.clone() if isinstance(v, torch.Tensor) else v)
                          for n, v in st.items()} for k, st in state_dict["state"].items()},
            "param_groups": state_dict["param_groups"]}


@pytest.mark.parametrize("dtype", HALF_TYPES, ids=str)
def test_an_autocast_training_step_keeps_float32_parameters(dtype):
    """SparseLinear layers in the 2-byte type under autocast, the fused loss in float32, and
    AdamW on float32 parameters: the loss falls, the parameters and their gradients stay
    float32, and no step leaves the kernels."""
    g = torch.Generator().manual_seed(4)
    model = _model(torch.float32)
    opt = tsm.optim.AdamW(model.parameters(), lr=3e-2)
    x = torch.randn(64, 24, generator=g)
    labels = (x[:, :5].argmax(1))  # learnable from the input
    losses = []
    with tsm.use_backend("emulator"), tsm.record() as launches:
        for _ in range(15):
            opt.zero_grad()
            with torch.autocast("cpu", dtype=dtype):
                logits = model(x)
                loss = tsm.nn.functional.cross_entropy(logits, labels)
            assert logits.dtype == dtype and loss.dtype == torch.float32
            loss.backward()
            opt.step()
            losses.append(float(loss))
    assert all(p.dtype == p.grad.dtype == torch.float32 for p in model.parameters())
    assert losses[-1] < 0.7 * losses[0], losses
    kinds = {l.kernel for l in launches}
    assert {f"sparse_linear_forward_batch_lanes_{tsm._kernel_names.dtype_suffix(dtype)}",
            "cross_entropy_forward_float", "adamw_step_float"} <= kinds, kinds

