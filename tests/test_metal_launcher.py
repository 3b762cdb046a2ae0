"""The Metal backend's launcher: its Python side everywhere, its stream contract by source
inspection everywhere, and real dispatches on a Mac.

The tests marked ``mac`` run a tiny inline shader through ``_launch.launch(...,
backend="metal")``: ``_metal_backend.shader_source`` is monkeypatched to serve that inline
source under a made-up shader name, so no file in ``shaders/`` is needed for them.
"""
from __future__ import annotations

import re
import subprocess
import sys
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch

import torch_sparse_metal._metal_backend as mb
from torch_sparse_metal._record import record
from torch_sparse_metal.emulator import LaunchError

REPO = Path(__file__).resolve().parents[1]
LAUNCHER = REPO / "csrc" / "metal" / "launcher.mm"
SETUP = REPO / "setup.py"

METAL_AVAILABLE = mb.is_available()
needs_mac = [pytest.mark.mac,
             pytest.mark.skipif(not METAL_AVAILABLE,
                                reason="needs macOS, an Apple GPU (MPS) and the built extension")]


# --------------------------------------------------------------------------------------
# Import and availability
# --------------------------------------------------------------------------------------

def test_backend_imports_without_loading_the_extension():
    code = ("import sys, torch_sparse_metal._metal_backend as m; "
            "print(m.EXTENSION in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True, cwd=REPO)
    assert out.stdout.strip() == "False"


@pytest.mark.skipif(sys.platform == "darwin", reason="checks behaviour off macOS")
def test_is_available_is_false_off_macos():
    assert mb.is_available() is False


def test_is_available_is_false_on_another_platform(monkeypatch):
    monkeypatch.setattr(sys, "platform", "linux")
    assert mb.is_available() is False


def test_dispatch_off_macos_raises_the_clear_error(monkeypatch):
    monkeypatch.setattr(sys, "platform", "linux")
    x = torch.zeros(4)
    with pytest.raises(mb.MetalUnavailableError,
                       match="needs macOS 14 or later on Apple silicon") as info:
        mb.dispatch("any.metal", "k", [x, np.int32(4)], threads=4, group_size=4)
    message = str(info.value)
    assert "backend 'emulator' or 'reference'" in message
    assert isinstance(info.value, RuntimeError)


def test_launch_with_backend_metal_off_macos_raises_the_clear_error(monkeypatch):
    launch_module = pytest.importorskip("torch_sparse_metal._launch")
    monkeypatch.setattr(sys, "platform", "linux")
    with pytest.raises(mb.MetalUnavailableError, match="'emulator' or 'reference'"):
        launch_module.launch("any.metal", "k", [torch.zeros(4)], threads=4, group_size=4,
                             backend="metal")


def test_missing_extension_is_reported_clearly(monkeypatch):
    monkeypatch.setattr(sys, "platform", "darwin")
    monkeypatch.setattr(mb, "EXTENSION", "torch_sparse_metal._no_such_extension")
    assert mb.is_available() is False
    with pytest.raises(mb.MetalUnavailableError, match="could not be imported") as info:
        mb.dispatch("any.metal", "k", [], threads=1, group_size=1)
    assert "pip install --no-build-isolation --no-deps -e ." in str(info.value)
    assert "xcode-select --install" in str(info.value)
    assert mb.unavailable_reason() == str(info.value)


def test_auto_runs_mps_tensors_on_the_reference_without_the_launcher(monkeypatch):
    """A Mac whose extension did not build still runs every op (plain torch), and says
    once how to get the kernels."""
    from torch_sparse_metal import _backend
    x = torch.zeros(2).as_subclass(PretendMps)
    monkeypatch.setattr(_backend, "_warned_for", set())
    monkeypatch.setattr(mb, "unavailable_reason", lambda: "no launcher; rebuild it so")
    with pytest.warns(RuntimeWarning, match="MPS tensors run on the plain-torch reference, not "
                                            "the Metal kernels: no launcher; rebuild it so"):
        assert _backend.resolve_backend("op", [x]) == "reference"
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # said once
        assert _backend.resolve_backend("op", [x]) == "reference"
        monkeypatch.setattr(mb, "unavailable_reason", lambda: None)
        assert _backend.resolve_backend("op", [x]) == "metal"
        assert _backend.resolve_backend("op", [torch.zeros(2)]) == "reference"


def test_metal_available_is_the_launchers_availability(monkeypatch):
    import torch_sparse_metal as tsm
    assert tsm.metal_available is mb.is_available
    monkeypatch.setattr(mb, "unavailable_reason", lambda: None)
    assert tsm.metal_available() is True


# --------------------------------------------------------------------------------------
# Argument handling, against a fake extension whose reflection is what the emulator parses
# from the same source (so both backends check one description of each kernel)
# --------------------------------------------------------------------------------------

FAKE_SHADER = r"""
#include <metal_stdlib>
using namespace metal;

kernel void kern(device float* t [[buffer(0)]], constant int& a [[buffer(1)]],
                 constant uint& b [[buffer(2)]], constant float& c [[buffer(3)]],
                 constant half& d [[buffer(4)]], constant long& e [[buffer(5)]],
                 constant bool& f [[buffer(6)]], threadgroup float* s0 [[threadgroup(0)]],
                 threadgroup float* s1 [[threadgroup(1)]], uint i [[thread_position_in_grid]]) {
  if (i == 0) {
    t[0] = float(a) + float(b) + c + float(d) + float(e) + float(f);
  }
}

kernel void pair(constant int& n [[buffer(0)]], device float* x [[buffer(1)]],
                 uint i [[thread_position_in_grid]]) {
  if (i < uint(n)) {
    x[i] = 0.0f;
  }
}

kernel void scratch(device float* x [[buffer(0)]], threadgroup float* a [[threadgroup(0)]],
                    threadgroup float* b [[threadgroup(2)]],
                    uint l [[thread_position_in_threadgroup]]) {
  a[l] = x[l];
  b[l] = x[l];
}

// MLX's copy_g* binding: indices 0, 1 and 3, none at 2.
kernel void split_copy(device const float* src [[buffer(0)]], device float* dst [[buffer(1)]],
                       constant int& n [[buffer(3)]], uint i [[thread_position_in_grid]]) {
  if (i < uint(n)) {
    dst[i] = src[i];
  }
}
"""

# (ParamInfo.scalar, size) -> MTLDataType, as Metal's reflection reports a pointee.
_METAL_TYPES = {("f", 4): 3, ("h", 2): 16, ("b", 2): 121, ("i", 1): 45, ("i", 2): 37,
                ("i", 4): 29, ("i", 8): 81, ("u", 1): 49, ("u", 2): 41, ("u", 4): 33,
                ("u", 8): 85, ("o", 1): 53}


def reflection_of(source: str, kernel: str, **overrides) -> dict:
    """What the extension's pipeline_info() returns for ``kernel``, built from the
    emulator's parse of ``source``."""
    from torch_sparse_metal.emulator import compile_shader
    from torch_sparse_metal.emulator._rewrite import P_BUFFER, P_THREADGROUP
    params = compile_shader(source)[kernel].params
    info = {"buffers": [(p.index, p.name, p.size, _METAL_TYPES.get((p.scalar, p.size), 1))
                        for p in params if p.kind == P_BUFFER],
            "threadgroups": [(p.index, p.name, p.size) for p in params
                             if p.kind == P_THREADGROUP],
            "max_total_threads_per_threadgroup": 1024, "thread_execution_width": 32,
            "static_threadgroup_memory": 0}
    info.update(overrides)
    return info


class FakeExtension:
    """The extension's Python interface over FAKE_SHADER (or the reflections given)."""

    class CompileError(RuntimeError):
        pass

    def __init__(self, reflections=None, compile_log=None):
        self.reflections = reflections or {k: reflection_of(FAKE_SHADER, k)
                                           for k in ("kern", "pair", "scratch", "split_copy")}
        self.compile_log = compile_log
        self.calls = []
        self.info_calls = []

    def kernel_names(self, source):
        if self.compile_log is not None:
            raise self.CompileError(self.compile_log)
        return list(self.reflections)

    def pipeline_info(self, source, kernel):
        self.info_calls.append(kernel)
        return self.reflections[kernel]

    def dispatch(self, source, kernel, args, threads, group_size, threadgroup_memory):
        self.calls.append((source, kernel, list(args), threads, group_size, threadgroup_memory))


class PretendMps(torch.Tensor):
    """A CPU tensor that claims to live on 'mps', to reach the checks after the device one."""

    @property
    def device(self):
        return torch.device("mps")


def _install(monkeypatch, ext, info=None):
    monkeypatch.setattr(mb, "_extension", lambda: ext)
    monkeypatch.setattr(mb, "shader_source", lambda name: f"// source of {name}\n")
    monkeypatch.setattr(mb, "_device_info", lambda: dict(info or FAKE_INFO))
    mb.kernel_info.cache_clear()
    mb.device_capabilities.cache_clear()


@pytest.fixture
def fake_ext(monkeypatch):
    ext = FakeExtension()
    _install(monkeypatch, ext)
    yield ext
    mb.kernel_info.cache_clear()
    mb.device_capabilities.cache_clear()


def test_scalars_become_their_bytes_and_dims_are_normalised(fake_ext):
    t = torch.arange(6, dtype=torch.float32).as_subclass(PretendMps)
    args = [t, np.int32(7), np.uint32(3), np.float32(1.5), np.float16(2), np.int64(-1),
            np.bool_(True)]
    with record() as launches:
        mb.dispatch("s.metal", "kern", args, threads=(10, 2), group_size=32,
                    threadgroup_memory=[64, 0])
    (source, kernel, packed, threads, group, tg), = fake_ext.calls
    assert source == "// source of s.metal\n" and kernel == "kern"
    assert packed[0] is t
    assert packed[1:] == [np.int32(7).tobytes(), np.uint32(3).tobytes(),
                          np.float32(1.5).tobytes(), np.float16(2).tobytes(),
                          np.int64(-1).tobytes(), b"\x01"]
    assert all(type(p) is bytes for p in packed[1:])
    assert threads == (10, 2, 1) and group == (32, 1, 1) and tg == [64, 0]
    assert [(l.kernel, l.threads, l.group_size, l.backend) for l in launches] == [
        ("kern", (10, 2, 1), (32, 1, 1), "metal")]


TABLE_SHADER = r"""
#include <metal_stdlib>
using namespace metal;
kernel void scale(constant float* table [[buffer(0)]], device float* x [[buffer(1)]],
                  uint i [[thread_position_in_grid]]) {
  x[i] *= table[i % 4];
}
"""


def test_a_small_table_binds_by_value(monkeypatch):
    """A C-contiguous NumPy array for a ``constant T*`` becomes its bytes (setBytes, under
    4 KB): host values that change every call without a copy to the device."""
    ext = FakeExtension({"scale": reflection_of(TABLE_SHADER, "scale")})
    _install(monkeypatch, ext)
    x = torch.ones(8).as_subclass(PretendMps)
    table = np.arange(4, dtype=np.float32)
    mb.dispatch("t.metal", "scale", [table, x], threads=8, group_size=8)
    (_, _, packed, _, _, _), = ext.calls
    assert packed[0] == table.tobytes()
    for bad, match in [(np.arange(4, dtype=np.int32), "NumPy int32"),
                       (np.zeros((4, 2), dtype=np.float32)[:, 0], "C-contiguous"),
                       (np.zeros(1025, dtype=np.float32), "at most 4096 bytes")]:
        with pytest.raises(LaunchError, match=match):
            mb.dispatch("t.metal", "scale", [bad, x], threads=8, group_size=8)
    with pytest.raises(TypeError, match="NumPy float64 array; Metal has no double"):
        mb.dispatch("t.metal", "scale", [np.arange(4.0), x], threads=8, group_size=8)


@pytest.mark.parametrize("bad, error, match", [
    (3, TypeError, "typed NumPy scalar"),
    (2.5, TypeError, "typed NumPy scalar"),
    (np.float64(1.0), TypeError, "no double"),
    (np.complex64(1j), TypeError, "bool, integer or floating"),
    (np.str_("x"), TypeError, "bool, integer or floating"),
    (torch.zeros(3), ValueError, "'mps'"),
])
def test_bad_arguments_are_rejected_before_the_extension(fake_ext, bad, error, match):
    with pytest.raises(error, match=match):
        mb.dispatch("s.metal", "pair", [np.int32(1), bad], threads=4, group_size=4)
    assert fake_ext.calls == []


def test_non_contiguous_tensors_are_rejected(fake_ext):
    t = torch.zeros(4, 4).t().as_subclass(PretendMps)
    with pytest.raises(ValueError, match="contiguous"):
        mb.dispatch("s.metal", "pair", [np.int32(4), t], threads=4, group_size=4)
    assert fake_ext.calls == []


@pytest.mark.parametrize("kwargs, match", [
    (dict(threads=4, group_size=0), "group_size"),
    (dict(threads=4, group_size=(4, 0)), "group_size"),
    (dict(threads=-1, group_size=4), "threads"),
    (dict(threads=(1, 2, 3, 4), group_size=4), "threads"),
    (dict(threads=4, group_size=4, threadgroup_memory=[-16]), "threadgroup_memory"),
])
def test_bad_launch_geometry_is_rejected(fake_ext, kwargs, match):
    with pytest.raises(ValueError, match=match):
        mb.dispatch("s.metal", "kern", [], **kwargs)
    assert fake_ext.calls == []


def test_too_many_arguments_are_rejected(fake_ext):
    with pytest.raises(ValueError, match="at most 31"):
        mb.dispatch("s.metal", "kern", [np.int32(i) for i in range(32)], threads=1,
                    group_size=1)


# Bad launches of FAKE_SHADER's kernels, with what both backends must say. Tensors are
# made per backend (CPU for the emulator, "mps" for Metal).
BIND_CASES = [
    ("pair", ["f"], {}, r"^pair: expected 2 arguments \(one per \[\[buffer\(i\)\]\]\), got 1$"),
    ("pair", [np.int32(4), "f", "f"], {}, r"^pair: expected 2 arguments"),
    ("pair", [np.uint32(4), "f"], {},
     r"^pair: argument 0 \(\[\[buffer\(0\)\]\] `[^`]*\bn\b[^`]*`\): got a NumPy uint32 \(4 "
     r"bytes\), the kernel declares signed integer of 4 bytes$"),
    ("pair", [np.int16(4), "f"], {}, r"got a NumPy int16 \(2 bytes\)"),
    ("kern", ["f", np.int32(1), np.uint32(1), np.int32(1), np.float16(1), np.int64(1),
              np.bool_(1)], {"threadgroup_memory": [16, 16]},
     r"^kern: argument 3 .*`[^`]*\bc\b[^`]*`\): got a NumPy int32 \(4 bytes\), the kernel "
     r"declares float of 4 bytes$"),
    ("split_copy", ["f", "f", np.int32(4)], {},
     r"^split_copy: expected 4 arguments \(one per \[\[buffer\(i\)\]\]; None at 2, where it has "
     r"none\), got 3$"),
    ("split_copy", ["f", "f", np.int32(4), np.int32(4)], {},
     r"^split_copy: argument 2 has no \[\[buffer\(2\)\]\] parameter; pass None there$"),
    ("split_copy", ["f", None, None, np.int32(4)], {},
     r"^split_copy: argument 1 \(\[\[buffer\(1\)\]\] `[^`]*\bdst\b[^`]*`\): got None; only an index "
     r"the kernel declares no \[\[buffer\(i\)\]\] for takes None$"),
    ("scratch", ["f"], {"threadgroup_memory": [64, 0]},
     r"^scratch: threadgroup_memory must give the byte length of each of its 3 "
     r"\[\[threadgroup\(n\)\]\] parameters, got \[64, 0\]$"),
    ("scratch", ["f"], {"threadgroup_memory": [64, 0, 24]},
     r"^scratch: threadgroup_memory\[2\] = 24: Metal needs a non-negative multiple of 16"),
    ("scratch", ["f"], {"group_size": 2048, "threadgroup_memory": [64, 0, 64]},
     r"^scratch: group_size \(2048, 1, 1\) has 2048 threads; a Metal threadgroup holds 1 to "
     r"1024 \(the pipeline's maxTotalThreadsPerThreadgroup\)$"),
]


def _args_for(case_args, device_tensor):
    return [device_tensor() if a == "f" else a for a in case_args]


@pytest.mark.parametrize("kernel, args, kwargs, match", BIND_CASES)
def test_bind_checks_are_the_emulators(fake_ext, kernel, args, kwargs, match):
    """The same bad launch raises the same LaunchError (a ValueError) on both backends,
    naming the kernel and the argument."""
    from torch_sparse_metal.emulator import LaunchError, compile_shader
    launch = dict(threads=4, group_size=4)
    launch.update(kwargs)
    with pytest.raises(LaunchError, match=match):
        compile_shader(FAKE_SHADER)[kernel](*_args_for(args, lambda: torch.zeros(4)), **launch)
    with pytest.raises(LaunchError, match=match):
        mb.dispatch("s.metal", kernel,
                    _args_for(args, lambda: torch.zeros(4).as_subclass(PretendMps)), **launch)
    assert fake_ext.calls == []


def test_none_at_a_gap_in_the_buffer_indices_reaches_the_extension_unbound(fake_ext):
    src, dst = (torch.zeros(4).as_subclass(PretendMps) for _ in range(2))
    mb.dispatch("s.metal", "split_copy", [src, dst, None, np.int32(4)], threads=4, group_size=4)
    (_, kernel, packed, _, _, _), = fake_ext.calls
    assert kernel == "split_copy"
    assert packed[0] is src and packed[1] is dst and packed[2] is None
    assert packed[3] == np.int32(4).tobytes()


UNUSED_SHADER = r"""
#include <metal_stdlib>
using namespace metal;

kernel void skip(device float* x [[buffer(0)]], constant long& ignored [[buffer(1)]],
                 constant float& scale [[buffer(2)]], uint i [[thread_position_in_grid]]) {
  x[i] *= scale;
}
"""


def unused_reflection(*unused: int) -> dict:
    """skip's reflection with the buffers ``unused`` reported as Metal may report a binding
    the function never reads: used NO, no size, MTLDataTypeNone."""
    info = reflection_of(UNUSED_SHADER, "skip")
    info["buffers"] = [(i, name, 0, 0, False) if i in unused else (i, name, size, kind, True)
                       for i, name, size, kind in info["buffers"]]
    return info


def test_an_unused_binding_takes_any_scalar_or_tensor(monkeypatch):
    ext = FakeExtension({"skip": unused_reflection(1)})
    _install(monkeypatch, ext)
    x = torch.zeros(4).as_subclass(PretendMps)
    other = torch.zeros(3, dtype=torch.int8).as_subclass(PretendMps)
    mb.dispatch("s.metal", "skip", [x, np.int32(3), np.float32(2)], threads=4, group_size=4)
    mb.dispatch("s.metal", "skip", [x, other, np.float32(2)], threads=4, group_size=4)
    assert [call[2][1] for call in ext.calls] == [np.int32(3).tobytes(), other]
    with pytest.raises(ValueError, match=r"^skip: expected 3 arguments"):  # its slot stays
        mb.dispatch("s.metal", "skip", [x, np.float32(2)], threads=4, group_size=4)
    from torch_sparse_metal.emulator import LaunchError, compile_shader
    with pytest.raises(LaunchError, match=r"argument 1 .*got a NumPy int32 \(4 bytes\), the "
                                          r"kernel declares signed integer of 8 bytes$"):
        compile_shader(UNUSED_SHADER).skip(torch.zeros(4), np.int32(3), np.float32(2),
                                           threads=4, group_size=4)  # the emulator knows


def test_a_used_binding_is_still_checked(monkeypatch):
    from torch_sparse_metal.emulator import LaunchError
    for reflection in (unused_reflection(1), unused_reflection()):
        _install(monkeypatch, FakeExtension({"skip": reflection}))
        x = torch.zeros(4).as_subclass(PretendMps)
        with pytest.raises(LaunchError, match=r"^skip: argument 2 .*got a NumPy int32 \(4 "
                                              r"bytes\), the kernel declares float of 4 bytes$"):
            mb.dispatch("s.metal", "skip", [x, np.int64(3), np.int32(2)], threads=4,
                        group_size=4)
    used_but_unreported = unused_reflection()
    used_but_unreported["buffers"][1] = (1, "ignored", 0, 0, True)
    _install(monkeypatch, FakeExtension({"skip": used_but_unreported}))
    with pytest.raises(LaunchError, match=r"argument 1 .*of 0 bytes$"):
        mb.dispatch("s.metal", "skip", [x, np.int32(3), np.float32(2)], threads=4, group_size=4)


def test_reflections_without_the_used_field_count_every_buffer_used():
    old = reflection_of(UNUSED_SHADER, "skip")
    assert all(len(entry) == 4 for entry in old["buffers"])
    info = mb.pipeline_info_from_reflection("skip", old)
    assert [p.used for p in info.buffers.values()] == [True, True, True]
    assert info.buffers[1].size == 8 and info.buffers[1].scalar == "i"
    info = mb.pipeline_info_from_reflection("skip", unused_reflection(1))
    assert [p.used for p in info.buffers.values()] == [True, False, True]
    assert (info.buffers[1].size, info.buffers[1].scalar, info.buffers[1].name) == (0, "s",
                                                                                    "ignored")


def test_threadgroup_memory_is_limited_by_the_device_less_static_memory(monkeypatch):
    ext = FakeExtension({"scratch": reflection_of(FAKE_SHADER, "scratch",
                                                  static_threadgroup_memory=1024)})
    _install(monkeypatch, ext, dict(FAKE_INFO, max_threadgroup_memory=4096))
    x = torch.zeros(4).as_subclass(PretendMps)
    mb.dispatch("s.metal", "scratch", [x], threads=4, group_size=4,
                threadgroup_memory=[2048, 0, 1024])
    with pytest.raises(ValueError, match="threadgroup_memory totals 3088 bytes; Metal allows 3072"):
        mb.dispatch("s.metal", "scratch", [x], threads=4, group_size=4,
                    threadgroup_memory=[2048, 0, 1040])
    assert len(ext.calls) == 1


def test_group_size_is_limited_by_the_pipeline(monkeypatch):
    ext = FakeExtension({"pair": reflection_of(FAKE_SHADER, "pair",
                                               max_total_threads_per_threadgroup=512)})
    _install(monkeypatch, ext)
    x = torch.zeros(4).as_subclass(PretendMps)
    with pytest.raises(ValueError, match=r"has 1024 threads; a Metal threadgroup holds 1 to 512"):
        mb.dispatch("s.metal", "pair", [np.int32(4), x], threads=1024, group_size=(32, 32))
    mb.dispatch("s.metal", "pair", [np.int32(4), x], threads=1024, group_size=(32, 16))
    assert mb.kernel_info("s.metal", "pair").max_total_threads_per_threadgroup == 512
    assert ext.info_calls == ["pair"]  # reflected once, then cached


def test_a_simd_width_other_than_32_is_refused(monkeypatch):
    ext = FakeExtension({"pair": reflection_of(FAKE_SHADER, "pair", thread_execution_width=64)})
    _install(monkeypatch, ext)
    with pytest.raises(RuntimeError, match="pair: the pipeline's threadExecutionWidth is 64; "
                                           "every kernel .* assumes SIMD-groups of 32"):
        mb.kernel_info("s.metal", "pair")


def test_unknown_kernel_is_the_same_error_on_both_backends(fake_ext):
    from torch_sparse_metal.emulator import LaunchError, UnknownKernelError, compile_shader
    with pytest.raises(UnknownKernelError, match=r"no kernel named 'nope' in s.metal; kernels: "
                                                 r"kern, pair, scratch, split_copy$") as metal:
        mb.dispatch("s.metal", "nope", [], threads=1, group_size=1)
    lib = compile_shader(FAKE_SHADER)
    with pytest.raises(UnknownKernelError, match=r"no kernel named 'nope' in .*; kernels: "
                                                 r"kern, pair, scratch, split_copy$"):
        lib.nope
    assert isinstance(metal.value, LaunchError) and isinstance(metal.value, ValueError)
    assert isinstance(metal.value, AttributeError)
    assert not hasattr(lib, "nope") and getattr(lib, "nope", 7) == 7
    assert fake_ext.calls == []


def test_a_metal_compile_error_names_the_shader_file_and_line(monkeypatch):
    """Apple's compiler names files and lines through the #line markers of shader_source;
    the error is the emulator's MetalCompileError, pointing at the line's text."""
    from torch_sparse_metal._paths import SHADERS_DIR
    from torch_sparse_metal.emulator import MetalCompileError
    header = (SHADERS_DIR / "matmul.h").read_text().splitlines()
    line = next(i for i, text in enumerate(header, 1) if "struct TsmMmEpilogue" in text)
    log = (f"matmul.h:{line}:8: error: redefinition of 'TsmMmEpilogue'\n"
           "matmul_tiled.metal:19:1: note: in instantiation\n")
    _install(monkeypatch, FakeExtension(compile_log=log))
    with pytest.raises(MetalCompileError) as info:
        mb.kernel_info("matmul_tiled.metal", "matmul_tiled_nn_float")
    message = str(info.value)
    assert message.startswith("compiling matmul_tiled.metal for Metal (MSL 3.2) failed: "
                              "redefinition of 'TsmMmEpilogue'\n  at matmul.h line "
                              f"{line}: struct TsmMmEpilogue {{")
    assert info.value.line == line and info.value.source_line == header[line - 1]
    assert message.endswith(log.strip()) and info.value.log == log
    mb.kernel_info.cache_clear()
    mb.device_capabilities.cache_clear()


def test_a_compile_error_without_a_location_keeps_the_whole_log(monkeypatch):
    from torch_sparse_metal.emulator import MetalCompileError
    _install(monkeypatch, FakeExtension(compile_log="Compiler encountered an internal error"))
    with pytest.raises(MetalCompileError, match=r"^compiling x.metal for Metal \(MSL 3.2\) "
                                                r"failed:\nCompiler encountered an internal "
                                                r"error$") as info:
        mb.kernel_info("x.metal", "k")
    assert info.value.line is None
    mb.kernel_info.cache_clear()
    mb.device_capabilities.cache_clear()


# --------------------------------------------------------------------------------------
# Shader sources for Metal: includes inlined, #line markers keep files and lines
# --------------------------------------------------------------------------------------

def test_inlined_sources_keep_each_lines_file_and_number(tmp_path):
    from torch_sparse_metal import _shaders
    (tmp_path / "inc").mkdir()
    (tmp_path / "inc" / "b.h").write_text("#pragma once\nint b;\n")
    (tmp_path / "a.h").write_text('#pragma once\n#include "inc/b.h"\nint a;\n')
    (tmp_path / "k.metal").write_text('#include "a.h"\n#include "inc/b.h"\nint k;\n')
    flat = _shaders._flatten(tmp_path / "k.metal", set())
    assert flat.splitlines() == [
        '#line 1 "k.metal"',
        '#line 1 "a.h"', "", '#line 1 "b.h"', "", "int b;", '#line 3 "a.h"', "int a;",
        '#line 2 "k.metal"',
        '#line 3 "k.metal"',  # b.h again: included once
        "int k;"]


def test_project_shaders_flatten_with_paths_relative_to_shaders():
    from torch_sparse_metal import _shaders
    flat = _shaders.shader_source("matmul_tiled.metal")
    assert flat.startswith('#line 1 "matmul_tiled.metal"\n')
    for name in ("matmul.h", "activations.h", "tsm_common.h"):
        assert flat.count(f'#line 1 "{name}"\n') == 1
    assert '#include "' not in flat and "#pragma once" not in flat


def test_a_flattened_shader_is_the_same_program_for_the_emulator():
    """The string the Metal launcher compiles, given to the emulator: the same kernels."""
    from torch_sparse_metal import _shaders
    from torch_sparse_metal.emulator import compile_shader, load_shader_file
    flat = _shaders.shader_source("cross_entropy.metal")
    assert compile_shader(flat).kernel_names == load_shader_file("cross_entropy.metal").kernel_names


# --------------------------------------------------------------------------------------
# Capabilities and their environment overrides
# --------------------------------------------------------------------------------------

FAKE_INFO = {
    "name": "Fake M9", "supports_apple7": True, "supports_metal3": True,
    "max_threads_per_threadgroup": 1024, "max_threadgroup_memory": 32768,
    "recommended_max_working_set_size": 1 << 34, "metal_language_version": "3.2",
    "fast_math": True,
}


@pytest.fixture
def fake_device(monkeypatch):
    monkeypatch.setattr(mb, "_device_info", lambda: dict(FAKE_INFO))
    monkeypatch.delenv(mb.FORCE_NO_SIMDGROUP_MATRIX, raising=False)
    monkeypatch.delenv(mb.FORCE_NO_ATOMIC_FLOAT, raising=False)
    mb.device_capabilities.cache_clear()
    yield monkeypatch
    mb.device_capabilities.cache_clear()


def test_capabilities_are_the_probed_ones_by_default(fake_device):
    caps = mb.device_capabilities()
    assert {k: caps[k] for k in FAKE_INFO} == FAKE_INFO
    assert caps["forced_off"] == ()
    assert mb.device_capabilities() is caps  # probed once


@pytest.mark.parametrize("env, apple7, metal3", [
    ({"TSM_FORCE_NO_SIMDGROUP_MATRIX": "1"}, False, True),
    ({"TSM_FORCE_NO_ATOMIC_FLOAT": "1"}, True, False),
    ({"TSM_FORCE_NO_SIMDGROUP_MATRIX": "1", "TSM_FORCE_NO_ATOMIC_FLOAT": "true"}, False, False),
    ({"TSM_FORCE_NO_SIMDGROUP_MATRIX": "0", "TSM_FORCE_NO_ATOMIC_FLOAT": ""}, True, True),
])
def test_capability_overrides(fake_device, env, apple7, metal3):
    for name, value in env.items():
        fake_device.setenv(name, value)
    mb.device_capabilities.cache_clear()
    caps = mb.device_capabilities()
    assert caps["supports_apple7"] is apple7
    assert caps["supports_metal3"] is metal3
    expected_forced = tuple(k for k, on in (("supports_apple7", apple7),
                                            ("supports_metal3", metal3)) if not on)
    assert caps["forced_off"] == expected_forced


def test_overrides_never_turn_a_capability_on(monkeypatch):
    monkeypatch.setattr(mb, "_device_info",
                        lambda: dict(FAKE_INFO, supports_apple7=False, supports_metal3=False))
    monkeypatch.setenv(mb.FORCE_NO_SIMDGROUP_MATRIX, "0")
    mb.device_capabilities.cache_clear()
    try:
        caps = mb.device_capabilities()
        assert caps["supports_apple7"] is False and caps["supports_metal3"] is False
    finally:
        mb.device_capabilities.cache_clear()


@pytest.mark.skipif(sys.platform == "darwin", reason="checks behaviour off macOS")
def test_capabilities_off_macos_raise_the_clear_error():
    mb.device_capabilities.cache_clear()
    with pytest.raises(mb.MetalUnavailableError):
        mb.device_capabilities()


# --------------------------------------------------------------------------------------
# The stream contract, checked on launcher.mm's source (cheap guards; no compiler needed)
# --------------------------------------------------------------------------------------

def _code_only(text: str) -> str:
    """``text`` with comments and string/char literals blanked (positions kept)."""
    out = []
    i, n = 0, len(text)
    while i < n:
        c = text[i]
        if text.startswith("//", i):
            j = text.find("\n", i)
            j = n if j < 0 else j
            out.append(" " * (j - i))
            i = j
        elif text.startswith("/*", i):
            j = text.find("*/", i + 2)
            j = n if j < 0 else j + 2
            out.append(re.sub(r"[^\n]", " ", text[i:j]))
            i = j
        elif c in "\"'":
            j = i + 1
            while j < n and text[j] != c:
                j += 2 if text[j] == "\\" else 1
            j = min(j + 1, n)
            out.append(c + " " * max(j - i - 2, 0) + c)
            i = j
        else:
            out.append(c)
            i += 1
    return "".join(out)


def _block_end(code: str, open_brace: int) -> int:
    depth = 0
    for k in range(open_brace, len(code)):
        if code[k] == "{":
            depth += 1
        elif code[k] == "}":
            depth -= 1
            if depth == 0:
                return k
    raise AssertionError("unbalanced braces in launcher.mm")


@pytest.fixture(scope="module")
def launcher_code() -> str:
    return _code_only(LAUNCHER.read_text())


def test_code_only_strips_comments_and_strings():
    text = 'a // commit\nb /* endEncoding */ "commit" \'}\' c'
    code = _code_only(text)
    assert len(code) == len(text)
    assert "commit" not in code and "endEncoding" not in code and "}" not in code
    assert code.replace('"', " ").replace("'", " ").split() == ["a", "b", "c"]


def test_launcher_never_ends_the_encoder_nor_commits(launcher_code):
    assert "endEncoding" not in launcher_code
    assert not re.search(r"commit", launcher_code, re.I)


def test_launcher_encodes_only_inside_the_streams_queue(launcher_code):
    spans = []
    for m in re.finditer(r"dispatch_sync\s*\(\s*\w+\s*->\s*queue\s*\(\s*\)\s*,\s*\^", launcher_code):
        brace = launcher_code.index("{", m.end())
        spans.append((brace, _block_end(launcher_code, brace)))
    assert spans, "no dispatch_sync(stream->queue(), ^{...}) block"
    uses = [m.start() for m in re.finditer(r"->\s*commandEncoder\s*\(\s*\)", launcher_code)]
    assert uses, "the launcher must encode on stream->commandEncoder()"
    assert all(any(a < u < b for a, b in spans) for u in uses)
    for verb in ("setBuffer:", "setBytes:", "setThreadgroupMemoryLength:", "dispatchThreads:",
                 "setComputePipelineState:"):
        found = [m.start() for m in re.finditer(re.escape(verb), launcher_code)]
        assert found and all(any(a < u < b for a, b in spans) for u in found), verb


def test_launcher_binds_tensors_at_their_storage_offset(launcher_code):
    assert re.search(r"storage_offset\s*\(\s*\)\s*\)?\s*\*", launcher_code)
    assert "element_size()" in launcher_code
    assert re.search(r"__builtin_bit_cast\s*\(\s*id\s*<\s*MTLBuffer\s*>\s*,\s*[\w.]+"
                     r"\.storage\s*\(\s*\)\s*\.data\s*\(\s*\)\s*\)", launcher_code)
    for m in re.finditer(r"setBuffer:\s*\w+\s+offset:\s*([\w.]+)", launcher_code):
        assert m.group(1) != "0", "a tensor bound at offset 0 ignores views"


def _dispatch_block(code: str) -> str:
    """The body of py_dispatch's dispatch_sync(stream->queue(), ^{ ... }) block."""
    start = code.index("void py_dispatch(")
    body = code[start:_block_end(code, code.index("{", start))]
    queue = re.search(r"dispatch_sync\s*\(\s*stream\s*->\s*queue\s*\(\s*\)\s*,\s*\^", body)
    brace = body.index("{", queue.end())
    return body[brace:_block_end(body, brace)]


def test_launcher_registers_each_dispatch_with_torchs_profiler(launcher_code):
    assert re.search(r"#include\s*<ATen/mps/MPSProfiler.h>", LAUNCHER.read_text())
    block = _dispatch_block(launcher_code)
    begin = re.search(r"getMPSProfiler\s*\(\s*\)\s*\.\s*beginProfileKernel\s*\(\s*"
                      r"\(__bridge const void\s*\*\)\s*pipeline\s*,", block)
    end = re.search(r"getMPSProfiler\s*\(\s*\)\s*\.\s*endProfileKernel\s*\(\s*"
                    r"\(__bridge const void\s*\*\)\s*pipeline\s*\)", block)
    assert begin and end
    # As torch's own kernels: after taking the encoder, around the whole encoding.
    assert block.index("commandEncoder()") < begin.start() < block.index("setComputePipelineState:")
    assert block.index("dispatchThreads:") < end.start()


def test_launcher_sets_every_declared_threadgroup_length(launcher_code):
    """Zero included, from the pipeline's reflection: the shared encoder keeps whatever
    length the previous kernel set at an index left alone."""
    block = _dispatch_block(launcher_code)
    loop = re.search(r"for\s*\(\s*const Parameter\s*&\s*p\s*:\s*\*\s*tg_params\s*\)\s*\{"
                     r"\s*\[encoder setThreadgroupMemoryLength:\(\*tg\)\[p\.index\]\s+"
                     r"atIndex:p\.index\]\s*;\s*\}", block)
    assert loop, "setThreadgroupMemoryLength must run, unconditionally, per declared parameter"
    assert len(re.findall(r"setThreadgroupMemoryLength:", launcher_code)) == 1
    assert re.search(r"tg_params\s*=\s*&\s*k\.threadgroups", launcher_code)


def test_launcher_reflects_each_pipeline_and_checks_bindings_against_it(launcher_code):
    assert re.search(r"newComputePipelineStateWithFunction:\s*function\s+options:\s*"
                     r"reflection_options\(\)\s+reflection:\s*&reflection", launcher_code)
    for fact in ("reflection.bindings", "MTLBindingTypeBuffer", "bufferDataSize",
                 "bufferDataType", "MTLBindingTypeThreadgroupMemory",
                 "threadgroupMemoryDataSize", "threadExecutionWidth",
                 "maxTotalThreadsPerThreadgroup", "MTLPipelineOptionBufferTypeInfo"):
        assert fact in launcher_code, fact
    check = launcher_code[launcher_code.index("void check_bindings("):]
    check = check[:_block_end(check, check.index("{"))]
    assert re.search(r"bindings\.size\(\)\s*!=\s*k\.buffer_slots", check)
    assert re.search(r"length\s*%\s*p->size\s*!=\s*0", check)   # a value, or a table of them
    assert re.search(r"tg\.size\(\)\s*<\s*k\.threadgroup_slots", check)
    dispatch = launcher_code[launcher_code.index("void py_dispatch("):]
    assert dispatch.index("check_bindings(") < dispatch.index("dispatch_sync(")


def test_launcher_reads_whether_each_binding_is_used_and_checks_only_used_ones(launcher_code):
    make = launcher_code[launcher_code.index("PipelineFailure make_kernel("):]
    make = make[:_block_end(make, make.index("{"))]
    loop = make[make.index("for (id<MTLBinding> binding in reflection.bindings)"):]
    assert re.search(r"p\.used\s*=\s*(binding\.used|\[binding isUsed\])\s*;", loop)
    assert loop.index("p.used") < loop.index("kernel->buffers.push_back(p)")
    info = launcher_code[launcher_code.index("py::dict py_pipeline_info("):]
    assert re.search(r"py::make_tuple\(p\.index,\s*p\.name,\s*p\.size,\s*p\.data_type,\s*"
                     r"p\.used\)", info)
    check = launcher_code[launcher_code.index("void check_bindings("):]
    check = check[:_block_end(check, check.index("{"))]
    skip = re.search(r"if\s*\(\s*p\s*==\s*nullptr\s*\|\|\s*!\s*p->used\s*\)\s*continue;", check)
    assert skip and skip.start() < check.index("length % p->size")


def test_launcher_binds_nothing_at_a_gap_and_only_there(launcher_code):
    parse = launcher_code[launcher_code.index("std::vector<Binding> parse_args("):]
    assert re.search(r"item\.is_none\(\)\s*\)\s*\{\s*b\.is_none\s*=\s*true", parse)
    check = launcher_code[launcher_code.index("void check_bindings("):]
    check = check[:_block_end(check, check.index("{"))]
    # None exactly where the reflection declares no [[buffer(i)]], before any size check.
    assert re.search(r"\(\s*p\s*==\s*nullptr\s*\)\s*!=\s*bindings\[i\]\.is_none", check)
    assert check.index("is_none") < check.index("length % p->size")
    block = _dispatch_block(launcher_code)
    skip = re.search(r"if\s*\(\s*b\.is_none\s*\)\s*\{\s*continue;", block)
    assert skip and skip.start() < block.index("setBuffer:") and skip.start() < block.index("setBytes:")


def test_launcher_module_exposes_reflection_and_compile_errors(launcher_code):
    text = LAUNCHER.read_text()
    assert re.search(r'register_exception<CompileFailure>\(m, "CompileError", PyExc_RuntimeError\)',
                     text)
    for name in ("kernel_names", "pipeline_info", "dispatch", "device_info", "mps_matmul"):
        assert re.search(rf'm\.def\("{name}"', text), name
    assert re.search(r"throw CompileFailure\(message\)", launcher_code)


def test_launcher_requires_arc_and_setup_builds_it_so():
    code = _code_only(LAUNCHER.read_text())
    assert re.search(r"#if\s*!\s*__has_feature\s*\(\s*objc_arc\s*\)\s*\n\s*#error", code)
    setup = SETUP.read_text()
    assert '"-fobjc-arc"' in setup
    assert '"-framework", "Metal"' in setup and '"-framework", "Foundation"' in setup
    assert 'sys.platform == "darwin"' in setup


# --------------------------------------------------------------------------------------
# Real dispatches (macOS with an Apple GPU and the built extension)
# --------------------------------------------------------------------------------------

INLINE_SHADER_NAME = "tests/inline_launcher_test.metal"
INLINE_SHADER = r"""
#include <metal_stdlib>
using namespace metal;

kernel void axpb(device const float* x [[buffer(0)]],
                 device float* y [[buffer(1)]],
                 constant float& a [[buffer(2)]],
                 constant uint& n [[buffer(3)]],
                 uint i [[thread_position_in_grid]]) {
  if (i < n) {
    y[i] = a * x[i] + 1.0f;
  }
}

kernel void reverse_in_group(device const int* x [[buffer(0)]],
                             device int* y [[buffer(1)]],
                             threadgroup int* scratch [[threadgroup(0)]],
                             uint i [[thread_position_in_grid]],
                             uint l [[thread_position_in_threadgroup]],
                             uint g [[threads_per_threadgroup]]) {
  scratch[l] = x[i];
  threadgroup_barrier(mem_flags::mem_threadgroup);
  y[i] = scratch[g - 1 - l];
}
"""


@pytest.fixture
def inline_shader(monkeypatch):
    original = mb.shader_source
    monkeypatch.setattr(mb, "shader_source",
                        lambda name: INLINE_SHADER if name == INLINE_SHADER_NAME else original(name))
    from torch_sparse_metal import _launch
    return _launch.launch


class TestOnTheGpu:
    pytestmark = needs_mac

    def test_axpb_on_views_with_storage_offsets(self, inline_shader):
        n = 1000
        base_x = torch.randn(n + 5, device="mps")
        base_y = torch.zeros(n + 3, device="mps")
        x, y = base_x[5:], base_y[3:]
        assert x.storage_offset() == 5 and y.storage_offset() == 3
        with record() as launches:
            inline_shader(INLINE_SHADER_NAME, "axpb", [x, y, np.float32(2.0), np.uint32(n)],
                          threads=n, group_size=256, backend="metal")
        assert [l.backend for l in launches] == ["metal"]
        torch.testing.assert_close(y.cpu(), 2.0 * x.cpu() + 1.0)
        assert torch.count_nonzero(base_y[:3].cpu()) == 0  # nothing written before the view

    def test_interleaves_with_torch_ops_on_the_same_stream(self, inline_shader):
        n = 4096
        x0 = torch.randn(n)
        x = x0.to("mps")
        for _ in range(20):
            y = torch.empty_like(x)
            inline_shader(INLINE_SHADER_NAME, "axpb", [x, y, np.float32(0.5), np.uint32(n)],
                          threads=n, group_size=128, backend="metal")
            x = y * 2.0 - 1.0  # a torch op consuming our output before any sync: x + 1
        torch.mps.synchronize()
        torch.testing.assert_close(x.cpu(), x0 + 20.0)

    def test_threadgroup_memory(self, inline_shader):
        n, g = 512, 64
        x = torch.arange(n, dtype=torch.int32, device="mps")
        y = torch.empty_like(x)
        inline_shader(INLINE_SHADER_NAME, "reverse_in_group", [x, y], threads=n, group_size=g,
                      threadgroup_memory=[g * 4], backend="metal")
        expected = torch.arange(n, dtype=torch.int32).view(-1, g).flip(1).reshape(-1)
        assert torch.equal(y.cpu(), expected)

    def test_empty_grid_encodes_nothing(self, inline_shader):
        y = torch.full((4,), 7.0, device="mps")
        inline_shader(INLINE_SHADER_NAME, "axpb", [y, y, np.float32(2.0), np.uint32(4)],
                      threads=0, group_size=32, backend="metal")
        assert torch.equal(y.cpu(), torch.full((4,), 7.0))

    def test_unknown_kernel(self, inline_shader):
        from torch_sparse_metal.emulator import UnknownKernelError
        with pytest.raises(UnknownKernelError, match="no kernel named 'nope'.*axpb"):
            inline_shader(INLINE_SHADER_NAME, "nope", [], threads=1, group_size=1,
                          backend="metal")

    def test_group_larger_than_the_pipeline_allows(self, inline_shader):
        x = torch.zeros(4096, device="mps")
        with pytest.raises(ValueError, match="maxTotalThreadsPerThreadgroup"):
            inline_shader(INLINE_SHADER_NAME, "axpb", [x, x, np.float32(1), np.uint32(4096)],
                          threads=4096, group_size=4096, backend="metal")

    def test_too_much_threadgroup_memory(self, inline_shader):
        x = torch.zeros(64, dtype=torch.int32, device="mps")
        with pytest.raises(ValueError, match="threadgroup_memory totals"):
            inline_shader(INLINE_SHADER_NAME, "reverse_in_group", [x, x], threads=64,
                          group_size=64, threadgroup_memory=[1 << 24], backend="metal")

    def test_reflection_of_a_real_pipeline(self, inline_shader):
        info = mb.kernel_info(INLINE_SHADER_NAME, "axpb")
        assert {i: (p.name, p.size, p.scalar) for i, p in info.buffers.items()} == {
            0: ("x", 4, "f"), 1: ("y", 4, "f"), 2: ("a", 4, "f"), 3: ("n", 4, "u")}
        assert info.threadgroups == {} and info.thread_execution_width == 32
        assert 32 <= info.max_total_threads_per_threadgroup <= 1024
        scratch = mb.kernel_info(INLINE_SHADER_NAME, "reverse_in_group").threadgroups
        assert [(p.index, p.name) for p in scratch.values()] == [(0, "scratch")]

    def test_a_scalar_of_the_wrong_type_is_the_emulators_error(self, inline_shader):
        from torch_sparse_metal.emulator import LaunchError
        x = torch.zeros(4, device="mps")
        with pytest.raises(LaunchError, match=r"^axpb: argument 3 .*got a NumPy int32 \(4 bytes\), "
                                              "the kernel declares unsigned integer"):
            inline_shader(INLINE_SHADER_NAME, "axpb", [x, x, np.float32(1), np.int32(4)],
                          threads=4, group_size=4, backend="metal")

    def test_runs_under_torchs_profiler(self, inline_shader):
        x = torch.ones(256, device="mps")
        y = torch.empty_like(x)
        with torch.mps.profiler.profile(mode="interval,event", wait_until_completed=True):
            inline_shader(INLINE_SHADER_NAME, "axpb", [x, y, np.float32(3.0), np.uint32(256)],
                          threads=256, group_size=64, backend="metal")
            torch.mps.synchronize()
        assert torch.equal(y.cpu(), torch.full((256,), 4.0))

    def test_compile_error_names_the_line(self, monkeypatch):
        from torch_sparse_metal.emulator import MetalCompileError
        monkeypatch.setattr(mb, "shader_source", lambda name: '#line 1 "broken.metal"\n'
                            "#include <metal_stdlib>\nkernel void broken( { }\n")
        mb.kernel_info.cache_clear()
        with pytest.raises(MetalCompileError, match="compiling broken.metal for Metal") as info:
            mb.kernel_info("broken.metal", "broken")
        assert info.value.line == 3
        mb.kernel_info.cache_clear()

    def test_extension_rejects_cpu_tensors_itself(self):
        ext = mb._extension()
        with pytest.raises(ValueError, match="'mps'"):
            ext.dispatch(INLINE_SHADER, "axpb", [torch.zeros(4)], (4, 1, 1), (4, 1, 1), [])

    def test_device_info(self):
        mb.device_capabilities.cache_clear()
        caps = mb.device_capabilities()
        for key in ("name", "supports_apple7", "supports_metal3", "max_threads_per_threadgroup",
                    "max_threadgroup_memory", "recommended_max_working_set_size"):
            assert key in caps
        assert caps["max_threads_per_threadgroup"] >= 256
        assert caps["max_threadgroup_memory"] >= 16384


@pytest.mark.parametrize("version, bfloat", [("3.0", False), ("3.1", True), ("3.2", True),
                                             ("4.0", True), ("default", False)])
def test_bfloat_is_offered_from_msl_3_1(monkeypatch, version, bfloat):
    monkeypatch.setattr(mb, "_device_info", lambda: dict(FAKE_INFO, metal_language_version=version))
    mb.device_capabilities.cache_clear()
    try:
        assert mb.device_capabilities()["supports_bfloat"] is bfloat
        if bfloat:
            mb.require_bfloat("mm")
        else:
            with pytest.raises(ValueError, match=rf"^mm: bfloat16 kernels need the Metal Shading "
                                                 rf"Language 3.1 .* compiles MSL {version}\."):
                mb.require_bfloat("mm")
    finally:
        mb.device_capabilities.cache_clear()


def test_matmul_refuses_bfloat16_on_metal_before_msl_3_1(monkeypatch):
    import torch_sparse_metal as tsm
    from torch_sparse_metal.ops import matmul as mmops
    monkeypatch.setattr(mb, "_device_info", lambda: dict(FAKE_INFO, metal_language_version="3.0"))
    monkeypatch.setattr(mmops, "resolve_backend", lambda op, tensors, kernels=None: "metal")
    mb.device_capabilities.cache_clear()
    a = torch.ones(4, 4, dtype=torch.bfloat16)
    try:
        with pytest.raises(ValueError, match="^addmm: bfloat16 kernels need"):
            tsm.addmm(None, a, a)
        with pytest.raises(ValueError, match="^mm: bfloat16 kernels need"):
            tsm.mm(a, a)
    finally:
        mb.device_capabilities.cache_clear()


def test_float_atomics_requirement_names_the_op(monkeypatch):
    """Kernels with atomic_float (sparse_linear backward) refuse a GPU without Metal 3 with
    an error naming the op, instead of a shader compile error."""
    monkeypatch.setattr(mb, "_device_info", lambda: {"supports_apple7": True, "supports_metal3": False})
    mb.device_capabilities.cache_clear()
    try:
        with pytest.raises(RuntimeError, match="sparse_linear backward: .*Metal 3"):
            mb.require_native_float_atomics("sparse_linear backward")
    finally:
        mb.device_capabilities.cache_clear()


def test_inline_shader_expectations_on_the_emulator():
    """The GPU tests' shader and oracles, checked here: the same source through the
    emulator (what needs the Apple GPU, the extension and the MPS stream, stays skipped)."""
    from torch_sparse_metal.emulator import compile_shader
    lib = compile_shader(INLINE_SHADER)
    n = 1000
    base_x, base_y = torch.randn(n + 5), torch.zeros(n + 3)
    x, y = base_x[5:], base_y[3:]
    lib.axpb(x, y, np.float32(2.0), np.uint32(n), threads=n, group_size=256)
    torch.testing.assert_close(y, 2.0 * x + 1.0)
    assert torch.count_nonzero(base_y[:3]) == 0
    n, g = 512, 64
    xi, yi = torch.arange(n, dtype=torch.int32), torch.empty(n, dtype=torch.int32)
    lib.reverse_in_group(xi, yi, threads=n, group_size=g, threadgroup_memory=[g * 4])
    assert torch.equal(yi, torch.arange(n, dtype=torch.int32).view(-1, g).flip(1).reshape(-1))
    y = torch.full((4,), 7.0)
    lib.axpb(y, y, np.float32(2.0), np.uint32(4), threads=0, group_size=32)
    assert torch.equal(y, torch.full((4,), 7.0))
