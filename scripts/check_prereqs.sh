#!/usr/bin/env bash
# Check what `make train` / `make test` need from the machine before installing anything, and say what
# is missing with the Debian package that provides it.
set -u
PY=${PY:-python3}
missing=()
if ! command -v "$PY" >/dev/null 2>&1; then
  missing+=("$PY (Debian: apt-get install python3)")
else
  "$PY" -c 'import sys; sys.exit(0 if sys.version_info >= (3, 11) else 1)' \
    || missing+=("Python >= 3.11 (found $("$PY" --version 2>&1); transformers 5 needs 3.11)")
  "$PY" -c 'import venv, ensurepip' 2>/dev/null || missing+=("python venv module (Debian: apt-get install python3-venv)")
  inc=$("$PY" -c 'import sysconfig; print(sysconfig.get_paths()["include"])' 2>/dev/null)
  [ -f "$inc/Python.h" ] || missing+=("Python headers, $inc/Python.h (Debian: apt-get install python3-dev)")
fi
command -v g++ >/dev/null 2>&1 || missing+=("a C++ compiler for DeepSpeed's CPU ops (Debian: apt-get install g++ or build-essential)")
command -v git >/dev/null 2>&1 || missing+=("git (Debian: apt-get install git)")
if [ ${#missing[@]} -gt 0 ]; then
  echo "raytrain_hymt cannot be installed on this machine yet; missing:" >&2
  for m in "${missing[@]}"; do echo "  - $m" >&2; done
  exit 1
fi
