"""With MLflow off (``tracking.enabled: false``) rank 0 still keeps the run's metrics in ``metrics.jsonl``:
``hymt plot``, the summary and the benchmarks read them from there."""

from raytrain_hymt.tracking.metrics_log import read_metrics
from raytrain_hymt.tracking.tracker import LocalTracker


def test_local_tracker_writes_metrics_and_params(tmp_path):
    tracker = LocalTracker(tmp_path)
    tracker.log_params({"optim": {"lr": 1e-4}, "tracking": {"tracking_uri": "http://u:secret@host"}})
    tracker.log_metrics({"train/loss": 2.5, "train/mfu": 0.41}, step=3)
    tracker.close()
    tracker.log_metrics({"train/loss": 9.0}, step=4)  # after close: ignored, as with MLflow on
    assert [(k, v, s) for k, v, s, _ in read_metrics(tmp_path / "metrics.jsonl")] == [
        ("train/loss", 2.5, 3), ("train/mfu", 0.41, 3)]
    text = (tmp_path / "metrics.jsonl").read_text()
    assert '"key": "optim.lr", "value": "0.0001"' in text
    assert "secret" not in text
