"""``hymt``: the command line. Each subcommand parses, builds the config, and calls one function."""

from __future__ import annotations

import argparse
import logging
import sys

from raytrain_hymt.config import ConfigError, load_config

log = logging.getLogger("raytrain_hymt")


def _config_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", "-c", default=None, help="preset name (jobs/configs/NAME.yaml) or YAML file; default tiny-cpu")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="SECTION.FIELD=VALUE",
                        help="override one config field (repeatable), e.g. --set optim.lr=3e-5")
    parser.add_argument("--name", default=None, help="run name; the same name resumes that run")


def _load(args) -> object:
    overrides = list(args.overrides) + ([f"run.name={args.name}"] if args.name else [])
    return load_config(args.config, overrides)


def cmd_train(args) -> int:
    """Train (or resume) a run and print where its results are."""
    from raytrain_hymt.trainer import finished_summary, run_training

    cfg = _load(args)
    done = finished_summary(cfg)
    if done is not None:
        print(f"run {done.name} already finished; nothing to do.")
        print("\n".join(done.lines()))
        return 0
    summary = run_training(cfg)
    print("\n".join(summary.lines()))
    return 0


def build_parser() -> argparse.ArgumentParser:
    """The ``hymt`` argument parser with every subcommand."""
    parser = argparse.ArgumentParser(prog="hymt", description="Fine-tune Hunyuan-MT with Ray Train + DeepSpeed")
    sub = parser.add_subparsers(dest="command", required=True)
    train = sub.add_parser("train", help="train or resume a run (default preset: tiny-cpu)")
    _config_args(train)
    train.set_defaults(func=cmd_train)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``hymt`` and ``jobs/*.py``; returns the exit status."""
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except Exception as e:  # noqa: BLE001 - the last line of defence: one clear line, full trace in the log
        from raytrain_hymt.errors import describe_failure

        log.debug("failure", exc_info=True)
        print(f"error: {describe_failure(e)}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
