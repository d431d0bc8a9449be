"""How the gateway knows its clients besides API keys: signed tokens (JWT) from the operator's identity provider."""

from __future__ import annotations

from typing import Literal
from urllib.parse import urlsplit

from pydantic import Field, field_validator

from tasks.platform.config.base import TRUST_ONLY, Section

SignedBy = Literal["RS256", "RS384", "RS512", "PS256", "PS384", "PS512", "ES256", "ES384", "ES512", "EdDSA"]
LOOPBACK_HOSTS = ("127.0.0.1", "::1", "localhost")


class JwtAuth(Section):
    """Signed client tokens: `Authorization: Bearer <JWT>` beside API keys. A token answers when its signature
    verifies against the issuer's published keys (JWKS) and its issuer, audience, expiry and not-before hold; the
    claim `client_claim` names its client (as `token:<claim>`, never an API key's name), whose limits, capture,
    feedback and `data forget` it shares. Only a
    profile file sets any of it: it decides whom the service trusts."""

    jwks: str = Field(
        description="The issuer's signing keys (a JSON Web Key Set): an https:// URL (http:// on loopback only), or a "
        "file. Read again every refresh_s, and at once (at most every 10 s) for a token signed by a key id it does "
        "not hold: a rotated key is taken without a restart.",
        json_schema_extra=TRUST_ONLY,
    )
    issuer: str = Field(description="The `iss` every token must carry.", json_schema_extra=TRUST_ONLY)
    audience: str = Field(description="The `aud` every token must name (this service).", json_schema_extra=TRUST_ONLY)
    client_claim: str = Field(
        "sub", description="The claim that names the token's client (limits and records key on it).",
        json_schema_extra=TRUST_ONLY,
    )  # fmt: skip
    algorithms: list[SignedBy] = Field(
        ["RS256", "ES256"],
        description="The signature algorithms taken (asymmetric only: `none` and HMAC never are).",
        json_schema_extra=TRUST_ONLY,
    )
    refresh_s: float = Field(300, gt=0, description="Seconds the key set is kept before it is read again.")
    leeway_s: float = Field(30, ge=0, le=300, description="Clock skew allowed on exp and nbf, in seconds.")

    @field_validator("jwks")
    @classmethod
    def _keys_not_in_clear(cls, value: str) -> str:
        parts = urlsplit(value)
        if parts.scheme == "http" and parts.hostname not in LOOPBACK_HOSTS:
            raise ValueError(f"{value}: signing keys over plain http:// to another machine could be swapped; use https")
        if parts.scheme not in ("", "http", "https", "file"):
            raise ValueError(f"{value}: an https:// URL or a file")
        return value


class AuthSection(Section):
    """Who may call the gateway besides holders of an API key (LLMOPS_API_KEYS_FILE)."""

    jwt: JwtAuth | None = Field(
        None,
        description="Signed client tokens from an identity provider (null: API keys only).",
        json_schema_extra=TRUST_ONLY,
    )
