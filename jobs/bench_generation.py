"""Decoding speed of the one generation function (``raytrain_hymt.generation``) on a model folder.

    python3 jobs/bench_generation.py --model-dir /dev/shm/hymt-8b --untied --lora --test-set DIR

Loads the folder as evaluation does (bf16 on GPU 0; ``--lora`` wraps it in the LoRA preset's adapters, as
BLEU during training sees the model), then times ``Generator.translate`` on one batch of ``--batch``
sentences with ``--new-tokens`` new tokens (a random-init model never emits its end token, so every call
decodes exactly that many steps): milliseconds per decoding step, first call and warm. With
``--test-set`` it also times what one BLEU-during-training evaluation adds: ``translate_all`` over the
first ``--sentences`` lines of each direction, batched as evaluation batches them. One JSON line.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model-dir", required=True)
    p.add_argument("--layers", type=int, default=32)
    p.add_argument("--untied", action="store_true")
    p.add_argument("--lora", action="store_true", help="wrap in the hy-mt-7b-lora preset's adapters")
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--test-set", default=None)
    p.add_argument("--directions", nargs="+", default=["en-zh", "zh-en"])
    p.add_argument("--sentences", type=int, default=32)
    p.add_argument("--out", default=None, help="append the JSON line to this file")
    args = p.parse_args(argv)

    import torch

    from benchmarks.throughput import model_folder
    from raytrain_hymt.generation import Generator, load_generator, translate_all

    gpu = torch.cuda.is_available()
    folder = model_folder("7b", args.layers, not args.untied, Path("/tmp"), gpu, args.model_dir)
    t0 = time.perf_counter()
    gen = load_generator(folder, "bf16" if gpu else "fp32", args.new_tokens, use_gpu=gpu)
    load_s = time.perf_counter() - t0
    if args.lora:
        from raytrain_hymt.config import load_config
        from raytrain_hymt.engine import apply_lora

        gen.model = apply_lora(gen.model, load_config("hy-mt-7b-lora").lora).to(gen.device).eval()
    sentence = "The committee will meet again next week to discuss the new proposal for the city budget."
    sources = [f"{sentence} ({i})" for i in range(args.batch)]

    def timed(*call):
        if gpu:
            torch.cuda.synchronize()
        start = time.perf_counter()
        out = call[0](*call[1:])
        if gpu:
            torch.cuda.synchronize()
        return out, time.perf_counter() - start

    result = {"model": folder, "lora": args.lora, "batch": args.batch, "new_tokens": args.new_tokens,
              "device": torch.cuda.get_device_name(0) if gpu else "cpu", "load_s": load_s}
    langs = (["en"] * args.batch, ["zh"] * args.batch)
    _, first = timed(gen.translate, sources, *langs)
    texts, warm = timed(gen.translate, sources, *langs)
    result.update(first_call_ms_per_step=1000 * first / args.new_tokens, warm_ms_per_step=1000 * warm / args.new_tokens)
    if args.test_set:
        from raytrain_hymt.testsets import load_test_set, plan_rows

        rows = plan_rows(load_test_set(args.test_set), args.directions, args.sentences)
        _, seconds = timed(translate_all, gen, [r["src"] for r in rows], [r["src_lang"] for r in rows],
                           [r["tgt_lang"] for r in rows], args.batch)
        result.update(bleu_sample_sentences=len(rows), bleu_sample_seconds=seconds)
    line = json.dumps(result)
    print(line, flush=True)
    if args.out:
        with open(args.out, "a") as f:
            f.write(line + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
