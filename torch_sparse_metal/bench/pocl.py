"""PoCL (CPU OpenCL) through ``pyopencl``, for ``python -m torch_sparse_metal.bench emulator``.

Optional: without ``pyopencl`` or a PoCL CPU device, :func:`find_pocl` says why, and the
benchmark runs the emulator alone. Neither is a dependency of this package.
"""
from __future__ import annotations

import re
from typing import Callable, Dict, List, Sequence, Tuple, Union

import numpy as np

from .._shaders import shader_path


class PoclDevice:
    """A PoCL CPU device with some of ``shaders/``'s OpenCL programs built (:func:`find_pocl`)."""

    def __init__(self, cl, context, programs: Dict[str, object]) -> None:
        self._cl = cl
        self.context = context
        self.queue = cl.CommandQueue(context)
        self._programs = programs
        device = context.devices[0]
        version = device.platform.version
        pocl = re.search(r"PoCL \S+", version)
        llvm = re.search(r"LLVM [\d.]+", version)
        self.description = (f"{pocl.group(0) if pocl else version}"
                            f"{f' ({llvm.group(0)})' if llvm else ''}, device {device.name!r}, "
                            f"{device.max_compute_units} compute units")

    def prepare(self, program: str, kernel: str, args: Sequence[object], outputs: Sequence[int],
                global_size: Tuple[int, ...], local_size: Tuple[int, ...],
                local_memory: Sequence[int] = ()
                ) -> Tuple[Callable[[], None], Callable[[], List[np.ndarray]]]:
        """``(run, read)`` for ``kernel`` of ``shaders/<program>.cl`` over ``args``: NumPy
        arrays (copied into buffers now; ``outputs`` are their indices) and NumPy scalars,
        then ``local_memory`` arguments of those byte lengths. ``run`` dispatches and waits;
        ``read`` copies the outputs back."""
        cl = self._cl
        k = cl.Kernel(self._programs[program], kernel)
        flags = cl.mem_flags.READ_WRITE | cl.mem_flags.COPY_HOST_PTR
        bound = [cl.Buffer(self.context, flags, hostbuf=a) if isinstance(a, np.ndarray) else a
                 for a in args]
        k.set_args(*bound, *(cl.LocalMemory(n) for n in local_memory))

        def run() -> None:
            cl.enqueue_nd_range_kernel(self.queue, k, global_size, local_size)
            self.queue.finish()

        def read() -> List[np.ndarray]:
            out = [np.empty_like(args[i]) for i in outputs]
            for i, host in zip(outputs, out):
                cl.enqueue_copy(self.queue, host, bound[i])
            self.queue.finish()
            return out
        return run, read


def _build_error(exc: Exception) -> str:
    """The compiler's error line from pyopencl's build failure (which quotes the log)."""
    lines = str(exc).strip().splitlines()
    errors = [line.strip() for line in lines if "error" in line.lower()]
    return errors[-1] if errors else (lines[0] if lines else type(exc).__name__)


def find_pocl(programs: Sequence[str]) -> Union[PoclDevice, str]:
    """The first PoCL CPU device that builds ``shaders/<program>.cl`` for each of
    ``programs``, or why there is none (``"not installed ..."``, ``"unavailable: ..."``)."""
    try:
        import pyopencl as cl
    except ImportError:
        return "not installed (pip install pyopencl pocl-binary-distribution)"
    try:
        platforms = [p for p in cl.get_platforms() if "pocl" in p.version.lower()]
    except cl.Error:  # the ICD loader found no OpenCL platform at all
        platforms = []
    devices = [d for p in platforms for d in p.get_devices() if d.type & cl.device_type.CPU]
    if not devices:
        return "not installed (pyopencl finds no PoCL CPU device)"
    failures = []
    for device in devices:
        context = cl.Context([device])
        try:
            built = {name: cl.Program(context, shader_path(name + ".cl").read_text()).build()
                     for name in programs}
        except cl.Error as exc:
            failures.append(f"{device.name}: {_build_error(exc)}")
            continue
        return PoclDevice(cl, context, built)
    return "unavailable: PoCL could not build the kernels (" + "; ".join(failures) + ")"
