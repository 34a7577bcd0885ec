"""Learning-rate search: ``python jobs/tune.py [--config PRESET] [--set a.b=v]``; same as ``hymt tune``.

Also runs under ``ray job submit --working-dir . -- python jobs/tune.py``.
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from raytrain_hymt.cli import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main(["tune", *sys.argv[1:]]))
