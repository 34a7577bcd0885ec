"""Train Hunyuan-MT: ``python jobs/train.py [--config PRESET] [--set a.b=v] [--name RUN]``.

Also the ``ray job submit --working-dir . -- python jobs/train.py`` entry point. Same as ``hymt train``.
"""

import sys
from pathlib import Path

# Under `ray job submit` the working dir is the repo but the package may not be installed there.
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from raytrain_hymt.cli import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main(["train", *sys.argv[1:]]))
