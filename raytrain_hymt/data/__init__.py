"""Parallel-corpus ingestion: readers, cleaning, prompts, tokenization, packing, the Ray Data pipeline."""
