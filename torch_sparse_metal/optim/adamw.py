"""``AdamW``: ``torch.optim.AdamW`` whose step is ONE kernel dispatch for all parameters.

Kernel: ``shaders/adamw.metal`` (``adamw_step``). It also leaves each parameter's gradient
norm in a small device buffer (:meth:`AdamW.grad_norms`, ``SparseLinear.grad_norm``).

The one-dispatch layout, and why
--------------------------------
A Metal dispatch binds at most 31 buffers, and AdamW touches four tensors per parameter
(parameter, gradient, two moments): binding every tensor separately would cap a step at
about six parameters (three layers with biases) and need a kernel signature per count.
Metal 3 argument buffers (a table of GPU addresses) would lift the cap but are outside the
launcher contract, and the emulator has no GPU addresses. So the optimizer owns flat
buffers instead, one per role (parameters, gradients, exp_avg, exp_avg_sq, max_exp_avg_sq),
and the kernel binds those five plus two small tables, whatever the number of parameters:

* the parameters are moved into the flat parameter buffer when the optimizer is built:
  each ``p.data`` becomes a view of its segment (values unchanged, the Parameter object
  the same, so modules, DDP and state dicts keep working; in-place writes such as
  ``load_state_dict`` or ``prune_and_regrow`` land in the flat buffer). Re-allocating a
  parameter afterwards (``.to()``, a ``load_state_dict`` that changes a sparse layer's
  nnz) detaches it: the next step says so; build a new optimizer.
* the optimizer states are views of their flat buffers (``state[p]["exp_avg"]`` etc.).
* the gradients stay where autograd puts them (``p.grad``, ``None`` after
  ``zero_grad()`` as in torch). The step gathers them into the flat gradient buffer with
  ONE ``torch.cat`` (a plain torch copy, not a kernel; skipped when every gradient already
  is a view of that buffer). Re-homing ``p.grad`` into the flat buffer instead would save
  that copy but costs the same in autograd's accumulation (``grad += new`` per parameter
  instead of stealing the kernel's output), fights ``zero_grad(set_to_none=True)`` and
  DDP's bucket views, and changes which parameters torch considers to have no gradient.
* each tensor's segment is padded to a whole number of 32-element chunks (at least one),
  and ``chunk_tensor`` maps a chunk to its tensor: one read per thread finds the tensor's
  hyper-parameters, and every SIMD-group lies inside one tensor, so gradient norms reduce
  with ``simd_sum`` before one atomic add per SIMD-group. Padding costs < 32 elements per
  tensor and stays zero (zero gradient and moments: the update adds 0).
* per-tensor scalars that change every step (the bias corrections) are computed on the
  host in double exactly as torch does, from step counts the host keeps (``state["step"]``
  is a CPU tensor, as in torch's own optimizers, mirrored so it is not read every step),
  and passed to the kernel by value, as the bytes of the dispatch (``setBytes``, at most
  4 KB: 102 tensors in float32). A table in a device buffer would need a host-to-device
  copy every step, which on MPS waits for the GPU (or must outlive the copy). Options that
  differ between param groups (``maximize``, ``amsgrad``) are columns of that table too,
  so one dispatch serves groups with different options; a model with more tensors than
  one table holds takes one dispatch per table.

Per step: one ``torch.cat``, one kernel dispatch (per 102 tensors), and nothing read back
from the device: the op ``torch.ops.torch_sparse_metal.adamw_step``, which updates the
flat buffers in place (see :mod:`torch_sparse_metal._custom_ops`).
"""
from __future__ import annotations

import math
import weakref
from typing import Dict, List, Optional, Tuple

import numpy as np
import torch

from .. import _custom_ops
from .. import _launch
from .. import _validation as V
from .._metal_backend import require_native_float_atomics
from .._backend import kernels_or_reference, require_kernel_dtype, resolve_backend
from .._kernel_names import kernel_name, kernel_names_for, library_kernels

OP = "AdamW"
SHADER = "adamw.metal"
KERNELS = ("adamw_step",)
# float32, float16 and bfloat16 parameters (bfloat16 from MSL 3.1); float64 on the emulator.
DTYPES = V.KERNEL_DTYPES_WITH_HALF


def _state_dtype(dtype: torch.dtype) -> torch.dtype:
    """The moments' dtype: float32 for 2-byte parameters (shaders/adamw.metal says why)."""
    return torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype
GROUP_SIZE = 256
CHUNK = 32  # elements per chunk = SIMD-group width (TSM_ADAMW_CHUNK in the shader)
# Columns of the hyper-parameter table (TsmAdamwColumn in the shader).
HYPER_COLUMNS = ("active", "decay", "one_minus_beta1", "beta2", "one_minus_beta2",
                 "step_size", "bc2_sqrt", "eps", "sign", "amsgrad")
# Metal's setBytes takes at most 4 KB: the table's rows one dispatch can take by value.
SET_BYTES_LIMIT = 4096

# Each parameter an AdamW owns carries (weak ref to the optimizer, index of its slot in
# the optimizer's grad_sq buffer) under this attribute, for SparseLinear.grad_norm. (A
# WeakKeyDictionary would compare tensors with ==.) The reference is weak: a parameter
# does not keep its optimizer alive.
_SLOT_ATTR = "_tsm_grad_sq_slot"


def kernel_names(backend: str = "emulator") -> Tuple[str, ...]:
    """Every kernel name the host code can ask ``backend`` for (tests check they exist)."""
    return kernel_names_for(KERNELS, backend, DTYPES)


def grad_norm_of(params) -> Optional[torch.Tensor]:
    """The L2 norm of the gradients of ``params`` as read by the last fused AdamW step.

    ``None`` if no :class:`AdamW` has stepped those parameters. Reads the optimizer's
    ``grad_sq`` buffer (written by the step kernel): no gradient is read again.
    """
    total = None
    for p in params:
        slot = getattr(p, _SLOT_ATTR, None)
        if slot is None:
            continue
        opt = slot[0]()
        if opt is None or opt._last_parity is None:
            continue
        sq = opt._grad_sq[opt._last_parity, slot[1]]
        total = sq if total is None else total + sq
    return None if total is None else total.sqrt()


class AdamW(torch.optim.Optimizer):
    """``torch.optim.AdamW`` with the same arguments; each ``step()`` is one kernel dispatch.

    Matches ``torch.optim.AdamW`` (its single-tensor path) to float32 rounding, including
    ``amsgrad`` and ``maximize`` (each per param group). All parameters must share one
    dtype and device; the step runs the kernel on the backend resolved for them
    (``use_backend``), or plain torch ops on the "reference" backend. The kernel needs a
    Metal 3 GPU (``atomic_float``); ``step`` says so on an older one.

    ``capturable``, ``differentiable`` and ``fused`` are not supported (the step already is
    one fused kernel); ``foreach`` is accepted and ignored. ``lr`` and ``betas`` must be
    Python numbers.

    After a step, :meth:`grad_norms` holds each parameter's gradient norm, computed by the
    step kernel from the gradient it read.

    float16 and bfloat16 parameters (a model in ``.half()``) keep their moments
    (``state["exp_avg"]``, ...) and gradient norms in float32 and compute the update in
    float32, rounding the parameter once per step; ``torch.optim.AdamW`` keeps them in the
    parameter's dtype, where the squared gradients of small gradients underflow.
    """

    def __init__(self, params, lr: float = 1e-3, betas: Tuple[float, float] = (0.9, 0.999),
                 eps: float = 1e-8, weight_decay: float = 1e-2, amsgrad: bool = False, *,
                 maximize: bool = False, foreach: Optional[bool] = None,
                 capturable: bool = False, differentiable: bool = False,
                 fused: Optional[bool] = None) -> None:
        if isinstance(lr, torch.Tensor) or any(isinstance(b, torch.Tensor) for b in betas):
            raise ValueError(f"{OP}: lr and betas must be Python numbers, not tensors")
        if not 0.0 <= lr:
            raise ValueError(f"{OP}: invalid learning rate: {lr}")
        if not 0.0 <= eps:
            raise ValueError(f"{OP}: invalid epsilon value: {eps}")
        for i, b in enumerate(betas):
            if not 0.0 <= b < 1.0:
                raise ValueError(f"{OP}: invalid beta parameter at index {i}: {b}")
        if not 0.0 <= weight_decay:
            raise ValueError(f"{OP}: invalid weight_decay value: {weight_decay}")
        for name, value in (("capturable", capturable), ("differentiable", differentiable),
                            ("fused", fused)):
            if value:
                raise ValueError(f"{OP}: {name}=True is not supported: the step is one fused "
                                 "kernel already")
        defaults = dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay,
                        amsgrad=amsgrad, maximize=maximize, foreach=foreach,
                        capturable=False, differentiable=False, fused=None)
        self._flat_ready = False
        super().__init__(params, defaults)
        self._build_flat()

    # -- the flat layout -----------------------------------------------------------------

    def _params(self) -> List[torch.Tensor]:
        return [p for group in self.param_groups for p in group["params"]]

    def add_param_group(self, param_group: dict) -> None:
        super().add_param_group(param_group)
        if self._flat_ready:
            self._build_flat()  # re-home every parameter into buffers that fit them all

    def _build_flat(self) -> None:
        params = self._params()
        if not params:
            raise ValueError(f"{OP}: got an empty parameter list")
        first = params[0]
        for i, p in enumerate(params):
            if p.layout != torch.strided:
                raise ValueError(f"{OP}: parameter {i} is sparse ({p.layout}); only dense "
                                 "tensors are supported")
            if not p.is_floating_point():
                raise ValueError(f"{OP}: parameter {i} has dtype {p.dtype}; expected floating")
            if p.dtype != first.dtype or p.device != first.device:
                raise ValueError(f"{OP}: all parameters must share one dtype and device (the "
                                 f"step is one kernel over flat buffers); parameter {i} is "
                                 f"{p.dtype} on {p.device}, parameter 0 {first.dtype} on "
                                 f"{first.device}")
        numels = [p.numel() for p in params]
        padded = [max(CHUNK, -(-n // CHUNK) * CHUNK) for n in numels]
        offsets = np.concatenate([[0], np.cumsum(padded)]).astype(np.int64)
        total = int(offsets[-1])
        V.check_fits_uint32(OP, "total parameter elements (padded)", total)
        dtype, device = first.dtype, first.device
        self._state_dtype = state_dtype = _state_dtype(dtype)
        any_amsgrad = any(g["amsgrad"] for g in self.param_groups)

        flat = {name: torch.zeros(total, dtype=dtype, device=device)
                for name in ("param", "grad")}
        flat.update({name: torch.zeros(total, dtype=state_dtype, device=device)
                     for name in ("exp_avg", "exp_avg_sq")})
        flat["max_exp_avg_sq"] = torch.zeros(total if any_amsgrad else 1, dtype=state_dtype,
                                             device=device)
        views: Dict[str, List[torch.Tensor]] = {name: [] for name in flat}
        for p, n, off in zip(params, numels, offsets[:-1].tolist()):
            for name, buf in flat.items():
                views[name].append(buf[off:off + n].view(p.shape)
                                   if buf.numel() == total else None)
        with torch.no_grad():
            for i, p in enumerate(params):
                views["param"][i].copy_(p.detach())
                p.data = views["param"][i]
                state = self.state.get(p)
                if state:
                    self._adopt_state(p, state, views, i)
        chunk_tensor = np.repeat(np.arange(len(params), dtype=np.int32),
                                 np.asarray(padded) // CHUNK)
        self._flat = flat
        self._views = views
        self._offsets = offsets
        self._numels = numels
        self._param_ptrs = [p.data_ptr() for p in params]
        # Parameter index -> (its state["step"] tensor, that tensor's version, its value)
        # as this optimizer last wrote it: the host's copy of the count (see _advance_step).
        self._steps: Dict[int, Tuple[torch.Tensor, int, float]] = {}
        self._chunk_tensor = torch.from_numpy(chunk_tensor).to(device)
        self._grad_sq = torch.zeros(2, len(params), dtype=state_dtype, device=device)
        self._parity = 0
        self._last_parity: Optional[int] = None
        self._zeros = torch.zeros(max(padded), dtype=dtype, device=device)
        for i, p in enumerate(params):
            setattr(p, _SLOT_ATTR, (weakref.ref(self), i))
        self._flat_ready = True

    def _adopt_state(self, p: torch.Tensor, state: dict, views, i: int) -> None:
        """Move a parameter's state tensors into the flat buffers' views (values kept)."""
        for name in ("exp_avg", "exp_avg_sq", "max_exp_avg_sq"):
            if name in state and views[name][i] is not None:
                views[name][i].copy_(state[name].reshape(p.shape))
                state[name] = views[name][i]
        if "step" in state and not isinstance(state["step"], torch.Tensor):
            state["step"] = torch.tensor(float(state["step"]), dtype=torch.float32)

    def _max_view(self, i: int) -> torch.Tensor:
        """Parameter ``i``'s max_exp_avg_sq view; allocates the flat buffer if it has none.

        The buffer is one element when no group had amsgrad at build time (the kernel
        never reads it then); a group switched to amsgrad later gets the full buffer here,
        before the kernel can read it.
        """
        if self._views["max_exp_avg_sq"][i] is None:
            params, total = self._params(), int(self._offsets[-1])
            buf = self._flat["exp_avg"].new_zeros(total)
            views = [buf[off:off + n].view(p.shape) for p, n, off in
                     zip(params, self._numels, self._offsets[:-1].tolist())]
            for j, p in enumerate(params):
                state = self.state.get(p)
                if state and "max_exp_avg_sq" in state:
                    views[j].copy_(state["max_exp_avg_sq"].reshape(p.shape))
                    state["max_exp_avg_sq"] = views[j]
            self._flat["max_exp_avg_sq"] = buf
            self._views["max_exp_avg_sq"] = views
        return self._views["max_exp_avg_sq"][i]

    def load_state_dict(self, state_dict: dict) -> None:
        super().load_state_dict(state_dict)
        # torch's loader installs new state tensors: copy them into the flat buffers.
        with torch.no_grad():
            for i, p in enumerate(self._params()):
                state = self.state.get(p)
                if state:
                    self._adopt_state(p, state, self._views, i)

    # -- the step ------------------------------------------------------------------------

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        params = self._params()
        for i, p in enumerate(params):
            if p.data_ptr() != self._param_ptrs[i]:
                raise RuntimeError(
                    f"{OP}: parameter {i} (shape {tuple(p.shape)}) no longer lives in the "
                    "optimizer's flat buffer: it was re-allocated (.to(), or load_state_dict "
                    "with another nnz) after the optimizer was built; build a new optimizer")
        if any(g["amsgrad"] for g in self.param_groups) \
                and self._flat["max_exp_avg_sq"].numel() != self._flat["param"].numel():
            self._max_view(0)  # amsgrad turned on since the build (load_state_dict, ...)
        hyper = np.zeros((len(params), len(HYPER_COLUMNS)), dtype=np.float64)
        pieces: List[torch.Tensor] = []
        already_flat = True
        i = 0
        for group in self.param_groups:
            beta1, beta2 = group["betas"]
            lr, wd, eps = group["lr"], group["weight_decay"], group["eps"]
            for p in group["params"]:
                n, seg = self._numels[i], int(self._offsets[i + 1] - self._offsets[i])
                grad = p.grad
                if grad is None:
                    pieces.append(self._zeros[:seg])
                else:
                    if grad.is_sparse:
                        raise RuntimeError(f"{OP} does not support sparse gradients")
                    if grad.dtype != p.dtype or grad.device != p.device:
                        raise RuntimeError(f"{OP}: parameter {i}'s gradient is {grad.dtype} on "
                                           f"{grad.device}, the parameter {p.dtype} on {p.device}")
                    already_flat &= grad.data_ptr() == self._views["grad"][i].data_ptr() \
                        and grad.is_contiguous()
                    pieces.append(grad.reshape(-1))
                    if seg > n:
                        pieces.append(self._zeros[:seg - n])
                    state = self.state[p]
                    if len(state) == 0:
                        state["step"] = self._new_step_count(i)
                        state["exp_avg"] = self._views["exp_avg"][i]
                        state["exp_avg_sq"] = self._views["exp_avg_sq"][i]
                        if group["amsgrad"]:
                            state["max_exp_avg_sq"] = self._max_view(i)
                    elif group["amsgrad"] and "max_exp_avg_sq" not in state:
                        # amsgrad switched on after this parameter's first step.
                        state["max_exp_avg_sq"] = self._max_view(i)
                    step = self._advance_step(i, state)
                    # As torch computes them: Python floats (double).
                    bias_correction1 = 1 - beta1 ** step
                    bias_correction2 = 1 - beta2 ** step
                    hyper[i] = (1.0, 1 - lr * wd, 1 - beta1, beta2, 1 - beta2,
                                lr / bias_correction1, math.sqrt(bias_correction2), eps,
                                -1.0 if group["maximize"] else 1.0,
                                1.0 if group["amsgrad"] else 0.0)
                i += 1
        if not any(p.grad is not None for p in params):
            return loss

        flat = self._flat
        if not already_flat:
            torch.cat(pieces, out=flat["grad"])
        backend = resolve_backend(OP, (flat["param"],), kernels=lambda: library_kernels(
            SHADER, KERNELS, flat["param"].dtype))

        def on_kernels() -> None:
            require_kernel_dtype(OP, flat["param"].dtype, backend, DTYPES)
            if backend == "metal":
                # atomic_float adds the per-tensor gradient squares
                require_native_float_atomics(OP, "Use torch.optim.AdamW, or "
                                                 "tsm.use_backend('reference') for the step")
            _ADAMW_STEP(flat["param"], flat["grad"], flat["exp_avg"], flat["exp_avg_sq"],
                        flat["max_exp_avg_sq"], self._chunk_tensor, hyper.reshape(-1).tolist(),
                        [int(o) for o in self._offsets], self._grad_sq, self._parity)

        kernels_or_reference(OP, backend, on_kernels, lambda: self._step_reference(hyper))
        self._last_parity = self._parity
        self._parity = 1 - self._parity
        return loss

    def _new_step_count(self, i: int) -> torch.Tensor:
        """Parameter ``i``'s ``state["step"]``, at 0: a CPU tensor whatever the parameters'
        device, as torch's optimizers keep it (capturable=False)."""
        step = torch.tensor(0.0, dtype=torch.float32)
        self._steps[i] = (step, step._version, 0.0)
        return step

    def _advance_step(self, i: int, state: dict) -> float:
        """``state["step"] += 1`` for parameter ``i``, and its new value. The value comes
        from the host's copy while the tensor is the one this optimizer last wrote, at the
        version it left it; a count set from outside (``load_state_dict``, a user) is read
        once. No tensor is read in a steady state, so ``tsm.syncs.watch()`` sees none."""
        step = state["step"]
        mirror = self._steps.get(i)
        if mirror is not None and mirror[0] is step and mirror[1] == step._version:
            value = mirror[2]
        else:
            value = float(step)
        step += 1
        self._steps[i] = (step, step._version, value + 1)
        return value + 1

    def _step_reference(self, hyper: np.ndarray) -> None:
        """The kernel's math with torch ops per tensor (the "reference" backend)."""
        flat = self._flat
        self._grad_sq[1 - self._parity].zero_()
        for i, (n, off) in enumerate(zip(self._numels, self._offsets[:-1].tolist())):
            (active, decay, w, beta2, omb2, step_size, bc2_sqrt, eps, sign,
             amsgrad) = hyper[i].tolist()
            if not active:
                continue
            sl = slice(off, off + n)
            # In the moments' dtype (float32 for 2-byte parameters), rounded once at the end.
            g = flat["grad"][sl].to(self._state_dtype) * sign
            p = flat["param"][sl].to(self._state_dtype)
            m, v = flat["exp_avg"][sl], flat["exp_avg_sq"][sl]
            self._grad_sq[self._parity, i] = (g * g).sum()
            p.mul_(decay)
            m.lerp_(g, w)
            v.mul_(beta2).addcmul_(g, g, value=omb2)
            if amsgrad:
                vm = flat["max_exp_avg_sq"][sl]
                torch.maximum(vm, v, out=vm)
                v = vm
            p.addcdiv_(m, (v.sqrt() / bc2_sqrt).add_(eps), value=-step_size)
            flat["param"][sl].copy_(p)

    # -- gradient statistics -------------------------------------------------------------

    def grad_sq(self) -> Optional[torch.Tensor]:
        """Per-parameter sum of squared gradients of the last step: a view, no copy."""
        return None if self._last_parity is None else self._grad_sq[self._last_parity]

    def grad_norms(self) -> Optional[torch.Tensor]:
        """Per-parameter gradient L2 norms of the last step, in parameter order."""
        sq = self.grad_sq()
        return None if sq is None else sq.sqrt()


# The op ``torch_sparse_metal::adamw_step``: one dispatch updates the flat buffers in place.


def _step_kernel(param, grad, exp_avg, exp_avg_sq, max_exp_avg_sq, chunk_tensor, hyper,
                 offsets, grad_sq, parity, *, backend) -> None:
    """One dispatch per table of at most ``SET_BYTES_LIMIT`` bytes: ``hyper`` is the
    flattened (tensors, columns) table, ``offsets`` the tensors' segment starts (and the
    total)."""
    if backend == "metal":
        require_native_float_atomics(OP)
    dtype = np.float64 if param.dtype == torch.float64 else np.float32  # the state's
    table = np.asarray(hyper, dtype=dtype).reshape(-1, len(HYPER_COLUMNS))
    n_tensors = table.shape[0]
    rows = SET_BYTES_LIMIT // table[0].nbytes
    name = kernel_name("adamw_step", param.dtype)
    for first in range(0, n_tensors, rows):
        last = min(first + rows, n_tensors)
        begin, end = offsets[first], offsets[last]
        args = (param, grad, exp_avg, exp_avg_sq, max_exp_avg_sq, chunk_tensor,
                np.ascontiguousarray(table[first:last]), grad_sq, np.uint32(end - begin),
                np.uint32(n_tensors), np.uint32(parity), np.uint32(first),
                np.uint32(last - first), np.uint32(begin))
        _launch.launch(SHADER, name, args, threads=end - begin, group_size=GROUP_SIZE,
                       backend=backend)


_ADAMW_STEP = _custom_ops.define(
    "adamw_step(Tensor(a!) param, Tensor grad, Tensor(b!) exp_avg, Tensor(c!) exp_avg_sq, "
    "Tensor(d!) max_exp_avg_sq, Tensor chunk_tensor, float[] hyper, int[] offsets, "
    "Tensor(e!) grad_sq, int parity) -> ()", _step_kernel, lambda *args: None)
