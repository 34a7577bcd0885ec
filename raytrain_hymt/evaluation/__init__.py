"""Translate and score: the batched decoder, test sets and BLEU/chrF, BLEU during training. Runs in
training workers, evaluation replicas and ``hymt translate``."""
