"""A run's records: MLflow through one tracker, the local ``metrics.jsonl``/TensorBoard copy, secrets redacted."""
