"""GPU throughput benchmark of the project's own training step (benchmarks.throughput).

    python jobs/benchmark.py --layers 32 --case tutorial-zero3 --case z2-flex-liger-compile-8k-a8 \
        --case z2-flex-liger-compile-8k-a8@torchrun --out bench_out

Random-init Hunyuan-7B shape (tied 7.50 B; --untied: 8.03 B) saved as a model folder and loaded through
``from_pretrained`` exactly as ``hymt train`` loads a real one; ``--case preset:hy-mt-7b-lora`` runs a
preset's own settings. Pairs from the bundled Tatoeba sample through the Ray Data pipeline, TorchTrainer +
DeepSpeed. Prints one JSON line per case and a Markdown table; both are
also written under --out. Also runs under ``ray job submit`` (it joins the cluster in RAY_ADDRESS).
Every figure comes from the metrics the workers' ``Worker.train_step`` returns (tokens/s, MFU, peak memory;
``benchmarks.throughput.bench_loop``), none from console text. A CPU smoke run:

    python jobs/benchmark.py --cpu --shape tiny --workers 2 --steps 2 --warmup 1 --case cpu-packed
"""

import argparse
import logging
import sys
from pathlib import Path

# Under `ray job submit` the working dir is the repo but the package may not be installed there.
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.throughput import CASES, document_mask_check, markdown_table, run_benchmark  # noqa: E402


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--case", action="append", default=[],
                   help=f"case to run, in order (repeatable): one of {', '.join(CASES)}, or NAME:a.b=v,c.d=w; "
                        "suffix @torchrun runs it without Ray")
    p.add_argument("--shape", default="7b", choices=["7b", "tiny"], help="model shape (tiny: CPU smoke runs)")
    p.add_argument("--layers", type=int, default=32, help="decoder layers of the 7B-width model (screen on 4-8)")
    p.add_argument("--untied", action="store_true", help="untied embeddings (8.03 B) instead of tied (7.50 B)")
    p.add_argument("--steps", type=int, default=10, help="measured optimizer steps per case")
    p.add_argument("--warmup", type=int, default=3, help="optimizer steps run before measuring")
    p.add_argument("--workers", type=int, default=2, help="workers (GPUs)")
    p.add_argument("--cpu", action="store_true", help="CPU workers with gloo (smoke runs)")
    p.add_argument("--out", default="bench_out", help="folder for results.jsonl, table.md and the cases' files")
    p.add_argument("--set", dest="extra", action="append", default=[], help="override for every case (a.b=v)")
    p.add_argument("--check-mask", action="store_true", help="first check flex document masking on the GPU")
    p.add_argument("--model-dir", default=None,
                   help="model folder to load (written there first if missing; e.g. /dev/shm/hymt-7b on GPU "
                        "machines); default: one under --out")
    p.add_argument("--profile", action="store_true",
                   help="one more step per case under torch.profiler: GPU time by kernel kind in the result")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    if args.check_mask:
        print(f"document mask check (packed vs separate, max |Δlogit|): {document_mask_check():.2e}", flush=True)
    # Default: the naive baseline (ZeRO-3, padded pairs), the fastest measured configuration, and the same without Ray.
    cases = args.case or ["tutorial-zero3", "z2-flex-liger-compile-8k-a8", "z2-flex-liger-compile-8k-a8@torchrun"]
    results = run_benchmark(cases, shape=args.shape, layers=args.layers, tied=not args.untied, steps=args.steps,
                            warmup=args.warmup, workers=args.workers, use_gpu=not args.cpu, out_dir=args.out,
                            extra=args.extra, model_dir=args.model_dir, profile=args.profile)
    print(markdown_table(results))
    return 1 if any("error" in r for r in results) else 0


if __name__ == "__main__":
    sys.exit(main())
