"""The emulator's public API is one documented list, and the rest of the package uses only it:
what both backends share (bind-time checks, launch records, errors) lives beside the launch
contract, not inside the emulator."""
from __future__ import annotations

import ast
import re
from pathlib import Path

import torch_sparse_metal as tsm
import torch_sparse_metal.emulator as emulator

PACKAGE = Path(tsm.__file__).resolve().parent
DOC = PACKAGE.parent / "docs" / "emulator.md"
PUBLIC = {"compile_shader", "load_shader_file", "Library", "Kernel", "Sampler", "record", "Launch",
          "instrumented", "sanitize_by_default", "coalescing_efficiency", "lane_efficiency", "KernelFault",
          "LaunchError", "MetalCompileError", "UnknownKernelError", "LANGUAGE_VERSIONS",
          "DEFAULT_LANGUAGE_VERSION", "LAUNCHER_LANGUAGE_VERSIONS", "DEFAULT_SEGMENT_BYTES",
          "cxx_compiler", "cache_dir"}


def test_the_public_api_is_the_documented_list():
    assert set(emulator.__all__) == PUBLIC
    table = DOC.read_text().split("### The public API", 1)[1].split("\n\n", 3)[2]
    documented = set(re.findall(r"`(\w+)", table))
    assert PUBLIC <= documented, PUBLIC - documented
    for name in PUBLIC:
        assert hasattr(emulator, name), name


def private_imports_of_the_emulator(path: Path):
    """``(line, what)`` for each import in ``path`` that reaches a private module or name
    of ``torch_sparse_metal.emulator``."""
    rel = path.relative_to(PACKAGE.parent).with_suffix("").parts
    package = rel[:-1] if rel[-1] != "__init__" else rel[:-1]
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            base = list(package[:len(package) - node.level + 1]) if node.level else []
            module = ".".join(base + ([node.module] if node.module else []))
            names = [a.name for a in node.names]
        elif isinstance(node, ast.Import):
            module, names = "", [a.name for a in node.names]
        else:
            continue
        for full in ([f"{module}.{n}" for n in names] if module else names):
            parts = full.split(".")
            if parts[:2] == ["torch_sparse_metal", "emulator"] and \
                    any(p.startswith("_") for p in parts[2:]):
                yield node.lineno, full
    yield from _private_attributes(path, package)


def _private_attributes(path: Path, package):
    """``emulator.<name>`` with ``<name>`` not public, where ``emulator`` is a name the module
    bound to the package (``from .. import emulator``, ``import ... as e``)."""
    tree = ast.parse(path.read_text())
    bound = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            base = list(package[:len(package) - node.level + 1]) if node.level else []
            module = ".".join(base + ([node.module] if node.module else []))
            bound |= {a.asname or a.name for a in node.names
                      if f"{module}.{a.name}" == "torch_sparse_metal.emulator"}
        elif isinstance(node, ast.Import):
            bound |= {a.asname for a in node.names
                      if a.name == "torch_sparse_metal.emulator" and a.asname}
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) \
                and node.value.id in bound and node.attr not in emulator.__all__:
            yield node.lineno, f"torch_sparse_metal.emulator.{node.attr}"


def test_the_rest_of_the_package_uses_only_the_public_api():
    found = [f"{path.relative_to(PACKAGE.parent)}:{line} imports {what}"
             for path in sorted(PACKAGE.rglob("*.py"))
             if "emulator" not in path.relative_to(PACKAGE).parts
             for line, what in private_imports_of_the_emulator(path)]
    assert not found, "\n".join(found)


def test_an_attribute_of_the_emulator_outside_its_api_is_found(tmp_path):
    probe = tmp_path / "probe.py"  # as if it were torch_sparse_metal/bench/probe.py
    probe.write_text("from .. import emulator as emu\nemu.sanitize_by_default()\nemu._compiler\n")
    found = list(_private_attributes(probe, ("torch_sparse_metal", "bench")))
    assert found == [(3, "torch_sparse_metal.emulator._compiler")]


def test_the_shared_launch_contract_lives_outside_the_emulator():
    import torch_sparse_metal._binding as binding
    import torch_sparse_metal._record as record
    import torch_sparse_metal.errors as errors
    for module in (binding, record, errors):
        assert "emulator" not in Path(module.__file__).parts
    assert emulator.LaunchError is errors.LaunchError and emulator.record is record.record
    assert tsm.record is record.record
