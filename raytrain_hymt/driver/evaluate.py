"""BLEU and chrF on a held-out multi-way test set (FLORES-200 style), translated with Ray Data.

The test set is a folder of line-aligned files, one per language, named by any label
:func:`~raytrain_hymt.languages.resolve` accepts (``eng_Latn.devtest``, ``zho_Hans.devtest``, ``de.txt``).
Each direction ``src-tgt`` translates the ``src`` file's lines with the model card's prompt and greedy
decoding, and scores them against the ``tgt`` file's lines with sacrebleu (BLEU, chrF, chrF++ and TER:
:mod:`~raytrain_hymt.evaluation.scoring`, which also keeps the history of evaluations).

Translation is batch inference on Ray Data: an actor pool of model replicas (one GPU each on GPU
clusters), sentences sorted by length so each batch pads little. The planning and scoring functions are
pure and run on the driver before any model is loaded, so a bad test set fails before GPUs are spent.
"""

from __future__ import annotations

import json
import logging
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping

import numpy as np

from raytrain_hymt.config.schema import EvalConfig
from raytrain_hymt.errors import ConfigError
from raytrain_hymt.evaluation.scoring import HISTORY_FILE, METRICS, new_evaluation_dir, record_evaluation
from raytrain_hymt.evaluation.scoring import load_test_set, plan_rows, score_rows

log = logging.getLogger("raytrain_hymt")


DEVICE_FIELDS = ("scaling.use_gpu", "deepspeed.precision")


def inference_device(explicit: Mapping[str, Any], cuda_available: bool, bf16_supported: bool) -> tuple[Any, Any]:
    """``(scaling.use_gpu, deepspeed.precision)`` for ``hymt translate`` and ``hymt evaluate``.

    ``explicit`` holds the values of :data:`DEVICE_FIELDS` the user chose for this command; each one it
    lacks is automatic: the GPU when ``cuda_available``, then bf16 on a GPU where ``bf16_supported``, fp16
    on one without, fp32 on the CPU. An explicit value is returned as given (the config validates it).
    """
    use_gpu = explicit.get("scaling.use_gpu", cuda_available)
    if "deepspeed.precision" in explicit:
        return use_gpu, explicit["deepspeed.precision"]
    if use_gpu is not True:
        return use_gpu, "fp32"
    return use_gpu, "bf16" if bf16_supported else "fp16"


def explicit_device_settings(config: str | None, overrides: list[str]) -> dict[str, Any]:
    """The values of :data:`DEVICE_FIELDS` that ``--set`` overrides or a ``--config`` file or preset the user
    named set (the last ``--set`` wins). The implicit default preset and a run's saved training config are
    not a choice for inference: ``config`` is only what the user gave."""
    import yaml

    from raytrain_hymt.config.schema import flatten, parse_override, preset_path

    chosen: dict[str, Any] = {}
    if config:
        try:
            tree = yaml.safe_load(preset_path(config).read_text(encoding="utf-8"))
        except yaml.YAMLError:
            tree = None
        if isinstance(tree, dict):  # anything else, load_config refuses with its own message
            chosen.update({k: v for k, v in flatten(tree).items() if k in DEVICE_FIELDS})
    for text in overrides:
        key, value = parse_override(text)
        if key in DEVICE_FIELDS:
            chosen[key] = value
    return chosen


def local_gpu() -> tuple[bool, bool]:
    """``(cuda_available, bf16_supported)`` in this process."""
    import torch

    cuda = torch.cuda.is_available()
    return cuda, cuda and torch.cuda.is_bf16_supported()


def inference_overrides(explicit: Mapping[str, Any]) -> list[str]:
    """``--set`` overrides that put the automatic :data:`DEVICE_FIELDS` (those not in ``explicit``) where
    :func:`inference_device` says for this machine; after the user's, over any config file's values."""
    decided = dict(zip(DEVICE_FIELDS, inference_device(explicit, *local_gpu())))
    return [f"{k}={str(v).lower() if isinstance(v, bool) else v}" for k, v in decided.items() if k not in explicit]


def settle_device_on_ray(cfg, explicit: Mapping[str, Any] | None) -> None:
    """After Ray started, for replicas: the automatic device again where the GPUs are the cluster's.

    Under ``ray job submit`` this process often runs on a head node without a GPU while the workers have
    them: an automatic ``scaling.use_gpu`` then turns on, with the precision a GPU of the cluster supports
    (asked once, by a one-GPU task). With the GPU chosen automatically, ``eval.workers`` unset means one
    replica per GPU of the cluster, at most ``scaling.num_workers``. ``explicit`` None: ``cfg`` is final.
    """
    if explicit is None or "scaling.use_gpu" in explicit:
        return
    import ray

    gpus = int(ray.cluster_resources().get("GPU", 0))
    if gpus < 1:
        return
    if not cfg.scaling.use_gpu:
        bf16 = ray.get(ray.remote(num_gpus=1, num_cpus=0)(_bf16_supported).remote())
        cfg.scaling.use_gpu, cfg.deepspeed.precision = inference_device(explicit, True, bf16)
    if cfg.eval.workers is None:
        cfg.eval.workers = min(cfg.scaling.num_workers, gpus)
    say_automatic_device(cfg, explicit)


def say_automatic_device(cfg, explicit: Mapping[str, Any] | None) -> None:
    """One line when the GPU was chosen for the user (not on their command line), saying how to choose."""
    if cfg.scaling.use_gpu and explicit is not None and "scaling.use_gpu" not in explicit:
        log.info("translating on GPU in %s (automatic: --set scaling.use_gpu=false for the CPU, "
                 "--set deepspeed.precision=... for another precision)", cfg.deepspeed.precision)


def _bf16_supported() -> bool:
    import torch

    return torch.cuda.is_bf16_supported()


class Translator:
    """Ray Data actor: one model replica translating batches of rows (:mod:`~raytrain_hymt.evaluation.generation`)."""

    def __init__(self, model: str, precision: str, max_new_tokens: int, use_gpu: bool,
                 trust_remote_code: bool = False, copy_token: str = "", sample: bool = False):
        from raytrain_hymt.train.model import load_generator

        self.generator = load_generator(model, precision, max_new_tokens, use_gpu, trust_remote_code,
                                        sample=sample, copy_token=copy_token)

    def __call__(self, batch: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        from raytrain_hymt.evaluation.generation import translate_or_report

        texts, errors = translate_or_report(self.generator, batch["src"], batch["src_lang"], batch["tgt_lang"])
        result = dict(batch)
        result["hyp"], result["error"] = np.array(texts, dtype=object), np.array(errors, dtype=object)
        return result


@dataclass
class EvalResult:
    """Scores per direction and where the translations were written."""

    test_set: str
    model: str
    scores: dict[str, dict] = field(default_factory=dict)
    out_dir: str | None = None

    def metrics(self) -> dict[str, float]:
        """MLflow metric names: ``test/<set>/<src>-<tgt>/bleu`` (and ``chrf``, ``chrfpp``, ``ter``)."""
        return {f"test/{self.test_set}/{d}/{k}": s[k] for d, s in self.scores.items() for k in METRICS}

    def lines(self) -> list[str]:
        """A small table for the console."""
        out = [f"test set {self.test_set}: {self.model}", "  direction  sentences   BLEU   chrF  chrF++    TER"]
        out += [f"  {d:<9}  {s['sentences']:>9}  {s['bleu']:5.2f}  {s['chrf']:5.2f}  {s['chrfpp']:6.2f}  {s['ter']:5.2f}"
                for d, s in self.scores.items()]
        if self.out_dir:
            out.append(f"  translations: {self.out_dir}")
        return out


def translate(rows: list[dict], cfg, model: str, sample: bool = False) -> tuple[list[str], list[str]]:
    """Hypotheses for ``rows`` (in their order), from a Ray Data actor pool of ``cfg.eval.workers`` replicas,
    and per row the error that stopped its translation ("" when none).

    Needs a running Ray. On GPU clusters each replica holds one GPU; on CPU one logical CPU. ``sample``:
    the model card's sampling settings instead of greedy decoding.
    """
    import glob
    import tempfile
    import uuid

    import ray.data

    from raytrain_hymt.data.pipeline import map_on_actors
    from raytrain_hymt.evaluation.generation import batches_longest_first
    from raytrain_hymt.train.model import COPY_PREFIX

    e = cfg.eval
    # No more replicas than batches: each loads the whole model, and one still loading when the work is
    # done would be killed for nothing.
    workers = min(e.workers or cfg.scaling.num_workers, -(-len(rows) // e.batch_size))
    token = uuid.uuid4().hex[:12]
    # Consecutive rows form a replica's batch: the same batches as every other caller of generation.
    ordered = [rows[i] for b in batches_longest_first([r["src"] for r in rows], e.batch_size) for i in b]
    ds = ray.data.from_items([{k: r[k] for k in ("id", "src", "src_lang", "tgt_lang")} for r in ordered])
    gpu = cfg.scaling.use_gpu
    # A failed replica fails the evaluation loudly (data/pipeline.py: why the replicas are never restarted).
    out = map_on_actors(
        ds, Translator, workers,
        fn_constructor_kwargs=dict(model=model, precision=cfg.deepspeed.precision,
                                   max_new_tokens=e.max_new_tokens, use_gpu=gpu,
                                   trust_remote_code=cfg.model.trust_remote_code, copy_token=token,
                                   sample=sample),
        batch_size=e.batch_size, batch_format="numpy", num_gpus=1 if gpu else 0, num_cpus=1,
        **({"runtime_env": {"env_vars": cfg.scaling.env}} if cfg.scaling.env else {}),
    )
    try:
        by_id = {int(r["id"]): (str(r["hyp"]), str(r["error"])) for r in out.iter_rows()}
    finally:
        # A replica removes its copy once loaded; one that failed or was stopped while loading cannot.
        for leftover in glob.glob(f"{tempfile.gettempdir()}/{COPY_PREFIX}{token}-*"):
            shutil.rmtree(leftover, ignore_errors=True)
    return [by_id[r["id"]][0] for r in rows], [by_id[r["id"]][1] for r in rows]


def evaluate_model(cfg, model: str, eval_root: Path | None = None, step: int | None = None) -> EvalResult:
    """Translate ``cfg.eval.test_set`` with ``model`` (folder, hub id or ``tiny``) and score every direction.

    With ``eval_root``, keeps the evaluation in the history of :mod:`~raytrain_hymt.evaluation.scoring`: a new
    ``<eval_root>/<test set>/<time>/`` with ``<src>-<tgt>.hyp`` (one translation per line, in the test
    set's order) and ``scores.json``, and a line in ``<eval_root>/<test set>/history.jsonl``. ``step``: the
    training step of the model, recorded with the scores.
    """
    e: EvalConfig = cfg.eval
    test_set = load_test_set(e.test_set)
    rows = plan_rows(test_set, e.directions, e.max_sentences)
    hyps, errors = translate(rows, cfg, model)
    failed = [(r, err) for r, err in zip(rows, errors) if err]
    if failed:
        r, err = failed[0]
        raise RuntimeError(f"{len(failed)} sentence(s) could not be translated, first {r['direction']} line "
                           f"{r['index'] + 1}: {err}")
    result = EvalResult(test_set=test_set.name, model=model)
    result.scores, translations = score_rows(rows, hyps)
    if eval_root is not None:
        out_dir = new_evaluation_dir(eval_root / test_set.name)
        record = {"time": out_dir.name, "test_set": test_set.folder, "model": model, "step": step,
                  "scores": result.scores}
        record_evaluation(out_dir, record, translations)
        result.out_dir = str(out_dir)
    return result


def log_result(tracker, result: EvalResult, step: int) -> None:
    """Scores as MLflow metrics at ``step`` (the run's last step); the evaluation's folder and the set's
    history.jsonl as artifacts (``eval/<set>/<time>/``, ``eval/<set>/history.jsonl``)."""
    tracker.log_metrics(result.metrics(), step=step)
    if result.out_dir:
        out = Path(result.out_dir)
        tracker.log_artifact(out, f"eval/{result.test_set}/{out.name}")
        tracker.log_artifact(out.parent / HISTORY_FILE, f"eval/{result.test_set}")


def _check_replica_resources(cfg, started_locally: bool) -> None:
    """Fail fast (a local Ray) or warn (a cluster) when not even one translating replica fits."""
    from raytrain_hymt.driver.session import check_cluster_resources

    one = cfg.model_copy(deep=True)
    one.scaling.num_workers, one.scaling.cpus_per_worker = 1, 1.0
    check_cluster_resources(one, started_locally)


def default_directions(cfg, model: str | None) -> list[str]:
    """``eval.directions`` left unset: a run's own. ``model`` the exported ``model/`` folder of a run
    anywhere (its ``config.yaml`` beside it): that run's directions; else those of ``cfg``'s corpus."""
    from raytrain_hymt.config.schema import load_config
    from raytrain_hymt.data.preflight import default_eval_directions
    from raytrain_hymt.storage import CONFIG_FILE, is_uri

    saved = Path(model).expanduser().parent / CONFIG_FILE if model and not is_uri(model) else None
    if saved is not None and saved.is_file():
        cfg = load_config(str(saved))
    return default_eval_directions(cfg, required=True)


def evaluate_run(cfg, model: str | None = None, explicit_device: Mapping[str, Any] | None = None) -> EvalResult:
    """``hymt evaluate``: score a finished run's exported model, or any ``model``, on ``cfg.eval.test_set``.

    Without ``model``, ``cfg.run.name`` names a run under ``run.storage_root``: its ``model/`` is
    translated, the scores join the run's own MLflow run at its last step (the run stays FINISHED even if
    scoring fails), and the translations go to ``<run>/eval/<test set>/``. With ``model`` (a folder, hub id
    or URI, e.g. the base Hunyuan-MT-7B for a baseline), a run named ``cfg.run.name`` or ``eval-<model
    folder name>`` holds them, with its own MLflow run, so baseline and fine-tuned scores sit side by side.
    Scoring again adds the new scores to the same MLflow run. ``explicit_device``: the device settings the
    user chose (:func:`explicit_device_settings`); the others may move to the cluster's GPUs
    (:func:`settle_device_on_ray`). None: ``cfg``'s device is final.
    """
    from raytrain_hymt.storage import RunFolder
    from raytrain_hymt.tracking.tracker import make_tracker
    from raytrain_hymt.driver.session import init_ray
    from raytrain_hymt.driver.runs import start_tracking
    from raytrain_hymt.storage import RUN_FILE, SUMMARY_FILE

    if not cfg.eval.test_set:
        raise ConfigError("eval.test_set is not set: name a test-set folder (--test-set or --set eval.test_set=DIR)")
    test_set = load_test_set(cfg.eval.test_set)
    if cfg.eval.directions is None:
        cfg.eval.directions = default_directions(cfg, model)
    plan_rows(test_set, cfg.eval.directions, cfg.eval.max_sentences)  # every mistake before a model loads
    if model is None:
        if not cfg.run.name:
            raise ConfigError("hymt evaluate needs --name RUN (a finished run) or --model PATH")
        folder = RunFolder(cfg.run.storage_path, cfg.run.name, create=False)
        summary = json.loads(folder.read_text(SUMMARY_FILE) or "null")
        if summary is None or not summary.get("model_dir"):
            raise ConfigError(f"{folder.uri} holds no finished run with an exported model/ "
                              "(train it to the end with run.export: true, or pass --model)")
        model, step, status_if_failed = summary["model_dir"], int(summary.get("steps", 0)), "FINISHED"
        started_locally = init_ray(cfg)
        saved = json.loads(folder.read_text(RUN_FILE) or "{}")
        tracker = make_tracker(cfg.tracking.enabled and bool(saved.get("mlflow_run_id") or saved.get("mlflow_run_key")),
                               tracking_uri=saved.get("tracking_uri"), experiment=cfg.tracking.experiment,
                               run_name=cfg.run.name, run_id=saved.get("mlflow_run_id"),
                               run_key=saved.get("mlflow_run_key"), local_dir=folder.local,
                               retry_interval_s=cfg.tracking.retry_interval_s, new_measurements=True)
    else:
        cfg.run.name = cfg.run.name or f"eval-{Path(model.rstrip('/')).name}"
        folder = RunFolder(cfg.run.storage_path, cfg.run.name)
        step, status_if_failed = 0, "FAILED"
        started_locally = init_ray(cfg)
        folder.pull(RUN_FILE)  # scoring again continues the same MLflow run, on any storage
        tracker, _ = start_tracking(cfg, folder.local, new_measurements=True)
        if tracker.run_id:
            folder.push(RUN_FILE)
        tracker.set_tags({"evaluated_model": model})
    try:
        settle_device_on_ray(cfg, explicit_device)
        _check_replica_resources(cfg, started_locally)
        result = evaluate_model(cfg, model, folder.local / "eval", step=step)
        folder.push("eval")
        log_result(tracker, result, step)
        tracker.finish("FINISHED")
    except BaseException:
        tracker.finish(status_if_failed)
        raise
    return result
