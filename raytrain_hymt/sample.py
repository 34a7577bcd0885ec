"""The bundled sample corpus (real Tatoeba eng-zho pairs; license in sample_data/NOTICE.md)."""

from pathlib import Path

SAMPLE_CORPUS = Path(__file__).parent / "sample_data" / "tatoeba-eng-zho.tsv"
