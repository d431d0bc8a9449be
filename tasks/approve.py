"""approve: a person's promote-or-reject after the automatic gate passed (`gate.approval: required`).

The flow pauses with Prefect's own human-in-the-loop input (`pause_flow_run(wait_for_input=...)`): the run's page
in the Prefect UI shows the gate report above a form (approve or reject, a reason, a name), and `llmops approve`
and `llmops reject` resume it from a terminal or a CI job with the same values. No decision within
`gate.approval_timeout_s` rejects. While the run waits, the champion serves all traffic and the candidate stays
loaded at 0%; the release owns the service, waiting for approval (tasks/serving/ownership.py), so other releases of
the model fail at once naming it.

Pause or suspend (`wait_for_decision(suspend=...)`): a pause keeps the waiting process; a suspension
(`suspend_flow_run`, for a run of a Prefect deployment) ends it, and the decision starts the run again from its
deployment in a new process, which replays the run up to here (its stages are cache hits) and, asking for the same
pause key, gets the decision Prefect stored. What the waiting run needs then lives in the Prefect server's database
(the Suspended state, its pause keys and the input) and in the pending record, none of it in a process: a restart
of the Prefect server or of the worker during the wait loses nothing. Prefect suspends no subflow
(prefect/server/orchestration/core_policy.py:1386-1391 at 3.7.2): the retrain flow starts its release as a
top-level run of the release deployment (flows/retrain.py).

With `gate.allowed_signers` a decision is an authorization, not a record: it counts only with a statement
{run, kind, model, version, artifact_sha256, decision, reason, principal} signed by the principal's SSH key
(`llmops approve --key`, tasks/platform/signatures.py), listed for that principal in the allowed-signers file the
operator's profile names, and bound to this run and the artifact it decides; with `gate.separate_duties` the
principal who started the run may not decide it. A decision that fails any of this is refused (logged) and the
run goes on waiting for a valid one until its timeout.

With a trusted proxy (the operator's LLMOPS_APPROVAL_PROXY_KEY_FILE in the worker's environment) a decision counts
only when `llmops approval-proxy` attests it: the proxy, behind an OIDC proxy such as oauth2-proxy, writes the
person its identity header names into `decided_by` and signs the decision with that key (tasks/platform/attestation.py
says why Prefect itself cannot hand the flow a request header). A resume sent to Prefect past the proxy is refused.
"""

from __future__ import annotations

import itertools
import json
import os
import time
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Literal

from prefect.input import RunInput
from pydantic import Field

from tasks.platform.attestation import KEY_FILE_ENV, attested, configured_key
from tasks.platform.decisions import (
    EXPIRY_GRACE_S,
    TIMED_OUT,
    pending_folder,
    waiting_record,
)
from tasks.platform.errors import BadInput
from tasks.platform.stage_cache import RunContext, logger
from tasks.quality.checks import GateReport
from tasks.reporting.evidence import REPORT_FILE, release_folder

APPROVAL_KEY = "approval"  # the pause's key: one approval per release run
POLL_S = 2  # how often the paused run asks the API whether it was resumed (Prefect's default is 10 s)


class ApprovalInput(RunInput):
    """The form the Prefect UI shows on the paused run, and what `llmops approve|reject` send."""

    decision: Literal["approve", "reject"] = Field(description="approve: roll the candidate out; reject: roll back")
    reason: str = Field(min_length=1, max_length=2000, description="Why, for the record (MLflow and the registry).")
    decided_by: str = Field(min_length=1, max_length=200, description="Who decides (the signing principal).")
    statement: str = Field(
        "",
        max_length=10_000,
        description="With gate.allowed_signers: the signed statement (`llmops approve` sends it).",
    )
    signature: str = Field("", max_length=10_000, description="Its SSH signature (`ssh-keygen -Y sign`).")
    proxy_attestation: str = Field(
        "", max_length=200, description="Set by `llmops approval-proxy` (a trusted OIDC proxy): leave it empty."
    )
    artifact_sha256: str = Field(
        "",
        max_length=64,
        description="The sha256 of the artifact this decides on (filled in): behind the approval proxy, a decision "
        "attested for another artifact does not count.",
    )


@dataclass
class Approval:
    approved: bool
    decided_by: str
    reason: str
    decided_at: float  # unix time
    waited_s: float
    timed_out: bool = False
    verified_key: str = ""  # the signing key's fingerprint where the decision was verified
    statement: str = ""
    signature: str = ""
    proxy_attested: bool = False  # decided_by is the identity the trusted proxy authenticated

    def summary(self) -> str:
        return f"{'approved' if self.approved else 'rejected'} by {self.decided_by}: {self.reason}"


@dataclass(frozen=True)
class DecisionPolicy:
    """Who may decide a run: signers of the operator's allowed-signers file, and not its creator where duties are
    separate (gate.allowed_signers, gate.separate_duties); where the operator configured a trusted proxy (its key in
    the environment that runs the flow), only people that proxy authenticated."""

    allowed_signers: Path | None = None
    separate_duties: bool = False
    creator: str = ""
    proxy_key: bytes | None = field(default_factory=configured_key, repr=False)

    @classmethod
    def of(cls, gate, creator: str) -> DecisionPolicy:
        signers = Path(gate.allowed_signers) if gate.allowed_signers else None
        return cls(signers, gate.separate_duties, creator)


def refuse_unverified_approval(gate) -> None:
    """A profile file that asks for a person's approval (gate.approval required) gets a verified one: signed decisions
    (gate.allowed_signers, a file the worker reads) or the approval proxy's attested ones (its key in this process's
    environment). Otherwise anyone with the Prefect login could approve as anyone, and the release refuses to start."""
    if gate.allowed_signers is not None:
        if not os.access(gate.allowed_signers, os.R_OK):
            raise BadInput(f"gate.allowed_signers {gate.allowed_signers}: not a readable file (ssh-keygen's format)")
        return
    if configured_key() is None:
        raise BadInput(
            "gate.approval required: a decision must be verified: set gate.allowed_signers (signed decisions) in the "
            f"profile file, or {KEY_FILE_ENV} (the approval proxy's key) in the worker's environment "
            "(docs/user-guide.md#a-person-approves-the-release)"
        )


def statement_of(flow_run_id: str, subject: dict, decision: str, reason: str, principal: str) -> dict[str, str]:
    """What a decision signs: this run, what it decides on (model, version, artifact sha256), the decision, why and
    who. `subject` is the waiting run's record (wait_for_decision)."""
    return {
        "run": flow_run_id,
        "kind": str(subject.get("kind", "release")),
        "model": str(subject.get("model", "")),
        "version": str(subject.get("candidate_version", "")),
        "artifact_sha256": str(subject.get("artifact_sha256", "")),
        "decision": decision,
        "reason": reason,
        "principal": principal,
    }


def check_decision(answer: ApprovalInput, flow_run_id: str, subject: dict, policy: DecisionPolicy) -> str:
    """The signing key's fingerprint of a decision the policy accepts ("" where none is required);
    SignatureRefused naming why otherwise."""
    from tasks.platform.signatures import SignatureRefused, verify

    if policy.proxy_key is not None:
        artifact = str(subject.get("artifact_sha256", ""))
        if answer.artifact_sha256 != artifact:
            raise SignatureRefused(
                f"decision by {answer.decided_by!r} is for artifact {answer.artifact_sha256[:12] or 'none'}, not this "
                f"run's {artifact[:12]}"
            )
        if not attested(policy.proxy_key, flow_run_id, answer.model_dump(), answer.proxy_attestation):
            raise SignatureRefused(
                f"decision by {answer.decided_by!r} did not come through the trusted proxy ({KEY_FILE_ENV} is set): "
                "decide through `llmops approval-proxy`"
            )
        if policy.separate_duties and answer.decided_by == policy.creator:  # decided_by is authenticated here
            raise SignatureRefused(f"{answer.decided_by} started this run and may not decide it (gate.separate_duties)")
    if policy.allowed_signers is None:
        return ""
    if not answer.statement or not answer.signature:
        raise SignatureRefused(f"unsigned decision by {answer.decided_by!r}: gate.allowed_signers asks for a signature")
    try:
        signed = json.loads(answer.statement)
    except ValueError:
        raise SignatureRefused("the statement is not JSON") from None
    expected = statement_of(flow_run_id, subject, answer.decision, answer.reason, answer.decided_by)
    if signed != expected:
        differ = sorted(k for k in expected.keys() | signed.keys() if signed.get(k) != expected.get(k))
        raise SignatureRefused(f"the statement is bound to another {', '.join(differ)} than this decision of this run")
    key = verify(signed, answer.signature, answer.decided_by, policy.allowed_signers)
    if policy.separate_duties and answer.decided_by == policy.creator:
        raise SignatureRefused(f"{answer.decided_by} started this run and may not decide it (gate.separate_duties)")
    return key


def wait_for_decision(
    home: Path,
    flow_run_id: str,
    report_markdown: str,
    timeout_s: float,
    subject: dict,
    policy: DecisionPolicy | None = None,
    suspend: bool = False,
) -> Approval:
    """Pause the current flow run until a person decides as `policy` allows, or timeout_s passes (a rejection).
    A decision the policy refuses is logged and the run waits again (a new pause, with the time that is left).

    `suspend` (a run of a deployment): suspended instead, its process ends (Prefect's Pause propagates out of here
    and the flow engine exits). The decision starts the run again; this call, reached again in the new process,
    asks Prefect for the same keys in the same order and gets each decision it was given, so refused decisions are
    refused again and the first accepted one is returned. The waiting time counts from the first wait (the pending
    record's waiting_since); past timeout_s the Prefect server fails the suspended run (its pause expired) and no
    process is left to roll back: the candidate is at 0% already and the service's ownership lapses."""
    from prefect.exceptions import FlowPauseTimeout, Pause

    from tasks.platform.signatures import SignatureRefused

    policy = policy or DecisionPolicy()
    pending = pending_folder(home) / f"{flow_run_id}.json"
    pending.parent.mkdir(parents=True, exist_ok=True)
    earlier = waiting_record(pending) if suspend else None  # a suspended run started again by its decision
    waiting_since = float(earlier["waiting_since"]) if earlier and "waiting_since" in earlier else time.time()
    record = {"flow_run_id": flow_run_id, "api_url": os.environ.get("PREFECT_API_URL", ""), **subject}
    record["signed"] = policy.allowed_signers is not None
    record["suspended"] = suspend
    partial = pending.with_suffix(".partial")  # whole or absent for `llmops approve` (a rename is atomic)
    partial.write_text(json.dumps({**record, "waiting_since": waiting_since, "timeout_s": timeout_s}))
    partial.replace(pending)
    started = time.monotonic() - (time.time() - waiting_since)
    artifact = str(subject.get("artifact_sha256", ""))  # the form names it; a decision for another does not count
    suspended = False
    try:
        for attempt in itertools.count(1):  # refused decisions never decide (a cap would let bogus ones veto)
            left = timeout_s - (time.monotonic() - started)
            if left < 1 and not suspend:  # a suspended run's timeout is the Prefect server's (its pause expiration)
                raise FlowPauseTimeout()
            answer = wait_once(
                ApprovalInput.with_initial_data(description=report_markdown, artifact_sha256=artifact),
                max(1, round(left)) + (EXPIRY_GRACE_S if suspend else 0),
                APPROVAL_KEY if attempt == 1 else f"{APPROVAL_KEY}-{attempt}",
                suspend,
            )
            if answer.decided_by == TIMED_OUT and answer.decision == "reject":
                if time.time() - waiting_since >= timeout_s:
                    raise FlowPauseTimeout()
                logger().warning("approval: a timeout before the approval timeout was refused, still waiting")
                continue
            try:
                key = check_decision(answer, flow_run_id, subject, policy)
            except SignatureRefused as refused:
                logger().warning(f"approval: decision refused, still waiting: {refused}")
                continue
            return Approval(
                answer.decision == "approve",
                answer.decided_by,
                answer.reason,
                time.time(),
                time.monotonic() - started,
                verified_key=key,
                statement=answer.statement,
                signature=answer.signature,
                proxy_attested=policy.proxy_key is not None,
            )
        raise AssertionError("unreachable: the wait ends with a decision or the timeout")
    except FlowPauseTimeout:
        running_again(flow_run_id)
        reason = f"no decision within {timeout_s:g}s (gate.approval_timeout_s)"
        return Approval(False, "timeout", reason, time.time(), time.monotonic() - started, timed_out=True)
    except Pause:  # suspended: the run waits without a process, its record stays for `llmops approve`
        suspended = True
        raise
    finally:
        if not suspended:
            pending.unlink(missing_ok=True)


def wait_once(form: type[ApprovalInput], timeout_s: int, key: str, suspend: bool) -> ApprovalInput:
    """One wait for a decision under `key`. Suspended: Prefect proposes a Suspended state with this pause key
    (prefect/flow_runs.py:682-698 at 3.7.2); the first time the server accepts it, the form's schema is saved
    under keys derived from the pause key (flow_runs.py:684-687, 715-716) and Pause ends the process
    (flow_runs.py:720-722); a run resumed with an input is started again, the server rejects the same key as fired
    (prefect/server/orchestration/core_policy.py:1378-1383), the state stays Running and the stored input is loaded
    and returned (flow_runs.py:700-706)."""
    from prefect.flow_runs import pause_flow_run, suspend_flow_run

    if suspend:
        answer = suspend_flow_run(wait_for_input=form, timeout=timeout_s, key=key)
    else:
        answer = pause_flow_run(wait_for_input=form, timeout=timeout_s, poll_interval=POLL_S, key=key)
    assert answer is not None  # wait_for_input given: Prefect returns the input or raises
    return answer


def running_again(flow_run_id: str) -> None:
    """Prefect leaves a timed-out pause PAUSED and raises in the flow; this run goes on to roll back, so its
    state must be RUNNING again for its next tasks to run."""
    from prefect.client.orchestration import get_client
    from prefect.states import Running

    with get_client(sync_client=True) as client:
        client.set_flow_run_state(flow_run_id, Running(), force=True)


def approve(ctx: RunContext, report: GateReport, flow_run_id: str, suspend: bool = False) -> Approval:
    """The DAG's approve step: not a cached stage, a person decides every time. `suspend`: the run waits without a
    process (wait_for_decision)."""
    timeout_s = ctx.profile.gate.approval_timeout_s
    logger().info(
        f"approval: {report.model} v{report.candidate_version} passed the gate and waits up to {timeout_s:g}s for a "
        f"person: the Resume form on this run's page in the Prefect UI, or `llmops approve {flow_run_id} --reason "
        f"...` / `llmops reject {flow_run_id} --reason ...`"
    )
    subject = {
        "kind": "release",
        "model": report.model,
        "candidate_version": report.candidate_version,
        "artifact_sha256": report.served_artifact,
        "mlflow_run_id": ctx.tracker.run_id,
    }
    policy = DecisionPolicy.of(ctx.profile.gate, run_creator())
    page = release_folder(ctx.home, ctx.tracker.run_id) / REPORT_FILE
    read_first = (
        f"\nThe release report (answers side by side, latency distributions, shadow traffic): `{page}` on the "
        f"worker, and artifact `report/{REPORT_FILE}` of MLflow run {ctx.tracker.run_id}.\n"
    )
    approval = wait_for_decision(
        ctx.home, flow_run_id, report.markdown() + read_first, timeout_s, subject, policy, suspend
    )
    record(ctx, report, approval)
    logger().info(f"approval: {report.model} v{report.candidate_version} {approval.summary()}")
    return approval


def run_creator() -> str:
    """The principal who started this run, for gate.separate_duties: the Prefect API's record of who created the
    flow run where it keeps one (Prefect Cloud, or a server behind an authenticating proxy that sets it), else
    LLMOPS_PRINCIPAL of the process that runs it, else USER@HOST (`llmops run`)."""
    import getpass
    import socket

    from prefect import runtime

    creator = None
    try:
        from prefect.client.orchestration import get_client

        with get_client(sync_client=True) as client:
            created_by = client.read_flow_run(runtime.flow_run.id).created_by
        creator = created_by.display_value if created_by is not None else None
    except Exception:  # no API to ask (a unit test): the environment decides
        creator = None
    return creator or os.environ.get("LLMOPS_PRINCIPAL") or f"{getpass.getuser()}@{socket.gethostname()}"


def record(ctx: RunContext, report: GateReport, approval: Approval) -> None:
    """Who decided, when and why: tags of the MLflow run and of the registry version, and the version's description;
    a verified decision's signed statement and signature as the run's artifact approval.json."""
    decided = "approved" if approval.approved else "rejected"
    at = datetime.fromtimestamp(approval.decided_at, UTC).isoformat(timespec="seconds")
    tags = {"approval.decision": decided, "approval.by": approval.decided_by, "approval.reason": approval.reason}
    tags |= {"approval.at": at, "approval.verified": str(bool(approval.verified_key)).lower()}
    tags["approval.proxy_authenticated"] = str(approval.proxy_attested).lower()
    if approval.verified_key:
        tags["approval.key"] = approval.verified_key
        ctx.tracker.log_json(
            "approval.json", {"statement": json.loads(approval.statement), "signature": approval.signature}
        )
    ctx.tracker.set_tags(tags)
    ctx.tracker.log_metrics("approval", {"wait_s": approval.waited_s})
    client, name, version = ctx.tracker.client, report.model, report.candidate_version
    for key, value in tags.items():
        client.set_model_version_tag(name, version, key, value)
    description = f"{report.description()} Approval: {decided} by {approval.decided_by} at {at}: {approval.reason}"
    client.update_model_version(name, version, description=description)
