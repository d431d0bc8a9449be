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

from flows.cli.common import llmops_home, prefect_api_env
from tasks.platform.errors import BadInput

EPILOG = """examples:
  llmops approve                                       # the releases of this home waiting for a decision
  llmops approve 0f1c...-flow-run-id --reason "answers read well; latency as v3"
  llmops reject 0f1c...-flow-run-id --reason "tone is off for support tickets" --by alice
The run's id is in its log line `approval: ... waits ...` and on its page in the Prefect UI."""


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
        parser.add_argument("--by", help="who decides (default: USER@HOST)")
        parser.set_defaults(handler=command_decide, decision=decision)


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
    decided_by = args.by or f"{getpass.getuser()}@{socket.gethostname()}"
    resume(
        api_url,
        auth_for(home, api_url),
        args.flow_run_id,
        {"decision": args.decision, "reason": args.reason, "decided_by": decided_by},
    )
    return f"{args.decision}d run {args.flow_run_id} as {decided_by}; it goes on now"


def waiting_list(home: Path) -> str:
    from tasks.approve import waiting_records

    lines = []
    for waiting in waiting_records(home):
        since = time.strftime("%Y-%m-%d %H:%M", time.localtime(waiting.get("waiting_since", 0)))
        mlflow_run = f", MLflow run {waiting['mlflow_run_id']}" if waiting.get("mlflow_run_id") else ""
        what = (
            f"harvest of {waiting.get('model', '?')}: {waiting.get('records', '?')} records in {waiting.get('dataset')}"
            if waiting.get("kind") == "harvest"
            else f"{waiting.get('model', '?')} v{waiting.get('candidate_version', '?')}"
        )
        lines.append(f"{waiting['flow_run_id']}  {what}  (waiting since {since}{mlflow_run})")
    return "\n".join(lines) or f"no release of {home} waits for approval"


def api_for(home: Path, flow_run_id: str) -> str:
    """The Prefect API holding the run: the one it wrote down while waiting, else PREFECT_API_URL or the stack's."""
    from tasks.approve import pending_folder, waiting_record

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
            raise BadInput(f"flow run {flow_run_id}: not found on the Prefect API at {api_url}") from None
        if not flow_run.state or not flow_run.state.is_paused():
            state = flow_run.state.name if flow_run.state else "no state"
            raise BadInput(f"flow run {flow_run_id} is not waiting for approval (its state: {state})")
        response = client.resume_flow_run(run_id, run_input=run_input)
    if response.status != SetStateStatus.ACCEPT:
        reason = getattr(response.details, "reason", None) or response.status.value
        raise BadInput(f"flow run {flow_run_id}: Prefect refused the decision: {reason}")
