"""Runs that wait for a person's decision (tasks/approve.py): their records under LLMOPS_HOME/approvals/, and deciding
them from outside: a decision sent to the Prefect API that holds the run (`llmops approve|reject`,
flows/cli/approval.py), and the rejection of a suspended run whose approval timed out (`llmops serve`).

A run that waits in its process rejects itself at its timeout. A suspended one has no process: past its timeout the
Prefect server would fail it (prefect/server/services/pause_expirations.py:44 at 3.7.2) and no code of it would run,
leaving its candidate loaded, its MLflow run open and its waiting record listed. So its pause outlives its timeout by
EXPIRY_GRACE_S, and `llmops serve` rejects it first on its behalf (`expire_overdue`, every
EXPIRY_CHECK_S): the run goes on in a new process and rolls back as a paused run does at its timeout (`approval.by`
timeout). The run checks that timeout on its own clock: a "timeout" sent early is refused like any bad decision.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import TYPE_CHECKING
from uuid import UUID

from tasks.platform.errors import BadInput

if TYPE_CHECKING:
    from prefect.client.orchestration import SyncPrefectClient

EXPIRY_CHECK_S = 30.0
TIMED_OUT = "timeout"  # who rejects a suspended run past its timeout: the run checks that on its own clock
# A suspended run's pause outlives its timeout by this much, so that `llmops serve` rejects it first (the run goes on
# and rolls back) rather than the Prefect server failing it (no code of the run then runs).
EXPIRY_GRACE_S = 600
# Prefect pauses a run that waits for input in two calls: the Paused state, then its input's schema
# (prefect/flow_runs.py:410-443 at 3.7.2); a decision sent between them is refused ("Run input schema not found.",
# prefect/server/api/flow_runs.py:440-453), so one waits for the schema this long, then sends it regardless.
INPUT_SCHEMA_WAIT_S = 15.0


class NotWaiting(BadInput):
    """The run is not on that Prefect API, or does not wait for a decision now; `ended`: gone or in a final state
    (not one started again by a decision, whose new process has yet to reach it)."""

    def __init__(self, message: str, ended: bool) -> None:
        super().__init__(message)
        self.ended = ended


def suspended_release(home: Path, flow_run_id: str) -> dict | None:
    """The waiting record of `flow_run_id` where it is a release that suspended for approval (and was started again
    by its decision); None otherwise."""
    record = waiting_record(pending_folder(home) / f"{flow_run_id}.json") if flow_run_id else None
    return record if record and record.get("suspended") and record.get("kind") == "release" else None


def forget_waiting(home: Path, flow_run_id: str) -> None:
    """No longer listed as waiting (a resumed release that ended before it came back to its decision)."""
    if flow_run_id:
        (pending_folder(home) / f"{flow_run_id}.json").unlink(missing_ok=True)


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


def expire_overdue(home: Path, now: float | None = None) -> list[str]:
    """Each suspended run of `home` waiting past its timeout rejected on its behalf; one line for each, said of what
    happened (a run that cannot be reached now is tried again at the next check)."""
    now = time.time() if now is None else now
    said = []
    for waiting in waiting_records(home):
        if not waiting.get("suspended") or now < float(waiting["waiting_since"]) + float(waiting["timeout_s"]):
            continue
        run, api_url = waiting["flow_run_id"], waiting.get("api_url", "")
        what = f"{waiting.get('kind', 'release')} {run} of {waiting.get('model', '?')}"
        reason = f"no decision within {float(waiting['timeout_s']):g}s (gate.approval_timeout_s)"
        try:
            resume(
                api_url, auth_for(home, api_url), run, {"decision": "reject", "reason": reason, "decided_by": TIMED_OUT}
            )
            said.append(f"approval: {what}: {reason}; rejected on its behalf, it rolls back now")
        except NotWaiting as exc:
            if exc.ended:  # ended some other way (the Prefect server failed it, a person cancelled it)
                forget_waiting(home, run)
                said.append(f"approval: {what} is past its timeout and no longer waits ({exc}); no longer listed")
            # else decided already and started again: its new process needs the record (its waiting time, its MLflow run)
        except BadInput as exc:
            said.append(f"approval: {what} is past its timeout but could not be rejected: {exc}")
        except Exception as exc:  # the Prefect API down or refusing: the next check tries again
            said.append(f"approval: {what} is past its timeout; the Prefect API at {api_url} did not answer ({exc})")
    return said


def auth_for(home: Path, api_url: str) -> str | None:
    """The Prefect auth string for `api_url`: PREFECT_API_AUTH_STRING where set, else the local stack's when the
    run waits on the stack's API (the stack's Prefect asks for one; a temporary API of `llmops run` does not)."""
    from tasks.platform.local_stack import require_running
    from tasks.platform.local_stack.prefect_server import AUTH_ENV

    if os.environ.get(AUTH_ENV):
        return os.environ[AUTH_ENV]
    try:
        stack = require_running(home)
    except BadInput:
        return None
    return stack.get(AUTH_ENV) if stack["PREFECT_API_URL"] == api_url else None


def wait_for_input_schema(
    client: SyncPrefectClient, run_id: UUID, key: str, timeout_s: float = INPUT_SCHEMA_WAIT_S
) -> None:
    """Until the paused run's input schema is on the server (its `key` of the pause's keyset), at most `timeout_s`."""
    import httpx

    deadline = time.monotonic() + timeout_s
    while True:
        try:
            client.read_flow_run_input(run_id, key)
            return
        except httpx.HTTPStatusError as exc:
            if exc.response.status_code != 404 or time.monotonic() > deadline:
                return
        time.sleep(0.2)


def form_defaults(client: SyncPrefectClient, run_id: UUID, key: str) -> dict:
    """What the paused run filled its form in with (the artifact it decides on), from its input schema; {} where
    that cannot be read."""
    try:
        schema = json.loads(client.read_flow_run_input(run_id, key))
    except Exception:  # noqa: BLE001 (no schema, another shape: nothing is filled in; the run says what it lacks)
        return {}
    fields = schema.get("properties", {}) if isinstance(schema, dict) else {}
    return (
        {"artifact_sha256": fields["artifact_sha256"]["default"]}
        if "default" in fields.get("artifact_sha256", {})
        else {}
    )


def resume(api_url: str, auth_string: str | None, flow_run_id: str, run_input: dict) -> None:
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.responses import SetStateStatus
    from prefect.exceptions import ObjectNotFound
    from prefect.settings import PREFECT_API_AUTH_STRING, PREFECT_API_URL, temporary_settings

    run_id = UUID(flow_run_id)
    # Prefect reads its settings once, when it is imported; the run's API is known only now.
    settings = {PREFECT_API_URL: api_url, **({PREFECT_API_AUTH_STRING: auth_string} if auth_string else {})}
    with temporary_settings(settings), get_client(sync_client=True) as client:
        try:
            flow_run = client.read_flow_run(run_id)
        except ObjectNotFound:
            raise NotWaiting(f"flow run {flow_run_id}: not found on the Prefect API at {api_url}", ended=True) from None
        if not flow_run.state or not flow_run.state.is_paused():
            state = flow_run.state.name if flow_run.state else "no state"
            ended = flow_run.state is None or flow_run.state.is_final()
            raise NotWaiting(f"flow run {flow_run_id} is not waiting for approval (its state: {state})", ended=ended)
        keyset = flow_run.state.state_details.run_input_keyset
        if keyset:
            wait_for_input_schema(client, run_id, keyset["schema"])
            run_input = {**form_defaults(client, run_id, keyset["schema"]), **run_input}
        response = client.resume_flow_run(run_id, run_input=run_input)
    if response.status != SetStateStatus.ACCEPT:
        reason = getattr(response.details, "reason", None) or response.status.value
        raise BadInput(f"flow run {flow_run_id}: Prefect refused the decision: {reason}")
