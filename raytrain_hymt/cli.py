"""``hymt``: the command line. Each subcommand parses, builds the config, and calls one function."""

from __future__ import annotations

import argparse
import logging
import os
import sys

from raytrain_hymt.config.schema import load_config
from raytrain_hymt.config.schema import run_name_problem
from raytrain_hymt.errors import ConfigError

log = logging.getLogger("raytrain_hymt")


def _config_args(parser: argparse.ArgumentParser, name_help: str = "run name; the same name resumes that run") -> None:
    parser.add_argument("--config", "-c", default=None,
                        help="preset name (raytrain_hymt/config/presets/NAME.yaml) or YAML file; default tiny-cpu")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="SECTION.FIELD=VALUE",
                        help="override one config field (repeatable), e.g. --set optim.lr=3e-5")
    parser.add_argument("--name", default=None, help=name_help)


def _load(args) -> object:
    if args.name and (problem := run_name_problem(args.name)):
        raise ConfigError(f"--name {problem}")
    overrides = list(args.overrides) + ([f"run.name={args.name}"] if args.name else [])
    return load_config(args.config, overrides)


def cmd_train(args) -> int:
    """Train (or resume) a run and print where its results are."""
    from raytrain_hymt.driver.train import run_training
    from raytrain_hymt.driver.runs import finished_summary

    cfg = _load(args)
    done = finished_summary(cfg)
    if done is not None:
        print(f"run {done.name} already finished; nothing to do.")
        print("\n".join(done.lines()))
        return 0
    summary = run_training(cfg)
    print("\n".join(summary.lines()))
    return 0


def cmd_prepare(args) -> int:
    """Run the data pipeline once and write training-ready rows to Parquet."""
    from raytrain_hymt.driver.train import prepare_dataset
    from raytrain_hymt.data.preflight import check_inputs

    from raytrain_hymt.data.prepared import PreparedDatasetExists
    from raytrain_hymt.storage import folder_problem

    cfg = _load(args)
    check_inputs(cfg)  # before Ray starts or OUT is created
    if problem := folder_problem("OUT", args.out, "the prepared dataset: Parquet files and manifest.json"):
        raise ConfigError(problem)
    try:
        stats = prepare_dataset(cfg, args.out, overwrite=args.overwrite)
    except PreparedDatasetExists as e:  # raised before Ray starts: a mistake, nothing was created
        raise ConfigError(str(e)) from None
    print(stats.summary())
    print(f"prepared dataset: {args.out}  (train on it with --set data.prepared_path={args.out})")
    return 0


def cmd_export(args) -> int:
    """Export a Hugging Face model folder from a checkpoint or a run's newest whole one (streaming shard by
    shard; in this process, or in a Ray task when RAY_ADDRESS names a cluster)."""
    from raytrain_hymt.driver.export import export_command

    done = export_command(args.checkpoint, args.out, max_shard_mb=args.max_shard_mb, adapter_out=args.adapter)
    print(f"exported {done.checkpoint} to {done.out}  (AutoModelForCausalLM.from_pretrained loads it; "
          f"peak memory of the export {'task' if done.on_ray else 'process'} {done.peak_gib:.2f} GiB)")
    if args.adapter:
        print(f"LoRA adapters alone: {args.adapter}  (adapter_config.json + adapter_model.safetensors)")
    return 0


def cmd_preview(args) -> int:
    """Print the first training examples as the model sees them, the loss-masked part marked (no Ray)."""
    from raytrain_hymt.driver.preview import run_preview

    color = sys.stdout.isatty() and not os.environ.get("NO_COLOR")
    sys.stdout.write(run_preview(_load(args), args.n, color=color))
    return 0


def cmd_tune(args) -> int:
    """Search learning rates (and more) with Ray Tune; each trial is a full training run."""
    from raytrain_hymt.driver.tune import run_search

    result = run_search(_load(args))
    print("\n".join(result.lines()))
    return 0


def cmd_evaluate(args) -> int:
    """BLEU/chrF of a finished run's model (``--name``) or any model (``--model``) on a test set."""
    from raytrain_hymt.data.preflight import model_problem
    from raytrain_hymt.driver.evaluate import evaluate_run, explicit_device_settings, inference_overrides

    if args.model and (problem := model_problem("--model", args.model)):
        raise ConfigError(problem)
    overrides = [f"eval.test_set={args.test_set}"] if args.test_set else []
    if args.directions:
        overrides.append(f"eval.directions=[{', '.join(args.directions)}]")
    args.overrides = list(args.overrides) + overrides  # the dedicated flags win over --set
    explicit = explicit_device_settings(args.config, args.overrides)
    args.overrides += inference_overrides(explicit)
    cfg = _load(args)
    if args.model is None and args.config is None and cfg.run.name:
        # A run is scored with its own settings (model, test set) unless --config says otherwise; the device
        # and precision are this machine's, as chosen above, not those the run trained with.
        from raytrain_hymt.storage import CONFIG_FILE, RunFolder

        saved = RunFolder(cfg.run.storage_path, cfg.run.name, create=False).read_text(CONFIG_FILE)
        if saved:
            import tempfile

            with tempfile.NamedTemporaryFile("w", suffix=".yaml", delete=False) as f:
                f.write(saved)
            args.config = f.name
            cfg = _load(args)
            os.unlink(f.name)
            _default_to_trained_directions(cfg, args)
    result = evaluate_run(cfg, model=args.model, explicit_device=explicit)
    print("\n".join(result.lines()))
    return 0


def _default_to_trained_directions(cfg, args) -> None:
    """A run is scored in the directions it trained unless --directions, --set or its config chose others."""
    from raytrain_hymt.data.preflight import default_eval_directions

    chosen = args.directions or any(o.split("=", 1)[0].strip() == "eval.directions" for o in args.overrides)
    if not chosen:
        cfg.eval.directions = default_eval_directions(cfg, required=False)


def _rerun_command(argv: list[str], exc: KeyboardInterrupt) -> str:
    """The command line that continues an interrupted run (its generated name added when it had none)."""
    import shlex

    from raytrain_hymt.driver.resume import Interrupted

    if isinstance(exc, Interrupted) and exc.run and "--name" not in argv:
        argv = [*argv, "--name", exc.run]
    return "hymt " + shlex.join(argv)


def cmd_translate(args) -> int:
    """Translate sentences (arguments, a file or stdin) and write them in the same order."""
    from raytrain_hymt.driver.evaluate import explicit_device_settings, inference_overrides
    from raytrain_hymt.driver.translate import read_input, translate_lines

    explicit = explicit_device_settings(args.config, args.overrides)
    args.overrides = list(args.overrides) + inference_overrides(explicit)
    cfg = _load(args)
    lines = read_input(args.sentences, args.input, sys.stdin, args.encoding, args.src)
    result = translate_lines(cfg, args.model, lines, args.src, args.tgt, sample=args.sample, use_ray=args.ray,
                             explicit_device=explicit)
    text = "".join(t.replace("\n", " ") + "\n" for t in result.translations)
    if args.output:
        with open(args.output, "w", encoding="utf-8") as f:
            f.write(text)
    else:
        sys.stdout.write(text)
    for line, problem in result.problems.items():
        print(f"line {line}: {problem}", file=sys.stderr)
    return 1 if result.problems else 0


def cmd_plot(args) -> int:
    """A PNG of a run's losses, BLEU/chrF, learning rate and throughput (and of runs compared with it)."""
    from pathlib import Path

    from raytrain_hymt.driver.plot import plot_runs

    cfg = _load(args)
    out = args.out or str(Path(cfg.run.storage_path, args.run, "plot.png"))
    plot_runs(cfg.run.storage_path, [args.run, *args.compare], out)
    print(f"plot: {out}")
    return 0


def cmd_sync(args) -> int:
    """Send a run's metrics.jsonl and params to MLflow where its MLflow run lacks them (after an outage)."""
    from raytrain_hymt.driver.runs import sync_run

    print("\n".join(sync_run(_load(args), args.run)))
    return 0


INFERENCE_DEVICE_HELP = (
    "The model runs on the GPU when there is one (this machine's, or the Ray cluster's), in bf16 where the "
    "GPU supports it, else fp16; on the CPU in fp32. A run's training settings (scaling.use_gpu, "
    "deepspeed.precision) do not carry over; --set scaling.use_gpu=... or --set deepspeed.precision=... "
    "(or a --config file or preset you name that sets them) chooses.")


def build_parser() -> argparse.ArgumentParser:
    """The ``hymt`` argument parser with every subcommand."""
    parser = argparse.ArgumentParser(prog="hymt", description="Fine-tune Hunyuan-MT with Ray Train + DeepSpeed")
    sub = parser.add_subparsers(dest="command", required=True)
    train = sub.add_parser("train", help="train or resume a run (default preset: tiny-cpu)")
    _config_args(train)
    train.set_defaults(func=cmd_train)
    prepare = sub.add_parser("prepare", help="preprocess the corpus once into Parquet for reuse")
    _config_args(prepare, name_help="run name (unused by prepare: OUT names the dataset)")
    prepare.add_argument("out", metavar="OUT", help="output folder or URI for the prepared dataset")
    prepare.add_argument("--overwrite", action="store_true",
                         help="replace what OUT holds (without it a non-empty OUT is refused)")
    prepare.set_defaults(func=cmd_prepare)
    preview = sub.add_parser("preview", help="print the first training examples as tokenized, the masked prompt in ⟦…⟧")
    _config_args(preview, name_help="run name (unused by preview)")
    preview.add_argument("-n", type=int, default=3, help="how many training examples (default 3)")
    preview.set_defaults(func=cmd_preview)
    export = sub.add_parser("export", help="export a Hugging Face model folder from a checkpoint")
    export.add_argument("checkpoint", help="a checkpoint_step* folder, or a run folder (its newest whole checkpoint)")
    export.add_argument("out", help="output folder or URI")
    export.add_argument("--max-shard-mb", type=int, default=5000, help="largest safetensors shard, in MB")
    export.add_argument("--adapter", default=None, metavar="DIR",
                        help="LoRA runs: also write the adapter-only PEFT folder here (vLLM/TGI serve it on the base)")
    export.set_defaults(func=cmd_export)
    evaluate = sub.add_parser("evaluate", help="BLEU/chrF on a test set (e.g. FLORES-200 devtest)",
                              description=INFERENCE_DEVICE_HELP)
    _config_args(evaluate, name_help="the finished run to score (its model, config and trained directions); "
                                     "with --model, the run that keeps the scores")
    evaluate.add_argument("--model", default=None,
                          help="model folder or hub id to score (default: the exported model of run --name)")
    evaluate.add_argument("--test-set", default=None, help="test-set folder (sets eval.test_set)")
    evaluate.add_argument("--directions", nargs="+", default=None, metavar="SRC-TGT",
                          help="directions to score (sets eval.directions), e.g. en-zh zh-en")
    evaluate.set_defaults(func=cmd_evaluate)
    tr = sub.add_parser("translate", help="translate sentences with a model, checkpoint or run",
                        description=INFERENCE_DEVICE_HELP)
    _config_args(tr)
    tr.add_argument("sentences", nargs="*", help="sentences to translate (default: --input, else stdin)")
    tr.add_argument("--model", "-m", required=True,
                    help="exported model folder, checkpoint_step* folder, run name, hub id, or tiny")
    tr.add_argument("--from", dest="src", required=True, help="source language (any code the table maps: en, zho_Hans...)")
    tr.add_argument("--to", dest="tgt", required=True, help="target language")
    tr.add_argument("--input", "-i", default=None, help="file with one sentence per line (- for stdin)")
    tr.add_argument("--encoding", default="utf-8",
                    help="text encoding of --input or piped stdin (default utf-8; e.g. shift_jis, gb18030, utf-16); "
                         "the translations are written in UTF-8")
    tr.add_argument("--output", "-o", default=None, help="write the translations here (default: stdout)")
    tr.add_argument("--sample", action="store_true",
                    help="the model card's sampling settings (top_k 20, top_p 0.6, temperature 0.7) instead of greedy")
    tr.add_argument("--ray", action="store_true",
                    help="translate on evaluation's Ray Data actor pool (default when RAY_ADDRESS is set)")
    tr.set_defaults(func=cmd_translate)
    plot = sub.add_parser("plot", help="PNG of a run's curves (loss, BLEU/chrF, lr, tokens/s) against step")
    _config_args(plot)
    plot.add_argument("run", help="run name under run.storage_root")
    plot.add_argument("--compare", nargs="+", default=[], metavar="RUN", help="more runs drawn in the same panels")
    plot.add_argument("--out", "-o", default=None, help="PNG file (default: <storage_root>/<run>/plot.png)")
    plot.set_defaults(func=cmd_plot)
    sync = sub.add_parser("sync", help="send a run's metrics.jsonl to MLflow after a tracking outage (once; no Ray)")
    _config_args(sync)
    sync.add_argument("run", help="run name under run.storage_root")
    sync.set_defaults(func=cmd_sync)
    tune = sub.add_parser("tune", help="learning-rate search with Ray Tune")
    _config_args(tune)
    tune.set_defaults(func=cmd_tune)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``hymt`` and ``jobs/*.py``; returns the exit status."""
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    argv = sys.argv[1:] if argv is None else list(argv)
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt as e:  # a run stopped cleanly (interrupt.fit): say how to go on, no traceback
        from raytrain_hymt.driver.resume import Interrupted

        if not isinstance(e, Interrupted):
            print(f"interrupted; run again with: {_rerun_command(argv, e)}", file=sys.stderr)
        elif e.checkpoint:
            print(f"interrupted: the last checkpoint is {e.checkpoint}; resume with: {_rerun_command(argv, e)}",
                  file=sys.stderr)
        else:
            print(f"interrupted before the first checkpoint; start again with: {_rerun_command(argv, e)}",
                  file=sys.stderr)
        return 130
    except Exception as e:  # noqa: BLE001 - the last line of defence: one clear line (trace on request)
        from raytrain_hymt.errors import describe_failure

        if os.environ.get("HYMT_VERBOSE"):
            log.error("traceback:", exc_info=True)
        print(f"error: {describe_failure(e)}", file=sys.stderr)
        if not os.environ.get("HYMT_VERBOSE"):
            print("(set HYMT_VERBOSE=1 for the full traceback and Ray's own output)", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
