"""The approval step against a real Prefect server: a flow pauses with the approval form, `llmops reject` (run
without PREFECT_API_URL, so it finds the server through the run's pending record) and a timeout decide it, and
the flow goes on. The full release with approval (a person approves in the browser) is in test_service.py;
the breach test in test_serving.py approves with `llmops approve` and then rolls back on the canary."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tasks.approve import pending_folder
from tasks.platform.local_stack import API

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]

ROOT = Path(__file__).resolve().parents[2]
LLMOPS = str(Path(sys.executable).parent / "llmops")
# A flow that waits for a decision as the release flow does, and prints what it got.
WAITING_FLOW = """
import json, sys
from dataclasses import asdict
from pathlib import Path
from prefect import flow, runtime
from tasks.approve import wait_for_decision

@flow(name="approval-test")
def waits(timeout_s: float):
    approval = wait_for_decision(
        Path(sys.argv[1]), str(runtime.flow_run.id), "# Gate: PROMOTE m v2", timeout_s, {"model": "m", "candidate_version": "2"}
    )
    print("APPROVAL " + json.dumps(asdict(approval)), flush=True)

waits(float(sys.argv[2]))
"""


def start_waiting_flow(home: Path, api: str, timeout_s: float) -> subprocess.Popen:
    env = {**os.environ, "PREFECT_API_URL": api, "LLMOPS_HOME": str(home)}
    return subprocess.Popen(
        [sys.executable, "-c", WAITING_FLOW, str(home), str(timeout_s)],
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )


def waiting_run(home: Path, flow: subprocess.Popen) -> dict:
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and flow.poll() is None:
        records = list(pending_folder(home).glob("*.json"))
        if records:
            return json.loads(records[0].read_text())
        time.sleep(0.2)
    raise AssertionError(
        f"no run waited for approval: {flow.communicate()[0][-2000:] if flow.poll() is not None else ''}"
    )


def approval_printed(flow: subprocess.Popen) -> dict:
    output = flow.communicate(timeout=60)[0]
    assert flow.returncode == 0, output[-3000:]
    return json.loads(output.split("APPROVAL ")[1].splitlines()[0])


def cli(home: Path, *args: str, api: str = "") -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith("PREFECT_API")}
    env.update(LLMOPS_HOME=str(home), **({"PREFECT_API_URL": api} if api else {}))
    return subprocess.run([LLMOPS, *args], env=env, capture_output=True, text=True, timeout=60)


def paused_state(api: str, flow_run_id: str) -> str:
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        state = API.get(f"{api}/flow_runs/{flow_run_id}", timeout=10).json()["state"]
        if state["type"] == "PAUSED":
            return state["name"]
        time.sleep(0.2)
    raise AssertionError(f"flow run {flow_run_id} never paused")


def test_a_release_rejected_from_the_terminal_goes_on_with_the_reason(tmp_path, shared_prefect):
    home = tmp_path / "home"
    flow = start_waiting_flow(home, shared_prefect, timeout_s=120)
    try:
        waiting = waiting_run(home, flow)
        run_id = waiting["flow_run_id"]
        assert waiting["api_url"] == shared_prefect and waiting["model"] == "m"
        paused_state(shared_prefect, run_id)
        listed = cli(home, "approve")
        assert listed.returncode == 0 and f"{run_id}  m v2" in listed.stdout, listed.stdout + listed.stderr
        no_reason = cli(home, "approve", run_id)
        assert no_reason.returncode == 2 and "--reason is required" in no_reason.stderr
        rejected = cli(home, "reject", run_id, "--reason", "answers are too terse", "--by", "alice")
        assert rejected.returncode == 0, rejected.stdout + rejected.stderr
        approval = approval_printed(flow)
    finally:
        flow.kill()
    assert (approval["approved"], approval["decided_by"], approval["reason"]) == (
        False,
        "alice",
        "answers are too terse",
    )
    assert not approval["timed_out"] and not list(pending_folder(home).glob("*.json"))
    final = API.get(f"{shared_prefect}/flow_runs/{run_id}", timeout=10).json()["state"]
    assert final["type"] == "COMPLETED"
    # a decided run is not decided twice; a wrong id is named
    again = cli(home, "approve", run_id, "--reason", "late")
    assert (
        again.returncode == 2
        and "no release of " in again.stderr
        and "waits for approval under this id" in again.stderr
    )
    again = cli(home, "approve", run_id, "--reason", "late", api=shared_prefect)
    assert again.returncode == 2, again.stderr
    assert again.stderr.strip().splitlines()[-1].endswith("is not waiting for approval (its state: Completed)")
    wrong = cli(home, "approve", "not-a-run", "--reason", "x")
    assert wrong.returncode == 2 and "'not-a-run': not a Prefect flow run id" in wrong.stderr


def test_no_decision_within_the_timeout_rejects_and_the_run_goes_on(tmp_path, shared_prefect):
    home = tmp_path / "home"
    flow = start_waiting_flow(home, shared_prefect, timeout_s=3)
    try:
        run_id = waiting_run(home, flow)["flow_run_id"]
        approval = approval_printed(flow)
    finally:
        flow.kill()
    assert (approval["approved"], approval["decided_by"], approval["timed_out"]) == (False, "timeout", True)
    assert approval["reason"] == "no decision within 3s (gate.approval_timeout_s)"
    assert API.get(f"{shared_prefect}/flow_runs/{run_id}", timeout=10).json()["state"]["type"] == "COMPLETED"
