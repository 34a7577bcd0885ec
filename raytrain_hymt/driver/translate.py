"""``hymt translate``: translate sentences with any model this project can name.

The model is an exported folder, a checkpoint (exported to a temporary folder first), the name of a run
under ``run.storage_root`` (its exported ``model/``), a hub id, or ``tiny``. Sentences are translated
with :mod:`~raytrain_hymt.evaluation.generation`, the function evaluation uses: in this process for a local job, or
on evaluation's Ray Data actor pool (``eval.workers`` replicas) when ``RAY_ADDRESS`` names a cluster
(``ray job submit`` sets it) or ``--ray`` asks for it. A sentence that fails or comes back empty is reported with its
line number; every other sentence is still translated and written in its place.
"""

from __future__ import annotations

import logging
import os
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

from raytrain_hymt.errors import ConfigError

log = logging.getLogger("raytrain_hymt")


@dataclass
class TranslateResult:
    """Translations in input order, and the problems per line (1-based line number → what happened)."""

    translations: list[str]
    problems: dict[int, str] = field(default_factory=dict)


def _checkpoint_state(folder: Path) -> bool:
    from raytrain_hymt.train.checkpoint import STATE_FILE

    return (folder / STATE_FILE).is_file()


def resolve_model(model: str, storage_root: str, scratch: str) -> str:
    """The model folder, hub id or URI to load for ``model``; a checkpoint is exported into ``scratch``.

    Raises ConfigError when ``model`` looks like a path (or names a run) that holds no model.
    """
    from raytrain_hymt.train.export import export_checkpoint
    from raytrain_hymt.console.quiet import no_bars, quiet_deepspeed
    from raytrain_hymt.storage import RunFolder, is_uri
    from raytrain_hymt.storage import SUMMARY_FILE

    if model == "tiny" or is_uri(model):
        return model
    path = Path(model).expanduser()
    if path.is_dir():
        if (path / "config.json").is_file():
            return str(path.resolve())
        if _checkpoint_state(path):
            log.info("exporting checkpoint %s to a temporary folder first", path)
            quiet_deepspeed()  # before the export imports DeepSpeed
            with no_bars():  # DeepSpeed's shard-loading bar would land between the translations
                return export_checkpoint(path, str(Path(scratch) / "model"), max_shard_bytes=5 * 10**9)
        raise ConfigError(f"model {model}: the folder holds neither an exported model (config.json) "
                          "nor a checkpoint (state.json)")
    import json

    summary = RunFolder(storage_root, model, create=False).read_text(SUMMARY_FILE) if "/" not in model else None
    if summary:
        model_dir = json.loads(summary).get("model_dir")
        if not model_dir:
            raise ConfigError(f"run {model} under {storage_root} exported no model (run.export: false); "
                              f"pass one of its checkpoint_step* folders instead")
        return model_dir
    looks_like_hub_id = model.count("/") == 1 and not model.startswith((".", "/", "~"))
    if not looks_like_hub_id:
        raise ConfigError(f"model {model}: no such folder, and no finished run of that name under {storage_root} "
                          "(give an exported model folder, a checkpoint, a run name or a hub id like "
                          "tencent/Hunyuan-MT-7B)")
    return model


def _decoded(data: bytes, encoding: str, where: str, src: str) -> str:
    """The text of input bytes in ``encoding`` (a UTF-8 or UTF-16 byte order mark skipped); ConfigError
    naming the line that does not decode and the encoding it reads as (for text in ``src``)."""
    from raytrain_hymt.data.files import decode_problem, language_codes, reading_codec

    problem = decode_problem(data, encoding, language_codes([src]), complete=True)
    if problem is not None:
        raise ConfigError(problem.describe(where, "add --encoding {}"))
    return data.decode(reading_codec(encoding)).removeprefix("\ufeff")


def read_input(sentences: list[str], input_path: str | None, stdin, encoding: str = "utf-8",
               src: str = "") -> list[str]:
    """The sentences to translate: the arguments, else the lines of ``input_path`` (``-``: stdin), else
    stdin when it is not a terminal; a file and piped bytes are text in ``encoding`` (in ``src``, the
    language the hint of a decoding error looks for). ConfigError when there is nothing to translate or
    the input does not decode. Only ``\n`` (or ``\r\n``) ends a line, as in evaluation's test sets."""
    from raytrain_hymt.config.schema import text_encoding_problem

    if (problem := text_encoding_problem(encoding)) is not None:
        raise ConfigError(f"--encoding: {problem}")
    if sentences and input_path:
        raise ConfigError("give sentences as arguments or --input FILE, not both")
    if sentences:
        lines = list(sentences)
    elif input_path and input_path != "-":
        if not Path(input_path).is_file():
            raise ConfigError(f"--input {input_path}: no such file")
        lines = _decoded(Path(input_path).read_bytes(), encoding, f"--input {input_path}", src).split("\n")
    elif input_path == "-" or not stdin.isatty():
        # Piped bytes, where there are any (a test's stdin may be text already).
        raw = getattr(stdin, "buffer", None)
        lines = (_decoded(raw.read(), encoding, "stdin", src) if raw is not None else stdin.read()).split("\n")
    else:
        raise ConfigError("nothing to translate: give sentences as arguments, --input FILE, or pipe lines to stdin")
    if not sentences:
        if lines and lines[-1] == "":
            lines.pop()
        lines = [line.removesuffix("\r") for line in lines]
    if not any(line.strip() for line in lines):
        where = "the arguments" if sentences else (f"--input {input_path}" if input_path not in (None, "-") else "stdin")
        raise ConfigError(f"nothing to translate: {where} holds no non-empty line")
    return lines


def _use_ray(force: bool) -> bool:
    # A command line process never finds Ray already initialized: RAY_ADDRESS (ray job submit, a cluster
    # shell) is how it learns that a cluster is there.
    return force or bool(os.environ.get("RAY_ADDRESS"))


def translate_lines(cfg, model: str, lines: list[str], src: str, tgt: str, sample: bool = False,
                    use_ray: bool = False, explicit_device=None) -> TranslateResult:
    """Translate ``lines`` from ``src`` to ``tgt`` (any label the language table maps) with ``model``.

    Blank lines stay blank (not translated, not a problem). ``cfg.eval`` sets the batch size, the longest
    translation and, on Ray, the number of replicas; ``cfg.deepspeed.precision`` and ``cfg.scaling.use_gpu``
    how the model is loaded; on Ray, those not in ``explicit_device`` (the user's choices) may move to the
    cluster's GPUs (:func:`~raytrain_hymt.driver.evaluate.settle_device_on_ray`).
    """
    from raytrain_hymt.driver.evaluate import say_automatic_device
    from raytrain_hymt.languages import UnsupportedLanguageError, resolve

    try:
        src_code, tgt_code = resolve(src).code, resolve(tgt).code
    except UnsupportedLanguageError as e:
        # Its hint about data.on_unsupported_language is for corpora, not for a command line.
        raise ConfigError(f"--from/--to: {str(e).split(' To drop such rows')[0]}") from None
    todo = [i for i, line in enumerate(lines) if line.strip()]
    with tempfile.TemporaryDirectory(prefix="hymt-translate-") as scratch:
        path = resolve_model(model, cfg.run.storage_path, scratch)
        if _use_ray(use_ray):
            texts, errors = _on_ray(cfg, path, [lines[i] for i in todo], src_code, tgt_code, sample, explicit_device)
        else:
            say_automatic_device(cfg, explicit_device)
            texts, errors = _in_process(cfg, path, [lines[i] for i in todo], src_code, tgt_code, sample)
    result = TranslateResult(translations=[""] * len(lines))
    for i, text, error in zip(todo, texts, errors):
        result.translations[i] = text
        if error:
            result.problems[i + 1] = f"failed: {error}"
        elif not text:
            result.problems[i + 1] = "the translation came back empty"
    return result


def _in_process(cfg, model: str, sources: list[str], src: str, tgt: str, sample: bool):
    from raytrain_hymt.evaluation.generation import translate_all
    from raytrain_hymt.train.model import load_generator

    try:
        generator = load_generator(model, cfg.deepspeed.precision, cfg.eval.max_new_tokens, cfg.scaling.use_gpu,
                                   cfg.model.trust_remote_code, sample=sample)
    except OSError as e:  # transformers: neither a folder nor a reachable hub repository
        raise ConfigError(f"model {model}: could not be loaded ({e})".split("\n")[0]) from None
    n = len(sources)
    return translate_all(generator, sources, [src] * n, [tgt] * n, cfg.eval.batch_size, report_errors=True)


def _on_ray(cfg, model: str, sources: list[str], src: str, tgt: str, sample: bool, explicit_device):
    from raytrain_hymt.driver.evaluate import settle_device_on_ray, translate
    from raytrain_hymt.driver.session import init_ray

    init_ray(cfg)
    settle_device_on_ray(cfg, explicit_device)
    rows = [{"id": i, "src": s, "src_lang": src, "tgt_lang": tgt} for i, s in enumerate(sources)]
    return translate(rows, cfg, model, sample=sample)
