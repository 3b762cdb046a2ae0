"""The diagnostics a Mac user runs first, run here on the emulator as CI: ``doctor`` (what this
machine can run and why not) and ``selftest`` (every kernel against the reference, a short
training with its synchronisations counted, a small benchmark)."""
from __future__ import annotations

import subprocess
import sys

import pytest
import torch

import torch_sparse_metal._metal_backend as mb
from torch_sparse_metal import doctor, selftest
from torch_sparse_metal._kernel_catalog import kernels_by_shader


def run_module(module: str, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", module, *args], capture_output=True,
                          text=True, timeout=1200)


def test_doctor_on_the_emulator():
    done = run_module("torch_sparse_metal.doctor")
    assert done.returncode == 0, done.stdout + done.stderr
    out = done.stdout
    assert f"torch {torch.__version__}" in out
    assert "Metal: unavailable" in out and "why not: the Metal backend needs macOS 14" in out
    assert "MPS tensors under backend 'auto' run on: plain-torch reference" in out
    for shader, names in kernels_by_shader("emulator").items():
        line = next(l for l in out.splitlines() if l.strip().startswith(shader + " "))
        assert " ok " in line and f"{len(names):3} kernels" in line, line


class RejectsBfloat:
    """A Metal launcher whose compiler rejects the bfloat libraries."""

    class CompileError(RuntimeError):
        pass

    def kernel_names(self, source):
        if source.startswith("#define TSM_LIBRARY_DTYPE TSM_DTYPE_BFLOAT"):
            raise self.CompileError("matmul_tiled.metal:40:3: error: 'bfloat' is not supported")
        return [n for names in kernels_by_shader("metal").values() for n in names]

    def pipeline_info(self, source, kernel):
        return {"buffers": [], "threadgroups": [], "max_total_threads_per_threadgroup": 1024,
                "thread_execution_width": 32, "static_threadgroup_memory": 0}


@pytest.fixture
def fake_mac(monkeypatch):
    monkeypatch.setattr(mb, "_extension", lambda: RejectsBfloat())
    monkeypatch.setattr(mb, "unavailable_reason", lambda: None)
    monkeypatch.setattr(mb, "_device_info", lambda: {
        "name": "Fake M9", "supports_apple7": True, "supports_metal3": True,
        "max_threadgroup_memory": 32768, "metal_language_version": "3.1", "fast_math": False})
    for cached in (mb.kernel_info, mb.kernel_failure, mb.device_capabilities):
        cached.cache_clear()
    yield
    for cached in (mb.kernel_info, mb.kernel_failure, mb.device_capabilities):
        cached.cache_clear()


def test_doctor_on_a_mac_builds_each_dtypes_library(fake_mac, capsys):
    assert doctor.main([]) == 1   # a library failed
    out = capsys.readouterr().out
    assert "Metal: available" in out and "name=Fake M9" in out
    assert "Metal, one library per dtype" in out
    for shader, names in kernels_by_shader("metal").items():
        for dtype in ("float", "half", "bfloat"):
            lines = [l for l in out.splitlines() if l.strip().startswith(f"{shader} [{dtype}]")]
            if not any(n.endswith("_" + dtype) for n in names):
                assert lines == []
                continue
            (line,) = lines
            if dtype == "bfloat":
                assert " FAILED " in line and "'bfloat' is not supported" in line
            else:
                assert " ok " in line


def test_doctor_quick_builds_nothing(fake_mac, capsys):
    assert doctor.main(["--quick"]) == 0
    out = capsys.readouterr().out
    assert " ok " not in out and "not built" in out


def test_doctor_says_why_the_extension_did_not_build(monkeypatch, tmp_path, capsys):
    """setup.py writes the build's failure beside the extension: pip hides it without -v."""
    record = tmp_path / "_metal_launcher.build-error.txt"
    record.write_text("torch_sparse_metal: torch_sparse_metal._metal_launcher was not built "
                      "(CompileError: xcrun: error: invalid active developer path)\n")
    monkeypatch.setattr(mb, "BUILD_ERROR", record)
    monkeypatch.setattr(sys, "platform", "darwin")
    monkeypatch.setattr(mb, "_import_extension",
                        lambda name: (None, ImportError("No module named '_metal_launcher'")))
    doctor.main(["--quick"])
    out = capsys.readouterr().out
    assert "invalid active developer path" in out
    assert "the install's build of it failed" in mb.unavailable_reason()


def test_selftest_on_the_emulator(tmp_path):
    report = tmp_path / "report.md"
    done = run_module("torch_sparse_metal.selftest", "--quick", "--output", str(report))
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    text = report.read_text()
    assert text in done.stdout
    passed = [l for l in text.splitlines() if l.startswith("## Kernels against")][0]
    n = int(passed.rsplit(" of ", 1)[1].split()[0])
    assert passed.endswith(f"{n} of {n} passed") and n >= 30
    assert "Every kernel ran." in text
    assert "- syncs per step: 0" in text
    assert "| mm 128^3 float32 (against torch.mm) |" in text
    assert "- backend: emulator (cpu)" in text


def test_selftest_fails_loudly(monkeypatch, tmp_path, capsys):
    """A check beyond its bound and a kernel no check ran each fail the run."""
    monkeypatch.setattr(selftest, "bound", lambda dtype, reduction: 0.0)
    original = selftest.checks
    monkeypatch.setattr(selftest, "checks", lambda m, quick: (
        c for c in original(m, quick) if not c[0].startswith(("k-means", "mm/addmm"))))
    monkeypatch.setattr(selftest, "training", lambda m, quick: {"syncs per step": 0})
    monkeypatch.setattr(selftest, "benchmark", lambda m, quick: [])
    assert selftest.main(["--quick", "--output", str(tmp_path / "r.md")]) == 1
    text = (tmp_path / "r.md").read_text()
    assert "| FAIL |" in text
    assert "Kernels no check ran" in text and "kmeans_assign_float" in text
