"""``python -m torch_sparse_metal.bench <benchmark> [options]``."""
from __future__ import annotations

import argparse
import json
import sys


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m torch_sparse_metal.bench",
                                     description=__doc__)
    sub = parser.add_subparsers(dest="benchmark", required=True)
    san = sub.add_parser("sanitizer", help="the sanitizer's slowdown on barrier-heavy kernels")
    san.add_argument("--sizes", type=int, nargs="+", default=[32, 64, 128],
                     help="matrix sizes n (the reduction uses n*n elements)")
    san.add_argument("--repeats", type=int, default=3)
    san.add_argument("--json", action="store_true", help="print the rows as JSON")
    args = parser.parse_args(argv)

    if args.benchmark == "sanitizer":
        from . import sanitizer
        rows = sanitizer.run(args.sizes, args.repeats)
        print(json.dumps(rows, indent=2) if args.json else sanitizer.format_table(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
