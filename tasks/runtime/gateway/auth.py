"""API keys per client: where they come from (the environment or a key file, never a profile) and the check
every /v1 and /v2 request passes. Each client has a key of its own, so one can lose it without the others. Where the
profile sets serve.auth.jwt, a bearer token that is a JWT is verified instead (tasks/platform/signed_tokens.py) and names its client."""

from __future__ import annotations

import contextlib
import hmac
import logging
import re
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from tasks.platform.errors import BadInput
from tasks.platform.signed_tokens import TokenRefused, TokenVerifier, looks_like_jwt
from tasks.runtime.gateway.protocol import RequestError

API_KEYS_ENV = "LLMOPS_API_KEYS"  # comma-separated keys
API_KEYS_FILE_ENV = "LLMOPS_API_KEYS_FILE"  # one key a line; `#` comments; a line `NAME: KEY` names its client
MIN_KEY_LENGTH = 16
ANONYMOUS = "anonymous"
RELOAD_CHECK_S = 1.0  # how often the key file's stat is looked at, at most
LOG = logging.getLogger("llmops.gateway")
COMMENT = re.compile(r"(?:^|\s)#.*$")  # `#` at a line's start or after a space: a key may hold `#` itself
# A signed token's client is named `token:<claim>`: a key's name cannot hold a colon (a key file's `NAME: KEY` splits
# on the first), so no token names a key's client and shares its limits, feedback or serve.capture.trusted_clients
# trust (issue 74: a token whose `sub` was a key-file name did).
TOKEN_CLIENT = "token:"


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


class KeyRing:
    """The API keys in force, re-read when the key file changes: a key deleted from LLMOPS_API_KEYS_FILE stops
    working within RELOAD_CHECK_S, without a restart, and a key added starts. An edit that does not read (a
    bad line, a half-written file) or that would leave no key at all (the service would open to anyone) keeps
    the keys in force and logs why; the next good edit is taken."""

    def __init__(self, environ: Mapping[str, str], tokens: TokenVerifier | None = None):
        self.tokens = tokens  # serve.auth.jwt's verifier, where the profile sets one
        self.environ = {name: environ[name] for name in (API_KEYS_ENV, API_KEYS_FILE_ENV) if name in environ}
        self.path = Path(self.environ[API_KEYS_FILE_ENV]) if API_KEYS_FILE_ENV in self.environ else None
        self.keys = read_api_keys(self.environ)
        self.stamp = self.file_stamp()
        self.checked = time.monotonic()

    @classmethod
    def fixed(cls, keys: Mapping[str, str]) -> KeyRing:
        """Keys given directly (no file to follow)."""
        ring = cls({})
        ring.keys = dict(keys)
        return ring

    def file_stamp(self) -> tuple[int, int, int] | None:
        try:
            stat = self.path.stat() if self.path is not None else None
        except OSError:
            return None
        return (stat.st_mtime_ns, stat.st_size, stat.st_ino) if stat is not None else None

    def current(self) -> dict[str, str]:
        """The keys (key -> client name), re-read first where the file changed since the last look."""
        if self.path is None or time.monotonic() - self.checked < RELOAD_CHECK_S:
            return self.keys
        self.checked = time.monotonic()
        stamp = self.file_stamp()
        if stamp == self.stamp:
            return self.keys
        self.stamp = stamp
        try:
            keys = read_api_keys(self.environ)
        except BadInput as exc:
            LOG.warning(f"API keys not reloaded, the {len(self.keys)} in force stay: {exc}")
            return self.keys
        if self.keys and not keys:
            LOG.warning(f"API keys not reloaded: {self.path} now holds none, which would open the service to anyone")
            return self.keys
        LOG.info(f"API keys reloaded from {self.path}: {len(keys)} in force")
        self.keys = keys
        return self.keys

    def authorize(self, authorization: str | None) -> str:
        """The client's name for an `Authorization` header: a signed token's client (`token:` and its claim) where it
        is a JWT and tokens are taken, else the API key's; anonymous only where neither keys nor tokens are
        configured."""
        if self.tokens is None:
            return authorize(self.current(), authorization)
        keys, (scheme, _, given) = self.current(), (authorization or "").partition(" ")
        token = given.strip() if scheme.lower() == "bearer" and looks_like_jwt(given.strip()) else None
        if token is None:
            if not keys:
                raise RequestError(401, "missing token: send `Authorization: Bearer <JWT>`", code="invalid_api_key")
            return authorize(keys, authorization)
        if keys:  # an API key may hold two dots too
            with contextlib.suppress(RequestError):
                return authorize(keys, authorization)
        try:
            return TOKEN_CLIENT + self.tokens.client(token)
        except TokenRefused as exc:
            raise RequestError(401, f"invalid token: {exc}", code="invalid_api_key") from None
