"""Rebuild the bundled tiny tokenizer (raytrain_hymt/assets/tiny-tokenizer) from the sample corpus.

Run once by maintainers; the result is committed so every machine gets the same bytes.
    python jobs/build_tiny_tokenizer.py
"""

from raytrain_hymt.tokenizer import TINY_TOKENIZER_DIR, build_tiny_tokenizer
from raytrain_hymt.data.files import SAMPLE_CORPUS


def main() -> None:
    lines = []
    with open(SAMPLE_CORPUS, encoding="utf-8") as f:
        for line in f:
            cols = line.rstrip("\n").split("\t")
            lines.extend(cols[2:4])
    tok = build_tiny_tokenizer(lines)
    tok.save_pretrained(TINY_TOKENIZER_DIR)
    print(f"saved {len(tok)} tokens to {TINY_TOKENIZER_DIR}")


if __name__ == "__main__":
    main()
