"""The approval proxy without a Prefect server: who it believes, what it writes into a resume, and what the approve
step accepts with a trusted proxy configured (the real Prefect path is tests/integration/test_approval.py)."""

import json

import pytest
from starlette.testclient import TestClient

from flows.approval_proxy import Approvers, attested_resume, authorize, proxy_app
from tasks.approve import ApprovalInput, DecisionPolicy, check_decision
from tasks.platform.attestation import KEY_FILE_ENV, attested, configured_key, read_key
from tasks.platform.errors import BadInput
from tasks.platform.signatures import SignatureRefused
from tests.profile_files import cpu_tiny_file

KEY = b"k" * 32
RUN = "0f1c2d3e-0000-4000-8000-000000000001"
SUBJECT = {"kind": "release", "model": "m", "candidate_version": "2", "artifact_sha256": "a" * 64}


def test_only_a_verified_id_token_reaches_prefect_and_no_forwarded_header_is_believed(tmp_path):
    """Issue 61, finding 4: the proxy believed X-Forwarded-Email from a peer address, and uvicorn rewrites addresses
    from X-Forwarded-For. Now every request needs an OIDC ID token that verifies (the provider's keys from a JWKS
    file here); forged headers are dropped, and a refused request never reaches Prefect (port 9: nothing there)."""
    from cryptography.hazmat.primitives.asymmetric import rsa

    from tasks.platform.config.auth import JwtAuth
    from tasks.platform.signed_tokens import TokenVerifier
    from tests.unit.test_tokens import AUDIENCE, ISSUER, token

    signing = rsa.generate_private_key(public_exponent=65537, key_size=2048)
    jwks = tmp_path / "jwks.json"
    public = jwt_algorithms()["RS256"].to_jwk(signing.public_key(), as_dict=True)
    jwks.write_text(json.dumps({"keys": [{**public, "kid": "key-1", "alg": "RS256"}]}))
    verifier = TokenVerifier(JwtAuth(jwks=str(jwks), issuer=ISSUER, audience=AUDIENCE))
    forged = {"X-Forwarded-Email": "alice@example.com", "X-Forwarded-For": "127.0.0.1"}
    with TestClient(proxy_app("http://127.0.0.1:9", KEY, verifier, APPROVERS)) as client:
        resume = f"/api/flow_runs/{RUN}/resume"
        no_token = client.post(resume, json={"run_input": {}}, headers=forged)
        assert no_token.status_code == 401 and "no ID token" in no_token.json()["detail"]
        wrong_audience = token(signing, aud="another-client", email="alice@example.com")
        refused = client.post(resume, json={}, headers={**forged, "Authorization": f"Bearer {wrong_audience}"})
        assert refused.status_code == 401 and "not for this service" in refused.json()["detail"]
        no_email = token(signing)
        nameless = client.get("/api/health", headers={"Authorization": f"Bearer {no_email}"})
        assert nameless.status_code == 401 and "names no email" in nameless.json()["detail"]
        valid = token(signing, email="alice@example.com", email_verified=True)
        not_json = client.post(resume, content=b"[1]", headers={"Authorization": f"Bearer {valid}"})
        assert not_json.status_code == 422


APPROVERS = Approvers(frozenset({"alice@example.com"}), "groups", "release-managers")


def test_authenticated_is_not_authorized_only_an_approver_decides_and_no_other_write_passes(tmp_path):
    """Issue 74, finding 5: any valid ID token of the audience approved, its `email` was taken unverified, and every
    Prefect API call went on with the shared login's powers. Now a decision needs an approver (named, or by the
    group claim), an email needs email_verified, and a verified person who is no approver reads and writes nothing;
    every refusal is answered here (port 9: nothing there to reach). The proxy will not start without approvers."""
    from cryptography.hazmat.primitives.asymmetric import rsa

    from tasks.platform.config.auth import JwtAuth
    from tasks.platform.signed_tokens import TokenVerifier
    from tests.unit.test_tokens import AUDIENCE, ISSUER, token

    signing = rsa.generate_private_key(public_exponent=65537, key_size=2048)
    jwks = tmp_path / "jwks.json"
    public = jwt_algorithms()["RS256"].to_jwk(signing.public_key(), as_dict=True)
    jwks.write_text(json.dumps({"keys": [{**public, "kid": "key-1", "alg": "RS256"}]}))
    verifier = TokenVerifier(JwtAuth(jwks=str(jwks), issuer=ISSUER, audience=AUDIENCE))
    with pytest.raises(ValueError, match="no approver named"):
        proxy_app("http://127.0.0.1:9", KEY, verifier, Approvers())

    def bearer(**claims) -> dict:
        return {"Authorization": f"Bearer {token(signing, **claims)}"}

    resume, decision = f"/api/flow_runs/{RUN}/resume", {"run_input": {"decision": "approve", "reason": "ok"}}
    with TestClient(proxy_app("http://127.0.0.1:9", KEY, verifier, APPROVERS)) as client:
        unverified = client.post(resume, json=decision, headers=bearer(email="alice@example.com"))
        assert unverified.status_code == 401 and "not verified (email_verified)" in unverified.json()["detail"]
        stranger = client.post(resume, json=decision, headers=bearer(email="eve@example.com", email_verified=True))
        assert stranger.status_code == 403 and stranger.json()["detail"] == (
            "approval proxy: eve@example.com is not an approver of releases"
        )
        for method, path in (("POST", "/api/deployments/"), ("DELETE", f"/api/flow_runs/{RUN}"), ("PATCH", "/api/x")):
            write = client.request(
                method, path, json={}, headers=bearer(email="alice@example.com", email_verified=True)
            )
            assert write.status_code == 403 and "forwards reads and decisions only" in write.json()["detail"], path
    # the approvers' calls do go on (to the upstream, absent here: the refusal is another's)
    assert APPROVERS.admit("alice@example.com", {}) and APPROVERS.admit("bob", {"groups": ["release-managers"]})
    assert not APPROVERS.admit("bob", {"groups": ["everyone"]}) and not APPROVERS.admit("bob", {})
    assert authorize("POST", "/api/flow_runs/filter", "eve", {}, APPROVERS) is None  # a read, sent as POST
    assert authorize("GET", f"/api/flow_runs/{RUN}", "eve", {}, APPROVERS) is None
    assert authorize("POST", resume, "bob", {"groups": "release-managers"}, APPROVERS) is None


def test_the_proxy_refuses_to_start_without_approvers(tmp_path):
    from flows.cli.approval import named_approvers

    with pytest.raises(BadInput, match=r"name who may decide releases: --approver PERSON .* or --approver-claim"):
        named_approvers([], None)
    with pytest.raises(BadInput, match=r"--approver-claim groups: expected CLAIM=VALUE"):
        named_approvers([], "groups")
    assert named_approvers(["a@x"], "groups=r") == Approvers(frozenset({"a@x"}), "groups", "r")


def jwt_algorithms():
    import jwt

    return jwt.algorithms.get_default_algorithms()


def test_a_resume_through_the_proxy_is_decided_by_the_logged_in_person_and_attested():
    decided = {"decision": "approve", "reason": "fine", "decided_by": "mallory", "artifact_sha256": "a" * 64}
    body = json.dumps({"run_input": decided}).encode()
    run_input = json.loads(attested_resume(body, RUN, "alice@example.com", KEY) or b"")["run_input"]
    assert run_input["decided_by"] == "alice@example.com"
    assert attested(KEY, RUN, run_input, run_input["proxy_attestation"])
    assert not attested(KEY, RUN, {**run_input, "reason": "other"}, run_input["proxy_attestation"])
    assert not attested(KEY, RUN.replace("1", "2"), run_input, run_input["proxy_attestation"])  # another run
    assert not attested(b"x" * 32, RUN, run_input, run_input["proxy_attestation"])
    other_artifact = {**run_input, "artifact_sha256": "b" * 64}  # the attestation binds the artifact decided on
    assert not attested(KEY, RUN, other_artifact, run_input["proxy_attestation"])
    assert attested_resume(b"not json", RUN, "alice", KEY) is None

    policy = DecisionPolicy(proxy_key=KEY, separate_duties=True, creator="carol@example.com")
    assert check_decision(ApprovalInput(**run_input), RUN, SUBJECT, policy) == ""
    with pytest.raises(SignatureRefused, match="did not come through the trusted proxy"):
        check_decision(ApprovalInput(**{**run_input, "proxy_attestation": ""}), RUN, SUBJECT, policy)
    elsewhere = json.loads(
        attested_resume(json.dumps({"run_input": other_artifact}).encode(), RUN, "alice", KEY) or b""
    )
    with pytest.raises(SignatureRefused, match=r"is for artifact bbbbbbbbbbbb, not this run's aaaaaaaaaaaa"):
        check_decision(ApprovalInput(**elsewhere["run_input"]), RUN, SUBJECT, policy)
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


def test_bogus_decisions_never_veto_a_release_however_many_arrive(tmp_path, monkeypatch):
    """Issue 61, finding 5: after 20 refused decisions the run rejected, so anyone with the Prefect login could veto
    a release with 21 unattested resumes. Refused decisions never decide now: the 30th decision, attested by the
    proxy, approves."""
    from tasks import approve as stage
    from tasks.platform.attestation import attest

    monkeypatch.setattr(stage, "logger", lambda: __import__("logging").getLogger("test"))
    bogus = {"decision": "reject", "reason": "no", "decided_by": "mallory@example.com"}
    good = {"decision": "approve", "reason": "fine", "decided_by": "alice@example.com", "artifact_sha256": "a" * 64}
    answers = [stage.ApprovalInput(**bogus)] * 29 + [
        stage.ApprovalInput(**good, proxy_attestation=attest(KEY, RUN, good))
    ]
    keys: list[str] = []

    def wait_once(form, timeout_s, key, suspend):
        keys.append(key)
        return answers[len(keys) - 1]

    monkeypatch.setattr(stage, "wait_once", wait_once)
    policy = DecisionPolicy(proxy_key=KEY)
    approval = stage.wait_for_decision(tmp_path, RUN, "report", 3600, SUBJECT, policy)
    assert approval.approved and approval.decided_by == "alice@example.com" and len(keys) == 30
    assert keys[:2] == ["approval", "approval-2"]


def test_a_profile_that_asks_for_approval_refuses_to_start_without_a_way_to_verify_it(tmp_path, monkeypatch):
    """Issue 61, finding 5: the five GPU profiles asked for a person's approval (required) with no signers and no
    proxy, so anyone with the Prefect login could approve as anyone. The release now refuses before training."""
    from flows.release import release
    from tasks.approve import refuse_unverified_approval
    from tasks.platform.config import load_profile

    monkeypatch.delenv(KEY_FILE_ENV, raising=False)
    monkeypatch.setenv("LLMOPS_HOME", str(tmp_path / "home"))
    gate = load_profile("llama3-8b-h100-fp8").gate
    assert gate.approval == "required" and gate.allowed_signers is None
    with pytest.raises(BadInput, match=r"^gate.approval required: a decision must be verified: set gate.allowed_sig"):
        refuse_unverified_approval(gate)
    key = tmp_path / "proxy.key"
    key.write_text("k" * 64)
    monkeypatch.setenv(KEY_FILE_ENV, str(key))
    refuse_unverified_approval(gate)  # the approval proxy verifies
    monkeypatch.delenv(KEY_FILE_ENV)
    with pytest.raises(BadInput, match=r"gate.allowed_signers /nowhere/allowed_signers: not a readable file"):
        refuse_unverified_approval(gate.model_copy(update={"allowed_signers": "/nowhere/allowed_signers"}))
    required = cpu_tiny_file(tmp_path / "required.yaml", {"gate": {"approval": "required"}})
    with pytest.raises(BadInput, match="a decision must be verified"):
        release.fn(profile=str(required))
    assert not (tmp_path / "home" / "store").exists()  # nothing trained
