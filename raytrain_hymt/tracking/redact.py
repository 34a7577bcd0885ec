"""Secrets out of all the project records (params, tags, config dumps, logs): values whose key names a secret,
and a URI's password wherever it appears (``http://alice:***@host``)."""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

REDACTED = "***"

_SECRET_WORDS = ("token", "password", "passwd", "secret", "api_key", "apikey", "access_key", "credential",
                 "credentials", "auth", "authorization", "private_key")  # fmt: skip
# Whole words only: `hf_token` is a secret, `max_tokens` / `tokenizer` are not.
_SECRET_KEY_RE = re.compile(r"(?:^|_)(?:" + "|".join(_SECRET_WORDS) + r")(?:_|$)")
# `pad_token_id`, `eos_token_ids`: numbers, not secrets.
_ID_SUFFIX_RE = re.compile(r"_ids?$")
_URI_CREDENTIALS_RE = re.compile(r"\b([a-zA-Z][a-zA-Z0-9+.\-]*://[^/\s:@]+):([^@\s/]+)@")
_TEXT_ASSIGNMENT_RE = re.compile(  # `key: value`, `"key": "value",`, `key=value`, `- key: value`, one a line
    r"""^(?P<head>\s*(?:-\s+)?["']?(?P<key>[\w.\-]+)["']?\s*[:=]\s*)(?P<value>.+?)(?P<tail>\s*,?\s*)$""", re.MULTILINE)


def is_secret_key(key: Any) -> bool:
    """True when any dotted component of ``key`` names a secret (token, password, api_key, ...)."""
    # `hfToken` / `HF-Token` / `hf token` -> `hf_token`, so that word matching is uniform.
    snake = [re.sub(r"(?<=[a-z0-9])(?=[A-Z])", "_", component).lower() for component in str(key).split(".")]
    words = [re.sub(r"[^a-z0-9]+", "_", w).strip("_") for w in snake]
    return any(_SECRET_KEY_RE.search(w) and not _ID_SUFFIX_RE.search(w) for w in words)


def redact_uri_credentials(text: str) -> str:
    """``scheme://user:pass@host`` -> ``scheme://user:***@host`` anywhere in ``text``."""
    return _URI_CREDENTIALS_RE.sub(rf"\1:{REDACTED}@", text)


def redact(obj: Any) -> Any:
    """Copy of ``obj`` (nested dicts/lists) with secret-named keys' values and URI passwords replaced."""
    if isinstance(obj, Mapping):
        return {k: REDACTED if is_secret_key(k) else redact(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(redact(v) for v in obj)
    if isinstance(obj, str):
        return redact_uri_credentials(obj)
    return obj


def redact_text(text: str) -> str:
    """Redact free text (YAML/JSON/INI dumps, logs): URI passwords and ``secret_key: value`` lines."""

    def _line(match: re.Match) -> str:
        if not is_secret_key(match["key"]):
            return match[0]
        quote = match["value"][0] if match["value"][0] in "\"'" else ""
        return f"{match['head']}{quote}{REDACTED}{quote}{match['tail']}"

    return _TEXT_ASSIGNMENT_RE.sub(_line, redact_uri_credentials(text))
