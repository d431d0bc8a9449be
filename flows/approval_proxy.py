"""`llmops approval-proxy`: the Prefect API behind an OIDC proxy, with the person it authenticated on every decision.

    browser / `llmops approve` -> oauth2-proxy (OIDC login) -> llmops approval-proxy -> Prefect server

Every request must carry the OIDC ID token the login proxy forwards (oauth2-proxy's `--pass-authorization-header`:
`Authorization: Bearer <ID token>`), verified here against the provider's published keys (issuer, audience, expiry,
signature: tasks/platform/signed_tokens.py); anything else is refused (401) and never reaches Prefect. No header and
no peer address is believed: `X-Forwarded-Email`, `X-Forwarded-For` and the like are dropped, and uvicorn does not
rewrite the peer from them (proxy_headers off). The token is not passed on: Prefect gets this proxy's own auth string
(PREFECT_API_AUTH_STRING) where it asks for one. A resume of a paused run (`POST /api/flow_runs/{id}/resume`, what
the UI's Resume form and `llmops approve` send) is decided by the token's person (its `identity_claim`, `email` by
default, taken only where the token says `email_verified: true`; or `sub`), whatever `decided_by` the form says, and
attested with the operator's key (tasks/platform/attestation.py), which the worker's flow runs check.

Authenticated is not authorized (issue 74, finding 5): a decision is forwarded only for an approver, a person the
operator named (`--approver`) or whose token carries the operator's group claim (`--approver-claim groups=NAME`), and
the proxy refuses to start without either. Every other verified person may read (GET, and the Prefect API's POST
reads: `.../filter`, `/count`, `/paginate`, `/history`, `/api/ui/...`) and nothing else: no write of the shared
Prefect login's but a decision reaches Prefect through it (403 naming the call).
"""

from __future__ import annotations

import base64
import json
import re
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass

import httpx
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from tasks.platform.attestation import attest
from tasks.platform.signed_tokens import TokenRefused, TokenVerifier

RESUME = re.compile(r"^/api/flow_runs/([0-9a-fA-F-]{36})/resume$")
READS = re.compile(r"^/api/(ui/.*|.*/(filter|count|paginate|history))$")  # the Prefect API's reads sent as POST
# Hop-by-hop headers (RFC 9110 7.6.1) and what httpx sets itself: not passed on.
DROPPED = {"connection", "keep-alive", "proxy-connection", "te", "trailer", "transfer-encoding", "upgrade", "host"}
DROPPED |= {"content-length"}
METHODS = ["GET", "POST", "PUT", "PATCH", "DELETE", "HEAD", "OPTIONS"]


@dataclass(frozen=True)
class Approvers:
    """Who may decide: people by their identity claim, or whoever's token carries `claim` with `value` (a string
    equal to it, or a list holding it)."""

    people: frozenset[str] = frozenset()
    claim: str | None = None
    value: str | None = None

    def __bool__(self) -> bool:
        return bool(self.people) or self.claim is not None

    def admit(self, identity: str, claims: dict) -> bool:
        if identity in self.people:
            return True
        found = claims.get(self.claim) if self.claim else None
        return self.value is not None and (found == self.value or (isinstance(found, list) and self.value in found))


def proxy_app(
    upstream: str,
    key: bytes,
    verifier: TokenVerifier,
    approvers: Approvers,
    identity_claim: str = "email",
    auth_string: str | None = None,
) -> Starlette:
    if not approvers:
        raise ValueError("approval proxy: no approver named (--approver or --approver-claim)")
    client = httpx.AsyncClient(base_url=upstream.rstrip("/"), timeout=60)
    upstream_auth = {"authorization": f"Basic {base64.b64encode(auth_string.encode()).decode()}"} if auth_string else {}

    async def forward(request: Request) -> Response:
        who = identify(request.headers.get("authorization", ""), verifier, identity_claim)
        if isinstance(who, Response):
            return who
        identity, claims = who
        denied = authorize(request.method, request.url.path, identity, claims, approvers)
        if denied is not None:
            return denied
        body = await request.body()
        if request.method == "POST" and (resume := RESUME.match(request.url.path)):
            attested_body = attested_resume(body, resume[1], identity, key)
            if attested_body is None:
                return JSONResponse({"detail": "approval proxy: the body is not a resume request (JSON object)"}, 422)
            body = attested_body
        headers = {
            name: value
            for name, value in request.headers.items()
            if name.lower() not in DROPPED
            and name.lower() != "authorization"
            and not name.lower().startswith("x-forwarded-")
        } | upstream_auth
        answer = await client.request(
            request.method, request.url.path, params=request.query_params, content=body, headers=headers
        )
        response = Response(answer.content, answer.status_code)
        response.raw_headers += [  # each as it came (several set-cookie stay several); httpx decoded the body
            (name.encode("latin-1"), value.encode("latin-1"))
            for name, value in answer.headers.multi_items()
            if name.lower() not in DROPPED | {"content-encoding"}
        ]
        return response

    @asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        yield
        await client.aclose()

    return Starlette(routes=[Route("/{path:path}", forward, methods=METHODS)], lifespan=lifespan)


def identify(authorization: str, verifier: TokenVerifier, identity_claim: str) -> tuple[str, dict] | Response:
    """The person a verified ID token names, and its claims; a 401 saying why otherwise. An email names a person only
    where the token says the provider verified it."""
    scheme, _, token = authorization.partition(" ")
    if scheme.lower() != "bearer" or not token.strip():
        return JSONResponse({"detail": "approval proxy: no ID token: log in through the OIDC proxy"}, 401)
    try:
        claims = verifier.claims(token.strip())
    except TokenRefused as exc:
        return JSONResponse({"detail": f"approval proxy: invalid ID token: {exc}"}, 401)
    identity = claims.get(identity_claim)
    if not isinstance(identity, str) or not identity:
        return JSONResponse({"detail": f"approval proxy: the ID token names no {identity_claim}"}, 401)
    if identity_claim == "email" and claims.get("email_verified") is not True:
        return JSONResponse({"detail": "approval proxy: the ID token's email is not verified (email_verified)"}, 401)
    return identity, claims


def authorize(method: str, path: str, identity: str, claims: dict, approvers: Approvers) -> Response | None:
    """None where the call may go on: a read for anyone verified, a decision for an approver; a 403 naming it else."""
    if method == "POST" and RESUME.match(path):
        if approvers.admit(identity, claims):
            return None
        return JSONResponse({"detail": f"approval proxy: {identity} is not an approver of releases"}, 403)
    if method in ("GET", "HEAD", "OPTIONS") or (method == "POST" and READS.match(path)):
        return None
    return JSONResponse({"detail": f"approval proxy: forwards reads and decisions only, not {method} {path}"}, 403)


def attested_resume(body: bytes, flow_run_id: str, identity: str, key: bytes) -> bytes | None:
    """The resume request with `decided_by` set to the authenticated identity and its attestation; None where the
    body is not a JSON object whose run_input (if any) is one."""
    try:
        request = json.loads(body or b"{}")
    except ValueError:
        return None
    if not isinstance(request, dict) or not isinstance(request.get("run_input") or {}, dict):
        return None
    run_input = dict(request.get("run_input") or {})
    run_input["decided_by"] = identity
    run_input["proxy_attestation"] = attest(key, flow_run_id, run_input)
    return json.dumps({**request, "run_input": run_input}).encode()
