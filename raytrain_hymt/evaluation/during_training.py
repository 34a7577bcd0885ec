"""BLEU/chrF during training (``eval.bleu_every_steps``): the model being trained translates a small
fixed sample of ``eval.test_set`` every N steps.

The sample is the first ``eval.bleu_sentences`` lines of each of ``eval.directions``: exactly the rows
``hymt evaluate --set eval.max_sentences=<bleu_sentences>`` translates, in the same batches
(:func:`~raytrain_hymt.evaluation.generation.batches_longest_first`, ``eval.batch_size``) with the same function, so
on CPU in fp32 the scores at step N equal ``hymt evaluate`` on the model exported at step N.

Who generates: under ZeRO-3 the parameters are sharded, so every rank runs ``generate`` on the whole
sample with ``synced_gpus`` (each forward gathers the layers from all ranks). Under ZeRO-0/1/2 every rank
holds the whole model: rank 0 generates alone while the others wait at a barrier, which costs the same
wall time and no extra compute. Rank 0 scores, logs ``val/<set>/<src>-<tgt>/{bleu,chrf,chrfpp,ter}`` and
``val/bleu_seconds`` at the step, and keeps the translations in the evaluation history format
(``<run>/eval/<set>-training/<time>/``, ``history.jsonl``), logged to MLflow as artifacts there.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path

log = logging.getLogger("raytrain_hymt")


class TrainingSample:
    """The fixed sample and how to translate and score it with the training engine's model."""

    def __init__(self, cfg, tokenizer, rank: int, run_dir: str):
        from raytrain_hymt.evaluation.scoring import load_test_set, plan_rows

        e = cfg.eval
        self.test_set = load_test_set(e.test_set)
        self.rows = plan_rows(self.test_set, e.directions, e.bleu_sentences)
        self.cfg, self.tokenizer, self.rank = cfg, tokenizer, rank
        self.sharded = cfg.deepspeed.zero_stage == 3
        self.set_root = Path(run_dir) / "eval" / f"{self.test_set.name}-training"

    def due(self, step: int) -> bool:
        """Whether step ``step`` translates the sample."""
        every = self.cfg.eval.bleu_every_steps
        return every is not None and step % every == 0

    def run(self, module, step: int, tracker) -> dict[str, float]:
        """Translate, score and record the sample at ``step`` (collective: call on every rank). Returns the
        metrics on rank 0, ``{}`` elsewhere."""
        import torch.distributed as dist

        from raytrain_hymt.evaluation.scoring import score_rows
        from raytrain_hymt.evaluation.generation import Generator, translate_all

        t0 = time.perf_counter()
        hyps = None
        if self.sharded or self.rank == 0:
            e = self.cfg.eval
            generator = Generator(module, self.tokenizer, e.max_new_tokens)
            hyps, _ = translate_all(generator, [r["src"] for r in self.rows], [r["src_lang"] for r in self.rows],
                                    [r["tgt_lang"] for r in self.rows], e.batch_size, synced_gpus=self.sharded)
        if dist.is_initialized():
            dist.barrier()  # ZeRO-0/1/2: the other ranks wait here for rank 0
        if self.rank != 0:
            return {}
        seconds = time.perf_counter() - t0
        scores, translations = score_rows(self.rows, hyps)
        self._record(step, scores, translations, tracker)
        metrics = {f"val/{self.test_set.name}/{d}/{k}": s[k] for d, s in scores.items()
                   for k in ("bleu", "chrf", "chrfpp", "ter")}
        metrics["val/bleu_seconds"] = seconds
        return metrics

    def _record(self, step: int, scores: dict, translations: dict, tracker) -> None:
        from raytrain_hymt.evaluation.scoring import HISTORY_FILE, new_evaluation_dir, record_evaluation

        out = new_evaluation_dir(self.set_root)
        record = {"time": out.name, "test_set": self.test_set.folder, "model": f"training step {step}",
                  "step": step, "scores": scores}
        record_evaluation(out, record, translations)
        tracker.log_artifact(out, f"eval/{self.set_root.name}/{out.name}")
        tracker.log_artifact(self.set_root / HISTORY_FILE, f"eval/{self.set_root.name}")
