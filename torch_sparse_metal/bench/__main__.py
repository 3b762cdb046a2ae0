"""``python -m torch_sparse_metal.bench <benchmark> [options]``."""
from __future__ import annotations

import argparse
import json
import sys


def _at_least(low: int):
    """An argparse type: an int >= ``low``."""
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
        if value < low:
            raise argparse.ArgumentTypeError(f"must be >= {low}, got {value}")
        return value
    return parse


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m torch_sparse_metal.bench",
                                     description=__doc__)
    sub = parser.add_subparsers(dest="benchmark", required=True)
    san = sub.add_parser("sanitizer", help="the sanitizer's slowdown on barrier-heavy kernels")
    san.add_argument("--sizes", type=int, nargs="+", default=[32, 64, 128],
                     help="matrix sizes n (the reduction uses n*n elements)")
    san.add_argument("--repeats", type=int, default=3)
    san.add_argument("--json", action="store_true", help="print the rows as JSON")
    train = sub.add_parser("train", help="a sparse MLP training step split by phase, with "
                                         "dispatch counts (emulator) or ms (MPS)")
    train.add_argument("--widths", type=int, nargs="+", default=[784, 256, 128, 10])
    train.add_argument("--density", type=float, default=0.1)
    train.add_argument("--batch", type=int, default=128)
    train.add_argument("--steps", type=int, default=5)
    train.add_argument("--backend", choices=["auto", "metal", "emulator"], default="auto",
                       help="auto: MPS when available, else the emulator")
    train.add_argument("--json", action="store_true", help="print the result as JSON")
    km = sub.add_parser("kmeans", help="k-means: ms per Lloyd iteration and points/s vs "
                                       "scikit-learn; emulator dispatch counts and counters")
    km.add_argument("--n", type=int, default=20000, help="points")
    km.add_argument("--d", type=int, default=32, help="features")
    km.add_argument("--k", type=int, default=16, help="clusters")
    km.add_argument("--iters", type=int, default=10, help="Lloyd iterations per fit")
    km.add_argument("--json", action="store_true", help="print the result as JSON")
    mat = sub.add_parser("matmul", help="the matmul ladder: counters on the emulator, "
                                        "TFLOP/s vs torch.mm and MPSMatrixMultiplication on MPS")
    mat.add_argument("--device", choices=["emulator", "mps"], default=None,
                     help="default: mps on a Mac with MPS and the extension, else emulator")
    mat.add_argument("--sizes", nargs="+", default=None, metavar="S|MxNxK",
                     help="shapes (default: 256-4096 square + transformer shapes on MPS, "
                          "small shapes on the emulator)")
    mat.add_argument("--kernels", nargs="+", default=None,
                     choices=["naive", "tiled", "register", "simdgroup", "shuffle"])
    mat.add_argument("--dtype", choices=["float32", "float16", "bfloat16"], default="float32")
    mat.add_argument("--warmup", type=int, default=3)
    mat.add_argument("--repeats", type=int, default=10,
                     help="MPS: calls timed back to back between two synchronisations")
    mat.add_argument("--peak-tflops", type=float, default=None,
                     help="the chip's FP32 peak, for %% of peak (default: from the chip name)")
    mat.add_argument("--csv", default=None, help="MPS: write the rows to this CSV file")
    mat.add_argument("--plot", default=None, help="MPS: write a PNG bar chart here")
    mat.add_argument("--json", action="store_true", help="print the rows as JSON")
    emu = sub.add_parser("emulator", help="the emulator's speed: kernels with an OpenCL twin "
                                          "against PoCL when installed, the project's shaders, "
                                          "the sanitizer's slowdown")
    emu.add_argument("--repeats", type=_at_least(1), default=5,
                     help="interleaved timing rounds after the checked warm-up")
    emu.add_argument("--sanitized-repeats", type=_at_least(0), default=1,
                     help="of those rounds, how many also run the sanitized build (0: none)")
    emu.add_argument("--matmul-sizes", type=_at_least(1), nargs="+", default=[128, 256, 512],
                     help="n of the tiled matmul twin (n^3)")
    emu.add_argument("--mm-sizes", type=_at_least(1), nargs="+", default=[256, 512],
                     help="n of tsm.mm, every rung (n^3)")
    emu.add_argument("--twins-only", action="store_true",
                     help="only the kernels with an OpenCL twin")
    emu.add_argument("--csv", default=None, metavar="PATH",
                     help="also write the rows to a CSV file")
    emu.add_argument("--json", action="store_true", help="print the result as JSON")
    args = parser.parse_args(argv)

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
    elif args.benchmark == "kmeans":
        from . import kmeans as kmeans_bench
        result = kmeans_bench.run(args.n, args.d, args.k, args.iters)
        print(json.dumps(result, indent=2) if args.json else kmeans_bench.format_report(result))
    elif args.benchmark == "emulator":
        from . import emulator
        result, table = emulator.main(args)
        print(json.dumps(result, indent=2) if args.json else table)
        return 0 if all(row["ok"] for row in result["rows"]) else 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
