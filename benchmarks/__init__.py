"""Benchmark logic behind jobs/bench*.py and jobs/benchmark.py: outside the product package, importing it
the way users run it (the same presets, model folders and training loop)."""
