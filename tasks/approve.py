"""approve: a person's promote-or-reject after the automatic gate passed (`gate.approval: required`).

The flow pauses with Prefect's own human-in-the-loop input (`pause_flow_run(wait_for_input=...)`): the run's page
in the Prefect UI shows the gate report above a form (approve or reject, a reason, a name), and `llmops approve`
and `llmops reject` resume it from a terminal or a CI job with the same values. No decision within
`gate.approval_timeout_s` rejects. While the run waits, the champion serves all traffic and the candidate stays
loaded at 0%; the run keeps its worker and the serving lock, so other releases of the model wait their turn.

Pause, not suspend: a suspended run exits its process and starts again from its deployment, but this run's Triton
(when it started one), its loaded candidate and its serving lock live in that process.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Literal

from prefect.input import RunInput
from pydantic import Field

from tasks.platform.stage_cache import RunContext, logger
from tasks.quality.checks import GateReport

APPROVAL_KEY = "approval"  # the pause's key: one approval per release run
POLL_S = 2  # how often the paused run asks the API whether it was resumed (Prefect's default is 10 s)


class ApprovalInput(RunInput):
    """The form the Prefect UI shows on the paused run, and what `llmops approve|reject` send."""

    decision: Literal["approve", "reject"] = Field(description="approve: roll the candidate out; reject: roll back")
    reason: str = Field(min_length=1, max_length=2000, description="Why, for the record (MLflow and the registry).")
    decided_by: str = Field(min_length=1, max_length=200, description="Who decides.")


@dataclass
class Approval:
    approved: bool
    decided_by: str
    reason: str
    decided_at: float  # unix time
    waited_s: float
    timed_out: bool = False

    def summary(self) -> str:
        return f"{'approved' if self.approved else 'rejected'} by {self.decided_by}: {self.reason}"


def pending_folder(home: Path) -> Path:
    """Where a waiting run writes down which Prefect API holds it: a plain `llmops run` has a temporary one."""
    return home / "approvals"


def waiting_record(path: Path) -> dict | None:
    """A waiting run's record (flow_run_id, api_url, model, candidate_version, waiting_since, ...); None once the
    run was decided (the record is removed) or when it does not read."""
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def waiting_records(home: Path) -> list[dict]:
    """The records of this home's releases that wait for a decision, oldest name first."""
    return [r for p in sorted(pending_folder(home).glob("*.json")) if (r := waiting_record(p)) is not None]


def wait_for_decision(home: Path, flow_run_id: str, report_markdown: str, timeout_s: float, subject: dict) -> Approval:
    """Pause the current flow run until a person decides, or timeout_s passes (a rejection)."""
    from prefect.exceptions import FlowPauseTimeout
    from prefect.flow_runs import pause_flow_run

    pending = pending_folder(home) / f"{flow_run_id}.json"
    pending.parent.mkdir(parents=True, exist_ok=True)
    record = {"flow_run_id": flow_run_id, "api_url": os.environ.get("PREFECT_API_URL", ""), **subject}
    partial = pending.with_suffix(".partial")  # whole or absent for `llmops approve` (a rename is atomic)
    partial.write_text(json.dumps({**record, "waiting_since": time.time(), "timeout_s": timeout_s}))
    partial.replace(pending)
    started = time.monotonic()
    try:
        answer = pause_flow_run(
            wait_for_input=ApprovalInput.with_initial_data(description=report_markdown),
            timeout=max(1, round(timeout_s)),
            poll_interval=POLL_S,
            key=APPROVAL_KEY,
        )
        return Approval(
            answer.decision == "approve", answer.decided_by, answer.reason, time.time(), time.monotonic() - started
        )
    except FlowPauseTimeout:
        running_again(flow_run_id)
        reason = f"no decision within {timeout_s:g}s (gate.approval_timeout_s)"
        return Approval(False, "timeout", reason, time.time(), time.monotonic() - started, timed_out=True)
    finally:
        pending.unlink(missing_ok=True)


def running_again(flow_run_id: str) -> None:
    """Prefect leaves a timed-out pause PAUSED and raises in the flow; this run goes on to roll back, so its
    state must be RUNNING again for its next tasks to run."""
    from prefect.client.orchestration import get_client
    from prefect.states import Running

    with get_client(sync_client=True) as client:
        client.set_flow_run_state(flow_run_id, Running(), force=True)


def approve(ctx: RunContext, report: GateReport, flow_run_id: str) -> Approval:
    """The DAG's approve step: not a cached stage, a person decides every time."""
    timeout_s = ctx.profile.gate.approval_timeout_s
    logger().info(
        f"approval: {report.model} v{report.candidate_version} passed the gate and waits up to {timeout_s:g}s for a "
        f"person: the Resume form on this run's page in the Prefect UI, or `llmops approve {flow_run_id} --reason "
        f"...` / `llmops reject {flow_run_id} --reason ...`"
    )
    subject = {
        "model": report.model,
        "candidate_version": report.candidate_version,
        "mlflow_run_id": ctx.tracker.run_id,
    }
    approval = wait_for_decision(ctx.home, flow_run_id, report.markdown(), timeout_s, subject)
    record(ctx, report, approval)
    logger().info(f"approval: {report.model} v{report.candidate_version} {approval.summary()}")
    return approval


def record(ctx: RunContext, report: GateReport, approval: Approval) -> None:
    """Who decided, when and why: tags of the MLflow run and of the registry version, and the version's description."""
    decided = "approved" if approval.approved else "rejected"
    at = datetime.fromtimestamp(approval.decided_at, UTC).isoformat(timespec="seconds")
    tags = {"approval.decision": decided, "approval.by": approval.decided_by, "approval.reason": approval.reason}
    tags["approval.at"] = at
    ctx.tracker.set_tags(tags)
    ctx.tracker.log_metrics("approval", {"wait_s": approval.waited_s})
    client, name, version = ctx.tracker.client, report.model, report.candidate_version
    for key, value in tags.items():
        client.set_model_version_tag(name, version, key, value)
    description = f"{report.description()} Approval: {decided} by {approval.decided_by} at {at}: {approval.reason}"
    client.update_model_version(name, version, description=description)
