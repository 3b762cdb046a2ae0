"""Fail safe on the GPU: under "auto", a kernel that cannot be built or dispatched on this Mac
makes that op (and dtype) run on the plain-torch reference, with one warning naming the
kernel and carrying Metal's message; backend "metal" raises the error instead.

No Mac here: the Metal extension is replaced by a fake whose compiler or pipeline fails on
demand, and the tensors are CPU tensors that say they live on 'mps' (the reference then
runs for real on the CPU).
"""
from __future__ import annotations

import warnings

import pytest
import torch

import torch_sparse_metal as tsm
import torch_sparse_metal._metal_backend as mb
from torch_sparse_metal import _backend
from torch_sparse_metal._kernel_names import library_kernels
from torch_sparse_metal.ops.sparse_linear import KERNELS as SPARSE_LINEAR_KERNELS
from torch_sparse_metal.emulator import MetalCompileError

COMPILER_LOG = ('matmul_naive.metal:21:7: error: use of undeclared identifier '
                '\'simdgroup_fancy\'\n  simdgroup_fancy(x);\n  ^')


class PretendMps(torch.Tensor):
    """A CPU tensor that claims to live on 'mps': the backend choice sees a GPU tensor, the
    reference's torch ops run on the CPU."""

    @property
    def device(self):
        return torch.device("mps")


def on_mps(t: torch.Tensor) -> torch.Tensor:
    return t.as_subclass(PretendMps)


class AnyKernel(list):
    """A library's kernel list that holds every name asked for."""

    def __contains__(self, name) -> bool:
        return True


class FailingExtension:
    """The extension's interface, whose compiler rejects the sources ``rejects(source)``
    says and whose pipelines fail for the kernels ``pipeline_fails(kernel)`` says."""

    class CompileError(RuntimeError):
        pass

    def __init__(self, rejects=lambda source: False, pipeline_fails=lambda kernel: False):
        self.rejects, self.pipeline_fails = rejects, pipeline_fails
        self.compiled = []
        self.dispatched = []

    def kernel_names(self, source):
        self.compiled.append(source)
        if self.rejects(source):
            raise self.CompileError(COMPILER_LOG)
        return AnyKernel()

    def pipeline_info(self, source, kernel):
        if self.pipeline_fails(kernel):
            raise RuntimeError("_metal_launcher: could not create the compute pipeline for "
                               f"'{kernel}': Compiler encountered an internal error")
        return {"buffers": [], "threadgroups": [], "max_total_threads_per_threadgroup": 1024,
                "thread_execution_width": 32, "static_threadgroup_memory": 0}

    def dispatch(self, *args):
        self.dispatched.append(args)


@pytest.fixture
def install(monkeypatch):
    """``install(ext)`` makes ``ext`` the Metal launcher of an Apple7 Mac."""
    def installed(ext):
        monkeypatch.setattr(mb, "_extension", lambda: ext)
        monkeypatch.setattr(mb, "unavailable_reason", lambda: None)
        monkeypatch.setattr(mb, "_device_info", lambda: {
            "name": "Fake M9", "supports_apple7": True, "supports_metal3": True,
            "max_threads_per_threadgroup": 1024, "max_threadgroup_memory": 32768,
            "metal_language_version": "3.1"})
        return ext
    monkeypatch.setattr(_backend, "_warned_for", set())
    monkeypatch.setattr(_backend, "_failed_dispatch", {})
    clear()
    yield installed
    clear()


def clear():
    for cached in (mb.kernel_info, mb.kernel_failure, mb.device_capabilities):
        cached.cache_clear()


def warnings_of(call):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        result = call()
    return result, [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)]


def test_a_shader_apples_compiler_rejects_runs_on_the_reference_with_one_warning(install):
    install(FailingExtension(rejects=lambda source: True))
    a, b = torch.randn(5, 7), torch.randn(7, 3)
    out, first = warnings_of(lambda: tsm.mm(on_mps(a), on_mps(b)))
    torch.testing.assert_close(out.as_subclass(torch.Tensor), a @ b)
    assert len(first) == 1
    assert "mm runs on the plain-torch reference" in first[0]
    assert "matmul_naive_nn_float" in first[0] and "shaders/matmul_naive.metal" in first[0]
    assert "use of undeclared identifier 'simdgroup_fancy'" in first[0]
    _, again = warnings_of(lambda: tsm.mm(on_mps(a), on_mps(b)))
    assert again == []   # one warning per op and kernel


def metal_refuses(error, match):
    """Under backend "metal" nothing falls back: the op goes to the launcher, whose first
    use of the kernel raises ``error``."""
    kernels = lambda: tsm.ops.matmul.kernels_for(None, torch.float32, "metal")
    with tsm.use_backend("metal"):
        backend, caught = warnings_of(lambda: _backend.resolve_backend(
            "mm", (on_mps(torch.ones(2, 2)),), kernels=kernels))
        assert backend == "metal" and caught == []
        with pytest.raises(error, match=match):
            tsm._launch.max_threads_per_group("matmul_naive.metal", "matmul_naive_nn_float",
                                              "metal")


def test_backend_metal_raises_the_compilers_error(install):
    install(FailingExtension(rejects=lambda source: True))
    metal_refuses(MetalCompileError, "(?s)undeclared identifier 'simdgroup_fancy'.*"
                                     "at matmul_naive.metal line 21")


def test_a_pipeline_metal_cannot_make_runs_on_the_reference(install):
    install(FailingExtension(pipeline_fails=lambda kernel: "naive" in kernel))
    a, b = torch.randn(5, 7), torch.randn(7, 3)
    out, caught = warnings_of(lambda: tsm.mm(on_mps(a), on_mps(b)))
    torch.testing.assert_close(out.as_subclass(torch.Tensor), a @ b)
    assert len(caught) == 1
    assert "could not create the compute pipeline" in caught[0]
    metal_refuses(mb.MetalPipelineError, "matmul_naive_nn_float.*internal error")


def test_a_bfloat_rejection_costs_the_bfloat_kernels_only(install):
    ext = install(FailingExtension(rejects=lambda source: source.startswith(
        "#define TSM_LIBRARY_DTYPE TSM_DTYPE_BFLOAT")))
    a, b = torch.randn(5, 7, dtype=torch.bfloat16), torch.randn(7, 3, dtype=torch.bfloat16)
    out, caught = warnings_of(lambda: tsm.mm(on_mps(a), on_mps(b)))
    torch.testing.assert_close(out.as_subclass(torch.Tensor), a @ b)
    assert len(caught) == 1 and "matmul_naive_nn_bfloat" in caught[0]
    # float32's libraries are other sources, which compile: it stays on the kernels.
    float_kernels = lambda: tsm.ops.matmul.kernels_for(None, torch.float32, "metal")
    backend, caught = warnings_of(lambda: _backend.resolve_backend(
        "mm", (on_mps(torch.randn(2, 2)),), kernels=float_kernels))
    assert backend == "metal" and caught == []
    libraries = {source.split("\n", 1)[0] for source in ext.compiled}
    assert libraries == {"#define TSM_LIBRARY_DTYPE TSM_DTYPE_BFLOAT",
                         "#define TSM_LIBRARY_DTYPE TSM_DTYPE_FLOAT"}


@pytest.mark.parametrize("dtype, library", [(torch.float16, "HALF"), (torch.bfloat16, "BFLOAT")])
def test_a_2_byte_rejection_costs_only_that_dtype_of_the_sparse_layer(install, dtype, library):
    """The sparse layer's half and bfloat kernels are libraries of their own: Apple's compiler
    rejecting one sends that dtype to the reference (one warning), not float32."""
    install(FailingExtension(rejects=lambda source: source.startswith(
        f"#define TSM_LIBRARY_DTYPE TSM_DTYPE_{library}")))

    def resolve(d):
        return warnings_of(lambda: _backend.resolve_backend(
            "sparse_linear", (on_mps(torch.randn(2, 2).to(d)),),
            kernels=lambda: library_kernels("sparse_linear.metal", SPARSE_LINEAR_KERNELS, d)))
    backend, caught = resolve(dtype)
    assert backend == "reference" and len(caught) == 1
    assert f"sparse_linear_forward_{library.lower()}" in caught[0]
    assert "use of undeclared identifier" in caught[0]
    assert resolve(torch.float32) == ("metal", [])


def test_bfloat_needs_msl_3_1_on_metal(install, monkeypatch):
    install(FailingExtension())
    monkeypatch.setattr(mb, "_device_info", lambda: {
        "name": "Fake M9", "supports_apple7": True, "supports_metal3": True,
        "max_threads_per_threadgroup": 1024, "max_threadgroup_memory": 32768,
        "metal_language_version": "3.0"})
    clear()
    from torch_sparse_metal.ops.sparse_linear import DTYPES
    _backend.require_kernel_dtype("sparse_linear", torch.float16, "metal", DTYPES)
    with pytest.raises(ValueError, match=r"sparse_linear: bfloat16 kernels need the Metal "
                                         r"Shading Language 3.1 .* compiles MSL 3.0"):
        _backend.require_kernel_dtype("sparse_linear", torch.bfloat16, "metal", DTYPES)


@pytest.mark.parametrize("op", ["cross_entropy", "addmm"])
def test_an_op_falls_back_on_its_own(install, op):
    install(FailingExtension(rejects=lambda source: True))
    g = torch.Generator().manual_seed(0)
    if op == "cross_entropy":
        logits, labels = torch.randn(4, 3, generator=g), torch.tensor([0, 2, 1, 1])
        call = lambda: tsm.nn.functional.cross_entropy(on_mps(logits), on_mps(labels))
        want = torch.nn.functional.cross_entropy(logits, labels)
    else:
        bias, a, b = (torch.randn(*s, generator=g) for s in ((3,), (4, 5), (5, 3)))
        call = lambda: tsm.addmm(on_mps(bias), on_mps(a), on_mps(b), activation="relu")
        want = torch.relu(torch.addmm(bias, a, b))
    out, caught = warnings_of(call)
    torch.testing.assert_close(out.as_subclass(torch.Tensor), want)
    assert len(caught) == 1 and caught[0].startswith(f"torch_sparse_metal: {op} runs on the "
                                                     "plain-torch reference")


@pytest.mark.parametrize("op, kernels, first", [
    ("sparse_linear", lambda d: library_kernels("sparse_linear.metal", SPARSE_LINEAR_KERNELS, d),
     "sparse_linear_forward_float"),
    ("kmeans", tsm.ops.kmeans.kernels_for, "kmeans_sq_norms_float"),
    ("AdamW", lambda d: library_kernels("adamw.metal", tsm.optim.adamw.KERNELS, d),
     "adamw_step_float"),
])
def test_the_kernels_each_op_declares_are_checked(install, op, kernels, first):
    """What the ops whose reference makes device tensors (which a pretended GPU cannot)
    tell resolve_backend: their kernels, the first of which the warning names."""
    ext = install(FailingExtension(pipeline_fails=lambda kernel: True))
    backend, caught = warnings_of(lambda: _backend.resolve_backend(
        op, (on_mps(torch.ones(1)),), kernels=lambda: kernels(torch.float32)))
    assert backend == "reference" and len(caught) == 1 and first in caught[0]
    assert ext.compiled[0].startswith("#define TSM_LIBRARY_DTYPE TSM_DTYPE_FLOAT")


def test_a_failed_dispatch_falls_back_from_then_on(install):
    install(FailingExtension())

    def dispatch_fails():
        raise mb.MetalDispatchError("dispatch(k): Metal refused the encoder")

    out, caught = warnings_of(lambda: _backend.kernels_or_reference(
        "op", "metal", dispatch_fails, lambda: "reference result"))
    assert out == "reference result"
    assert len(caught) == 1 and "Metal refused the encoder" in caught[0]
    # From then on the op resolves to the reference without trying.
    assert _backend.resolve_backend("op", (on_mps(torch.ones(1)),)) == "reference"
    assert _backend.resolve_backend("other op", (on_mps(torch.ones(1)),)) == "metal"
    with tsm.use_backend("metal"), pytest.raises(mb.MetalDispatchError):
        _backend.kernels_or_reference("op", "metal", dispatch_fails, lambda: None)


def test_errors_of_the_inputs_are_not_swallowed(install):
    """Only Metal's failures fall back: a bad argument is the caller's error."""
    install(FailingExtension())
    with pytest.raises(ValueError, match="^mm: "):
        tsm.mm(on_mps(torch.randn(5, 7)), on_mps(torch.randn(6, 3)))


def test_each_dtype_is_a_library_of_its_own():
    """What the launcher compiles for a kernel: its dtype's instantiations only."""
    float_source = mb.library_source("matmul_naive.metal", "matmul_naive_nn_float")
    half_source = mb.library_source("matmul_naive.metal", "matmul_naive_tt_half")
    assert float_source.startswith("#define TSM_LIBRARY_DTYPE TSM_DTYPE_FLOAT\n")
    assert half_source.startswith("#define TSM_LIBRARY_DTYPE TSM_DTYPE_HALF\n")
    assert mb.library_source("matmul_naive.metal", "matmul_naive_nn_float") is float_source
    assert mb.library_source("bench/noop.metal", "noop") == tsm._shaders.shader_source(
        "bench/noop.metal")
    names = tsm.emulator.compile_shader(half_source).kernel_names
    assert sorted(names) == [f"matmul_naive_{v}_half" for v in ("nn", "nt", "tn", "tt")]
