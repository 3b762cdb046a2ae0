"""The emulator from the command line, for Metal written outside this project.

    python -m torch_sparse_metal.emulator check kernel.metal [--std 3.1] [-I DIR]
    python -m torch_sparse_metal.emulator run kernel.metal my_kernel --grid 1024 --group 256 \\
        in.npy out.npy int32:1024 [--sanitize] [--out DIR]

``check`` runs Metal's language rules at a language version (what Apple's compiler would
reject: address spaces, what MSL lacks, Metal's library signatures) and the emulator's
translation, without building anything, and lists the file's kernels. ``run`` builds the
file and dispatches one kernel: each argument binds ``[[buffer(i)]]`` in order, a ``.npy``
file as a buffer (the kernel's writes go back to that file, or to ``--out DIR``), a typed
scalar as its value (``int32:5``, ``uint32:3``, ``float32:1.5``, ``float16:0.5``,
``bool:1``), ``none`` where the kernel's indices have a gap. ``--sanitize`` runs the
checked build: an out-of-bounds access, a race or a divergent barrier is reported with
the thread, the buffer and the element.

Exit status 0 on success, 1 when the source is rejected or the kernel faults, 2 for bad
arguments.
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import List, Optional, Sequence, Tuple

import numpy as np

from . import LANGUAGE_VERSIONS, DEFAULT_LANGUAGE_VERSION, compile_shader
from ..errors import KernelFault, LaunchError, MetalCompileError

_SCALARS = {"int8": np.int8, "int16": np.int16, "int32": np.int32, "int64": np.int64,
            "uint8": np.uint8, "uint16": np.uint16, "uint32": np.uint32, "uint64": np.uint64,
            "float16": np.float16, "float32": np.float32, "bool": np.bool_}


def _dims(text: str) -> Tuple[int, ...]:
    try:
        dims = tuple(int(d) for d in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected 1 to 3 comma-separated integers, got {text!r}")
    if not 1 <= len(dims) <= 3 or any(d < 0 for d in dims):
        raise argparse.ArgumentTypeError(f"expected 1 to 3 non-negative integers, got {text!r}")
    return dims


def _argument(text: str):
    """``path.npy`` -> (Path, array); ``type:value`` -> NumPy scalar; ``none`` -> None."""
    if text == "none":
        return None
    if text.endswith(".npy"):
        path = Path(text)
        if not path.is_file():
            raise argparse.ArgumentTypeError(f"no such file: {text}")
        return path, np.ascontiguousarray(np.load(path, allow_pickle=False))
    kind, sep, value = text.partition(":")
    if not sep or kind not in _SCALARS:
        raise argparse.ArgumentTypeError(
            f"{text!r}: an argument is a .npy file, none, or TYPE:VALUE with TYPE one of "
            f"{', '.join(_SCALARS)}")
    try:
        number = float(value) if kind.startswith("float") else int(value)
        return _SCALARS[kind](number)
    except (ValueError, OverflowError):
        raise argparse.ArgumentTypeError(f"{text!r}: {value!r} is not a {kind}")


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m torch_sparse_metal.emulator",
                                     description=__doc__.split("\n\n")[0])
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("source", type=Path, help="the .metal file")
    common.add_argument("--std", default=DEFAULT_LANGUAGE_VERSION, choices=LANGUAGE_VERSIONS,
                        help="Metal Shading Language version (default: %(default)s)")
    common.add_argument("-I", dest="include_dirs", action="append", default=[], type=Path,
                        help="a directory quoted and angle includes resolve in (repeatable)")
    commands = parser.add_subparsers(dest="command", required=True)
    commands.add_parser("check", parents=[common],
                        help="check Metal's rules and list the kernels; builds nothing")
    run = commands.add_parser("run", parents=[common], help="build the file and run one kernel")
    run.add_argument("kernel", help="the kernel's name (its host_name for a template)")
    run.add_argument("arguments", nargs="*", type=_argument,
                     help="[[buffer(i)]] in order: FILE.npy, TYPE:VALUE or none")
    run.add_argument("--grid", type=_dims, required=True,
                     help="threads in the grid, X[,Y[,Z]] (dispatchThreads)")
    run.add_argument("--group", type=_dims, default=None,
                     help="threads per threadgroup, X[,Y[,Z]] (default: the emulator's choice)")
    run.add_argument("--threadgroup-memory", type=_dims, default=(),
                     help="byte length of each [[threadgroup(n)]], N0[,N1...]")
    run.add_argument("--sanitize", action="store_true",
                     help="the checked build: bounds, races, divergent barriers")
    run.add_argument("--out", type=Path, default=None,
                     help="write the buffers here (same names) instead of back to their files")
    return parser


def _check(args) -> int:
    from ._compiler import generated_cxx
    source = args.source.resolve()
    cxx = generated_cxx(source, include_dirs=[d.resolve() for d in args.include_dirs],
                        language_version=args.std)
    names = [k.host_name for k in cxx.kernels]
    print(f"{args.source}: passes Metal's rules at MSL {args.std}; "
          f"{len(names)} kernel(s): {', '.join(names) or '(none)'}")
    return 0


def _run(args) -> int:
    library = compile_shader(args.source.read_text(),
                             include_dirs=[str(d) for d in [args.source.parent, *args.include_dirs]],
                             sanitize=args.sanitize, language_version=args.std)
    buffers: List[Tuple[Path, np.ndarray]] = [a for a in args.arguments if isinstance(a, tuple)]
    bound = [a[1] if isinstance(a, tuple) else a for a in args.arguments]
    launch = dict(threads=args.grid, threadgroup_memory=list(args.threadgroup_memory))
    if args.group is not None:
        launch["group_size"] = args.group
    start = time.perf_counter()
    library[args.kernel](*bound, **launch)
    took = time.perf_counter() - start
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
    for path, array in buffers:
        np.save(path if args.out is None else args.out / path.name, array)
    checked = " sanitized" if args.sanitize else ""
    where = f" to {args.out}" if args.out is not None else " back to their files"
    print(f"{args.kernel}: ran{checked} over grid {args.grid} in {took * 1e3:.1f} ms; "
          f"{len(buffers)} buffer(s) written{where}")
    return 0


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = _parser().parse_args(argv)
    if not args.source.is_file():
        print(f"no such file: {args.source}", file=sys.stderr)
        return 2
    try:
        return (_check if args.command == "check" else _run)(args)
    except (MetalCompileError, KernelFault) as error:
        print(error, file=sys.stderr)
        return 1
    except LaunchError as error:
        print(error, file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
