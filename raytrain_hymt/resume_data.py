"""The data part of the resume check, on the driver: fingerprint the data, compare it with the newest
checkpoint's, stop before training when it changed (``data.fingerprint``).

Kept apart from the config check so that one resume-compatibility check (issue #14's) can call it with
the same single override, ``run.allow_config_change``.
"""

from __future__ import annotations

import json

from raytrain_hymt.config import Config
from raytrain_hymt.data.fingerprint import check_same_data, data_fingerprint
from raytrain_hymt.storage import RunFolder


def newest_checkpoint_state(folder: RunFolder) -> tuple[str, dict] | None:
    """``(checkpoint folder name, its state.json)`` of the newest checkpoint in a run folder that has a
    ``state.json``, or None for a run without checkpoints (a new run)."""
    import pyarrow.fs

    from raytrain_hymt.checkpoint import CHECKPOINT_DIR_RE, STATE_FILE

    infos = folder.fs.get_file_info(pyarrow.fs.FileSelector(folder.path, allow_not_found=True))
    found = []
    for info in infos:
        m = CHECKPOINT_DIR_RE.match(info.base_name)
        if m and info.type == pyarrow.fs.FileType.Directory:
            found.append(((int(m.group(1)), int(m.group(2) or 0)), info.base_name))
    for _, name in sorted(found, reverse=True):
        text = folder.read_text(f"{name}/{STATE_FILE}")
        if text is not None:
            return name, json.loads(text)
    return None


def check_resume_data(cfg: Config, folder: RunFolder) -> dict:
    """The data fingerprint of ``cfg``, after checking that a resumed run (one with a checkpoint in
    ``folder``) resumes on the data it trained on; see :func:`~raytrain_hymt.data.fingerprint.check_same_data`."""
    fingerprint = data_fingerprint(cfg)
    newest = newest_checkpoint_state(folder)
    if newest is not None:
        name, state = newest
        check_same_data(state.get("data_fingerprint"), fingerprint, cfg.run.allow_config_change,
                        where=f"{folder.uri}/{name}, step {state.get('step')}")
    return fingerprint
