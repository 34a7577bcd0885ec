"""docs/errors.md against the messages the commands really print.

Each table row of docs/errors.md (its first cell names the mistake) has a producer here: a function that makes
the mistake through ``cli.main`` in this process (or, where the command would refuse another mistake of this
machine first, through the check the command runs, reported as ``cli.main`` reports it), in a fresh folder that
is also the working directory, and returns the exit status and stderr. A row matches when every backticked
snippet of its message cell occurs in stderr, in order, with ``...`` standing for any text, the fresh folder's
path written as ``/data`` and the default run.storage_root's (``~/hymt_runs``) as ``/root/hymt_runs``. A row
without a producer fails, unless it is named in :data:`NOT_PRODUCED` (a message that needs Ray, a model, a
trained run or a server; each of those has its own test in the file the row names) - so nobody documents a
message that is never checked, and a documented message that changes fails here.
"""

from __future__ import annotations

import json
import os
import re
import sys
from pathlib import Path
from unittest.mock import patch

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from raytrain_hymt import cli
from raytrain_hymt.driver.runs import resolve_init_from
from raytrain_hymt.errors import ConfigError
from raytrain_hymt.train.checkpoint import base_identity
from run_folders import cut_off_checkpoint, finished_run, run_config, whole_checkpoint
from test_encodings import flores, moses_pair, text

DOC = Path(__file__).resolve().parents[2] / "docs" / "errors.md"


def rows() -> list[tuple[str, str]]:
    """``(mistake, message cell)`` of every table row (header and separator rows skipped)."""
    found = []
    for line in DOC.read_text(encoding="utf-8").splitlines():
        if not line.startswith("| ") or line.startswith(("| mistake |", "| situation |", "| what |")):
            continue
        cells = [c.strip() for c in re.split(r"(?<!\\)\|", line)[1:-1]]
        found.append((cells[0], cells[1]))
    return found


def pattern(snippet: str) -> str:
    return ".*?".join(re.escape(part) for part in snippet.split("..."))


def snippets(cell: str) -> list[str]:
    """The backticked parts of a message cell, except those inside a parenthesis of prose (an explanation:
    "(also `cn`→`zh`)")."""
    found, depth = [], 0
    for i, piece in enumerate(cell.split("`")):
        if i % 2:
            if depth == 0:
                found.append(piece)
        else:
            depth = max(0, depth + piece.count("(") - piece.count(")"))
    return found


def matches(cell: str, stderr: str) -> bool:
    """Every backticked snippet of ``cell`` (:func:`snippets`) occurs in ``stderr``, in order."""
    snippets_ = snippets(cell)
    return bool(snippets_) and re.search(".*?".join(f"(?:{pattern(s)})" for s in snippets_), stderr, re.S) is not None


def sources(*items: dict) -> str:
    return "data.sources=" + json.dumps(list(items))


def tsv(path: str, **extra) -> dict:
    return {"path": path, "format": "tsv", "src_lang": "de", "tgt_lang": "en", **extra}


def write(path: str, text: str) -> str:
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(text, encoding="utf-8")
    return path


def jsonl_as_tatoeba():
    write("c.jsonl", '{"src": "Hallo", "tgt": "Hello"}\n')
    return ["prepare", "out", "--set", sources({"path": "c.jsonl", "format": "tatoeba"})]


def parquet_as_text():
    pq.write_table(pa.table({"src": ["Hallo"], "tgt": ["Hello"]}), "p.parquet")
    return ["prepare", "out", "--set", sources(tsv("p.parquet"))]


def moses_side_as_tsv():
    write("m.de", "eins\nzwei\ndrei\n")
    write("m.en", "one\ntwo\nthree\n")
    return ["prepare", "out", "--set", sources(tsv("m.de"))]


def folder_as_corpus():
    write("corpus/a.tsv", "Hallo\tHello\n")
    return ["prepare", "out", "--set", sources(tsv("corpus"))]


def storage_root(value: str, make=None):
    def produce():
        if make:
            make()
        return ["train", "--name", "r", "--set", f"run.storage_root={Path(value).resolve()}"]
    return produce


def read_only():
    os.mkdir("ro")
    if os.geteuid() == 0:
        pytest.skip("root writes in any folder (tests/integration/test_mistakes.py makes one immutable)")
    os.chmod("ro", 0o555)
    return ["train", "--set", f"run.storage_root={Path('ro').resolve()}"]


def yaml_file(text: str):
    def produce():
        write("mine.yaml", text)
        return ["train", "--config", "mine.yaml"]
    return produce


def moses(name: str, en: list[str], other: bytes, lang: str, **extra) -> dict:
    """A Moses pair ``name.en`` (UTF-8) and ``name.<lang>`` (the bytes ``other``)."""
    write(f"{name}.en", "".join(f"{line}\n" for line in en))
    Path(f"{name}.{lang}").write_bytes(other)
    return {"path": name, "format": "moses", "src_lang": "en", "tgt_lang": lang, **extra}


def shift_jis_moses():
    en, ja = moses_pair()
    return ["prepare", "out", "--set", sources(moses("sjis", en, text(ja, "shift_jis"), "ja"))]


def utf16_moses():
    """English in UTF-16 without a byte order mark is valid UTF-8 byte for byte, NUL bytes and all."""
    write("c.de", "".join(f"{line}\n" for line in flores("deu_Latn", n=3)))
    Path("c.en").write_bytes(text(flores("eng_Latn", n=3), "utf-16-le"))
    return ["prepare", "out", "--set", sources({"path": "c", "format": "moses", "src_lang": "de", "tgt_lang": "en"})]


def german_labelled_japanese():
    """cp1252 German under a Japanese label: no encoding tried reads it as Japanese."""
    return ["prepare", "out", "--set",
            sources(moses("g", flores("eng_Latn", n=3), text(flores("deu_Latn", "cp1252", n=3), "cp1252"), "ja"))]


def translate_shift_jis(*extra: str):
    def produce():
        Path("sjis.txt").write_bytes(text(flores("jpn_Jpan", "shift_jis", 3), "shift_jis"))
        return ["translate", "--model", "/nope", "--from", "ja", "--to", "en", "-i", "sjis.txt", *extra]
    return produce


def home_runs() -> Path:
    """The default run.storage_root (``~/hymt_runs``, HOME being the test's ``home`` folder, printed as /root)."""
    return Path("home", "hymt_runs").resolve()


def in_process(check):
    """``check`` (a function ``hymt`` calls before Ray starts) as ``cli.main`` reports it: exit 2 and one
    ``error:`` line for a ConfigError."""
    def run() -> int:
        try:
            check()
        except ConfigError as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
        return 0
    return run


def finished_e2e(*sets: str):
    """``hymt train --name e2e`` again, with ``sets``, after run e2e finished at step 20 with lr 0.002."""
    def produce():
        finished_run(home_runs(), "e2e", 20, "optim.lr=0.002")
        return ["train", "--name", "e2e", *settings("optim.max_steps=20", "optim.lr=0.002", *sets)]
    return produce


def init_from(value, *sets: str, name: str = "new", make=None):
    """``hymt train --name NAME --set model.init_from=VALUE`` (a new run: the check runs before Ray starts);
    ``make`` builds run r's folder under the default run.storage_root first."""
    def produce():
        if make:
            make(home_runs() / "r")
        return ["train", "--name", name, *settings(f"model.init_from={value}", *sets)]
    return produce


def settings(*sets: str) -> list[str]:
    return [arg for value in sets for arg in ("--set", value)]


def finished_r(*sets: str, checkpoint: bool = True, base_model: dict | None = None):
    """Builds run r, finished at step 20 with ``sets``, with a whole checkpoint of that step unless not ``checkpoint``."""
    def make(run: Path):
        finished_run(home_runs(), "r", 20, *sets)
        if checkpoint:
            whole_checkpoint(run, 20, base_model=base_model)
    return make


def other_adapters():
    """Both refusals of the row, one after the other: another rank, then another base (another seed)."""
    lora = init_from("r", "lora.enabled=true", make=finished_r("lora.enabled=true", base_model=base_identity("tiny", 0)))()
    return lambda: max(cli.main([*lora, "--set", "lora.rank=8"]), cli.main([*lora, "--set", "run.seed=1"]))


def exported_model():
    run = home_runs() / "e2e"
    finished_run(home_runs(), "e2e")
    write(str(run / "model" / "config.json"), "{}")
    return init_from(run / "model")()


def init_from_check(*sets: str, make=None):
    """``model.init_from`` checked as ``hymt train`` checks it, for a config whose model preflight would refuse
    first on this machine (a model folder that is not there)."""
    def produce():
        make(home_runs() / "r")
        cfg = run_config(home_runs(), "model.init_from=r", *sets)
        return in_process(lambda: resolve_init_from(cfg))
    return produce


def export_run(make):
    def produce():
        run = home_runs() / "r"
        make(run)
        return ["export", str(run), str(Path("out").resolve())]
    return produce


def export_into_notes():
    ckpt = whole_checkpoint(home_runs() / "r", 4, world=1)
    (ckpt / "hf").mkdir()
    write("out/notes.txt", "mine")
    return ["export", str(ckpt), str(Path("out").resolve())]


def sync_while_down():
    folder = home_runs() / "r"
    write(str(folder / "metrics.jsonl"),
          json.dumps({"kind": "metric", "step": 1, "key": "train/loss", "value": 5.0, "time": 0}) + "\n")
    # Nothing listens on the documented port here: a server that is down.
    return ["sync", "r", "--set", "tracking.tracking_uri=http://127.0.0.1:5000"]


def eval_folder(**files: str):
    """A test-set folder ``ts`` with ``files`` (name -> text), then ``hymt evaluate --test-set ts`` with ``extra``."""
    def make(*extra: str):
        def produce():
            for name, body in files.items():
                write(f"ts/{name}", body)
            Path("ts").mkdir(exist_ok=True)
            return ["evaluate", "--test-set", "ts", *extra]
        return produce
    return make


def translate(*argv: str, make=None):
    """``hymt translate --from de --to en ARGV`` (``--model empty`` unless ARGV names one)."""
    def produce():
        if make:
            make()
        model = [] if "--model" in argv else ["--model", "nope/none/x"]
        return ["translate", *model, "--from", "de", "--to", "en", *argv]
    return produce


def checkpoints_short():
    """``hymt export`` of two checkpoints of run r: rank 1's shard gone from one, cut to 3 bytes in the other."""
    gone, short = whole_checkpoint(home_runs() / "r", 4), whole_checkpoint(home_runs() / "r", 6)
    (gone / "shard1.pt").unlink()
    (short / "shard1.pt").write_bytes(b"xyz")
    out = str(Path("out").resolve())
    return lambda: max(cli.main(["export", str(gone), out]), cli.main(["export", str(short), out]))


def lora_on_other_modules():
    """peft's wrapping of a model whose only linear layer is ``q_proj`` (a stand-in for the loaded model)."""
    import torch

    from raytrain_hymt.config.schema import LoraConfig
    from raytrain_hymt.train.engine import apply_lora

    model = torch.nn.Module()
    model.q_proj = torch.nn.Linear(2, 2)
    return in_process(lambda: apply_lora(model, LoraConfig(target_modules=["q_proj", "nope"])))


def uri_storage_root():
    """``hymt train`` with a ``file://`` run.storage_root (a URI, as a bucket's is) and no tracking server."""
    argv = ["train", "--set", f"run.storage_root=file://{Path('runs').resolve()}"]
    def run() -> int:
        os.environ.pop("MLFLOW_TRACKING_URI", None)  # the test restores the environment afterwards
        return cli.main(argv)
    return run


def translate_at_a_terminal():
    """``hymt translate`` without sentences or --input, stdin a terminal (a stand-in whose isatty() is True)."""
    class Terminal:
        def isatty(self) -> bool:
            return True
    argv = translate()()
    def run() -> int:
        with patch.object(sys, "stdin", Terminal()):
            return cli.main(argv)
    return run


def lora_base_changed():
    """``hymt export`` of a LoRA checkpoint of run r trained on the model folder ``base``, whose config.json
    changed since."""
    write("base/config.json", "{}")
    ckpt = whole_checkpoint(home_runs() / "r", 4, base_model=base_identity(str(Path("base").resolve()), 0))
    write("base/config.json", '{"hidden_size": 8}')
    return ["export", str(ckpt), str(Path("out").resolve())]


#: mistake (the first cell of its row) -> (exit status, a function that makes it and returns hymt's argv, or a
#: function to run instead of ``cli.main`` that returns the exit status).
PRODUCERS = {
    "a language code Hunyuan-MT does not know, with a near one":
        (2, lambda: write("corpus.tsv", "Hallo\tHello\n") and ["prepare", "out", "--set", sources(tsv("corpus.tsv", tgt_lang="jp"))]),
    "languages not given where rows carry none":
        (2, lambda: write("c.tsv", "a\tb\n") and ["prepare", "out", "--set", sources({"path": "c.tsv", "format": "tsv"})]),
    "source and target in one language":
        (2, lambda: write("c.tsv", "a\tb\n") and ["prepare", "out", "--set", sources(tsv("c.tsv", src_lang="en", tgt_lang="eng"))]),
    "a path or glob that matches nothing": (2, lambda: ["prepare", "out", "--set", sources(tsv("missing*.tsv"))]),
    "`hymt prepare` with `data.prepared_path` set": (2, lambda: ["prepare", "out", "--set", "data.prepared_path=/x"]),
    "a folder given as a corpus file": (2, folder_as_corpus),
    "JSON lines read as `tatoeba`, `tsv` or `csv`": (2, jsonl_as_tatoeba),
    "a Parquet file read as text": (2, parquet_as_text),
    "one side of a Moses pair read as `tsv`": (2, moses_side_as_tsv),
    "`--set model.name_or_path=/nope`": (2, lambda: ["train", "--set", "model.name_or_path=/nope"]),
    "a bad `--set` value": (2, lambda: ["train", "--set", "optim.lr=abc"]),
    "an unknown field, in a YAML file or `--set`": (2, lambda: ["train", "--set", "optim.learning_rate=1e-4"]),
    "`{path:x}` in a YAML flow mapping": (2, yaml_file("data:\n  sources:\n    - {path:x}\n")),
    "`--name ../x`": (2, lambda: ["train", "--name", "../x"]),
    "`--set run.name=/abs`": (2, lambda: ["train", "--set", "run.name=/abs"]),
    "`run.storage_root` is a file": (2, storage_root("afile", lambda: write("afile", ""))),
    "`run.storage_root` inside a file": (2, storage_root("afile/runs", lambda: write("afile", ""))),
    "`run.storage_root` this user cannot write in": (2, read_only),
    "`hymt prepare OUT` into a folder that holds something":
        (2, lambda: write("out/x", "") and ["prepare", str(Path("out").resolve())]),
    "`hymt prepare OUT` where OUT is a file": (2, lambda: write("afile", "") and ["prepare", str(Path("afile").resolve())]),
    "a file in another encoding than its source's `encoding` (default utf-8): Shift-JIS, GBK, EUC-KR, Big5, UTF-16, cp1252...":
        (2, shift_jis_moses),
    "UTF-16 without a byte order mark, read as utf-8": (2, utf16_moses),
    "a file no encoding tried reads as its language": (2, german_labelled_japanese),
    "a source `encoding` Python does not know": (2, lambda: ["train", "--set", sources(tsv("c.tsv", encoding="sjis2"))]),
    "an `encoding` on a parquet, hf_disk or hf_hub source":
        (2, lambda: ["train", "--set", sources({"path": "c.parquet", "format": "parquet", "encoding": "gbk"})]),
    "`hymt translate -i FILE` in another encoding than `--encoding` (default utf-8)": (2, translate_shift_jis()),
    "`hymt translate --encoding sjis2`": (2, translate_shift_jis("--encoding", "sjis2")),
    "changing `optim.lr` (or another trajectory field) on a finished run": (2, finished_e2e("optim.lr=0.001")),
    "a finished run with `optim.max_steps` not above the steps it trained": (2, finished_e2e("optim.max_steps=10")),
    "a finished run with an allowed trajectory change but no more steps":
        (2, finished_e2e("optim.lr=0.001", "run.allow_config_change=true")),
    "`model.init_from` naming no run": (2, init_from("nope")),
    "`model.init_from` naming an exported model folder": (2, exported_model),
    "`model.init_from` naming this run itself": (2, init_from("r", name="r", make=finished_r())),
    "`model.init_from` of a run without a whole checkpoint": (2, init_from("r", make=finished_r(checkpoint=False))),
    "`model.init_from` naming a missing or cut-off checkpoint":
        (2, init_from("r/checkpoint_step00000007", make=finished_r())),
    "`model.init_from` of a run that trained another model":
        (2, init_from_check("model.name_or_path=/models/hy-mt", make=finished_r())),
    "`model.init_from` mixing LoRA and full weights":
        (2, init_from("r", make=finished_r("lora.enabled=true", base_model=base_identity("tiny", 0)))),
    "`model.init_from` of LoRA adapters of another shape or base": (2, other_adapters),
    "`hymt export` of a run folder whose checkpoints are all cut off (these `hymt export` refusals exit 2 before anything starts; a run folder otherwise stands for its newest whole checkpoint)":
        (2, export_run(lambda run: [cut_off_checkpoint(run / f"checkpoint_step{s:08d}", s) for s in (2, 4)])),
    "`hymt export` of a run folder with no checkpoint yet": (2, export_run(finished_r(checkpoint=False))),
    "`hymt export` into a folder that holds something other than a model": (2, export_into_notes),
    "`hymt sync` of a run that has no `metrics.jsonl`": (2, lambda: ["sync", "nope"]),
    "`hymt sync` while the tracking server is still down (or the URI is wrong)": (2, sync_while_down),
    "a `--set` without `=`": (2, lambda: ["train", "--set", "optim.lr"]),
    "a `--set` below a field that is not a section": (2, lambda: ["train", *settings("optim.lr=1", "optim.lr.x=1")]),
    "`--config` naming neither a file nor a preset": (2, lambda: ["train", "--config", "nope.yaml"]),
    "a config file that is not valid YAML": (2, yaml_file("optim: [1\n")),
    "a config file that is a list or a scalar at the top": (2, yaml_file("- optim\n")),
    "`optim.global_batch_rows` not a multiple of workers × micro-batch":
        (2, lambda: ["train", "--set", "optim.global_batch_rows=7"]),
    "`optim.global_batch_rows` with `optim.grad_accum`":
        (2, lambda: ["train", *settings("optim.global_batch_rows=8", "optim.grad_accum=2")]),
    "`scaling.min_workers` without `optim.global_batch_rows`": (2, lambda: ["train", "--set", "scaling.min_workers=1"]),
    "an elastic range some worker count of which does not divide the global batch":
        (2, lambda: ["train", *settings("scaling.min_workers=2", "scaling.num_workers=4", "optim.global_batch_rows=8",
                                        "optim.micro_batch_size=1")]),
    "`scaling.min_workers` above `scaling.num_workers`":
        (2, lambda: ["train", *settings("scaling.min_workers=3", "scaling.num_workers=2")]),
    "a fractional `scaling.cpus_per_worker` in an elastic run":
        (2, lambda: ["train", *settings("scaling.min_workers=2", "scaling.cpus_per_worker=1.5")]),
    "`scaling.env` with a name that is no environment variable name": (2, lambda: ["train", "--set", "scaling.env={1X: a}"]),
    "`scaling.env` with a value that is neither text nor a number": (2, lambda: ["train", "--set", "scaling.env={X: true}"]),
    "`data.sort_partitions` below 2": (2, lambda: ["train", "--set", "data.sort_partitions=1"]),
    "no `data.sources` and no `data.prepared_path`": (2, lambda: ["train", "--set", "data.sources=[]"]),
    "`data.min_chars` above `data.max_chars`": (2, lambda: ["train", *settings("data.min_chars=50", "data.max_chars=10")]),
    "`data.pack_tokens` below `data.max_example_tokens`":
        (2, lambda: ["train", *settings("data.packing=true", "data.pack_tokens=16", "data.max_example_tokens=64")]),
    "`deepspeed.offload_param` below ZeRO stage 3":
        (2, lambda: ["train", *settings("deepspeed.offload_param=true", "deepspeed.zero_stage=2")]),
    "`deepspeed.offload_optimizer` with ZeRO stage 0":
        (2, lambda: ["train", *settings("deepspeed.offload_optimizer=true", "deepspeed.zero_stage=0")]),
    "`deepspeed.precision fp16` on CPU": (2, lambda: ["train", "--set", "deepspeed.precision=fp16"]),
    "`model.attn_implementation flex_attention` on CPU":
        (2, lambda: ["train", "--set", "model.attn_implementation=flex_attention"]),
    "`model.fused_loss` or `model.compile` on CPU": (2, lambda: ["train", "--set", "model.compile=true"]),
    "an `eval.directions` entry that names no two languages": (2, lambda: ["train", "--set", "eval.directions=[en-xx]"]),
    "a direction twice in `eval.directions`": (2, lambda: ["train", "--set", "eval.directions=[en-zh, eng-zh]"]),
    "`eval.bleu_every_steps` without `eval.test_set`": (2, lambda: ["train", "--set", "eval.bleu_every_steps=5"]),
    "`eval.test_set` with `run.export: false`":
        (2, lambda: write("ts/de.txt", "a\n") and write("ts/en.txt", "b\n")
         and ["train", *settings("eval.test_set=ts", "run.export=false", "eval.directions=[de-en]")]),
    "LoRA `lora.target_modules` that match no module of the model (when the model loads)": (2, lora_on_other_modules),
    "an empty `lora.target_modules`": (2, lambda: ["train", "--set", "lora.target_modules=[]"]),
    "`checkpoint.num_to_keep` below 2": (2, lambda: ["train", "--set", "checkpoint.num_to_keep=1"]),
    "both or neither of `tune.lr_grid` and `tune.lr_range`":
        (2, lambda: ["tune", *settings("tune.lr_grid=[1e-4]", "tune.lr_range=[1e-4, 1e-3]")]),
    "`hymt export` of a LoRA checkpoint whose base model folder changed since it trained": (2, lora_base_changed),
    'a `deepspeed.config_file` with `"auto"` where raytrain_hymt sets nothing':
        (2, lambda: write("ds.json", '{"my_setting": "auto"}') and ["train", "--set", "deepspeed.config_file=ds.json"]),
    "a `deepspeed.config_file` value that contradicts the config":
        (2, lambda: write("ds.json", '{"zero_optimization": {"stage": 3}}')
         and ["train", *settings("deepspeed.config_file=ds.json", "deepspeed.zero_stage=2")]),
    "`hymt evaluate` without a test set": (2, lambda: ["evaluate"]),
    "`--test-set` naming no folder": (2, lambda: ["evaluate", "--test-set", "nope"]),
    "a test-set folder without a file named by a language": (2, eval_folder(**{"README.md": "x\n"})()),
    "two test-set files of one language": (2, eval_folder(**{"en.txt": "a\n", "eng_Latn.devtest": "a\n"})()),
    "an empty test-set file": (2, eval_folder(**{"de.txt": "a\n", "en.txt": ""})()),
    "test-set files of different lengths": (2, eval_folder(**{"de.txt": "a\nb\n", "en.txt": "a\n"})()),
    "a direction whose language the test set lacks":
        (2, eval_folder(**{"de.txt": "a\n", "en.txt": "b\n"})("--directions", "de-zh")),
    "`hymt evaluate` with neither `--name` nor `--model`":
        (2, eval_folder(**{"de.txt": "a\n", "en.txt": "b\n"})("--directions", "de-en")),
    "`hymt evaluate --name R` of a run that exported no model":
        (2, lambda: finished_run(home_runs(), "e2e") and eval_folder(**{"de.txt": "a\n", "en.txt": "b\n"})(
            "--directions", "de-en", "--name", "e2e")()),
    "`hymt translate` with sentences and `--input`": (2, translate("Hallo", "-i", "x.txt")),
    "a `run.storage_root` URI without a tracking server": (2, uri_storage_root),
    "`hymt translate` with no sentences, no `--input` and nothing piped": (2, translate_at_a_terminal),
    "`hymt translate --input` of a missing file": (2, translate("-i", "nope.txt")),
    "`hymt translate` of blank lines only": (2, translate("-i", "blank.txt", make=lambda: write("blank.txt", " \n\n"))),
    "`hymt translate --from`/`--to` naming no Hunyuan-MT language":
        (2, lambda: ["translate", "--model", "nope/none/x", "--from", "xx", "--to", "en", "Hallo"]),
    "`hymt translate --model` of a folder with neither model nor checkpoint":
        (2, translate("--model", "empty", "Hallo", make=lambda: os.mkdir("empty"))),
    "`hymt translate --model NAME` with no such folder or run": (2, translate("--model", "nope", "Hallo")),
    "`hymt translate --model RUN` of a run that exported no model":
        (2, translate("--model", "e2e", "Hallo", make=lambda: finished_run(home_runs(), "e2e"))),
    "`hymt tune` of a config without a `tune` section": (2, lambda: ["tune"]),
    "an empty `tune.lr_grid`": (2, lambda: ["tune", "--set", "tune.lr_grid=[]"]),
    "`tune.lr_range` not `[low, high]`": (2, lambda: ["tune", "--set", "tune.lr_range=[1e-3, 1e-4]"]),
    "an empty `tune.warmup_steps` or `tune.lora_rank`":
        (2, lambda: ["tune", *settings("tune.lr_grid=[1e-4]", "tune.warmup_steps=[]")]),
    "a searched value no trial can train with": (2, lambda: ["tune", *settings("tune.lr_grid=[1e-4]", "tune.lora_rank=[0]")]),
    "`hymt plot` of a run with no metrics": (2, lambda: ["plot", "nope"]),
    "a checkpoint with a rank's file missing or cut short":
        (2, checkpoints_short),
    "`data.prepared_path` naming a folder that is not a prepared dataset":
        (2, lambda: os.mkdir("nope") or ["train", "--set", "data.prepared_path=nope"]),
}

#: Rows whose message needs what a unit test does not start (Ray, a model, a trained run, a server, another
#: user's permissions) or that document no message; each is tested in the file its row or section names.
NOT_PRODUCED = {
    "a language code with no near one", "a language the model does not translate",
    "an alias of a language the model does not translate (`dk`)",
    "Tatoeba rows in other languages than `src_lang`/`tgt_lang`",
    "a tsv/csv/jsonl/Moses file whose columns are the other way round",
    "a side of such a file mostly in another language than its label",
    "`data.prepared_path` and `data.sources` both set", "`hymt preview` of a config with `data.prepared_path`",
    "an empty file (or Moses pair)", "a file that cannot be read", "a 2-column file read as Tatoeba",
    "a Tatoeba file read as 2-column TSV", "JSONL without the configured columns", "a file that is not Parquet",
    "a Moses file without its partner", "Moses files of different lengths", "several of the above",
    "a UTF-8 BOM at the start of a file", "too many unreadable rows (after Ray started)",
    "`hymt evaluate --model /nope`", "a hub id not in the cache while `HF_HUB_OFFLINE=1`",
    "a folder that holds no model", "a bad value in a preset file",
    "the workers do not fit the local Ray this command started (exit 2 after Ray started)",
    "any start that fails before the run's first step (Ray, the resources, the data, the workers)",
    "`ray` installed without `[default]` (no RAY_ADDRESS)", "`hymt tune` there",
    "another process took the dashboard port while Ray started (two `hymt` commands at once)",
    "re-submitting a run with another corpus, model, optimizer, schedule or batch",
    "changing logging, evaluation or `max_failures` on resume", "a run submitted again after a crash",
    "`hymt export` of a folder that is no checkpoint", "a checkpoint folder that does not exist",
    "a checkpoint cut off while rank 0 wrote it",
    "a state or marker file left empty or short by a full disk (skipped on resume with this warning)",
    "training ran out of disk space", "a shard of the right size with damaged content (on resume)",
    "Ctrl-C during training", "Ctrl-C before the first checkpoint", "Ctrl-C outside training (data preparation)",
    "a prepared dataset prepared with other data settings (after Ray started)",
    "an `hf_hub` dataset that cannot be loaded (offline and not cached, no such dataset)",
    "the cluster too small for one trial (after Ray started)",
    "a Parquet column that holds no text, or a struct column without the language (after Ray started)",
    "re-submitting a run whose corpus files or data settings changed",
}


#: Rows other changes documented whose producer is still to be written (a debt, skipped by name: a new row
#: that is in neither table fails).
NO_PRODUCER_YET = {
    # "(no error: ...)" rows: their message is in a parenthesis, which the match rule reads as prose.
    'continuing a finished run with a larger `optim.max_steps`',
    # Its documented line names the MLflow server at http://127.0.0.1:5000, which a unit test does not start.
    '`hymt sync` of a run MLflow already has whole',
}


@pytest.mark.parametrize("mistake, message", rows(), ids=[r[0][:60] for r in rows()])
def test_each_documented_message_is_what_the_command_prints(mistake, message, tmp_path, monkeypatch, capsys):
    if mistake in NOT_PRODUCED:
        pytest.skip("needs Ray, a model, a run or a server: tested where its row says")
    if mistake in NO_PRODUCER_YET:
        pytest.skip("no producer yet")
    assert mistake in PRODUCERS, (f"docs/errors.md documents {mistake!r} but tests/unit/test_errors_doc.py has no "
                                  "producer for it: add one to PRODUCERS (or, for a message a unit test cannot "
                                  "produce, its name to NOT_PRODUCED and a test where the row says)")
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))  # the default run.storage_root: nothing of the user's
    code, make = PRODUCERS[mistake]
    runs = tmp_path / "home" / "hymt_runs"
    argv = make()
    before = sorted(runs.rglob("*"))
    # patch.dict only restores the environment afterwards: hymt sync sets MLflow's HTTP defaults in it.
    with patch.dict(os.environ):
        status = argv() if callable(argv) else cli.main(argv)
    # The default run.storage_root (~/hymt_runs) as the rows write it for root.
    err = capsys.readouterr().err.replace(str(runs.resolve()), "/root/hymt_runs")
    err = err.replace(str(tmp_path.resolve()), "/data")
    assert status == code, err
    said = argv.__doc__ or argv.__qualname__ if callable(argv) else "hymt " + " ".join(argv)
    assert matches(message, err), f"docs/errors.md says {message}\n{said} printed:\n{err}"
    assert sorted(runs.rglob("*")) == before  # nothing created (inputs a producer wrote aside)


def test_every_producer_and_exception_names_a_documented_row():
    documented = {mistake for mistake, _ in rows()}
    assert set(PRODUCERS) - documented == set()
    assert (NOT_PRODUCED | NO_PRODUCER_YET) - documented == set()


def test_the_match_rule():
    assert matches("`error: a ... b` / `  c`", "error: a x y b\n  c\n")
    assert not matches("`error: a ... b` / `  c`", "error: a x y\n  c\n")
    assert not matches("(no message)", "anything")
