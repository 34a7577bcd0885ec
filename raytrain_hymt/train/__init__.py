"""Worker code: what runs inside each Ray Train worker (the loop, the worker's state, the DeepSpeed engine,
the model, checkpoints and resharding, export, FLOPs)."""
