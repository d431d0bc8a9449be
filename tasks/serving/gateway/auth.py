"""API keys per client: where they come from (the environment or a key file, never a profile) and the check
every /v1 and /v2 request passes. Each client has a key of its own, so one can lose it without the others."""

from __future__ import annotations

import hmac
import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from tasks.platform.errors import BadInput
from tasks.serving.gateway.protocol import RequestError

API_KEYS_ENV = "LLMOPS_API_KEYS"  # comma-separated keys
API_KEYS_FILE_ENV = "LLMOPS_API_KEYS_FILE"  # one key a line; `#` comments; a line `NAME: KEY` names its client
MIN_KEY_LENGTH = 16
ANONYMOUS = "anonymous"
COMMENT = re.compile(r"(?:^|\s)#.*$")  # `#` at a line's start or after a space: a key may hold `#` itself


@dataclass(frozen=True)
class KeyEntry:
    key: str
    client: str
    origin: str  # where it was written, for errors: "LLMOPS_API_KEYS entry 2", "LLMOPS_API_KEYS_FILE f line 3"


def read_api_keys(environ: Mapping[str, str]) -> dict[str, str]:
    """API keys (key -> client name) from LLMOPS_API_KEYS and the file LLMOPS_API_KEYS_FILE names.

    A key shorter than MIN_KEY_LENGTH, or one written twice, is refused naming where it was written."""
    entries: list[KeyEntry] = []
    for index, key in enumerate(k.strip() for k in environ.get(API_KEYS_ENV, "").split(",")):
        if key:
            entries.append(KeyEntry(key, f"client-{index + 1}", f"{API_KEYS_ENV} entry {index + 1}"))
    path = environ.get(API_KEYS_FILE_ENV)
    if path:
        entries += read_key_file(Path(path))
    keys: dict[str, str] = {}
    origins: dict[str, str] = {}
    for entry in entries:
        if len(entry.key) < MIN_KEY_LENGTH:
            raise BadInput(f"{entry.origin}: an API key must be at least {MIN_KEY_LENGTH} characters")
        if entry.key in origins:
            raise BadInput(f"{entry.origin}: the same API key as {origins[entry.key]}; each client needs its own")
        keys[entry.key], origins[entry.key] = entry.client, entry.origin
    return keys


def read_key_file(path: Path) -> list[KeyEntry]:
    """The keys of a key file; `NAME: KEY` splits on the first colon; an unnamed key is named after its line."""
    try:
        lines = path.read_text().splitlines()
    except OSError as exc:
        raise BadInput(f"{API_KEYS_FILE_ENV} {path}: cannot read ({exc.strerror})") from None
    entries: list[KeyEntry] = []
    for number, line in enumerate(lines, 1):
        line = COMMENT.sub("", line).strip()
        if not line:
            continue
        name, colon, key = line.partition(":")
        if not colon:
            name, key = "", line
        origin = f"{API_KEYS_FILE_ENV} {path} line {number}"
        entries.append(KeyEntry(key.strip(), name.strip() or f"{path.name}:{number}", origin))
    return entries


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
