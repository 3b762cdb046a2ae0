"""The emulator's AArch64 code (Apple silicon, AArch64 Linux), run on any machine: the
runtime and the C++ the package's rewriter generates for aarch64/kernels.metal are
cross-compiled for AArch64 Linux with a driver (aarch64/driver.cpp) that dispatches them
through the runtime's C interface and checks the results, then run under qemu-user, with
the assembly fiber switch and with the ucontext fallback.

Covered: fibers switching across threadgroup barriers (a tree reduction), SIMD-group
collectives (sums, shuffles, ballots, reconvergence), atomics racing across worker threads
(int, float, a CAS loop), faults reported as crashes while the process lives on (a wild
write, a null read, a fiber stack overflow, a trap), arithmetic the flags make independent
of the host, and a canary: values live across 200 switches in every callee-saved integer
and floating-point register, compared bit for bit with the same arithmetic run without
fibers.

Needs qemu-user, the GNU AArch64 cross toolchain (libraries, linker) and a cross compiler
with _Float16 and stack-clash protection (without it a large frame can step over a fiber's
guard region): aarch64-linux-gnu-g++ 13+, or clang++ 19+ with --target=aarch64-linux-gnu
(Debian 12's cross g++ is version 12). `.ci/run` installs them; skipped when missing.
"""
import functools
import os
import shutil
import subprocess
from pathlib import Path
from typing import List, Optional

import pytest

from torch_sparse_metal._paths import EMULATOR_DIR
from torch_sparse_metal.emulator import _compiler

HERE = Path(__file__).resolve().parent / "aarch64"
SYSROOT = "/usr/aarch64-linux-gnu"  # where Debian's cross toolchain keeps AArch64 libraries
CHECKS = ["tree_sum", "simd_collectives", "atomics", "canary", "host_independent_arithmetic",
          "fault_wild_write", "fault_null_read", "fault_stack_overflow", "fault_trap"]
CLANGS = ["clang++"] + [f"clang++-{v}" for v in range(22, 13, -1)]
EM_AARCH64 = 183  # ELF e_machine


@functools.lru_cache(maxsize=None)
def cross_compiler() -> Optional[List[str]]:
    """The first AArch64 Linux C++ compiler fit for the emulator (see the module's doc)."""
    probe = "#include <thread>\n" + _compiler.FLOAT16_PROBE
    candidates = [["aarch64-linux-gnu-g++"]] + [[c, "--target=aarch64-linux-gnu"] for c in CLANGS]
    for command in candidates:
        if shutil.which(command[0]) and _compiler.compiles(command, probe, ["-Werror", "-fstack-clash-protection"]):
            return command
    return None


def build(command: List[str]) -> None:
    done = subprocess.run(command, capture_output=True, text=True)
    assert done.returncode == 0, f"{' '.join(command)}\n{done.stderr}"


def missing_tools() -> List[str]:
    missing = [tool for tool in ("qemu-aarch64", "aarch64-linux-gnu-g++") if not shutil.which(tool)]
    if not missing and cross_compiler() is None:
        missing.append("an AArch64 C++ compiler with _Float16 and stack-clash protection")
    return missing


@pytest.fixture(scope="module")
def driver(tmp_path_factory) -> Path:
    missing = missing_tools()
    if missing:
        pytest.skip(f"needs {', '.join(missing)} (Debian: apt-get install qemu-user "
                    f"g++-aarch64-linux-gnu clang-19)")
    cxx = cross_compiler()
    out = tmp_path_factory.mktemp("aarch64")
    generated = _compiler.generated_cxx(HERE / "kernels.metal", command=cxx)
    kernels = out / "kernels.cpp"
    kernels.write_text(generated.text)
    objects = []
    for source in [*_compiler.runtime_sources(), kernels, HERE / "driver.cpp"]:
        obj = out / (source.stem + ".o")
        build([*cxx, *generated.flags, "-I", str(EMULATOR_DIR / "src"), "-c", str(source), "-o", str(obj)])
        objects.append(str(obj))
    exe = out / "driver"
    build([*cxx, *objects, "-o", str(exe), "-pthread", "-lm"])
    assert exe.read_bytes()[18] == EM_AARCH64, "the driver was not built for AArch64"
    return exe


@pytest.mark.parametrize("switch", ["assembly", "ucontext"])
def test_runtime_on_aarch64(driver, switch):
    env = dict(os.environ, TSM_EMU_UCONTEXT="1" if switch == "ucontext" else "0")
    done = subprocess.run(["qemu-aarch64", "-L", SYSROOT, str(driver)], env=env, capture_output=True,
                          text=True, timeout=300)
    passed = [line.split()[1] for line in done.stdout.splitlines() if line.startswith("ok ")]
    assert done.returncode == 0 and passed == CHECKS, done.stdout + done.stderr
