"""``python -m torch_sparse_metal.bench <benchmark> [options]``."""
from __future__ import annotations

import argparse
import json
import sys

from .dims import parse_dims


def _checked(convert):
    """An argparse ``type`` from ``convert`` (text -> value, ValueError naming the problem):
    a bad value becomes argparse's usage message and exit status 2, not a traceback."""
    def parse(text: str):
        try:
            return convert(text)
        except ValueError as e:
            raise argparse.ArgumentTypeError(str(e)) from None
    return parse


def _number(text: str, kind=float):
    try:
        return kind(text)
    except ValueError:
        raise ValueError(f"{text!r} is not {'an int' if kind is int else 'a number'}") from None


def _at_least(minimum: int):
    def convert(text: str) -> int:
        value = _number(text, int)
        if value < minimum:
            raise ValueError(f"{text!r}: must be at least {minimum}")
        return value
    return _checked(convert)


@_checked
def _positive_float(text: str) -> float:
    value = _number(text)
    if not 0 < value < float("inf"):
        raise ValueError(f"{text!r}: must be a positive number")
    return value


@_checked
def _density(text: str) -> float:
    value = _number(text)
    if not 0 < value <= 1:
        raise ValueError(f"{text!r}: must lie in (0, 1]")
    return value


@_checked
def _chip(text: str):
    from .roofline import chip
    return chip(text)


@_checked
def _size(text: str):
    """``IxO`` (in_features x out_features) or ``S`` for ``S x S``."""
    return parse_dims(text, "size", "IxO")


def _add_chip(parser, default=None):
    parser.add_argument("--chip", type=_chip, nargs="+", default=default,
                        metavar="{m1,m1-max,m2-max,m3-max,m4,m4-max,m5}",
                        help="print beside the counters a lower bound on the GPU time on "
                             "these chips, from public peak figures (not a measurement)")


@_checked
def _shape(text: str):
    from .matmul import parse_shape
    return parse_shape(text)


POSITIVE = _at_least(1)
NON_NEGATIVE = _at_least(0)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m torch_sparse_metal.bench",
                                     description=__doc__)
    sub = parser.add_subparsers(dest="benchmark", required=True)
    san = sub.add_parser("sanitizer", help="the sanitizer's slowdown on barrier-heavy kernels")
    san.add_argument("--sizes", type=POSITIVE, nargs="+", default=[32, 64, 128],
                     help="matrix sizes n (the reduction uses n*n elements)")
    san.add_argument("--repeats", type=POSITIVE, default=3)
    san.add_argument("--json", action="store_true", help="print the rows as JSON")
    train = sub.add_parser("train", help="a sparse MLP training step split by phase, with "
                                         "dispatch counts (emulator) or ms (MPS)")
    train.add_argument("--widths", type=POSITIVE, nargs="+", default=[784, 256, 128, 10],
                       help="layer widths, input first (at least two)")
    train.add_argument("--density", type=_density, default=0.1)
    train.add_argument("--batch", type=POSITIVE, default=128)
    train.add_argument("--steps", type=POSITIVE, default=5)
    train.add_argument("--backend", choices=["auto", "metal", "emulator"], default="auto",
                       help="auto: MPS when available, else the emulator")
    train.add_argument("--json", action="store_true", help="print the result as JSON")
    km = sub.add_parser("kmeans", help="k-means: ms per Lloyd iteration and points/s vs "
                                       "scikit-learn; emulator dispatch counts and counters")
    km.add_argument("--n", type=POSITIVE, default=20000, help="points")
    km.add_argument("--d", type=POSITIVE, default=32, help="features")
    km.add_argument("--k", type=POSITIVE, default=16, help="clusters")
    km.add_argument("--iters", type=POSITIVE, default=10, help="Lloyd iterations per fit")
    km.add_argument("--json", action="store_true", help="print the result as JSON")
    _add_chip(km)
    sp = sub.add_parser("sparse", help="the sparse layer's forward and backward kernels: "
                                       "emulator counters, coalescing, a roofline per chip")
    sp.add_argument("--sizes", type=_size, nargs="+", default=[(4096, 4096)], metavar="S|IxO",
                    help="in_features x out_features (default 4096x4096)")
    sp.add_argument("--density", type=_density, default=0.01)
    sp.add_argument("--batch", type=POSITIVE, default=64)
    sp.add_argument("--dtypes", nargs="+", choices=["float32", "float16", "bfloat16"],
                    default=["float32", "float16"], help="default: float32 float16")
    sp.add_argument("--json", action="store_true", help="print the rows as JSON")
    _add_chip(sp, default=[_chip("m1-max"), _chip("m4-max")])
    bl = sub.add_parser("block", help="BlockSparseLinear at several block sparsities against "
                                      "the dense layer: emulator counters, a roofline per chip")
    bl.add_argument("--size", type=POSITIVE, default=1024, help="in = out features (default 1024)")
    bl.add_argument("--batch", type=POSITIVE, default=64)
    bl.add_argument("--block", type=int, choices=[8, 16, 32], default=16)
    bl.add_argument("--sparsities", type=_density, nargs="+", default=[0.5, 0.75, 0.9, 0.95],
                    help="fractions of the blocks left empty (default 0.5 0.75 0.9 0.95)")
    bl.add_argument("--dtype", choices=["float32", "float16", "bfloat16"], default="float32")
    bl.add_argument("--json", action="store_true", help="print the rows as JSON")
    _add_chip(bl, default=[_chip("m1-max"), _chip("m4-max")])
    ops = sub.add_parser("ops", help="per-call cost of each op registration style (direct, "
                                     "autograd.Function, custom_op, Library.define) around a "
                                     "no-op kernel")
    ops.add_argument("--device", choices=["emulator", "mps"], default=None,
                     help="default: mps on a Mac with MPS and the extension, else emulator")
    ops.add_argument("--calls", type=POSITIVE, default=2000, help="calls per timed round")
    ops.add_argument("--repeats", type=POSITIVE, default=5, help="rounds (the minimum counts)")
    ops.add_argument("--json", action="store_true", help="print the rows as JSON")
    mat = sub.add_parser("matmul", help="the matmul ladder: counters on the emulator, "
                                        "TFLOP/s vs torch.mm and MPSMatrixMultiplication on MPS")
    mat.add_argument("--device", choices=["emulator", "mps"], default=None,
                     help="default: mps on a Mac with MPS and the extension, else emulator")
    mat.add_argument("--sizes", type=_shape, nargs="+", default=None, metavar="S|MxNxK",
                     help="shapes (default: 256-4096 square + transformer shapes on MPS, "
                          "small shapes on the emulator)")
    mat.add_argument("--kernels", nargs="+", default=None,
                     choices=["naive", "tiled", "register", "simdgroup", "shuffle"])
    mat.add_argument("--dtype", choices=["float32", "float16", "bfloat16"], default="float32")
    mat.add_argument("--warmup", type=NON_NEGATIVE, default=3)
    mat.add_argument("--repeats", type=POSITIVE, default=10,
                     help="MPS: calls timed back to back between two synchronisations")
    mat.add_argument("--peak-tflops", type=_positive_float, default=None,
                     help="the chip's FP32 peak, for %% of peak (default: from the chip name)")
    mat.add_argument("--csv", default=None, help="MPS: write the rows to this CSV file")
    mat.add_argument("--plot", default=None, help="MPS: write a PNG bar chart here")
    mat.add_argument("--json", action="store_true", help="print the rows as JSON")
    _add_chip(mat)
    emu = sub.add_parser("emulator", help="the emulator's speed: kernels with an OpenCL twin "
                                          "against PoCL when installed, the project's shaders, "
                                          "the sanitizer's slowdown")
    emu.add_argument("--repeats", type=POSITIVE, default=5,
                     help="interleaved timing rounds after the checked warm-up")
    emu.add_argument("--sanitized-repeats", type=NON_NEGATIVE, default=1,
                     help="of those rounds, how many also run the sanitized build (0: none)")
    emu.add_argument("--matmul-sizes", type=POSITIVE, nargs="+", default=[128, 256, 512],
                     help="n of the tiled matmul twin (n^3)")
    emu.add_argument("--mm-sizes", type=POSITIVE, nargs="+", default=[256, 512],
                     help="n of tsm.mm, every rung (n^3)")
    emu.add_argument("--twins-only", action="store_true",
                     help="only the kernels with an OpenCL twin")
    emu.add_argument("--csv", default=None, metavar="PATH",
                     help="also write the rows to a CSV file")
    emu.add_argument("--json", action="store_true", help="print the result as JSON")
    args = parser.parse_args(argv)
    if args.benchmark == "train" and len(args.widths) < 2:
        train.error("--widths needs at least two widths (input and output)")
    if args.benchmark == "kmeans" and args.k > args.n:
        km.error(f"--k {args.k} is more clusters than --n {args.n} points")

    if args.benchmark == "sanitizer":
        from . import sanitizer
        rows = sanitizer.run(args.sizes, args.repeats)
        print(json.dumps(rows, indent=2) if args.json else sanitizer.format_table(rows))
    elif args.benchmark == "matmul":
        from . import matmul
        rows, table = matmul.main(args)
        print(json.dumps(rows, indent=2) if args.json else table)
    elif args.benchmark == "train":
        from . import train as train_bench
        result = train_bench.run(args.widths, args.density, args.batch, args.steps,
                                 args.backend)
        print(json.dumps(result, indent=2) if args.json else train_bench.format_table(result))
    elif args.benchmark == "ops":
        from . import ops as ops_bench
        device = args.device or ops_bench.default_device()
        rows = ops_bench.run(args.calls, args.repeats, device)
        print(json.dumps(rows, indent=2) if args.json else ops_bench.format_table(rows, device))
    elif args.benchmark == "kmeans":
        from . import kmeans as kmeans_bench
        result = kmeans_bench.run(args.n, args.d, args.k, args.iters, chips=args.chip or ())
        print(json.dumps(result, indent=2) if args.json else kmeans_bench.format_report(result))
    elif args.benchmark == "sparse":
        from . import sparse
        rows = sparse.run(args.sizes, args.density, args.batch, args.chip, dtypes=args.dtypes)
        print(json.dumps(rows, indent=2) if args.json else sparse.format_table(rows, args.chip))
    elif args.benchmark == "block":
        from . import block
        if args.size % args.block:
            parser.error(f"argument --size: {args.size} is not a multiple of --block {args.block}")
        rows = block.run(args.size, args.batch, args.block, args.sparsities, args.dtype,
                         args.chip)
        print(json.dumps(rows, indent=2) if args.json else block.format_table(rows, args.chip))
    elif args.benchmark == "emulator":
        from . import emulator
        result, table = emulator.main(args)
        print(json.dumps(result, indent=2) if args.json else table)
        return 0 if all(row["ok"] for row in result["rows"]) else 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
