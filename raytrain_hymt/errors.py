"""Turn a failure into one line that says what went wrong and where (original exception, failing rank)."""

from __future__ import annotations

import errno


class ConfigError(ValueError):
    """A configuration problem, with the offending field in the message."""



class DataSourceError(ValueError):
    """A corpus that cannot be read: missing files, mismatched Moses files, unknown columns."""


class NonFiniteError(FloatingPointError):
    """A training step produced a non-finite loss or gradient norm (``checkpoint.on_nonfinite: fail``)."""


class TrainingFailed(RuntimeError):
    """Training ended with an error after the failure budget was spent; the message says what and where."""


def _root_causes(exc: BaseException) -> list[tuple[str, BaseException]]:
    """(where, exception) pairs: Ray Train wraps worker errors per rank; walk to the originals."""
    found: list[tuple[str, BaseException]] = []
    errors = getattr(exc, "worker_failures", None)
    if isinstance(errors, dict) and errors:
        for rank, err in sorted(errors.items()):
            found.append((f"rank {rank}", _unwrap(err)))
        return found
    return [("", _unwrap(exc))]


def _unwrap(exc: BaseException) -> BaseException:
    seen = set()
    while id(exc) not in seen:
        seen.add(id(exc))
        inner = (getattr(exc, "cause", None) or getattr(exc, "controller_failure", None)
                 or getattr(exc, "__cause__", None))
        # Ray Data raises a user error "from SystemException()": an empty marker, not the cause.
        if not isinstance(inner, BaseException) or not str(inner).strip():
            break
        exc = inner
    return exc


def message(err: BaseException) -> str:
    """The text of ``err`` as its raiser wrote it, whole (several lines stay several lines).

    Ray's task errors carry the remote traceback in their text: only its last line, the original
    ``Type: message``, is kept. An empty text never reaches the user as an empty line.
    """
    text = str(err).strip()
    if not text:
        return "(the error carried no message; HYMT_VERBOSE=1 shows where it was raised)"
    if any(line.lstrip().startswith(('File "', "Traceback (most recent call last)")) for line in text.splitlines()):
        return text.splitlines()[-1].strip()
    return text


def describe_failure(exc: BaseException) -> str:
    """``"training failed on rank 1: ValueError: ..."`` for Ray Train errors, ``"Type: msg"`` otherwise."""
    if isinstance(exc, TrainingFailed):
        return str(exc)
    causes = _root_causes(exc)
    parts = []
    for where, err in causes:
        text = f"{type(err).__name__}: {message(err)}"
        parts.append(f"{where}: {text}" if where else text)
    prefix = "training failed on " if any(w for w, _ in causes) else ""
    return prefix + "; ".join(parts)


def budget_spent(exc: BaseException, max_failures: int) -> TrainingFailed:
    """The error a run ends with when Ray Train gave up: the original failure, then the budget it spent."""
    attempts = "" if max_failures < 0 else f" after {max_failures + 1} attempt{'s' if max_failures else ''}"
    return TrainingFailed(
        f"{describe_failure(exc)}{attempts} (checkpoint.max_failures={max_failures}; the run resumes from "
        "its last good checkpoint when submitted again with the same name)"
    )


#: How a full disk reads once it has crossed a process boundary as text (pyarrow's, sqlite's own wording).
_NO_SPACE_TEXTS = ("No space left on device", "database or disk is full")


def no_space(exc: BaseException) -> bool:
    """Whether ``exc`` or what it wraps (any rank's failure, any cause or context) is a full disk."""
    todo, seen = [exc], set()
    while todo:
        err = todo.pop()
        if err is None or id(err) in seen:
            continue
        seen.add(id(err))
        if (isinstance(err, OSError) and err.errno == errno.ENOSPC) or any(t in str(err) for t in _NO_SPACE_TEXTS):
            return True
        failures = getattr(err, "worker_failures", None)
        todo += list(failures.values()) if isinstance(failures, dict) else []
        todo += [getattr(err, name, None) for name in ("cause", "controller_failure", "__cause__", "__context__")]
        todo = [e for e in todo if e is None or isinstance(e, BaseException)]
    return False


def disk_full(exc: BaseException, storage_root: str, checkpoint: str | None) -> str:
    """The one line a run that ran out of disk space ends with: the failure, ``run.storage_root`` and the
    whole ``checkpoint`` a resubmission resumes from (None: it starts over)."""
    resumes = (f"it resumes from its last whole checkpoint, {checkpoint}" if checkpoint
               else "it starts over (it has no whole checkpoint yet)")
    return (f"no space left on device under run.storage_root {storage_root} ({describe_failure(exc)}); free space "
            f"and submit the run again with the same name: {resumes}")
