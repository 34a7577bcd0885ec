"""Peak host memory per worker when ZeRO-3 loads a pretrained model: whole, or partitioned while loading.

    python jobs/bench_zero3_load.py                                 # tiny model, 2 CPU processes (gloo)
    python3 jobs/bench_zero3_load.py --gpu --layers 32 --world 2    # Hunyuan-MT-7B shape (8.03 B), 2 GPUs

Prints one JSON line per rank and way of loading (logic: ``benchmarks/zero3_load.py``).
"""

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.throughput import print_json_lines  # noqa: E402
from benchmarks.zero3_load import measure  # noqa: E402


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--gpu", action="store_true", help="one GPU per process (NCCL)")
    p.add_argument("--layers", type=int, default=None, help="layers of the full-width 7B shape (default: tiny model)")
    p.add_argument("--world", type=int, default=2, help="processes (ZeRO-3 ranks)")
    p.add_argument("--workdir", default=None, help="where the model folder is written (default: the temp dir)")
    p.add_argument("--out", default=None, help="also write the JSON lines to this file")
    args = p.parse_args()
    print_json_lines(measure(args.layers, args.world, args.gpu, args.workdir), args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
