"""Signed tokens (JWT) verified against the issuer's published keys: the gateway's clients' (serve.auth.jwt) and the
OIDC ID tokens the approval proxy takes (flows/approval_proxy.py). A claim of a verified token names who sent it.

PyJWT verifies (signature, `exp`, `nbf`, `iss`, `aud`, with the profile's algorithms only, so `alg: none` and an
HMAC token "signed" with a public key never verify). The key set is ours to keep rather than PyJWKClient's, which
reads it again for every unknown key id: a caller sending made-up `kid`s would make the gateway call the identity
provider on every request. Here the set is read once when the verifier is made (a service's start), then off the
request path: a request reads the set held, and a stale set (refresh_s) or an unknown `kid` (a rotated key, at most
every MIN_REFETCH_S) has it read again in a thread of its own, one read at a time. An unknown `kid` is a 401 at once:
before, its read (up to FETCH_TIMEOUT_S) ran in the request, on the gateway's event loop, and an identity provider
that answered slowly stalled every client, stream and probe (issue 74, finding 4).
"""

from __future__ import annotations

import json
import logging
import threading
import time
import urllib.request
from pathlib import Path
from urllib.parse import urlsplit

import jwt

from tasks.platform.config.auth import JwtAuth

MIN_REFETCH_S = 10.0
FETCH_TIMEOUT_S = 5.0
LOG = logging.getLogger("llmops.gateway")


class TokenRefused(ValueError):
    """A token that does not verify; the message says why, for the caller's 401."""


def looks_like_jwt(credential: str) -> bool:
    return credential.count(".") == 2


class TokenVerifier:
    def __init__(self, settings: JwtAuth):
        self.settings = settings
        self.keys: dict[str, jwt.PyJWK] = {}
        self.fetched_at = -float("inf")
        self.lock = threading.Lock()
        self.reading: threading.Thread | None = None  # the read in flight, if any
        self.refresh()  # at the start, before any request waits on it

    def client(self, token: str) -> str:
        """Who a valid token names (its `client_claim`); TokenRefused naming what is wrong otherwise."""
        claims = self.claims(token)
        client = claims.get(self.settings.client_claim)
        if not isinstance(client, str) or not client:
            raise TokenRefused(f"the token names no client ({self.settings.client_claim})")
        return client

    def claims(self, token: str) -> dict:
        """The claims of a token whose signature, issuer, audience, expiry and not-before hold; TokenRefused else."""
        settings = self.settings
        try:
            header = jwt.get_unverified_header(token)
        except jwt.PyJWTError:
            raise TokenRefused("the token is not a JWT") from None
        algorithm = header.get("alg")
        if algorithm not in settings.algorithms:
            raise TokenRefused(f"tokens signed with {algorithm} are not accepted ({', '.join(settings.algorithms)})")
        key = self.signing_key(str(header.get("kid") or ""))
        try:
            claims = jwt.decode(
                token,
                key,
                algorithms=list(settings.algorithms),
                audience=settings.audience,
                issuer=settings.issuer,
                leeway=settings.leeway_s,
                options={"require": ["exp", "iss", "aud"]},
            )
        except jwt.ExpiredSignatureError:
            raise TokenRefused("the token expired") from None
        except jwt.ImmatureSignatureError:
            raise TokenRefused("the token is not valid yet (nbf)") from None
        except jwt.InvalidIssuerError:
            raise TokenRefused("the token's issuer is not this service's") from None
        except jwt.InvalidAudienceError:
            raise TokenRefused("the token is not for this service (aud)") from None
        except jwt.PyJWTError as exc:
            raise TokenRefused(f"the token does not verify ({type(exc).__name__})") from None
        return claims

    def signing_key(self, kid: str) -> jwt.PyJWK:
        """The key `kid` names in the set held now; never a read of the set (that is `refresh_later`'s)."""
        keys, age = self.keys, time.monotonic() - self.fetched_at
        key = keys.get(kid)
        if key is None and not kid and len(keys) == 1:  # a token without `kid` from a one-key issuer
            key = next(iter(keys.values()))
        if age > self.settings.refresh_s or (key is None and age > MIN_REFETCH_S):
            self.refresh_later()
        if key is None:
            raise TokenRefused(f"the token's signing key ({kid or 'no kid'}) is not one of the issuer's")
        return key

    def refresh_later(self) -> None:
        """The key set read again in a thread of its own, unless a read is in flight; the request goes on."""
        with self.lock:
            if self.reading is not None and self.reading.is_alive():
                return
            self.fetched_at = time.monotonic()  # the next unknown kid waits MIN_REFETCH_S from this read's start
            self.reading = threading.Thread(target=self.refresh, name="jwks-refresh", daemon=True)
            self.reading.start()

    def refresh(self) -> None:
        """The key set read again; where it cannot be, the keys held stay (and the next try waits MIN_REFETCH_S)."""
        self.fetched_at = time.monotonic()
        try:
            keys = jwt.PyJWKSet.from_dict(json.loads(self.read())).keys
        except (OSError, ValueError, jwt.PyJWTError) as exc:
            LOG.warning(
                f"serve.auth.jwt: the key set at {self.settings.jwks} was not read ({exc}); keeping {len(self.keys)}"
            )
            return
        self.keys = {str(key.key_id or ""): key for key in keys}  # one assignment: a request reads old or new whole

    def read(self) -> str:
        source = self.settings.jwks
        if urlsplit(source).scheme in ("http", "https"):
            with urllib.request.urlopen(source, timeout=FETCH_TIMEOUT_S) as answer:  # noqa: S310 (http(s) only)
                return answer.read().decode()
        return Path(source.removeprefix("file://")).read_text()
