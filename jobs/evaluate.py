"""BLEU/chrF on a test set: ``python jobs/evaluate.py (--name RUN | --model PATH) --test-set DIR``.

Also the ``ray job submit --working-dir . -- python jobs/evaluate.py ...`` entry point. Same as
``hymt evaluate``.
"""

import sys
from pathlib import Path

# Under `ray job submit` the working dir is the repo but the package may not be installed there.
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from raytrain_hymt.cli import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main(["evaluate", *sys.argv[1:]]))
