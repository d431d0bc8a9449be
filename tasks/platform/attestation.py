"""A trusted proxy's word on who decided a paused run.

Prefect OSS 3.7.2 passes no request header to a paused flow: its resume endpoint validates the JSON `run_input` and
stores it as the run's input, and nothing else (prefect/server/api/flow_runs.py:383-530; the input record has a
`sender` field, prefect/server/schemas/core.py:1327, that resume never sets, :513-520), and the only request headers
it records as provenance are an automation's (`get_created_by`, prefect/server/api/dependencies.py:134-153). So an
OIDC proxy's identity header cannot reach the approve step through Prefect. `llmops approval-proxy`
(flows/approval_proxy.py) stands between the OIDC proxy and Prefect's API instead: on a resume it writes the
identity header into the decision and signs {run, decision, reason, decided_by} with a key the operator gives both
it and the worker; the flow counts only decisions with a valid attestation when that key is configured.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import os
from collections.abc import Mapping
from pathlib import Path

from tasks.platform.errors import BadInput

KEY_FILE_ENV = "LLMOPS_APPROVAL_PROXY_KEY_FILE"  # operator-written: the worker's and the proxy's environment
MIN_KEY_BYTES = 32


def read_key(path: Path) -> bytes:
    try:
        key = path.read_bytes().strip()
    except OSError as exc:
        raise BadInput(f"approval proxy key file {path}: unreadable ({exc.strerror})") from None
    if len(key) < MIN_KEY_BYTES:
        raise BadInput(
            f"approval proxy key file {path}: {len(key)} bytes, at least {MIN_KEY_BYTES} (`openssl rand -hex 32`)"
        )
    return key


def configured_key() -> bytes | None:
    """The key of the trusted proxy where the operator configured one (KEY_FILE_ENV), else None."""
    path = os.environ.get(KEY_FILE_ENV)
    return read_key(Path(path)) if path else None


def attested_fields(flow_run_id: str, decision: Mapping) -> bytes:
    named = ("decision", "reason", "decided_by", "artifact_sha256")  # the artifact decided on: one digest, not another
    fields = {"run": flow_run_id, **{k: str(decision.get(k, "")) for k in named}}
    return json.dumps(fields, sort_keys=True, separators=(",", ":")).encode()


def attest(key: bytes, flow_run_id: str, decision: Mapping) -> str:
    return hmac.new(key, attested_fields(flow_run_id, decision), hashlib.sha256).hexdigest()


def attested(key: bytes, flow_run_id: str, decision: Mapping, token: str) -> bool:
    return hmac.compare_digest(attest(key, flow_run_id, decision), token)
