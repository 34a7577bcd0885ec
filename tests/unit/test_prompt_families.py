"""Every prompt kind of every model family, rendered and compared with its model card's text, and the label
mask of a kind-carrying row through TokenizePairs (the tiny offline tokenizer stands in for the real one;
it uses Hunyuan's turn format). The expected texts are typed here from the cards, not read from the
package's template files, so a changed pinned copy fails."""

from __future__ import annotations

import json
import logging

import numpy as np
import pytest

from raytrain_hymt.config.schema import Config, load_config
from raytrain_hymt.data.prompts import (
    FAMILIES,
    build_prompt,
    detect_family,
    expand_directions,
    family_templates,
    prompt_kinds,
    resolve_family,
)
from raytrain_hymt.data.tokenize import IGNORE_INDEX, TokenizePairs, render_prompts
from raytrain_hymt.tokenizer import load_tokenizer

HY15_ZH = "将以下文本翻译为{target_language}，注意只需要输出翻译后的结果，不要额外解释：\n\n{source_text}"
HY15_EN = "Translate the following segment into {target_language}, without additional explanation.\n\n{source_text}"
HY15_TERMS = ("参考下面的翻译：\n{source_term} 翻译成 {target_term}\n\n"
              "将以下文本翻译为{target_language}，注意只需要输出翻译后的结果，不要额外解释：\n{source_text}")
HY15_CONTEXT = ("{context}\n参考上面的信息，把下面的文本翻译成{target_language}，注意不需要翻译上文，也不要额外解释：\n"
                "{source_text}\n")
HY15_FORMATTED = ("将以下<source></source>之间的文本翻译为中文，注意只需要输出翻译后的结果，不要额外解释，原文中的<sn></sn>"
                  "标签表示标签内文本包含格式信息，需要在译文中相应的位置尽量保留该标签。输出格式为：<target>str</target>\n\n"
                  "<source>{src_text_with_format}</source>")

# (family, fields, src, tgt, expected): one case per kind and template language.
CASES = [
    ("hunyuan-mt", {}, "en", "zh", "把下面的文本翻译成中文，不要额外解释。\n\nS"),
    ("hunyuan-mt", {}, "en", "de", "Translate the following segment into German, without additional explanation.\n\nS"),
    ("hy-mt1.5", {}, "en", "zh", HY15_ZH.format(target_language="中文", source_text="S")),
    ("hy-mt1.5", {}, "de", "fr", HY15_EN.format(target_language="French", source_text="S")),
    ("hy-mt1.5", {"terms": [["house", "房子"]]}, "en", "zh",
     HY15_TERMS.format(source_term="house", target_term="房子", target_language="中文", source_text="S")),
    ("hy-mt1.5", {"terms": [["Haus", "house"], {"source": "Tür", "target": "door"}]}, "de", "en",
     "参考下面的翻译：\nHaus 翻译成 house\nTür 翻译成 door\n\n"
     "将以下文本翻译为英语，注意只需要输出翻译后的结果，不要额外解释：\nS"),
    ("hy-mt1.5", {"context": "C"}, "en", "zh", HY15_CONTEXT.format(context="C", target_language="中文", source_text="S")),
    ("hy-mt1.5", {"formatted": True}, "en", "zh", HY15_FORMATTED.format(src_text_with_format="<sn>S</sn>")),
    ("hy-mt2", {}, "en", "zh", "将以下文本翻译为 中文，注意只需要输出翻译后的结果，不要额外解释：\n\nS"),
    ("hy-mt2", {}, "de", "en", "Translate the following text into English. Note that you should only output the "
     "translated result without any additional explanation:\n\nS"),
    ("hy-mt2", {"terms": [["a", "甲"], ["b", "乙"]]}, "en", "zh",
     "参考下面的翻译：\na 翻译成 甲\nb 翻译成 乙\n将以下文本翻译为 中文，注意只需要输出翻译后的结果，不要额外解释：\n\nS"),
    ("hy-mt2", {"terms": [["a", "b"]]}, "en", "de",
     "Reference the following translations:\na translates to b\n\nTranslate the following text into German. "
     "Note that you must ONLY output the translated result without any additional explanation:\n\nS"),
    ("hy-mt2", {"style": "正式"}, "en", "zh", "请将以下文本翻译为 中文。\n注意翻译的风格要严格符合【正式】\n\nS"),
    ("hy-mt2", {"style": "formal"}, "de", "en", "Please translate the following text into English. Note that the "
     "translation style must strictly conform to [formal]:\n\nS"),
    ("hy-mt2", {"context": "C"}, "en", "zh", "【背景信息】\nC\n\n请结合背景信息将以下文本翻译为 中文。\n\n【待翻译文本】\nS"),
    ("hy-mt2", {"context": "C"}, "de", "en", "[Background Information]\nC\n\nPlease translate the following text "
     "into English, taking the provided background information into consideration.\n\n[Source Text]\nS"),
]


@pytest.mark.parametrize(("family", "fields", "src", "tgt", "expected"), CASES)
def test_every_kind_renders_the_cards_text(family, fields, src, tgt, expected):
    source = "<sn>S</sn>" if fields.get("formatted") else "S"
    assert build_prompt(source, src, tgt, family, **fields) == expected


def test_the_cases_cover_every_kind_of_every_family():
    covered = {(f, next(iter(fields), "plain")) for f, fields, *_ in CASES}
    assert covered == {(f, k) for f in FAMILIES for k in prompt_kinds(f)}
    for family in FAMILIES:
        pinned = family_templates(family)
        assert pinned["family"] == family and pinned["source"].startswith("https://") and pinned["revision"]


def test_default_family_is_hunyuan_mt_byte_for_byte():
    assert build_prompt("It’s on the house.", "en", "zh") == build_prompt("It’s on the house.", "en", "zh", "hunyuan-mt")
    assert build_prompt("x", "en", "zh").encode() == "把下面的文本翻译成中文，不要额外解释。\n\nx".encode()


@pytest.mark.parametrize(("family", "fields", "message"), [
    ("hunyuan-mt", {"terms": [["a", "b"]]}, "terms: model family hunyuan-mt has no such prompt"),
    ("hy-mt1.5", {"style": "formal"}, "style: model family hy-mt1.5 has no such prompt"),
    ("hy-mt2", {"terms": [["a", "b"]], "context": "C"}, "a row may set only one of terms, context, style, formatted; "
     "this one sets terms, context"),
    ("hy-mt2", {"terms": [["a"]]}, "terms: each term must be [source, target]"),
])
def test_kind_mistakes_name_the_field(family, fields, message):
    with pytest.raises(ValueError, match=message.replace("[", r"\[").replace("]", r"\]")):
        build_prompt("S", "en", "zh", family, **fields)


def test_formatted_translates_into_chinese_only():
    with pytest.raises(ValueError, match="formatted: hy-mt1.5's formatted prompt translates into Chinese only"):
        build_prompt("<sn>S</sn>", "zh", "en", "hy-mt1.5", formatted=True)


def test_empty_fields_give_the_plain_prompt():
    plain = build_prompt("S", "en", "zh", "hy-mt1.5")
    assert build_prompt("S", "en", "zh", "hy-mt1.5", terms=[], context="", formatted=False, style=None) == plain
    assert build_prompt("S", "en", "zh", "hy-mt1.5", terms=None, context=float("nan")) == plain


def test_reversed_rows_swap_their_term_pairs():
    rows = {"src": ["a"], "tgt": ["b"], "src_lang": ["en"], "tgt_lang": ["zh"], "terms": [[["house", "房子"]]]}
    out = expand_directions(rows, both_directions=True)
    assert out["terms"] == [[["house", "房子"]], [["房子", "house"]]]


@pytest.mark.parametrize(("name", "family"), [
    ("tencent/Hy-MT2-7B", "hy-mt2"), ("/models/hy_mt2_1.8b", "hy-mt2"), ("tencent/HY-MT1.5-1.8B", "hy-mt1.5"),
    ("tencent/Hunyuan-MT-7B", "hunyuan-mt"), ("tiny", None),
])
def test_family_recognised_from_the_name(name, family):
    assert detect_family(name) == family


def test_family_recognised_from_a_folders_chat_template(tmp_path):
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"chat_template": "<｜hy_User｜>{{ m }}"}), "utf-8")
    assert detect_family(str(tmp_path)) == "hy-mt2"
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"chat_template": "<|startoftext|>"}), "utf-8")
    assert detect_family(str(tmp_path)) is None


def test_auto_falls_back_to_hunyuan_mt_with_one_info_line(caplog):
    with caplog.at_level(logging.INFO, logger="raytrain_hymt.data.prompts"):
        assert resolve_family("auto", "tiny") == "hunyuan-mt"
        assert resolve_family("hy-mt2", "tiny") == "hy-mt2"
    assert [r.getMessage() for r in caplog.records] == [
        "model.family: nothing in tiny names a model family; using hunyuan-mt's prompts (set model.family to choose)"
    ]


def test_model_family_setting():
    assert Config().model.family == "auto"
    assert Config.model_validate({"model": {"family": "hy-mt1.5"}}).model.family == "hy-mt1.5"
    with pytest.raises(ValueError, match="model.family"):
        Config.model_validate({"model": {"family": "hy-mt3"}})


@pytest.mark.parametrize(("family", "column", "value"), [
    ("hy-mt1.5", "terms", np.array([np.array(["house", "房子"], dtype=object)], dtype=object)),
    ("hy-mt1.5", "context", "前文。"),
    ("hy-mt2", "style", "正式"),
])
def test_label_mask_covers_exactly_the_answer(family, column, value):
    tok = load_tokenizer("tiny")
    values = np.empty(2, dtype=object)
    values[0], values[1] = value, None
    batch = {
        "src": np.array(["The house.", "Hello."], dtype=object), "tgt": np.array(["房子。", "你好。"], dtype=object),
        "src_lang": np.array(["en", "en"], dtype=object), "tgt_lang": np.array(["zh", "zh"], dtype=object),
        "drop_reason": np.array(["", ""], dtype=object), "example_id": np.array([1, 2], dtype=np.int64),
        column: values,
    }
    out = TokenizePairs("tiny", max_example_tokens=512, family=family)(batch)
    assert column not in out.column_names
    for row, fields in ((0, {column: value}), (1, {})):
        prompt = build_prompt(batch["src"][row], "en", "zh", family, **fields)
        [prompt_text] = render_prompts(tok, [prompt])
        n = len(tok(prompt_text, add_special_tokens=False)["input_ids"])
        ids, labels = out["input_ids"][row].as_py(), out["labels"][row].as_py()
        assert tok.decode(ids[:n]) == prompt_text
        assert labels[:n] == [IGNORE_INDEX] * n and labels[n:] == ids[n:]
        assert tok.decode(labels[n:]) == batch["tgt"][row] + "<|eos|>"


@pytest.mark.parametrize(("preset", "hub", "family"), [
    ("hy-mt1.5-1.8b-full", "tencent/HY-MT1.5-1.8B", "hy-mt1.5"), ("hy-mt1.5-1.8b-lora", "tencent/HY-MT1.5-1.8B", "hy-mt1.5"),
    ("hy-mt1.5-7b-lora", "tencent/HY-MT1.5-7B", "hy-mt1.5"), ("hy-mt2-1.8b-full", "tencent/Hy-MT2-1.8B", "hy-mt2"),
    ("hy-mt2-7b-lora", "tencent/Hy-MT2-7B", "hy-mt2"),
])
def test_family_presets_name_their_model_and_family(preset, hub, family):
    cfg = load_config(preset)
    assert (cfg.model.name_or_path, cfg.model.family) == (hub, family)
    assert resolve_family("auto", hub) == family  # the hub id alone would pick the same family
    assert cfg.lora.enabled == preset.endswith("-lora")
