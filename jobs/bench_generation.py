"""Decoding speed of the one generation function (``raytrain_hymt.evaluation.generation``) on a model folder,
before (transformers' ``generate``, dynamic cache) and after (static cache, CUDA-graph decoding step).

    python3 jobs/bench_generation.py --model-dir /dev/shm/hymt-8b --untied --lora --test-set DIR

Loads the folder as evaluation does (bf16 on GPU 0; ``--lora`` wraps it in the LoRA preset's adapters, as
BLEU during training sees the model), then times ``Generator.translate`` on one batch of ``--batch``
sentences with ``--new-tokens`` new tokens (a random-init model never emits its end token, so every call
decodes exactly that many steps), each way: milliseconds per decoding step (the call's wall time over
its steps, prompt included), first call (the static path's includes building the cache and capturing
the graph) and warm; the prompt's forward alone (a one-token call) gives the decoding steps' own time.
Agreement: per row, the static path's tokens must equal ``generate``'s up to the first position whose
top-2 logit margin (``generate``'s logits) is below ``--margin``; a random-init model's near-uniform
logits let kernel changes flip the argmax after such a near tie. With ``--test-set`` it also times what
one BLEU-during-training evaluation adds, both ways: ``translate_all`` over the first ``--sentences``
lines of each direction, batched as evaluation batches them. One JSON line.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


class StaticChoice:
    """A generator whose ``translate`` always takes one path (``static`` True or False)."""

    def __init__(self, generator, static: bool):
        self.generator, self.static = generator, static

    def translate(self, *args, **kwargs):
        return self.generator.translate(*args, static=self.static, **kwargs)


def agreement(gen, enc, margin: float) -> dict:
    """How far the static path's tokens agree with ``generate``'s, row by row, up to the first position
    whose top-2 logit margin (from ``generate``'s logits) is below ``margin``."""
    import torch

    gen.model.eval()
    with torch.no_grad():
        old = gen.model.generate(**enc, output_logits=True, return_dict_in_generate=True)
    new = gen.new_tokens(enc, static=True)
    before = old.sequences[:, enc["input_ids"].shape[1]:]
    top2 = torch.stack([step.float().topk(2, dim=-1).values for step in old.logits], 1)  # [rows, steps, 2]
    near = (top2[..., 0] - top2[..., 1]) < margin
    steps = before.shape[1]
    checked, agree, identical = [], 0, 0
    for row in range(before.shape[0]):
        ties = near[row].nonzero()
        upto = int(ties[0]) if len(ties) else steps  # the tokens before the first near tie must agree
        checked.append(upto)
        agree += new.shape[1] >= upto and bool(torch.equal(before[row, :upto], new[row, :upto]))
        identical += new.shape[1] == steps and bool(torch.equal(before[row], new[row]))
    return {"rows": len(checked), "rows_agreeing_before_first_near_tie": agree, "rows_identical": identical,
            "margin": margin, "first_near_tie_mean": sum(checked) / len(checked), "first_near_tie_min": min(checked),
            "rows_without_near_tie": sum(c == steps for c in checked)}


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
    p.add_argument("--margin", type=float, default=1e-3, help="top-2 logit margin of a near tie")
    p.add_argument("--out", default=None, help="append the JSON line to this file")
    args = p.parse_args(argv)

    import torch
    import transformers

    from benchmarks.throughput import model_folder
    from raytrain_hymt.evaluation.generation import translate_all
    from raytrain_hymt.train.model import load_generator

    gpu = torch.cuda.is_available()
    folder = model_folder("7b", args.layers, not args.untied, Path("/tmp"), gpu, args.model_dir)
    t0 = time.perf_counter()
    gen = load_generator(folder, "bf16" if gpu else "fp32", args.new_tokens, use_gpu=gpu)
    load_s = time.perf_counter() - t0
    if args.lora:
        from raytrain_hymt.config.schema import load_config
        from raytrain_hymt.train.engine import apply_lora

        gen.model = apply_lora(gen.model, load_config("hy-mt-7b-lora").lora).to(gen.device).eval()
    sentence = "The committee will meet again next week to discuss the new proposal for the city budget."
    sources = [f"{sentence} ({i})" for i in range(args.batch)]
    langs = (["en"] * args.batch, ["zh"] * args.batch)

    def timed(*call, **kwargs):
        if gpu:
            torch.cuda.synchronize()
        start = time.perf_counter()
        out = call[0](*call[1:], **kwargs)
        if gpu:
            torch.cuda.synchronize()
        return out, time.perf_counter() - start

    result = {"model": folder, "lora": args.lora, "batch": args.batch, "new_tokens": args.new_tokens,
              "device": torch.cuda.get_device_name(0) if gpu else "cpu", "load_s": load_s,
              "transformers": transformers.__version__, "torch": torch.__version__}
    config = gen.model.generation_config
    import raytrain_hymt.evaluation.generation as generation

    for name, static, compiled in (("generate", False, False), ("static", True, False), ("static_compiled", True, True)):
        generation.COMPILE_STEP = compiled
        gen.model.__dict__.pop(generation.DECODER_ATTR, None)  # a new decoder: captured (and compiled) again
        _, first = timed(gen.translate, sources, *langs, static=static)
        _, warm = timed(gen.translate, sources, *langs, static=static)
        config.max_new_tokens = 1
        _, prompt = timed(gen.translate, sources, *langs, static=static)
        config.max_new_tokens = args.new_tokens
        result[name] = {"first_call_ms_per_step": 1000 * first / args.new_tokens,
                        "warm_ms_per_step": 1000 * warm / args.new_tokens, "prompt_forward_ms": 1000 * prompt,
                        "decoding_ms_per_step": 1000 * (warm - prompt) / (args.new_tokens - 1)}
    for name in ("static", "static_compiled"):
        result[name]["speedup_warm"] = result["generate"]["warm_ms_per_step"] / result[name]["warm_ms_per_step"]
    result["agreement"] = agreement(gen, gen.encode(sources, *langs), args.margin)  # the compiled decoder's
    if args.test_set:
        from raytrain_hymt.evaluation.scoring import load_test_set, plan_rows

        rows = plan_rows(load_test_set(args.test_set), args.directions, args.sentences)
        columns = [[r[k] for r in rows] for k in ("src", "src_lang", "tgt_lang")]
        result["bleu_sample_sentences"] = len(rows)
        for name, static in (("generate", False), ("static_compiled", True)):
            (texts, _), seconds = timed(translate_all, StaticChoice(gen, static), *columns, args.batch)
            result[name]["bleu_sample_seconds"] = seconds
            result[name]["bleu_sample_texts"] = texts[:2]
    line = json.dumps(result)
    print(line, flush=True)
    if args.out:
        with open(args.out, "a") as f:
            f.write(line + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
