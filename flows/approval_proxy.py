"""`llmops approval-proxy`: the Prefect API behind an OIDC proxy, with the person it authenticated on every decision.

    browser / `llmops approve` -> oauth2-proxy (OIDC login) -> llmops approval-proxy -> Prefect server

Every request must carry the OIDC ID token the login proxy forwards (oauth2-proxy's `--pass-authorization-header`:
`Authorization: Bearer <ID token>`), verified here against the provider's published keys (issuer, audience, expiry,
signature: tasks/platform/signed_tokens.py); anything else is refused (401) and never reaches Prefect. No header and
no peer address is believed: `X-Forwarded-Email`, `X-Forwarded-For` and the like are dropped, and uvicorn does not
rewrite the peer from them (proxy_headers off). The token is not passed on: Prefect gets this proxy's own auth string
(PREFECT_API_AUTH_STRING) where it asks for one. A resume of a paused run (`POST /api/flow_runs/{id}/resume`, what
the UI's Resume form and `llmops approve` send) is decided by the token's person (its `identity_claim`, `email` by
default), whatever `decided_by` the form says, and attested with the operator's key (tasks/platform/attestation.py),
which the worker's flow runs check.
"""

from __future__ import annotations

import base64
import json
import re
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import httpx
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from tasks.platform.attestation import attest
from tasks.platform.signed_tokens import TokenRefused, TokenVerifier

RESUME = re.compile(r"^/api/flow_runs/([0-9a-fA-F-]{36})/resume$")
# Hop-by-hop headers (RFC 9110 7.6.1) and what httpx sets itself: not passed on.
DROPPED = {"connection", "keep-alive", "proxy-connection", "te", "trailer", "transfer-encoding", "upgrade", "host"}
DROPPED |= {"content-length"}
METHODS = ["GET", "POST", "PUT", "PATCH", "DELETE", "HEAD", "OPTIONS"]


def proxy_app(
    upstream: str, key: bytes, verifier: TokenVerifier, identity_claim: str = "email", auth_string: str | None = None
) -> Starlette:
    client = httpx.AsyncClient(base_url=upstream.rstrip("/"), timeout=60)
    upstream_auth = {"authorization": f"Basic {base64.b64encode(auth_string.encode()).decode()}"} if auth_string else {}

    async def forward(request: Request) -> Response:
        scheme, _, token = request.headers.get("authorization", "").partition(" ")
        if scheme.lower() != "bearer" or not token.strip():
            return JSONResponse({"detail": "approval proxy: no ID token: log in through the OIDC proxy"}, 401)
        try:
            identity = verifier.claims(token.strip()).get(identity_claim)
        except TokenRefused as exc:
            return JSONResponse({"detail": f"approval proxy: invalid ID token: {exc}"}, 401)
        if not isinstance(identity, str) or not identity:
            return JSONResponse({"detail": f"approval proxy: the ID token names no {identity_claim}"}, 401)
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
