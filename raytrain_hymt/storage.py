"""A run's folder in storage: a local path, a shared filesystem, or an object store URI (``s3://``, ``gs://``).

Ray Train writes the checkpoints there itself (``RunConfig(storage_path=...)`` takes the same paths and
URIs). The driver's own small files (``config.yaml``, ``run.json``, ``summary.json``) and the exported
model go through pyarrow's filesystems, so every kind of storage works the same way. Files that have to
be local first (the MLflow ``metrics.jsonl`` copy, the model while it is exported) live in
``local``: the run folder itself when storage is local, else a staging folder on the driver.
"""

from __future__ import annotations

import os
from pathlib import Path

# The files of a run folder, named here once for every command that reads or writes them.
#: The run's first config (a re-submission is compared with it).
CONFIG_FILE = "config.yaml"
#: Every config difference a re-submission brought, allowed or not, one JSON line each.
CHANGES_FILE = "config-changes.jsonl"
#: The run's MLflow run (id, key, tracking URI), so that every later command continues the same one.
RUN_FILE = "run.json"
#: The finished run's summary (``hymt train``'s last lines, the model's folder).
SUMMARY_FILE = "summary.json"
#: The local copy of every metric the tracker logs.
METRICS_FILE = "metrics.jsonl"

#: Where runs on a URI storage root stage their local files (``<dir>/<run name>``).
STAGING_ROOT = Path(os.path.expanduser("~/.cache/raytrain_hymt/runs"))


def is_uri(path: str) -> bool:
    """True for ``scheme://...`` (object stores, ``file://``), False for a plain path."""
    return "://" in str(path)


def folder_problem(field: str, path: str, holds: str) -> str | None:
    """One line when the local folder ``path`` (the value of ``field``, which ``holds`` something) cannot be
    created or written, else None. Checked before anything is created: the nearest part of the path that
    exists must be a folder in which this user can create one. A URI is checked where it is written (a
    bucket needs credentials and the network)."""
    import tempfile

    if is_uri(path):
        return None
    target = Path(path).expanduser()
    existing = target
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    if not existing.is_dir():
        inside = "" if existing == target else f", so {target} cannot be created"
        return f"{field}: {existing} is a file, not a folder{inside} ({field} is a folder that holds {holds})"
    try:  # the real test: permissions, read-only mounts and immutable folders all say no here
        os.rmdir(tempfile.mkdtemp(prefix=".hymt-write-check-", dir=existing))
    except OSError as e:
        cannot = "" if existing == target else f"cannot create {target}: "
        return f"{field}: {cannot}{existing} is not writable ({e.strerror or e})"
    return None


class RunFolder:
    """The folder ``<storage_root>/<name>`` on whatever filesystem ``storage_root`` names."""

    def __init__(self, storage_root: str, name: str, create: bool = True):
        """``create=False`` only looks (e.g. "did this run finish?") and leaves no empty folders behind."""
        import pyarrow.fs

        self.uri = f"{storage_root.rstrip('/')}/{name}"
        if is_uri(storage_root):
            self.fs, root = pyarrow.fs.FileSystem.from_uri(storage_root)
            self.path = f"{root.rstrip('/')}/{name}"
            self.local = STAGING_ROOT / name
        else:
            self.fs, self.path = pyarrow.fs.LocalFileSystem(), str(Path(storage_root, name))
            self.local = Path(self.path)
        self.created = False
        """Whether :meth:`create` made the folder (it did not exist before)."""
        if create:
            self.create()

    def create(self) -> None:
        """Make the folder (and the local staging folder) when it does not exist yet."""
        import pyarrow.fs

        self.created = self.created or self.fs.get_file_info(self.path).type == pyarrow.fs.FileType.NotFound
        self.fs.create_dir(self.path, recursive=True)
        self.local.mkdir(parents=True, exist_ok=True)

    def remove(self) -> None:
        """Delete the folder, and its local staging copy when storage is remote."""
        import shutil

        self.fs.delete_dir(self.path)
        if self.remote:
            shutil.rmtree(self.local, ignore_errors=True)

    @property
    def remote(self) -> bool:
        """Whether ``local`` is a staging copy (storage is a URI) rather than the run folder itself."""
        return self.local != Path(self.path)

    def location(self, name: str) -> str:
        """Where ``<run folder>/name`` is: a local path, or a URI when storage is remote."""
        return f"{self.uri}/{name}" if self.remote else str(Path(self.path, name))

    def read_text(self, name: str) -> str | None:
        """The text of ``<run folder>/name``, or None when there is no such file."""
        import pyarrow.fs

        target = f"{self.path}/{name}"
        if self.fs.get_file_info(target).type != pyarrow.fs.FileType.File:
            return None
        with self.fs.open_input_stream(target) as f:
            return f.read().decode("utf-8")

    def write_text(self, name: str, text: str) -> None:
        """Write ``<run folder>/name`` whole (object stores publish it on close; local: via a rename)."""
        target = f"{self.path}/{name}"
        if not self.remote:
            tmp = Path(target + ".partial")
            tmp.write_text(text, encoding="utf-8")
            tmp.replace(target)
            return
        with self.fs.open_output_stream(target) as f:
            f.write(text.encode("utf-8"))

    def pull(self, name: str) -> None:
        """Copy ``<run folder>/name`` into ``local`` when storage is remote and the file exists."""
        text = self.read_text(name) if self.remote else None
        if text is not None:
            (self.local / name).write_text(text, encoding="utf-8")

    def push(self, name: str, source: Path | None = None) -> str:
        """Copy ``local/name`` (a file or folder; or ``source``, e.g. a worker's own staging copy) into the
        run folder when storage is remote; its URI/path. A missing source is skipped."""
        if not self.remote:
            return str(self.local / name)
        import pyarrow.fs

        source = source or self.local / name
        target = f"{self.path}/{name}"
        if source.is_dir():
            self.fs.create_dir(target, recursive=True)  # a local destination needs its folder first
            pyarrow.fs.copy_files(str(source), target, source_filesystem=pyarrow.fs.LocalFileSystem(),
                                  destination_filesystem=self.fs)
        elif source.is_file():
            self.fs.create_dir(self.path, recursive=True)
            pyarrow.fs.copy_files(str(source), target, source_filesystem=pyarrow.fs.LocalFileSystem(),
                                  destination_filesystem=self.fs)
        return f"{self.uri}/{name}"
