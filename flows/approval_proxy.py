"""`llmops approval-proxy`: the Prefect API behind an OIDC proxy, with the person it authenticated on every decision.

    browser / `llmops approve` -> oauth2-proxy (OIDC login) -> llmops approval-proxy -> Prefect server

Every request is passed on to Prefect as it came (its Prefect auth string included), but a resume of a paused run
(`POST /api/flow_runs/{id}/resume`, what the UI's Resume form and `llmops approve` send): there the identity header
the OIDC proxy sets (oauth2-proxy's `X-Forwarded-Email` with --pass-user-headers, its default) replaces whatever
`decided_by` the form says, and the decision is attested with the operator's key (tasks/platform/attestation.py),
which the worker's flow runs check. A resume without the header is refused (401) and never reaches Prefect.

The header is believed only from the peers named in `trusted` (the OIDC proxy's address; default loopback): anyone
else is refused (403), so listen where only the OIDC proxy reaches this service.
"""

from __future__ import annotations

import json
import re
from collections.abc import AsyncIterator, Iterable
from contextlib import asynccontextmanager

import httpx
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from tasks.platform.attestation import attest

RESUME = re.compile(r"^/api/flow_runs/([0-9a-fA-F-]{36})/resume$")
DEFAULT_IDENTITY_HEADER = "X-Forwarded-Email"
# Hop-by-hop headers (RFC 9110 7.6.1) and what httpx sets itself: not passed on.
DROPPED = {"connection", "keep-alive", "proxy-connection", "te", "trailer", "transfer-encoding", "upgrade", "host"}
DROPPED |= {"content-length"}
METHODS = ["GET", "POST", "PUT", "PATCH", "DELETE", "HEAD", "OPTIONS"]


def proxy_app(
    upstream: str,
    key: bytes,
    identity_header: str = DEFAULT_IDENTITY_HEADER,
    trusted: Iterable[str] = ("127.0.0.1", "::1"),
) -> Starlette:
    trusted_peers = frozenset(trusted)
    client = httpx.AsyncClient(base_url=upstream.rstrip("/"), timeout=60)

    async def forward(request: Request) -> Response:
        peer = request.client.host if request.client else ""
        if peer not in trusted_peers:
            return JSONResponse({"detail": f"approval proxy: {peer or 'unknown peer'} is not a trusted proxy"}, 403)
        body = await request.body()
        identity = request.headers.get(identity_header, "").strip()
        if request.method == "POST" and (resume := RESUME.match(request.url.path)):
            if not identity:
                return JSONResponse({"detail": f"approval proxy: no {identity_header}: log in through the proxy"}, 401)
            attested_body = attested_resume(body, resume[1], identity, key)
            if attested_body is None:
                return JSONResponse({"detail": "approval proxy: the body is not a resume request (JSON object)"}, 422)
            body = attested_body
        headers = {
            name: value
            for name, value in request.headers.items()
            if name.lower() not in DROPPED and name.lower() != identity_header.lower()
        }
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
