"""``python -m torch_sparse_metal.doctor``: what this machine can run, and why not.

Prints the platform, torch and its MPS backend, the Metal extension (loaded from where, or
why not, with the install's own build error when there was one), the Metal device and the
Metal language version the launcher compiles, the emulator's compiler and cache, and every
shader library the package uses, built on this machine's backend: on a Mac with the
extension, each shader once per dtype by Apple's compiler and each kernel's pipeline; else
each shader by the emulator (cached after the first run). ``--quick`` skips the builds;
``--json`` prints the same as JSON. ``tsm.show_config()`` prints it from Python.
"""
from __future__ import annotations

import argparse
import json
import platform
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Dict, List, Optional, Sequence

import torch

from . import _metal_backend
from ._kernel_catalog import dtype_of, kernels_by_shader
from ._version import __version__


@dataclass
class Library:
    """One shader library as this machine builds it."""
    shader: str
    dtype: Optional[str]        # Metal builds one library per dtype; the emulator one per file
    kernels: int
    ok: Optional[bool]          # None: not built (--quick)
    seconds: Optional[float] = None
    message: str = ""           # why it failed, or what was skipped


@dataclass
class Report:
    package: Dict[str, str]
    platform: Dict[str, str]
    torch: Dict[str, object]
    metal: Dict[str, object]
    emulator: Dict[str, object]
    backend: str                # what "auto" runs MPS tensors on, and why
    libraries: List[Library] = field(default_factory=list)


def _first_line(text: str) -> str:
    return text.strip().splitlines()[0] if text.strip() else ""


def _metal_section() -> Dict[str, object]:
    reason = _metal_backend.unavailable_reason()
    section: Dict[str, object] = {"available": reason is None}
    if reason is not None:
        section["why not"] = reason
    module, error = _metal_backend._import_extension(_metal_backend.EXTENSION) \
        if sys.platform == "darwin" else (None, None)
    if module is not None:
        section["extension"] = getattr(module, "__file__", "?")
    elif sys.platform == "darwin":
        section["extension"] = f"not importable: {error}"
    build_error = _metal_backend.build_error()
    if build_error:
        section["last build"] = build_error
    if reason is None:
        section["device"] = dict(_metal_backend.device_capabilities())
    return section


def _emulator_section() -> Dict[str, object]:
    from .emulator import cache_dir, cxx_compiler
    section: Dict[str, object] = {"cache": str(cache_dir())}
    try:
        cxx = cxx_compiler()
        version = subprocess.run([cxx, "--version"], capture_output=True, text=True).stdout
        section["compiler"] = f"{cxx} ({_first_line(version)})"
    except Exception as exc:  # noqa: BLE001 -- no compiler is a finding, not a crash
        section["compiler"] = f"none usable: {exc}"
    return section


def _metal_libraries(build: bool) -> List[Library]:
    libraries = []
    for shader, names in kernels_by_shader("metal").items():
        for dtype in dict.fromkeys(dtype_of(n) for n in names):
            mine = [n for n in names if dtype_of(n) == dtype]
            if not build:
                libraries.append(Library(shader, dtype, len(mine), None, message="not built"))
                continue
            start = time.perf_counter()
            failures = [(n, e) for n in mine
                        if (e := _metal_backend.kernel_failure(shader, n)) is not None]
            seconds = time.perf_counter() - start
            message = "" if not failures else \
                f"{len(failures)} of {len(mine)} kernels fail, {failures[0][0]} first: " \
                f"{failures[0][1]}"
            libraries.append(Library(shader, dtype, len(mine), not failures, seconds, message))
    return libraries


def _emulator_libraries(build: bool) -> List[Library]:
    from .emulator import load_shader_file
    libraries = []
    for shader, names in kernels_by_shader("emulator").items():
        if not build:
            libraries.append(Library(shader, None, len(names), None, message="not built"))
            continue
        start = time.perf_counter()
        try:
            built = set(load_shader_file(shader).kernel_names)
        except Exception as exc:  # noqa: BLE001 -- a shader that does not build is the finding
            libraries.append(Library(shader, None, len(names), False,
                                     time.perf_counter() - start, str(exc)))
            continue
        missing = [n for n in names if n not in built]
        libraries.append(Library(shader, None, len(names), not missing,
                                 time.perf_counter() - start,
                                 f"missing: {', '.join(missing)}" if missing else ""))
    return libraries


def report(build: bool = True) -> Report:
    """The findings; ``build=False`` skips building the shader libraries."""
    metal = _metal_section()
    on_metal = bool(metal["available"])
    backend = ("metal kernels, falling back per op where a kernel does not build (see the "
               "libraries)" if on_metal else f"plain-torch reference: {metal.get('why not')}")
    return Report(
        package={"version": __version__, "path": str(Path(__file__).resolve().parent)},
        platform={"system": platform.platform(), "machine": platform.machine(),
                  "python": platform.python_version()},
        torch={"version": torch.__version__, "mps built": torch.backends.mps.is_built(),
               "mps available": torch.backends.mps.is_available()},
        metal=metal, emulator=_emulator_section(), backend=backend,
        libraries=(_metal_libraries if on_metal else _emulator_libraries)(build))


def format_report(r: Report) -> str:
    lines = [f"torch_sparse_metal {r.package['version']} ({r.package['path']})",
             f"platform: {r.platform['system']} ({r.platform['machine']}), "
             f"Python {r.platform['python']}",
             f"torch {r.torch['version']}: MPS built {r.torch['mps built']}, "
             f"available {r.torch['mps available']}"]
    metal = dict(r.metal)
    lines.append("Metal: " + ("available" if metal.pop("available") else "unavailable"))
    device = metal.pop("device", None)
    lines += [f"  {key}: {value}" for key, value in metal.items()]
    if device:
        lines.append("  device: " + ", ".join(f"{k}={v}" for k, v in device.items()))
    lines.append("emulator: " + ", ".join(f"{k} {v}" for k, v in r.emulator.items()))
    lines.append(f"MPS tensors under backend 'auto' run on: {r.backend}")
    where = "Metal, one library per dtype" if r.metal["available"] else "the emulator"
    lines.append(f"shader libraries ({where}):")
    for lib in r.libraries:
        name = lib.shader + (f" [{lib.dtype}]" if lib.dtype else "")
        status = {True: "ok", False: "FAILED", None: "-"}[lib.ok]
        took = f"{lib.seconds:6.1f} s" if lib.seconds is not None else ""
        lines.append(f"  {name:32} {status:6} {lib.kernels:3} kernels {took}"
                     + (f"  {lib.message}" if lib.message else ""))
    return "\n".join(lines)


def show_config(build: bool = True) -> None:
    """Print the doctor's report (``python -m torch_sparse_metal.doctor``)."""
    print(format_report(report(build)))


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m torch_sparse_metal.doctor",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="do not build the shader libraries")
    parser.add_argument("--json", action="store_true", help="print the report as JSON")
    args = parser.parse_args(argv)
    r = report(build=not args.quick)
    print(json.dumps(asdict(r), indent=2, default=str) if args.json else format_report(r))
    return 0 if all(lib.ok is not False for lib in r.libraries) else 1


if __name__ == "__main__":
    sys.exit(main())
