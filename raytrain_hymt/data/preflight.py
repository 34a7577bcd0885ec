"""The data sources and model paths checked on the driver before Ray starts (``hymt train/prepare/tune``).

Every problem found becomes one line naming the field, the file, the value and, for a language code,
the nearest valid one; all of them are raised together as one :class:`~raytrain_hymt.errors.ConfigError`,
so nothing (no Ray session, run folder or MLflow run) exists yet when a typo is reported. Only cheap
checks: files exist and open, their first few KB decode in the source's encoding (else the one they
read as is named), the first lines fit the format, Moses partners have as many lines.
Object-store URIs and hub ids are left to the readers (no credentials or network here).
"""

from __future__ import annotations

import csv
import json
import os
from contextlib import closing
from pathlib import Path

from raytrain_hymt.config.schema import Config, DataConfig
from raytrain_hymt.config.schema import SourceConfig
from raytrain_hymt.errors import ConfigError
from raytrain_hymt.data.sources import moses_pairs
from raytrain_hymt.errors import DataSourceError
from raytrain_hymt.data.files import (count_lines, decode_problem, decoded_lines, expand_paths, language_codes,
                                      open_binary, read_head)
from raytrain_hymt.data.language_id import sample_problem
from raytrain_hymt.languages import LANGUAGES, direction_text, is_supported, orientation, resolve
from raytrain_hymt.storage import is_uri

#: Lines of each file peeked at to see whether the format fits.
PEEK_LINES = 5
#: Rows of a Tatoeba file looked at for one in the direction its source's src_lang/tgt_lang select.
PEEK_ROWS = 500
#: Pairs of each file whose languages are identified, to catch swapped columns or a side in another language.
IDENTIFY_LINES = 200
#: Files of a glob peeked at (a corpus of thousands of shards has one format; opening each costs a round trip).
PEEK_FILES = 50

# Labels people write for a language that are no code resolve() accepts: country codes, old or wrong
# codes, and English names. Consulted before edit distance, which alone would turn ``cn`` into ``bn``.
_SUGGEST: dict[str, str] = {
    "jp": "ja", "cn": "zh", "kr": "ko", "cz": "cs", "ua": "uk", "vn": "vi", "sp": "es",
    "esp": "es", "br": "pt", "ir": "fa", "tw": "zh-Hant", "hk": "zh-Hant", "cht": "zh-Hant", "chs": "zh",
    "zh-hans": "zh", "jap": "ja", "kor": "ko", "ch": "zh", "ph": "tl", "kz": "kk", "il": "he",
    "mandarin": "zh", "farsi": "fa", "tagalog": "tl", "simplified chinese": "zh", "chinese simplified": "zh",
    **{lang.english_name.lower(): code for code, lang in LANGUAGES.items()},
    **{lang.chinese_name: code for code, lang in LANGUAGES.items()},
}
# Languages people ask for that Hunyuan-MT does not translate, so "did you mean" would mislead.
_NOT_SUPPORTED = {"gr": "Greek", "el": "Greek", "ell": "Greek", "greek": "Greek", "da": "Danish", "dk": "Danish",
                  "sv": "Swedish", "fi": "Finnish", "no": "Norwegian", "hu": "Hungarian", "ro": "Romanian"}


def _edit_distance(a: str, b: str) -> int:
    row = list(range(len(b) + 1))
    for i, ca in enumerate(a, 1):
        prev, row[0] = row[0], i
        for j, cb in enumerate(b, 1):
            prev, row[j] = row[j], min(row[j] + 1, row[j - 1] + 1, prev + (ca != cb))
    return row[-1]


def nearest_language(label: str) -> str | None:
    """The Hunyuan-MT code a mistyped ``label`` most likely means (``jp`` → ``ja``, ``cn`` → ``zh``), or None.

    The alias table first, then the closest code, ISO 639-2/3 code or English name by edit distance
    (at most one edit for short labels, a third of the letters for names).
    """
    if is_supported(label):
        return resolve(label).code
    key = label.strip().replace("_", "-").lower()
    if key in _SUGGEST:
        return _SUGGEST[key]
    if key in _NOT_SUPPORTED:
        return None
    candidates = {code.lower(): code for code in LANGUAGES}
    candidates.update({name: code for name, code in _SUGGEST.items() if name not in candidates})
    limit = max(1, len(key) // 3)
    best = min(candidates, key=lambda c: (_edit_distance(key, c), len(c)))
    near = candidates[best] if _edit_distance(key, best) <= limit else None
    # A suggestion must be a language the model has: "did you mean" names it (LANGUAGES[near]).
    return near if near in LANGUAGES else None


def language_problem(field: str, label: str, where: str) -> str | None:
    """One line when ``label`` is no Hunyuan-MT language (with the nearest valid code), else None."""
    if is_supported(label):
        return None
    near = nearest_language(label)
    if near is not None:
        hint = f"did you mean '{near}' ({LANGUAGES[near].english_name})?"
    elif label.strip().lower() in _NOT_SUPPORTED:
        hint = f"{_NOT_SUPPORTED[label.strip().lower()]} is not among Hunyuan-MT's {len(LANGUAGES)} languages"
    else:
        hint = f"Hunyuan-MT's codes: {', '.join(LANGUAGES)}"
    return f"{field}: {label!r} is not a Hunyuan-MT language ({where}); {hint}"


def _peek(path: str, n: int = PEEK_LINES, encoding: str = "utf-8") -> list[str]:
    """The first ``n`` non-blank lines of a text file, decoded leniently, BOM and line ends stripped."""
    lines: list[str] = []
    with closing(decoded_lines(path, encoding)) as decoded:
        for _, line, _ in decoded:
            if line.strip():
                lines.append(line)
            if len(lines) >= n:
                break
    return lines


def _encoding_problem(source: SourceConfig, path: str, languages: tuple[str, ...] | None = None) -> str | None:
    """Why the first few KB of a text file do not decode in ``source.encoding``, and the encoding they read as
    (guessed for the text of ``languages``: by default the source's, or a Tatoeba file's first labels)."""
    if source.format not in ("tatoeba", "tsv", "csv", "jsonl", "moses"):
        return None
    head, complete = read_head(path)
    if languages is None:
        labels = [source.src_lang, source.tgt_lang]
        if source.format == "tatoeba":
            rows = (line.split(b"\t") for line in head.split(b"\n")[:PEEK_ROWS])
            labels += [col.decode("ascii", errors="replace") for cols in rows if len(cols) == 4 for col in cols[:2]]
        languages = language_codes(labels)
    problem = decode_problem(head, source.encoding, languages, complete)
    return None if problem is None else problem.describe(path, "set encoding: {}")


def _format_problem(source: SourceConfig, path: str) -> str | None:
    """Why the first lines of ``path`` cannot be ``source.format``, with the format they look like."""
    fmt = source.format
    if fmt == "parquet":
        if _is_parquet(path):
            return None
        with open_binary(path) as f:
            head = f.read(4)
        return f"it does not start like a Parquet file (first bytes {head!r}){looks_like(_peek(path), path)}"
    if fmt not in ("tatoeba", "tsv", "jsonl", "csv"):
        return None
    if _is_parquet(path):
        return "it is a Parquet file, not lines of text (format 'parquet' reads it)"
    lines = _peek(path, encoding=source.encoding)
    if not lines:
        return None  # empty: said by the caller, about the path
    if fmt == "jsonl":
        try:
            row = json.loads(lines[0])
        except ValueError:
            return f"line 1 is not JSON: {lines[0][:60]!r}{looks_like(lines, path)}"
        if not isinstance(row, dict):
            return f"line 1 is a JSON {type(row).__name__}, not an object"
        absent = [c for c in dict.fromkeys((source.src_column, source.tgt_column)) if c not in row]
        if absent:
            return (f"line 1 has no field {', '.join(map(repr, absent))} (fields: {', '.join(row)}); "
                    "set src_column/tgt_column")
        return None
    looks = looks_like(lines, path)
    if _json_object(lines[0]):
        separator = "comma" if fmt == "csv" else "tab"
        return f"line 1 is a JSON object, format {fmt!r} reads {separator}-separated columns{looks}"
    tabs = [line.count("\t") + 1 for line in lines]
    lines_have = "line 1 has" if len(lines) == 1 else f"its first {len(lines)} lines have"
    if fmt == "csv":  # lines that all split into 2 or 4 at tabs are a TSV file; lines without a comma no CSV
        if tabs[0] in (2, 4) and len(set(tabs)) == 1:
            return f"{lines_have} {tabs[0]} tab-separated columns, format 'csv' reads comma-separated ones{looks}"
        if not any("," in line for line in lines):
            return f"{lines_have} no comma, format 'csv' reads 2 comma-separated columns{looks}"
        return None
    want = 4 if fmt == "tatoeba" else 2
    if any(t == want for t in tabs):
        return None
    return f"{lines_have} {tabs[0]} tab-separated columns, format {fmt!r} needs {want}{looks}"


def _is_parquet(path: str) -> bool:
    with open_binary(path) as f:
        return f.read(4) == b"PAR1"


def _json_object(line: str) -> bool:
    """Whether ``line`` is one JSON object (a line of a JSON lines file)."""
    if not line.lstrip().startswith("{"):
        return False
    try:
        return isinstance(json.loads(line), dict)
    except ValueError:
        return False


def looks_like(lines: list[str], path: str) -> str:
    """`` (<the format these first lines of ``path`` look like>)``, said in a wrong-format message, or ""."""
    if _is_parquet(path):
        return " (a Parquet file: format 'parquet')"
    if not lines:
        return ""
    if _json_object(lines[0]):
        return " (JSON lines: format 'jsonl')"
    columns = lines[0].count("\t") + 1
    if columns == 4:
        return " (format 'tatoeba' reads 4 columns: src_lang, tgt_lang, src, tgt)"
    if columns == 2:
        return " (format 'tsv' reads 2 columns: src, tgt)"
    if columns == 1 and "," in lines[0]:
        return " (comma-separated: format 'csv')"
    stem, _, suffix = path.removesuffix(".gz").rpartition(".")
    if columns == 1 and stem and "/" not in suffix and is_supported(suffix):
        return f" (one sentence a line, like a Moses file: format 'moses' with path '{stem}' reads {stem}.<src_lang> " \
               f"and {stem}.<tgt_lang>)"
    return ""


def _folder_problem(source: SourceConfig) -> str | None:
    """What to say when a file source's path is a folder: the glob that reads its files."""
    if is_uri(source.path) or not Path(source.path).expanduser().is_dir():
        return None
    suffix = {"tatoeba": "tsv", "tsv": "tsv", "csv": "csv", "jsonl": "jsonl", "parquet": "parquet"}.get(source.format, "*")
    return (f"data source {source.path!r} is a folder, not a file; to read the files in it give a glob, "
            f"e.g. '{source.path.rstrip('/')}/*.{suffix}'")


def _direction_problem(source: SourceConfig, path: str) -> str | None:
    """Why ``src_lang``/``tgt_lang`` contradict the rows of a Tatoeba file: none of its first rows is in
    the direction they select, either way round (rows in other languages are dropped, not refused)."""
    rows = [cols for cols in (line.split("\t") for line in _peek(path, PEEK_ROWS, source.encoding)) if len(cols) == 4]
    labels = [(c[0] or source.src_lang or "", c[1] or source.tgt_lang or "") for c in rows]
    if not labels or any(orientation(s, t, source.src_lang, source.tgt_lang) for s, t in labels):
        return None
    given = [f"{side} {getattr(source, side)!r}" for side in ("src_lang", "tgt_lang") if getattr(source, side)]
    want, back = direction_text(source.src_lang, source.tgt_lang), direction_text(source.tgt_lang, source.src_lang)
    return (f"{' and '.join(given)} {'contradict' if len(given) > 1 else 'contradicts'} the rows of {path}: its "
            f"first row is {labels[0][0]}→{labels[0][1]} and none of its first {len(labels)} rows is {want} or "
            f"{back} (the rows carry their languages: set src_lang/tgt_lang to the rows' own, or leave them unset)")


def _sample_pairs(source: SourceConfig, path: str) -> list[tuple[str, str]]:
    """The first :data:`IDENTIFY_LINES` pairs of a tsv/csv/jsonl file (flat text columns), as read."""
    lines = _peek(path, IDENTIFY_LINES, source.encoding)
    if source.format == "tsv":
        rows = [line.split("\t") for line in lines]
    elif source.format == "csv":
        rows = list(csv.reader(lines))
    else:
        rows = []
        for line in lines:
            try:
                record = json.loads(line)
            except ValueError:
                continue
            if isinstance(record, dict):
                rows.append([record.get(source.src_column), record.get(source.tgt_column)])
    return [(s, t) for s, t in (r for r in rows if len(r) == 2) if isinstance(s, str) and isinstance(t, str)]


def _moses_sample(src_file: str, tgt_file: str, encoding: str) -> list[tuple[str, str]]:
    """The first :data:`IDENTIFY_LINES` line pairs of a Moses pair (blank lines kept: they align)."""
    def head(path: str) -> list[str]:
        with closing(decoded_lines(path, encoding)) as decoded:
            return [line for (_, line, _), _ in zip(decoded, range(IDENTIFY_LINES))]

    return list(zip(head(src_file), head(tgt_file)))


def _identity_problem(source: SourceConfig, pairs: list[tuple[str, str]], path: str) -> str | None:
    """One line when the identified languages of a file's first pairs contradict src_lang/tgt_lang."""
    if not (source.src_lang and source.tgt_lang):
        return None
    problem = sample_problem(pairs, resolve(source.src_lang).code, resolve(source.tgt_lang).code)
    return None if problem is None else f"{path} {problem}"


def _source_problems(i: int, source: SourceConfig, identify: bool = True) -> list[str]:
    field = f"data.sources[{i}]"
    where = f"source {source.path!r}"
    problems = []
    languages_given = True
    for side in ("src_lang", "tgt_lang"):
        label = getattr(source, side)
        if label is None:
            languages_given = False
            if source.format != "tatoeba":
                problems.append(f"{field}.{side}: not set; format {source.format!r} rows do not carry their languages")
        elif (problem := language_problem(f"{field}.{side}", label, where)) is not None:
            problems.append(problem)
    if languages_given and not problems and resolve(source.src_lang) == resolve(source.tgt_lang):
        problems.append(f"{field}: src_lang {source.src_lang!r} and tgt_lang {source.tgt_lang!r} are the same "
                        f"language ({resolve(source.src_lang).code}); a pair needs two languages")
    if is_uri(source.path) or source.format == "hf_hub":
        return problems
    if source.format == "hf_disk":
        if not Path(source.path).expanduser().is_dir():
            problems.append(f"{field}.path: no such folder {source.path!r} (format hf_disk: a save_to_disk folder)")
        return problems
    if source.format == "moses":
        if problems:
            return problems
        try:
            pairs = moses_pairs(source)
        except DataSourceError as e:
            if not is_uri(source.path) and Path(source.path).expanduser().is_file():
                # A file where a prefix belongs: the prefix of its pair, or the format its lines look like.
                return [f"{field}.path: {e}; {source.path} is a file, format 'moses' takes the prefix of a file pair"
                        f"{looks_like(_peek(source.path), source.path)}"]
            return [f"{field}.path: {e}"]
        for src_file, tgt_file in pairs:
            sides = ((src_file, source.src_lang), (tgt_file, source.tgt_lang))
            undecodable = [p for p in (_encoding_problem(source, f, language_codes([lang])) for f, lang in sides) if p]
            if undecodable:
                problems += [f"{field}.encoding: {p}" for p in undecodable]
                continue
            n_src, n_tgt = count_lines(src_file, source.encoding), count_lines(tgt_file, source.encoding)
            if n_src == n_tgt == 0:
                problems.append(f"{field}.path: {src_file} and {tgt_file} are empty")
            elif n_src != n_tgt:
                problems.append(f"{field}.path: Moses files are not line-aligned: {src_file} has {n_src} lines, "
                                f"{tgt_file} has {n_tgt}")
            elif identify and (wrong := _identity_problem(
                    source, _moses_sample(src_file, tgt_file, source.encoding), src_file)):
                problems.append(f"{field}: {wrong}")
        return problems
    try:
        files = expand_paths(source.path)
    except DataSourceError as e:
        return problems + [f"{field}.path: {_folder_problem(source) or e}"]
    select = source.format == "tatoeba" and (source.src_lang or source.tgt_lang) and not problems
    for path in files[:PEEK_FILES]:
        try:
            undecodable = None if _is_parquet(path) else _encoding_problem(source, path)  # said as a format
            empty = source.format != "parquet" and not _peek(path, 1, source.encoding)
            wrong = None if empty else _format_problem(source, path)
            contradiction = None if empty or wrong or not select else _direction_problem(source, path)
        except OSError as e:
            problems.append(f"{field}.path: cannot read {path}: {e.strerror or e}")
            continue
        if undecodable:
            problems.append(f"{field}.encoding: {undecodable}")
        elif empty:
            problems.append(f"{field}.path: {path} is empty (no lines with text)")
        elif wrong:
            problems.append(f"{field}.format: {path}: {wrong}")
        elif contradiction:
            problems.append(f"{field}: {contradiction}")
        elif identify and source.format in ("tsv", "csv", "jsonl") and not problems and (
                wrong := _identity_problem(source, _sample_pairs(source, path), path)):
            problems.append(f"{field}: {wrong}")
    return problems


def source_problems(data: DataConfig) -> list[str]:
    """One line per problem of ``data.sources``; with ``data.prepared_path``, which replaces them, the one
    problem is sources the user chose too (a preset's own default source is no choice)."""
    if data.prepared_path:
        chosen = "sources" in data.model_fields_set and data.sources != DataConfig().sources
        return [f"data.prepared_path: {data.prepared_path} is set together with data.sources; a prepared dataset "
                "trains on the sources it was prepared from (its manifest.json), so data.sources would be "
                "ignored: unset one of them"] if chosen else []
    return [p for i, s in enumerate(data.sources) for p in _source_problems(i, s, data.language_id)]


def looks_local(name_or_path: str) -> bool:
    """Whether a model value means a local folder: ``/x``, ``./x``, ``~/x``, ``a/b/c`` (hub ids are
    ``org/name``, one slash) or anything that exists here."""
    if is_uri(name_or_path):
        return False
    return name_or_path.startswith(("/", ".", "~")) or name_or_path.count("/") > 1 or os.path.exists(name_or_path)


def model_problem(field: str, value: str | None) -> str | None:
    """One line when ``value`` (a model or tokenizer) is a local path that holds no model, else None."""
    if value is None:
        return None
    if not looks_local(value) and ":" not in value:
        return _hub_problem(field, value)
    from raytrain_hymt.tokenizer import RANDOM_PREFIX, TINY_MODEL  # torch: only for the rare values that need it

    if value == TINY_MODEL:
        return None
    if value.startswith(RANDOM_PREFIX):
        config_json = value[len(RANDOM_PREFIX):]
        return None if Path(config_json).expanduser().is_file() else f"{field}: no such config.json file {config_json!r}"
    if not looks_local(value):
        return None
    folder = Path(value).expanduser()
    if not folder.is_dir():
        return (f"{field}: no such folder {value!r} (looked for a local model folder; a hub id is written "
                "org/name, e.g. tencent/Hunyuan-MT-7B)")
    if not (folder / "config.json").is_file() and not (folder / "tokenizer_config.json").is_file():
        return f"{field}: {value!r} is a folder but not a Hugging Face model folder (no config.json)"
    return None


def _hub_problem(field: str, repo_id: str) -> str | None:
    """A hub id can be checked without the network only where the hub is off (``HF_HUB_OFFLINE=1``):
    then it must be in the local cache. Online it is downloaded where it is loaded."""
    if repo_id.count("/") != 1:  # "tiny" and single-name ids: nothing to look up
        return None
    from huggingface_hub import constants, try_to_load_from_cache

    if not constants.HF_HUB_OFFLINE or isinstance(try_to_load_from_cache(repo_id, "config.json"), str):
        return None
    return (f"{field}: {repo_id!r} is not in the Hugging Face cache ({constants.HF_HUB_CACHE}) and HF_HUB_OFFLINE=1 "
            "forbids the download (looked for a hub model org/name; a local folder starts with / . or ~)")


def check_inputs(cfg: Config) -> None:
    """Raise one :class:`ConfigError` listing every problem of the data sources and model paths."""
    problems = source_problems(cfg.data)
    problems += [p for p in (model_problem("model.name_or_path", cfg.model.name_or_path),
                             model_problem("model.tokenizer", cfg.model.tokenizer)) if p]
    if len(problems) == 1:
        raise ConfigError(problems[0])
    if problems:
        raise ConfigError(f"{len(problems)} problems in the data sources and model:\n" + "\n".join(f"  {p}" for p in problems))


def trained_directions(data: DataConfig) -> list[str]:
    """The ``src-tgt`` directions a run's sources train (Tatoeba rows: the languages of their first
    lines, turned to the direction src_lang/tgt_lang select), reversed too with ``data.both_directions``."""
    pairs: list[tuple[str, str]] = []
    for source in data.sources:
        if source.src_lang and source.tgt_lang:
            found = [(source.src_lang, source.tgt_lang)]
        else:
            try:
                files = expand_paths(source.path) if source.format == "tatoeba" and not is_uri(source.path) else []
                cols = [line.split("\t") for path in files[:1] for line in _peek(path, 500, source.encoding)]
            except (OSError, DataSourceError):
                cols = []
            found = [(c[0] or source.src_lang, c[1] or source.tgt_lang) for c in cols if len(c) == 4]
            if source.src_lang or source.tgt_lang:
                turned = ((s, t, orientation(s, t, source.src_lang, source.tgt_lang)) for s, t in found)
                found = [(s, t) if how == "keep" else (t, s) for s, t, how in turned if how]
        for s, t in found:
            if s and t and is_supported(s) and is_supported(t):
                pairs.append((resolve(s).code, resolve(t).code))
                if data.both_directions:
                    pairs.append((resolve(t).code, resolve(s).code))
    return [f"{s}-{t}" for s, t in dict.fromkeys(pairs) if s != t]


def corpus_directions(cfg: Config) -> list[str]:
    """The directions the corpus of ``cfg`` trains (:func:`trained_directions`): of ``data.sources``, or
    of the sources a prepared dataset was prepared from (its manifest's fingerprint)."""
    data = cfg.data
    if data.prepared_path:
        from raytrain_hymt.data.prepared import read_manifest

        fingerprint = read_manifest(data.prepared_path)["fingerprint"]
        fields = SourceConfig.model_fields
        data = DataConfig(sources=[SourceConfig(**{k: v for k, v in s.items() if k in fields})
                                   for s in fingerprint["sources"]],
                          both_directions=fingerprint["settings"]["both_directions"])
    return trained_directions(data)


def default_eval_directions(cfg: Config, required: bool) -> list[str] | None:
    """``eval.directions`` when the config leaves it unset: the directions of the run's own corpus. None
    when they cannot be read (an object-store Tatoeba file); with ``required`` that is a ConfigError."""
    if cfg.eval.directions is not None:
        return cfg.eval.directions
    found = corpus_directions(cfg)
    if not found and required:
        where = f"data.prepared_path {cfg.data.prepared_path}" if cfg.data.prepared_path else "data.sources"
        raise ConfigError(f"eval.directions: not set, and the languages of {where} cannot be read to default it "
                          "to the corpus's own directions; set it, e.g. --set 'eval.directions=[en-zh]'")
    return found or None
