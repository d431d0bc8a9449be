"""API keys per client: where they come from (the environment or a key file, never a profile) and the check
every /v1 and /v2 request passes. Each client has a key of its own, so one can lose it without the others."""

from __future__ import annotations

import hmac
from collections.abc import Mapping
from pathlib import Path

from tasks.platform.errors import BadInput
from tasks.serving.gateway.protocol import RequestError

API_KEYS_ENV = "LLMOPS_API_KEYS"  # comma-separated keys
API_KEYS_FILE_ENV = "LLMOPS_API_KEYS_FILE"  # one key a line; `#` comments; a line `NAME: KEY` names its client
MIN_KEY_LENGTH = 16
ANONYMOUS = "anonymous"


def read_api_keys(environ: Mapping[str, str]) -> dict[str, str]:
    """API keys (key -> client name) from LLMOPS_API_KEYS or the file LLMOPS_API_KEYS_FILE names."""
    keys: dict[str, str] = {}
    for index, key in enumerate(k.strip() for k in environ.get(API_KEYS_ENV, "").split(",")):
        if key:
            keys[key] = f"client-{index + 1}"
    path = environ.get(API_KEYS_FILE_ENV)
    if path:
        keys.update(read_key_file(Path(path)))
    return keys


def read_key_file(path: Path) -> dict[str, str]:
    """The keys of a key file; an unnamed key is named after its file and line."""
    try:
        lines = path.read_text().splitlines()
    except OSError as exc:
        raise BadInput(f"{API_KEYS_FILE_ENV} {path}: cannot read ({exc.strerror})") from None
    keys: dict[str, str] = {}
    for number, line in enumerate(lines, 1):
        line = line.split("#", 1)[0].strip()
        if not line:
            continue
        name, _, key = line.rpartition(":")
        key = key.strip()
        if len(key) < MIN_KEY_LENGTH:
            raise BadInput(
                f"{API_KEYS_FILE_ENV} {path} line {number}: an API key must be at least {MIN_KEY_LENGTH} characters"
            )
        keys[key] = name.strip() or f"{path.name}:{number}"
    return keys


def authorize(api_keys: Mapping[str, str], authorization: str | None) -> str:
    """The client's name for an `Authorization` header; anonymous where no key is configured.

    Every key is compared in constant time, so the answer's timing does not tell how much of a key was right."""
    if not api_keys:
        return ANONYMOUS
    scheme, _, given = (authorization or "").partition(" ")
    if scheme.lower() != "bearer" or not given:
        raise RequestError(401, "missing API key: send `Authorization: Bearer <key>`", code="invalid_api_key")
    for key, name in api_keys.items():
        if hmac.compare_digest(given.strip().encode(), key.encode()):
            return name
    raise RequestError(401, "invalid API key", code="invalid_api_key")
