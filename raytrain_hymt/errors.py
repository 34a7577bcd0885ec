"""Turn a failure into one line that says what went wrong and where (original exception, failing rank)."""

from __future__ import annotations


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
        inner = getattr(exc, "cause", None) or getattr(exc, "__cause__", None)
        if not isinstance(inner, BaseException):
            break
        exc = inner
    return exc


def describe_failure(exc: BaseException) -> str:
    """``"training failed on rank 1: ValueError: ..."`` for Ray Train errors, ``"Type: msg"`` otherwise."""
    causes = _root_causes(exc)
    parts = []
    for where, err in causes:
        text = f"{type(err).__name__}: {str(err).strip().splitlines()[-1] if str(err).strip() else ''}"
        parts.append(f"{where}: {text}" if where else text)
    prefix = "training failed on " if any(w for w, _ in causes) else ""
    return prefix + "; ".join(parts)
