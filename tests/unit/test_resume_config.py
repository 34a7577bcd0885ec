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
