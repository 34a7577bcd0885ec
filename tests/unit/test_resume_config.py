"""A run's first ``config.yaml`` written before a source field existed resumes: the field had its default."""

from raytrain_hymt.config.schema import SourceConfig, load_config
from raytrain_hymt.driver.resume import check_resume


def test_a_source_field_the_saved_config_predates_is_its_default():
    new = load_config(None, ["data.sources=[{path: c.tsv, format: tsv, src_lang: en, tgt_lang: de}]"]).model_dump(
        mode="json")
    source = new["data"]["sources"][0]
    at_default = [k for k, f in SourceConfig.model_fields.items()
                  if not f.is_required() and f.default_factory is None and source[k] == f.default]
    assert len(at_default) >= 4, at_default
    old_source = {k: v for k, v in source.items() if k not in at_default}
    saved = {**new, "data": {**new["data"], "sources": [old_source]}}
    assert check_resume(saved, new) == []
    # A value that differs from the default is still a change.
    changed = {**new, "data": {**new["data"], "sources": [{**old_source, "format": "csv"}]}}
    assert [d.field for d in check_resume(changed, new)] == ["data.sources"]


def test_a_run_from_before_the_language_filter_resumes_only_without_it():
    """A run whose config and data fingerprint predate ``data.language_id`` trained without the filter: resuming
    it with the filter on changes the kept rows and is refused by name; ``data.language_id=false`` resumes it."""
    from raytrain_hymt.data.fingerprint import compare_fingerprints

    now = load_config(None).model_dump(mode="json")
    saved = {**now, "data": {k: v for k, v in now["data"].items() if k != "language_id"}}
    assert [(d.field, d.before, d.after, d.trajectory) for d in check_resume(saved, now)] == [
        ("data.language_id", False, True, True)]
    off = load_config(None, ["data.language_id=false"]).model_dump(mode="json")
    assert check_resume(saved, off) == []
    old_print = {"settings": {"tokenizer": "tiny", "dedup": True}}
    assert compare_fingerprints(old_print, {"settings": {"tokenizer": "tiny", "dedup": True, "language_id": True}}) \
        == ["data.language_id: False → True"]
    assert compare_fingerprints(old_print, {"settings": {"tokenizer": "tiny", "dedup": True, "language_id": False}}) == []
