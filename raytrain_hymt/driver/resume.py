"""Resuming a run: the check that a re-submitted run continues what its first submission started, and
Ctrl-C, which stops a run so that it can be resumed.

The run's first ``config.yaml`` is kept. A re-submission is compared with it field by field
(:func:`check_resume`); a difference in a field that changes the training trajectory (data, model,
optimizer, schedule, batch: every field not in :data:`TRAJECTORY_FREE`) stops the run with one
:class:`~raytrain_hymt.errors.ConfigError` naming the fields, unless ``run.allow_config_change`` is set.
Every difference, allowed or not, is recorded in ``<run>/config-changes.jsonl``. The data fingerprint
(:func:`check_resume_data`: the newest checkpoint's against the data configured now) goes through the same
single override.

Ctrl-C: Ray Train's ``fit()`` installs its own SIGINT handler (Ray 2.60): it aborts the controller, after
which ``fit()`` returns (or the handler exits the process with status 0), so no ``KeyboardInterrupt``
ever reaches the caller and the run would go on to export a half-trained model. :func:`fit` wraps that
handler to remember the interrupt and turns the end of ``fit()`` into :class:`Interrupted`, which the
command line reports in one line with the last checkpoint and how to resume (exit 130).
"""

from __future__ import annotations

import json
import logging
import signal
import threading
from dataclasses import asdict, dataclass
from datetime import datetime, timezone
from typing import Any

import yaml

from raytrain_hymt.config.schema import PREDATING_VALUES, Config, flatten, to_yaml
from raytrain_hymt.data.fingerprint import check_same_data, data_fingerprint
from raytrain_hymt.errors import ConfigError, TrainingFailed, disk_full, no_space
from raytrain_hymt.storage import CHANGES_FILE, CONFIG_FILE, SUMMARY_FILE, RunFolder

log = logging.getLogger("raytrain_hymt")


#: Fields a resumed run may change: they decide how the run is observed, stored, retried or how fast it
#: runs, never which updates the weights get. A name ending in "." covers its whole section. Any field
#: not listed changes the trajectory (so a new field is protected until someone lists it here).
TRAJECTORY_FREE: tuple[str, ...] = (
    "preset",
    "tracking.",
    "eval.",
    "tune.",
    "checkpoint.every_steps", "checkpoint.num_to_keep", "checkpoint.max_failures", "checkpoint.async_upload",
    "run.storage_root", "run.export", "run.export_shard_mb", "run.allow_config_change", "run.name",
    "scaling.num_workers", "scaling.min_workers", "scaling.elastic_resize_monitor_interval_s", "scaling.use_gpu",
    "scaling.cpus_per_worker", "scaling.local_num_cpus", "scaling.env.",
    "data.tokenize_actors", "data.tokenize_batch_size", "data.max_val_examples",
    "model.compile", "model.fused_loss", "model.attn_implementation",
    "deepspeed.activation_checkpointing", "deepspeed.overlap_comm", "deepspeed.reduce_bucket_size",
    "deepspeed.offload_optimizer", "deepspeed.offload_param",
)


def changes_trajectory(field: str) -> bool:
    """Whether a resumed run may not change ``field`` (a dotted config name) without the override."""
    # "tune." also covers "tune" itself: an unset section flattens to one None value.
    return not any(field == free.rstrip(".") or (free.endswith(".") and field.startswith(free)) for free in TRAJECTORY_FREE)


@dataclass(frozen=True)
class Difference:
    """One way a re-submission differs from what its run started with."""

    field: str
    before: Any
    after: Any
    trajectory: bool
    """True when the difference changes the training trajectory (needs ``run.allow_config_change``)."""


_ABSENT = "(not set)"


def check_resume(saved: dict, new: dict) -> list[Difference]:
    """The differences between a run's first config and a re-submission's (both as plain dicts)."""
    defaults = {**flatten(Config().model_dump(mode="json")), **PREDATING_VALUES}
    before, after = flatten(saved), flatten(new)
    if isinstance(before.get("data.sources"), list):  # a source field the first config.yaml predates: its default
        before["data.sources"] = [_with_source_defaults(s) for s in before["data.sources"]]
    diffs = []
    # Only fields of the schema: a recorded non-config difference (a data fingerprint) is not one.
    for field in sorted(set(after) | (set(before) & set(defaults))):
        # A field the first config.yaml predates had its default then.
        old = before.get(field, defaults.get(field, _ABSENT))
        now = after.get(field, _ABSENT)
        if old != now:
            trajectory = changes_trajectory(field) and not (field == "data.sources" and _moved_only(old, now))
            diffs.append(Difference(field, old, now, trajectory))
    # The worker count may change (a run continues on the nodes it has), the global batch may not: without
    # optim.global_batch_rows it is workers × accumulation × micro-batch, so a new count changes it.
    rows = [_rows_per_step({**defaults, **flat}) for flat in (before, after)]
    if rows[0] != rows[1]:
        diffs.append(Difference(ROWS_PER_STEP, rows[0], rows[1], True))
    return diffs


def _with_source_defaults(source: Any) -> Any:
    if not isinstance(source, dict):
        return source
    from raytrain_hymt.config.schema import SourceConfig

    fields = SourceConfig.model_fields
    filled = {k: f.default for k, f in fields.items() if k not in source and not f.is_required()
              and f.default_factory is None}
    return {**SourceConfig.model_construct(**filled).model_dump(mode="json", include=set(filled)), **source}


#: The name a changed global batch is reported under (not a config field: it is derived from several).
ROWS_PER_STEP = "global batch (rows per optimizer step)"


def _rows_per_step(flat: dict) -> int:
    fixed = flat.get("optim.global_batch_rows")
    return fixed or flat["scaling.num_workers"] * flat["optim.grad_accum"] * flat["optim.micro_batch_size"]


def _moved_only(old: Any, now: Any) -> bool:
    """Whether two ``data.sources`` lists differ in their paths alone. Rows are named relative to their
    source's root, so a corpus moved or mounted elsewhere trains the same rows; whether the files still
    hold the same data is the data fingerprint's check (:func:`check_resume_data`), which runs next."""
    def strip(sources):
        return [{k: v for k, v in s.items() if k != "path"} for s in sources] if isinstance(sources, list) else sources
    return strip(old) == strip(now)


def _shown(value: Any) -> str:
    text = json.dumps(value, ensure_ascii=False) if not isinstance(value, str) else repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def enforce(diffs: list[Difference], run: str, allow: bool, finished: int | None = None) -> None:
    """Raise one :class:`ConfigError` when ``diffs`` change the trajectory and ``allow`` is off;
    ``finished``: the run finished after that many steps (the message says how to start from its weights)."""
    blocking = [d for d in diffs if d.trajectory]
    if not blocking or allow:
        return
    lines = "\n".join(f"  {d.field}: {_shown(d.before)} -> {_shown(d.after)}" for d in blocking)
    other = (f"or start a new run from its weights with another --name and --set model.init_from={run}"
             if finished is not None else "or start a new run with another --name")
    raise ConfigError(
        f"run {run!r} started with another config; resuming it with this one would change what it trains "
        f"({len(blocking)} field{'s' if len(blocking) > 1 else ''}):\n{lines}\n"
        f"Resume anyway with --set run.allow_config_change=true (the change is recorded in {CHANGES_FILE}), "
        f"{other}."
    )


def record(folder, diffs: list[Difference], allowed: bool) -> None:
    """Append one line to ``<run>/config-changes.jsonl`` and log the changed fields."""
    if not diffs:
        return
    line = {"time": datetime.now(timezone.utc).isoformat(timespec="seconds"), "allowed": allowed,
            "changes": [asdict(d) for d in diffs]}
    text = folder.read_text(CHANGES_FILE) or ""
    folder.write_text(CHANGES_FILE, text + json.dumps(line, ensure_ascii=False) + "\n")
    log.info("resuming with changed config (recorded in %s): %s", CHANGES_FILE,
             ", ".join(f"{d.field} {_shown(d.before)} -> {_shown(d.after)}" for d in diffs))


def current_config(first: dict, changes: str | None) -> dict:
    """The config a run last ran with, flat: its first ``config.yaml`` with every recorded change applied
    (so a change accepted once is not asked about again)."""
    current = flatten(first)
    for line in (changes or "").splitlines():
        for change in json.loads(line)["changes"]:
            if change["field"] != ROWS_PER_STEP and (change["field"] in current or change["after"] != _ABSENT):
                current[change["field"]] = change["after"]
    return current


def resubmission_diffs(folder, cfg: Config) -> list[Difference] | None:
    """How ``cfg`` differs from the config run ``folder`` last ran with; None for a run without a
    ``config.yaml`` (a new run)."""
    saved_text = folder.read_text(CONFIG_FILE)
    if saved_text is None:
        return None
    new = yaml.safe_load(to_yaml(cfg))  # the same YAML round trip as the saved one (tuples are lists)
    return check_resume(current_config(yaml.safe_load(saved_text) or {}, folder.read_text(CHANGES_FILE)), new)


def finished_steps(folder) -> int | None:
    """The steps a finished run trained (its ``summary.json``), or None for a run that has not finished."""
    text = folder.read_text(SUMMARY_FILE)
    return int(json.loads(text)["steps"]) if text else None


#: The one field a finished run may be submitted again with to train on: ``optim.max_steps``.
MORE_STEPS = "optim.max_steps"


def check_finished(diffs: list[Difference], steps: int, run: str, allow: bool) -> tuple[bool, list[Difference]]:
    """A run that finished after ``steps`` steps, submitted again with ``diffs``: ``(continues, diffs)``.

    It continues when ``optim.max_steps`` grew past ``steps``: that difference is then no trajectory change
    (the run trains on from its last checkpoint, as a resume does). A trajectory change is refused as on an
    unfinished run (:func:`enforce`); with ``allow`` it is accepted only together with more steps, since a
    finished run has nothing left to train. A smaller or equal ``optim.max_steps`` is one line.
    """
    more = next((d for d in diffs if d.field == MORE_STEPS), None)
    continues = more is not None and isinstance(more.after, int) and more.after > steps
    if more is not None and isinstance(more.after, int) and not continues:
        raise ConfigError(f"run {run!r} finished at step {steps}: optim.max_steps={more.after} trains nothing more; "
                          f"continue it with an optim.max_steps larger than {steps}")
    if continues:
        diffs = [Difference(d.field, d.before, d.after, False) if d is more else d for d in diffs]
    enforce(diffs, run, allow, finished=steps)
    changed = [d.field for d in diffs if d.trajectory]
    if changed and not continues:
        raise ConfigError(f"run {run!r} finished at step {steps}: changing {', '.join(changed)} trains nothing; continue "
                          f"it with --set optim.max_steps=N (N > {steps}), or start a new run from its weights with "
                          f"--set model.init_from={run}")
    return continues, diffs


def keep_first_config(folder, cfg: Config, extra: list[Difference] = ()) -> None:
    """Write the run's ``config.yaml`` on its first submission; on a later one, check the new config
    against it (plus ``extra`` differences, e.g. of the data) and record what changed. The first
    ``config.yaml`` is never replaced. A finished run goes on only with a larger ``optim.max_steps``
    (:func:`check_finished`); its ``summary.json`` is removed then, so a continuation that stops before
    its end is resumed like any unfinished run rather than reported as finished."""
    diffs = resubmission_diffs(folder, cfg)
    if diffs is None:
        folder.write_text(CONFIG_FILE, to_yaml(cfg))
        return
    diffs += list(extra)
    steps = finished_steps(folder)
    continues = False
    if steps is None:
        enforce(diffs, cfg.run.name, cfg.run.allow_config_change)
    else:
        continues, diffs = check_finished(diffs, steps, cfg.run.name, cfg.run.allow_config_change)
    record(folder, diffs, allowed=any(d.trajectory for d in diffs))
    if continues:
        folder.fs.delete_file(f"{folder.path}/{SUMMARY_FILE}")
        log.info("continuing finished run %s from step %d to step %d", cfg.run.name, steps, cfg.optim.max_steps)


def newest_checkpoint_state(folder: RunFolder) -> tuple[str, dict] | None:
    """``(checkpoint folder name, its state.json)`` of the newest whole checkpoint in a run folder, or None
    for a run without one (a new run). A newer checkpoint that was cut off (a full disk, a killed upload)
    is skipped with one warning naming it: the run resumes from the one before."""
    from raytrain_hymt.train.checkpoint import newest_whole_checkpoint

    newest = newest_whole_checkpoint(folder.fs, folder.path)
    return None if newest is None else (newest[0], asdict(newest[1]))


def check_resume_data(cfg: Config, folder: RunFolder) -> dict:
    """The data fingerprint of ``cfg``, after checking that a resumed run (one with a checkpoint in
    ``folder``) resumes on the data it trained on; see :func:`~raytrain_hymt.data.fingerprint.check_same_data`."""
    fingerprint = data_fingerprint(cfg)
    newest = newest_checkpoint_state(folder)
    if newest is not None:
        name, state = newest
        check_same_data(state.get("data_fingerprint"), fingerprint, cfg.run.allow_config_change,
                        where=f"{folder.uri}/{name}, step {state.get('step')}")
    return fingerprint


class Interrupted(KeyboardInterrupt):
    """The user interrupted run ``run``; ``checkpoint``: its newest checkpoint, None if there is none."""

    def __init__(self, run: str | None, checkpoint: str | None):
        super().__init__(run, checkpoint)
        self.run = run
        self.checkpoint = checkpoint


def latest_checkpoint(storage_path: str, name: str | None) -> str | None:
    """The newest whole ``checkpoint_step*`` folder of run ``name`` (the one a resubmission resumes from),
    or None (no run, no whole checkpoint yet)."""
    from raytrain_hymt.storage import RunFolder
    from raytrain_hymt.train.checkpoint import newest_whole_checkpoint

    if not name:
        return None
    folder = RunFolder(storage_path, name, create=False)
    try:
        newest = newest_whole_checkpoint(folder.fs, folder.path, warn=False)
    except OSError:
        return None
    return f"{folder.uri}/{newest[0]}" if newest else None


def fit(trainer, storage_path: str, name: str):
    """``trainer.fit()``; a Ctrl-C during it aborts the run as Ray does, then raises :class:`Interrupted`.
    A run that ran out of disk space ends in one :class:`TrainingFailed` line naming the storage root and
    the newest whole checkpoint, the one a resubmission resumes from."""
    interrupts: list[int] = []
    register = getattr(trainer, "_register_sigint_handler", None)
    main_thread = threading.current_thread() is threading.main_thread()
    previous = signal.getsignal(signal.SIGINT) if main_thread else None

    def register_and_wrap(controller):
        register(controller)
        ray_handler = signal.getsignal(signal.SIGINT)

        def on_sigint(signum, frame):
            interrupts.append(signum)
            if callable(ray_handler):
                ray_handler(signum, frame)

        signal.signal(signal.SIGINT, on_sigint)

    if register is not None:
        trainer._register_sigint_handler = register_and_wrap
    try:
        result = trainer.fit()
    except (Exception, SystemExit) as e:  # Ray's handler may sys.exit(0) or the aborted run end with an error
        if interrupts:
            raise Interrupted(name, latest_checkpoint(storage_path, name)) from None
        if isinstance(e, Exception) and no_space(e):
            raise TrainingFailed(disk_full(e, storage_path, latest_checkpoint(storage_path, name))) from e
        raise
    finally:
        if main_thread and previous is not None:  # Ray's handler would abort a controller that is gone
            signal.signal(signal.SIGINT, previous)
    if interrupts:
        fallback = result.checkpoint.path if result.checkpoint else None
        raise Interrupted(name, latest_checkpoint(storage_path, name) or fallback)
    return result
