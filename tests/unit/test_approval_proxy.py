"""The approval proxy without a Prefect server: who it believes, what it writes into a resume, and what the approve
step accepts with a trusted proxy configured (the real Prefect path is tests/integration/test_approval.py)."""

import json

import pytest
from starlette.testclient import TestClient

from flows.approval_proxy import attested_resume, proxy_app
from tasks.approve import ApprovalInput, DecisionPolicy, check_decision
from tasks.platform.attestation import KEY_FILE_ENV, attested, configured_key, read_key
from tasks.platform.errors import BadInput
from tasks.platform.signatures import SignatureRefused

KEY = b"k" * 32
RUN = "0f1c2d3e-0000-4000-8000-000000000001"
SUBJECT = {"kind": "release", "model": "m", "candidate_version": "2", "artifact_sha256": "a" * 64}


def test_only_a_trusted_peer_reaches_prefect_through_the_proxy():
    # Starlette's test client connects as peer "testclient": not a trusted proxy, so refused before any upstream call
    app = proxy_app("http://127.0.0.1:9", KEY)
    with TestClient(app) as client:
        refused = client.post(f"/api/flow_runs/{RUN}/resume", json={}, headers={"X-Forwarded-Email": "a@example.com"})
    assert refused.status_code == 403
    assert refused.json() == {"detail": "approval proxy: testclient is not a trusted proxy"}
    with TestClient(proxy_app("http://127.0.0.1:9", KEY, trusted=["testclient"])) as client:
        no_identity = client.post(f"/api/flow_runs/{RUN}/resume", json={"run_input": {}})
        not_json = client.post(f"/api/flow_runs/{RUN}/resume", content=b"[1]", headers={"X-Forwarded-Email": "a@x"})
    assert no_identity.status_code == 401 and not_json.status_code == 422


def test_a_resume_through_the_proxy_is_decided_by_the_logged_in_person_and_attested():
    body = json.dumps({"run_input": {"decision": "approve", "reason": "fine", "decided_by": "mallory"}}).encode()
    run_input = json.loads(attested_resume(body, RUN, "alice@example.com", KEY) or b"")["run_input"]
    assert run_input["decided_by"] == "alice@example.com"
    assert attested(KEY, RUN, run_input, run_input["proxy_attestation"])
    assert not attested(KEY, RUN, {**run_input, "reason": "other"}, run_input["proxy_attestation"])
    assert not attested(KEY, RUN.replace("1", "2"), run_input, run_input["proxy_attestation"])  # another run
    assert not attested(b"x" * 32, RUN, run_input, run_input["proxy_attestation"])
    assert attested_resume(b"not json", RUN, "alice", KEY) is None

    policy = DecisionPolicy(proxy_key=KEY, separate_duties=True, creator="carol@example.com")
    assert check_decision(ApprovalInput(**run_input), RUN, SUBJECT, policy) == ""
    with pytest.raises(SignatureRefused, match="did not come through the trusted proxy"):
        check_decision(ApprovalInput(**{**run_input, "proxy_attestation": ""}), RUN, SUBJECT, policy)
    by_creator = json.loads(attested_resume(body, RUN, "carol@example.com", KEY) or b"")["run_input"]
    with pytest.raises(SignatureRefused, match="carol@example.com started this run and may not decide it"):
        check_decision(ApprovalInput(**by_creator), RUN, SUBJECT, policy)
    # without a trusted proxy configured, decisions count as before
    assert (
        check_decision(
            ApprovalInput(**{**run_input, "proxy_attestation": ""}), RUN, SUBJECT, DecisionPolicy(proxy_key=None)
        )
        == ""
    )


def test_the_proxy_key_is_the_operators_file(tmp_path, monkeypatch):
    monkeypatch.delenv(KEY_FILE_ENV, raising=False)
    assert configured_key() is None and DecisionPolicy().proxy_key is None
    short = tmp_path / "short.key"
    short.write_text("abc\n")
    with pytest.raises(BadInput, match=f"approval proxy key file {short}: 3 bytes, at least 32"):
        read_key(short)
    with pytest.raises(BadInput, match="unreadable"):
        read_key(tmp_path / "missing.key")
    good = tmp_path / "good.key"
    good.write_text("f" * 64 + "\n")
    monkeypatch.setenv(KEY_FILE_ENV, str(good))
    assert DecisionPolicy().proxy_key == b"f" * 64
