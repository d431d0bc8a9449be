"""`llmops approve` / `llmops reject`: decide a release paused for approval (`gate.approval`), or a flywheel harvest
waiting for review (`flywheel.review`), as the Resume form on the run's page in the Prefect UI does; `llmops approve`
without a run lists the waiting ones."""

from __future__ import annotations

import argparse
import getpass
import os
import socket
import time
from pathlib import Path
from uuid import UUID

from flows.cli.common import prefect_api_env
from tasks.platform.decisions import auth_for, resume
from tasks.platform.errors import BadInput
from tasks.platform.project import llmops_home

EPILOG = """examples:
  llmops approve                                       # the releases of this home waiting for a decision
  llmops approve 0f1c...-flow-run-id --reason "answers read well; latency as v3"
  llmops reject 0f1c...-flow-run-id --reason "tone is off for support tickets" --by alice
  llmops approve 0f1c...-flow-run-id --reason "read it" --by alice@example.com --key ~/.ssh/id_ed25519
The run's id is in its log line `approval: ... waits ...` and on its page in the Prefect UI. Where the profile names
gate.allowed_signers, a decision counts only signed (--key) by a principal (--by) that file lists for your key."""


def register(commands) -> None:
    for decision, help_text in (
        ("approve", "approve a release (it rolls out) or a harvest (it is pushed) waiting for a person's decision"),
        ("reject", "reject a release (it rolls back) or a harvest (it is deleted) waiting for a person's decision"),
    ):
        parser = commands.add_parser(
            decision,
            help=help_text,
            description=f"{help_text.capitalize()} (profile settings gate.approval, flywheel.review).",
            epilog=EPILOG,
            formatter_class=argparse.RawDescriptionHelpFormatter,
        )
        parser.add_argument("flow_run_id", nargs="?" if decision == "approve" else None, help="the paused run's id")
        parser.add_argument("--reason", required=decision == "reject", help="why, for the record (MLflow, registry)")
        parser.add_argument(
            "--by", help="who decides: the principal your key is listed for (default: LLMOPS_PRINCIPAL, else USER@HOST)"
        )
        parser.add_argument(
            "--key",
            help="your SSH key (a private key file, or a public key an ssh-agent holds) to sign the decision with; "
            "needed where the profile names gate.allowed_signers (default: LLMOPS_APPROVAL_KEY)",
        )
        parser.set_defaults(handler=command_decide, decision=decision)
    register_proxy(commands)


PROXY_EPILOG = """examples:
  llmops approval-proxy --upstream http://127.0.0.1:4200 --port 4300 --key-file /etc/llmops/approval-proxy.key \\
      --oidc-jwks https://login.example.com/.well-known/jwks.json --oidc-issuer https://login.example.com \\
      --oidc-audience llmops-approvals --approver-claim groups=release-managers
  # who may decide: --approver alice@example.com (repeatable) or --approver-claim; anyone else verified only reads
  # oauth2-proxy in front: --upstream=http://127.0.0.1:4300/ --pass-authorization-header (the ID token goes on as
  #   Authorization: Bearer, and is verified here; no X-Forwarded-* header is believed)
  # the worker's environment: LLMOPS_APPROVAL_PROXY_KEY_FILE=/etc/llmops/approval-proxy.key (the same key)
A run then counts a decision only when it came through this proxy, as the person whose ID token verified."""


def register_proxy(commands) -> None:
    from tasks.platform.attestation import KEY_FILE_ENV

    parser = commands.add_parser(
        "approval-proxy",
        help="serve the Prefect API behind an OIDC proxy, recording the person it logged in on every decision",
        description="Pass every request that carries a valid OIDC ID token on to the Prefect server; on a resume of "
        "a paused run (an approval), set decided_by to the token's person and attest the decision with the key the "
        f"worker's flow runs check ({KEY_FILE_ENV}).",
        epilog=PROXY_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--upstream", required=True, help="the Prefect server's URL (without /api)")
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    parser.add_argument("--port", type=int, default=4300, help="port to listen on (default 4300)")
    parser.add_argument("--oidc-jwks", required=True, help="the OIDC provider's signing keys: a JWKS URL or file")
    parser.add_argument("--oidc-issuer", required=True, help="the `iss` every ID token must carry")
    parser.add_argument("--oidc-audience", required=True, help="the `aud` every ID token must name (this client)")
    parser.add_argument(
        "--identity-claim",
        default="email",
        help="the ID token's claim that names the person (default email, taken only with email_verified true; or sub)",
    )
    parser.add_argument(
        "--approver",
        action="append",
        default=[],
        metavar="PERSON",
        help="a person who may decide releases, as the identity claim names them (repeatable)",
    )
    parser.add_argument(
        "--approver-claim",
        metavar="CLAIM=VALUE",
        help="whoever's ID token carries CLAIM with VALUE (a string, or a list holding it) may decide: groups=releases",
    )
    parser.add_argument("--key-file", help=f"the attestation key, at least 32 bytes (default: {KEY_FILE_ENV})")
    parser.set_defaults(handler=command_proxy)


def command_proxy(args) -> None:
    import uvicorn
    from pydantic import ValidationError

    from flows.approval_proxy import proxy_app
    from tasks.platform.attestation import KEY_FILE_ENV, read_key
    from tasks.platform.config.auth import JwtAuth
    from tasks.platform.signed_tokens import TokenVerifier

    try:
        oidc = JwtAuth(jwks=args.oidc_jwks, issuer=args.oidc_issuer, audience=args.oidc_audience)
    except ValidationError as exc:
        raise BadInput(f"llmops approval-proxy: --oidc-jwks {args.oidc_jwks}: {exc.errors()[0]['msg']}") from None
    path = args.key_file or os.environ.get(KEY_FILE_ENV)
    if not path:
        raise BadInput(f"llmops approval-proxy: --key-file (or {KEY_FILE_ENV}) is required")
    key = read_key(Path(path))
    approvers = named_approvers(args.approver, args.approver_claim)
    verifier = TokenVerifier(oidc)
    auth_string = os.environ.get("PREFECT_API_AUTH_STRING")
    app = proxy_app(args.upstream, key, verifier, approvers, args.identity_claim, auth_string)
    # proxy_headers off: the peer is never rewritten from X-Forwarded-For (uvicorn's default believes loopback's)
    uvicorn.run(app, host=args.host, port=args.port, log_level="warning", proxy_headers=False)


def named_approvers(people: list[str], claim: str | None):
    """Who may decide through the proxy; BadInput where nobody is named (any person the provider knows would be)."""
    from flows.approval_proxy import Approvers

    name, _, value = (claim or "").partition("=")
    if claim is not None and not (name.strip() and value.strip()):
        raise BadInput(f"llmops approval-proxy: --approver-claim {claim}: expected CLAIM=VALUE, e.g. groups=releases")
    approvers = Approvers(frozenset(p for p in people if p), name.strip() or None, value.strip() or None)
    if not approvers:
        raise BadInput(
            "llmops approval-proxy: name who may decide releases: --approver PERSON (repeatable) or --approver-claim "
            "CLAIM=VALUE; without one every person the OIDC provider knows could approve"
        )
    return approvers


def command_decide(args) -> str:
    home = llmops_home()
    if args.flow_run_id is None:
        return waiting_list(home)
    try:
        UUID(args.flow_run_id)
    except ValueError:
        raise BadInput(f"flow run id {args.flow_run_id!r}: not a Prefect flow run id (a UUID)") from None
    if not args.reason:
        raise BadInput(f"llmops {args.decision}: --reason is required (it is recorded with the decision)")
    api_url = api_for(home, args.flow_run_id)
    decided_by = args.by or os.environ.get("LLMOPS_PRINCIPAL") or f"{getpass.getuser()}@{socket.gethostname()}"
    decision = {"decision": args.decision, "reason": args.reason, "decided_by": decided_by}
    decision |= signed(home, args, decided_by)
    resume(api_url, auth_for(home, api_url), args.flow_run_id, decision)
    verified = " (signed: the run verifies it and logs a refusal)" if "signature" in decision else ""
    return f"{args.decision}d run {args.flow_run_id} as {decided_by}{verified}; it goes on now"


def signed(home: Path, args, principal: str) -> dict[str, str]:
    """The statement and its signature, where a key is given; refused where the waiting run asks for one and none
    is, or where this home does not hold the run's record (what it decides on: model, version, artifact)."""
    from tasks.approve import statement_of
    from tasks.platform.decisions import pending_folder, waiting_record
    from tasks.platform.signatures import sign, statement_text

    record = waiting_record(pending_folder(home) / f"{args.flow_run_id}.json")
    key = args.key or os.environ.get("LLMOPS_APPROVAL_KEY")
    if key is None:
        if record and record.get("signed"):
            raise BadInput(
                f"flow run {args.flow_run_id}: the profile names gate.allowed_signers, so the decision must be signed: "
                "--key YOUR_SSH_KEY (or LLMOPS_APPROVAL_KEY)"
            )
        return {}
    if record is None:
        raise BadInput(
            f"flow run {args.flow_run_id}: no release or harvest of {home} waits under this id, so there is nothing to "
            "bind a signature to; sign where its LLMOPS_HOME is (`llmops approve` lists what waits)"
        )
    statement = statement_of(args.flow_run_id, record, args.decision, args.reason, principal)
    return {"statement": statement_text(statement), "signature": sign(statement, Path(key).expanduser())}


def waiting_list(home: Path) -> str:
    from tasks.platform.decisions import waiting_records

    lines = []
    for waiting in waiting_records(home):
        since = time.strftime("%Y-%m-%d %H:%M", time.localtime(waiting.get("waiting_since", 0)))
        mlflow_run = f", MLflow run {waiting['mlflow_run_id']}" if waiting.get("mlflow_run_id") else ""
        what = (
            f"harvest of {waiting.get('model', '?')}: {waiting.get('records', '?')} records in {waiting.get('dataset')}"
            if waiting.get("kind") == "harvest"
            else f"{waiting.get('model', '?')} v{waiting.get('candidate_version', '?')}"
        )
        if waiting.get("artifact_sha256"):
            what += f" (artifact sha256 {waiting['artifact_sha256'][:12]}{', signed decisions only' if waiting.get('signed') else ''})"
        lines.append(f"{waiting['flow_run_id']}  {what}  (waiting since {since}{mlflow_run})")
    return "\n".join(lines) or f"no release of {home} waits for approval"


def api_for(home: Path, flow_run_id: str) -> str:
    """The Prefect API holding the run: the one it wrote down while waiting, else PREFECT_API_URL or the stack's."""
    from tasks.platform.decisions import pending_folder, waiting_record

    recorded = waiting_record(pending_folder(home) / f"{flow_run_id}.json")
    if recorded and recorded.get("api_url"):
        return recorded["api_url"]
    try:
        os.environ.update(prefect_api_env())
    except BadInput as exc:
        raise BadInput(
            f"flow run {flow_run_id}: no release of {home} waits for approval under this id (`llmops approve` lists "
            f"them), and no Prefect API to ask ({exc}; or set PREFECT_API_URL)"
        ) from None
    return os.environ["PREFECT_API_URL"]
