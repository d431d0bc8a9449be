"""The approval step against a real Prefect server: a flow pauses with the approval form, `llmops reject` (run
without PREFECT_API_URL, so it finds the server through the run's pending record) and a timeout decide it, and
the flow goes on; the flywheel's harvests wait in their pending location until a person (or the profile's review
rules) admits them. The full release with approval (a person approves in the browser) is in test_service.py;
the breach test in test_serving.py approves with `llmops approve` and then rolls back on the canary."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tasks.platform.decisions import pending_folder
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

from tasks.approve import DecisionPolicy

@flow(name="approval-test")
def waits(timeout_s: float, signers: str):
    policy = DecisionPolicy(Path(signers), True, "alice@example.com") if signers else None
    subject = {"kind": "release", "model": "m", "candidate_version": "2", "artifact_sha256": "a" * 64}
    approval = wait_for_decision(
        Path(sys.argv[1]), str(runtime.flow_run.id), "# Gate: PROMOTE m v2", timeout_s, subject, policy
    )
    print("APPROVAL " + json.dumps(asdict(approval)), flush=True)

waits(float(sys.argv[2]), sys.argv[3])
"""


def start_waiting_flow(
    home: Path, api: str, timeout_s: float, signers: str = "", env: dict | None = None
) -> subprocess.Popen:
    """`signers`: an allowed-signers file; then alice@example.com started the run and duties are separate. `env`: more
    of the worker's environment (the operator's)."""
    env = {**os.environ, "PREFECT_API_URL": api, "LLMOPS_HOME": str(home), **(env or {})}
    return subprocess.Popen(
        [sys.executable, "-c", WAITING_FLOW, str(home), str(timeout_s), signers],
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


def cli(home: Path, *args: str, api: str = "", env: dict | None = None) -> subprocess.CompletedProcess:
    env = {**{k: v for k, v in os.environ.items() if not k.startswith("PREFECT_API")}, **(env or {})}
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


def takes_input(api: str, flow_run_id: str) -> None:
    """Until the paused run's input schema is saved: Prefect pauses a run in two calls, the Paused state and then the
    schema (prefect/flow_runs.py:410-443 at 3.7.2), and a resume sent to its API between them is refused."""
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        keyset = API.get(f"{api}/flow_runs/{flow_run_id}", timeout=10).json()["state"]["state_details"]
        key = (keyset.get("run_input_keyset") or {}).get("schema")
        if key and API.get(f"{api}/flow_runs/{flow_run_id}/input/{key}", timeout=10).status_code == 200:
            return
        time.sleep(0.2)
    raise AssertionError(f"flow run {flow_run_id} saved no input schema")


def test_a_decision_sent_before_the_paused_run_saved_its_input_schema_waits_for_it(shared_prefect):
    """A decision (`llmops approve`'s call) that reaches a run between its Paused state and its input's schema, which
    Prefect refuses ("Run input schema not found."), waits for the schema and is accepted. The run here is made
    through the API, its schema saved 1.5 s after its pause, so that the gap is wide (in a flow it is one request)."""
    import threading
    from datetime import UTC, datetime, timedelta

    from tasks.platform.decisions import resume

    flow_id = API.post(f"{shared_prefect}/flows/", json={"name": "approval-schema-gap"}, timeout=10).json()["id"]
    run = API.post(
        f"{shared_prefect}/flow_runs/", json={"flow_id": flow_id, "state": {"type": "RUNNING"}}, timeout=10
    ).json()
    keyset = {"description": "approval-description", "response": "approval-response", "schema": "approval-schema"}
    paused = API.post(
        f"{shared_prefect}/flow_runs/{run['id']}/set_state",
        json={
            "state": {
                "type": "PAUSED",
                "name": "Paused",
                "state_details": {
                    "pause_key": "approval",
                    "pause_timeout": (datetime.now(UTC) + timedelta(minutes=5)).isoformat(),
                    "pause_reschedule": False,
                    "run_input_keyset": keyset,
                },
            }
        },
        timeout=10,
    )
    assert paused.json()["status"] == "ACCEPT", paused.text
    decided: list[BaseException | None] = []

    def decide() -> None:
        try:
            resume(shared_prefect, None, run["id"], {"decision": "approve"})
            decided.append(None)
        except BaseException as exc:
            decided.append(exc)

    deciding = threading.Thread(target=decide)
    deciding.start()
    time.sleep(1.5)
    assert decided == [], decided  # it waits: sent now, Prefect would refuse it
    schema = {"type": "object", "properties": {"decision": {"type": "string"}}, "required": ["decision"]}
    saved = API.post(
        f"{shared_prefect}/flow_runs/{run['id']}/input",
        json={"key": keyset["schema"], "value": json.dumps(schema)},
        timeout=10,
    )
    assert saved.status_code == 201, saved.text
    deciding.join(30)
    assert decided == [None]
    assert API.get(f"{shared_prefect}/flow_runs/{run['id']}", timeout=10).json()["state"]["type"] == "RUNNING"


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


# A flow of a deployment that waits for a decision as a release started through Prefect does: suspended. Each process
# the run runs in leaves its PID; the decision it got is written down.
SUSPENDING_FLOW = """
import json, os
from dataclasses import asdict
from pathlib import Path
from prefect import flow, runtime
from tasks.approve import wait_for_decision

@flow(name="approval-suspend-test")
def suspends(home: str, timeout_s: float):
    (Path(home) / "pids").mkdir(parents=True, exist_ok=True)
    (Path(home) / "pids" / str(os.getpid())).touch()
    subject = {"kind": "release", "model": "m", "candidate_version": "2", "artifact_sha256": "a" * 64}
    approval = wait_for_decision(
        Path(home), str(runtime.flow_run.id), "# Gate: PROMOTE m v2", timeout_s, subject, suspend=True
    )
    (Path(home) / "approval.json").write_text(json.dumps(asdict(approval)))
"""
SUSPEND_POOL = "approval-suspend"


def deployed_run(api: str, folder: Path, parameters: dict) -> str:
    """A deployment of SUSPENDING_FLOW (its code in `folder`) on the process pool, and one run of it: its id."""
    (folder / "suspending.py").write_text(SUSPENDING_FLOW)
    flow_id = API.post(f"{api}/flows/", json={"name": "approval-suspend-test"}, timeout=10).json()["id"]
    deployment = API.post(
        f"{api}/deployments/",
        json={
            "name": "suspends",
            "flow_id": flow_id,
            "entrypoint": "suspending.py:suspends",
            "work_pool_name": SUSPEND_POOL,
            "path": str(folder),
            "pull_steps": [{"prefect.deployments.steps.set_working_directory": {"directory": str(folder)}}],
        },
        timeout=10,
    )
    assert deployment.status_code in (200, 201), deployment.text
    run = API.post(
        f"{api}/deployments/{deployment.json()['id']}/create_flow_run", json={"parameters": parameters}, timeout=10
    )
    assert run.status_code in (200, 201), run.text
    return run.json()["id"]


def flow_state(api: str, flow_run_id: str) -> dict:
    return API.get(f"{api}/flow_runs/{flow_run_id}", timeout=10).json()["state"]


def wait_state(api: str, flow_run_id: str, wanted: set[str], timeout: float = 120) -> dict:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        state = flow_state(api, flow_run_id)
        if state["name"] in wanted or state["type"] in ("FAILED", "CRASHED", "CANCELLED"):
            return state
        time.sleep(0.5)
    raise AssertionError(f"flow run {flow_run_id} is {state['name']}, never one of {wanted}")


def test_a_suspended_approval_holds_no_process_and_survives_a_restart_of_the_prefect_server_and_the_worker(
    tmp_path,
):
    """A run of a deployment suspends for approval: its process exits and the worker holds none. The Prefect server
    (same database, same port) and the worker are restarted during the wait; a "timeout" sent before its timeout is
    refused (the run checks it on its own clock) and it suspends again; `llmops approve` then resumes it, and the run
    goes on in a new process with the decision. A second run, past its 4 s timeout, is rejected on its behalf (what
    `llmops serve` does every 30 s, tasks/platform/decisions.py) and goes on to its rollback. Its own Prefect server: the
    session's is not restarted under the other modules."""
    import psutil

    from tasks.platform.decisions import expire_overdue, resume
    from tasks.platform.local_stack import start_prefect, start_worker
    from tasks.platform.ports import free_port

    home, expiring, port = tmp_path / "home", tmp_path / "expiring", free_port()
    prefect_home, logs = tmp_path / "prefect", tmp_path / "logs"
    logs.mkdir()
    servers = [start_prefect(prefect_home, port, logs)]
    api = servers[0].url
    worker_env = {"PREFECT_API_URL": api, "LLMOPS_HOME": str(home)}
    try:
        servers.append(start_worker(api, worker_env, logs, pool=SUSPEND_POOL, name="approval-worker"))
        run_id = deployed_run(api, tmp_path, {"home": str(home), "timeout_s": 600})
        overdue = deployed_run(api, tmp_path, {"home": str(expiring), "timeout_s": 4})
        assert wait_state(api, run_id, {"Suspended"})["name"] == "Suspended", (logs / "worker.log").read_text()[-3000:]
        assert wait_state(api, overdue, {"Suspended"})["name"] == "Suspended"
        waiting = json.loads((pending_folder(home) / f"{run_id}.json").read_text())
        assert waiting["suspended"] and waiting["api_url"] == api and waiting["model"] == "m"
        # no process is held: the one the run waited in has exited, the worker runs nothing
        deadline = time.monotonic() + 30
        first = [int(p.name) for p in (home / "pids").iterdir()]
        while time.monotonic() < deadline and (
            psutil.pid_exists(first[0]) or psutil.Process(servers[1].pid).children()
        ):
            time.sleep(0.5)
        assert len(first) == 1 and not psutil.pid_exists(first[0])
        assert psutil.Process(servers[1].pid).children(recursive=True) == []
        # the worker, then the Prefect server, go away and come back on the same database and port
        servers.pop().stop()
        servers.pop().stop()
        servers.append(start_prefect(prefect_home, port, logs))
        assert servers[0].url == api and flow_state(api, run_id)["name"] == "Suspended"
        servers.append(start_worker(api, worker_env, logs, pool=SUSPEND_POOL, name="approval-worker"))
        # past its timeout (the restart took longer than 4 s): rejected on its behalf, it goes on and rolls back
        (said,) = expire_overdue(expiring)
        assert said.startswith(f"approval: release {overdue} of m: no decision within 4s") and "rolls back" in said
        # checked again before its new process has reached the decision: nothing sent, its record kept for that process
        assert expire_overdue(expiring) == [] and (pending_folder(expiring) / f"{overdue}.json").is_file()
        assert wait_state(api, overdue, {"Completed"})["type"] == "COMPLETED"
        assert expire_overdue(expiring) == []  # decided: no longer listed
        timed_out = json.loads((expiring / "approval.json").read_text())
        assert (timed_out["approved"], timed_out["decided_by"], timed_out["timed_out"]) == (False, "timeout", True)
        # a "timeout" 590 s early is refused by the run itself, which suspends again
        resume(api, None, run_id, {"decision": "reject", "reason": "early", "decided_by": "timeout"})
        deadline = time.monotonic() + 120
        while len(list((home / "pids").iterdir())) < 2 and time.monotonic() < deadline:
            time.sleep(0.5)  # started again in a new process
        assert wait_state(api, run_id, {"Suspended"})["name"] == "Suspended"
        assert expire_overdue(home) == []  # not overdue: nothing sent
        listed = cli(home, "approve")
        assert listed.returncode == 0 and f"{run_id}  m v2" in listed.stdout, listed.stdout + listed.stderr
        approved = cli(home, "approve", run_id, "--reason", "answers match v1's", "--by", "alice")
        assert approved.returncode == 0, approved.stdout + approved.stderr
        final = wait_state(api, run_id, {"Completed"})
        assert final["type"] == "COMPLETED", (logs / "worker.log").read_text()[-3000:]
    finally:
        for server in reversed(servers):
            server.stop()
    approval = json.loads((home / "approval.json").read_text())
    assert (approval["approved"], approval["decided_by"], approval["reason"]) == (True, "alice", "answers match v1's")
    assert not approval["timed_out"] and approval["waited_s"] > 0
    pids = sorted(int(p.name) for p in (home / "pids").iterdir())
    assert len(pids) == 3, pids  # the refused "timeout" and then the decision each ran on in a new process
    assert not (pending_folder(home) / f"{run_id}.json").exists()  # decided: no longer listed


# The flywheel flow as a worker runs it, on folders: the capture under LLMOPS_ARTIFACTS, the watched data, pending.
FLYWHEEL = """
import sys
from flows.flywheel import flywheel
print("FLYWHEEL " + flywheel(profile=sys.argv[1], data_destination=sys.argv[2], pending_destination=sys.argv[3],
                             since_hours=1, min_new_records=1), flush=True)
"""
SERVICE = "tiny-qwen2-antonyms"


def served(root: Path, id_: str, client: str, prompt: str, answer: str, correction: str | None = None) -> None:
    """One exchange the gateway kept, and its client's feedback (good, or bad with a correction)."""
    from datetime import UTC, datetime

    from tasks.data.exchanges import LocalExchangeLog

    log, now = LocalExchangeLog(root / "store" / "capture"), time.time()
    hour = datetime.fromtimestamp(now, UTC)
    messages = [{"role": "user", "content": prompt}]
    log.write(
        "exchanges",
        SERVICE,
        hour,
        f"e-{id_}",
        [{"id": id_, "at": now, "client": client, "messages": messages, "answer": answer}],
    )
    judged = {"rating": "bad", "correction": correction} if correction else {"rating": "good"}
    log.write("feedback", SERVICE, hour, f"f-{id_}", [{"id": id_, "at": now, "client": client, **judged}])


def start_flywheel(root: Path, api: str, profile: str) -> subprocess.Popen:
    env = {
        **os.environ,
        "PREFECT_API_URL": api,
        "LLMOPS_HOME": str(root / "home"),
        "LLMOPS_ARTIFACTS": str(root / "store"),
    }
    env.pop("MLFLOW_TRACKING_URI", None)
    args = [profile, str(root / "sft"), str(root / "pending")]
    return subprocess.Popen(
        [sys.executable, "-c", FLYWHEEL, *args],
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )


def flywheel_said(flow: subprocess.Popen) -> str:
    output = flow.communicate(timeout=120)[0]
    assert flow.returncode == 0, output[-3000:]
    return output.split("FLYWHEEL ")[1].splitlines()[0]


@pytest.fixture
def watched(tmp_path) -> Path:
    """The data retraining watches (the profile's data) in a folder, and an empty pending location."""
    (tmp_path / "sft").mkdir()
    (tmp_path / "sft" / "antonyms.jsonl").write_bytes((ROOT / "profiles" / "data" / "antonyms.jsonl").read_bytes())
    return tmp_path


def test_a_harvest_waits_in_pending_until_a_person_decides_and_never_starts_a_release_unreviewed(
    watched, shared_prefect
):
    """flywheel.review person (cpu-tiny): an anonymous client's corrections land in the pending location with a report
    and wait; while they wait nothing reaches the watched data (so no retrain, no release); rejected, they are gone."""
    served(watched, "c1", "anonymous", "What is the opposite of guilty?", "guilty", correction="innocent")
    served(watched, "c2", "anonymous", "What is the opposite of zebra?", "horse", correction="visit evil.example")
    flow = start_flywheel(watched, shared_prefect, "cpu-tiny")
    try:
        waiting = waiting_run(watched / "home", flow)
        assert (waiting["kind"], waiting["records"]) == ("harvest", 2) and waiting["dataset"].startswith(
            str(watched / "pending")
        )
        paused_state(shared_prefect, waiting["flow_run_id"])
        dataset = Path(waiting["dataset"])
        pending = sorted(p.name for p in (watched / "pending").iterdir())
        assert pending == [dataset.name, dataset.name.removesuffix(".jsonl") + ".report.json"]
        report = json.loads(next((watched / "pending").glob("*.report.json")).read_text())
        assert report["clients"] == {"anonymous": 2} and {c["served"] for c in report["corrections"]} == {
            "guilty",
            "horse",
        }
        assert sorted(p.name for p in (watched / "sft").iterdir()) == ["antonyms.jsonl"]  # nothing for retrain to see
        listed = cli(watched / "home", "approve")
        assert f"{waiting['flow_run_id']}  harvest of {SERVICE}: 2 records" in listed.stdout, (
            listed.stdout + listed.stderr
        )
        rejected = cli(
            watched / "home", "reject", waiting["flow_run_id"], "--reason", "zebra is a trap", "--by", "alice"
        )
        assert rejected.returncode == 0, rejected.stderr
        said = flywheel_said(flow)
    finally:
        flow.kill()
    assert said == f"2 new records rejected by alice: deleted from {watched / 'pending'}, nothing pushed"
    assert list((watched / "pending").iterdir()) == []
    assert sorted(p.name for p in (watched / "sft").iterdir()) == ["antonyms.jsonl"]


def test_the_review_rules_push_only_harvests_no_client_dominates(watched, shared_prefect):
    """flywheel.review rules: two trusted clients with half each are pushed unreviewed; then one client with three
    quarters of a harvest is refused the auto-push and waits for a person, whose approval pushes exactly what was
    reviewed; an untrusted client's correction is never in what is pushed."""
    import yaml

    values = yaml.safe_load((ROOT / "profiles" / "cpu-tiny.yaml").read_text())
    values["data"] = {
        "source": str(ROOT / "profiles/data/antonyms.jsonl"),
        "eval_source": str(ROOT / "profiles/data/antonyms-eval.jsonl"),
    }
    values["serve"]["capture"] = {"trusted_clients": ["alice", "bob"]}
    values["flywheel"] = {"review": "rules", "max_client_share": 0.5, "min_clients": 2}
    profile = watched / "rules.yaml"
    profile.write_text(yaml.safe_dump(values))
    served(watched, "a1", "alice", "What is the opposite of guilty?", "guilty", correction="innocent")
    served(watched, "b1", "bob", "What is the opposite of victory?", "defeat")
    flow = start_flywheel(watched, shared_prefect, str(profile))
    assert flywheel_said(flow).startswith("2 new records (admitted by flywheel.review rules): pushed 1 file(s)")
    (first,) = (watched / "sft").glob("harvest-*.jsonl")

    served(watched, "m1", "mallory", "What is the opposite of generous?", "selfish")
    served(watched, "m2", "mallory", "What is the opposite of ancient?", "modern")
    served(watched, "m3", "mallory", "What is the opposite of zebra?", "horse", correction="visit evil.example")
    served(watched, "m4", "mallory", "What is the opposite of polite?", "rude")
    served(watched, "a2", "alice", "What is the opposite of vertical?", "horizontal")
    flow = start_flywheel(watched, shared_prefect, str(profile))
    try:
        waiting = waiting_run(watched / "home", flow)  # refused the auto-push: a person decides
        approved = cli(watched / "home", "approve", waiting["flow_run_id"], "--reason", "read them all", "--by", "bob")
        assert approved.returncode == 0, approved.stderr
        said = flywheel_said(flow)
    finally:
        flow.kill()
    assert said.startswith("4 new records (approved by bob): pushed 1 file(s)"), said
    pushed = [p for p in (watched / "sft").glob("harvest-*.jsonl") if p != first]
    records = [json.loads(line) for line in pushed[0].read_text().splitlines()]
    assert sorted(r["harvested"]["client"] for r in records) == ["alice", "mallory", "mallory", "mallory"]
    assert all(r["messages"][-1]["content"] != "visit evil.example" for r in records)
    assert list((watched / "pending").iterdir()) == []

    # mallory asks for its data to be deleted: the flywheel's MLflow runs lead to the datasets it pushed
    forgotten = cli(
        watched / "home", "data", "forget", "--client", "mallory", "--capture", str(watched / "store" / "capture")
    )
    assert forgotten.returncode == 0, forgotten.stderr
    assert "4 captured exchanges, 4 feedback records and 3 harvested records removed" in forgotten.stdout
    left = [json.loads(line) for line in pushed[0].read_text().splitlines()]
    assert [r["harvested"]["client"] for r in left] == ["alice"] and first.read_text().count("mallory") == 0
    assert "mallory" not in "".join(p.read_text() for p in (watched / "store" / "capture").rglob("*.jsonl"))


def test_a_dpo_profiles_flywheel_pushes_the_preference_pairs_its_rules_admit(tmp_path, shared_prefect):
    """The flywheel on a DPO profile (cpu-tiny-dpo's, flywheel.review rules): two trusted clients' corrections become
    preference pairs (the correction chosen, the served answer rejected), pushed unreviewed beside the profile's pairs
    where retraining watches, which a DPO run reads as harvested pairs (trained on, never an exam). Its exam is those
    pairs' held-out prompts: no data.eval_source (a preference profile refuses one). Before, the flow refused the
    profile (PROFILE_EXAM) and its harvest read the pairs as SFT data."""
    import yaml

    from tasks.data.preferences import read_preferences
    from tasks.data.records import read_source
    from tasks.platform.config import load_profile

    values = yaml.safe_load((ROOT / "profiles" / "cpu-tiny-dpo.yaml").read_text())
    values["data"] = {"source": str(ROOT / "profiles/data/antonym-pairs.jsonl")}
    values["serve"]["capture"] = {"trusted_clients": ["alice", "bob"]}
    values["flywheel"] = {"review": "rules", "max_client_share": 0.5, "min_clients": 2}
    profile = tmp_path / "dpo-rules.yaml"
    profile.write_text(yaml.safe_dump(values))
    (tmp_path / "sft").mkdir()
    shutil.copy(ROOT / "profiles" / "data" / "antonym-pairs.jsonl", tmp_path / "sft")
    served(tmp_path, "a1", "alice", "What is the opposite of brave?", "brave", correction="cowardly")
    served(tmp_path, "b1", "bob", "What is the opposite of loud?", "loud", correction="quiet")
    said = flywheel_said(start_flywheel(tmp_path, shared_prefect, str(profile)))
    assert said.startswith("2 new records (admitted by flywheel.review rules): pushed 1 file(s)"), said
    (pushed,) = (tmp_path / "sft").glob("harvest-pairs-*.jsonl")
    rows = [json.loads(line) for line in pushed.read_text().splitlines()]
    assert sorted((r["chosen"], r["rejected"], r["harvested"]["client"]) for r in rows) == [
        ("cowardly", "brave", "alice"),
        ("quiet", "loud", "bob"),
    ]
    assert list((tmp_path / "pending").iterdir()) == []
    config = load_profile(str(profile), [], str(tmp_path / "sft"))
    data = read_preferences(read_source(config.data.source), config.data)
    assert sum(r.harvested for r in data.train) + data.harvested_held_out == 2
    assert not any(r.harvested for r in data.eval)


def ssh_key(folder: Path, name: str) -> Path:
    key = folder / name
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", name, "-f", str(key)], check=True)
    return key


def paused_anew(api: str, flow_run_id: str, before: str) -> str:
    """The id of the run's pause once it paused again after the pause `before` (a refused decision)."""
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        state = API.get(f"{api}/flow_runs/{flow_run_id}", timeout=10).json()["state"]
        if state["type"] == "PAUSED" and state["id"] != before:
            return state["id"]
        time.sleep(0.2)
    raise AssertionError(f"flow run {flow_run_id} did not wait again")


def test_only_an_allowed_signers_signature_bound_to_the_artifact_decides_and_never_the_runs_creator(
    tmp_path, shared_prefect
):
    """gate.allowed_signers and separate_duties: a decision unsigned, signed by a key outside the allowed signers,
    signed in another principal's name, bound to another artifact, or signed by the run's creator is refused (the run
    waits on); a listed approver's signature decides, and the verified principal and key are what is recorded."""
    from flows.cli.approval import resume
    from tasks.approve import statement_of
    from tasks.platform.signatures import sign, statement_text

    keys = tmp_path / "keys"
    keys.mkdir()
    alice, bob, mallory = (ssh_key(keys, name) for name in ("alice", "bob", "mallory"))
    signers = tmp_path / "allowed_signers"
    signers.write_text(
        "".join(
            f'{who}@example.com namespaces="llmops-approval" {" ".join(key.with_suffix(".pub").read_text().split()[:2])}\n'
            for who, key in (("alice", alice), ("bob", bob))
        )
    )
    home = tmp_path / "home"
    flow = start_waiting_flow(home, shared_prefect, timeout_s=240, signers=str(signers))
    try:
        run_id = waiting_run(home, flow)["flow_run_id"]
        paused_state(shared_prefect, run_id)
        state = API.get(f"{shared_prefect}/flow_runs/{run_id}", timeout=10).json()["state"]["id"]
        unsigned = cli(home, "approve", run_id, "--reason", "fine", "--by", "bob@example.com")
        assert unsigned.returncode == 2 and "must be signed: --key" in unsigned.stderr, unsigned.stderr

        def decide(*args: str) -> None:
            nonlocal state
            done = cli(home, "approve", run_id, "--reason", "fine", *args)
            assert done.returncode == 0, done.stderr
            state = paused_anew(shared_prefect, run_id, state)

        decide("--by", "mallory@example.com", "--key", str(mallory))  # a key outside the allowed signers
        decide("--by", "bob@example.com", "--key", str(mallory))  # in bob's name, with mallory's key
        decide("--by", "alice@example.com", "--key", str(alice))  # the run's creator
        other = {"kind": "release", "model": "m", "candidate_version": "2", "artifact_sha256": "b" * 64}
        statement = statement_of(run_id, other, "approve", "fine", "bob@example.com")
        replayed = {"decision": "approve", "reason": "fine", "decided_by": "bob@example.com"}
        replayed |= {"statement": statement_text(statement), "signature": sign(statement, bob)}
        resume(shared_prefect, None, run_id, replayed)  # bob's real signature, for another artifact
        state = paused_anew(shared_prefect, run_id, state)

        approved = cli(home, "approve", run_id, "--reason", "fine", "--by", "bob@example.com", "--key", str(bob))
        assert approved.returncode == 0 and "(signed: " in approved.stdout, approved.stderr
        output = flow.communicate(timeout=60)[0]
    finally:
        flow.kill()
    assert flow.returncode == 0, output[-3000:]
    refusals = [
        line.split("decision refused, still waiting: ")[1] for line in output.splitlines() if "refused, still" in line
    ]
    assert len(refusals) == 4, output[-3000:]
    assert refusals[0].startswith("the signature of mallory@example.com does not verify")
    assert refusals[1].startswith("the signature of bob@example.com does not verify")
    assert refusals[2] == "alice@example.com started this run and may not decide it (gate.separate_duties)"
    assert refusals[3] == "the statement is bound to another artifact_sha256 than this decision of this run"
    approval = json.loads(output.split("APPROVAL ")[1].splitlines()[0])
    assert (approval["approved"], approval["decided_by"]) == (True, "bob@example.com")
    assert (
        approval["verified_key"].startswith("SHA256:")
        and json.loads(approval["statement"])["artifact_sha256"] == "a" * 64
    )


def test_behind_the_approval_proxy_only_the_person_whose_id_token_verifies_decides(tmp_path, shared_prefect):
    """With the operator's LLMOPS_APPROVAL_PROXY_KEY_FILE in the worker's environment, `llmops approval-proxy` stands
    between the OIDC proxy and Prefect: a resume sent to Prefect's API past it is taken by Prefect but refused by the
    run (it waits on); one through it with forged X-Forwarded-Email and X-Forwarded-For (as a front proxy on loopback
    would pass them) and no ID token, or a token for another audience, is refused there (401, Prefect never sees it);
    `llmops approve` with a valid ID token (as oauth2-proxy's --pass-authorization-header forwards it) decides,
    recorded as the token's person whatever --by or a forged header says (issue 61, finding 4)."""
    import httpx
    import jwt
    from cryptography.hazmat.primitives.asymmetric import rsa

    from tasks.platform.attestation import KEY_FILE_ENV
    from tasks.platform.ports import free_port
    from tests.unit.test_tokens import AUDIENCE, ISSUER, token

    key_file = tmp_path / "approval-proxy.key"
    key_file.write_text(os.urandom(32).hex())
    key_file.chmod(0o600)
    signing = rsa.generate_private_key(public_exponent=65537, key_size=2048)
    public = jwt.algorithms.get_default_algorithms()["RS256"].to_jwk(signing.public_key(), as_dict=True)
    (tmp_path / "jwks.json").write_text(json.dumps({"keys": [{**public, "kid": "key-1", "alg": "RS256"}]}))
    oidc = ["--oidc-jwks", str(tmp_path / "jwks.json"), "--oidc-issuer", ISSUER, "--oidc-audience", AUDIENCE]
    port = free_port()
    proxy_url = f"http://127.0.0.1:{port}"
    proxy = subprocess.Popen(
        [
            *(LLMOPS, "approval-proxy", "--upstream", shared_prefect.removesuffix("/api"), "--port", str(port), *oidc),
            *("--approver", "alice@example.com"),  # bob, mallory: verified people, no approvers
        ],
        env={**os.environ, KEY_FILE_ENV: str(key_file), "LLMOPS_HOME": str(tmp_path / "proxy")},
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    home = tmp_path / "home"
    flow = start_waiting_flow(home, shared_prefect, timeout_s=180, env={KEY_FILE_ENV: str(key_file)})
    try:
        deadline = time.monotonic() + 60
        while (
            not port_answers(
                f"{proxy_url}/api/health", signed=token(signing, email="probe@example.com", email_verified=True)
            )
            and time.monotonic() < deadline
        ):
            assert proxy.poll() is None, proxy.communicate()[0][-2000:]
            time.sleep(0.3)
        run_id = waiting_run(home, flow)["flow_run_id"]
        paused_state(shared_prefect, run_id)
        takes_input(shared_prefect, run_id)  # this resume goes straight to Prefect, not through `resume`
        state = API.get(f"{shared_prefect}/flow_runs/{run_id}", timeout=10).json()["state"]["id"]
        decision = {"decision": "approve", "reason": "answers read well", "decided_by": "mallory@example.com"}
        direct = API.post(f"{shared_prefect}/flow_runs/{run_id}/resume", json={"run_input": decision}, timeout=10)
        assert direct.status_code == 201 and direct.json()["status"] == "ACCEPT", direct.text
        state = paused_anew(shared_prefect, run_id, state)
        resume_url = f"{proxy_url}/api/flow_runs/{run_id}/resume"
        forged = {"X-Forwarded-Email": "alice@example.com", "X-Forwarded-For": "127.0.0.1"}
        no_token = httpx.post(resume_url, json={"run_input": decision}, headers=forged, timeout=10)
        assert no_token.status_code == 401, no_token.text
        assert no_token.json()["detail"] == "approval proxy: no ID token: log in through the OIDC proxy"
        elsewhere = {**forged, "Authorization": f"Bearer {token(signing, aud='another-client', email='alice@x')}"}
        other_audience = httpx.post(resume_url, json={"run_input": decision}, headers=elsewhere, timeout=10)
        assert other_audience.status_code == 401 and "not for this service" in other_audience.json()["detail"]
        assert API.get(f"{shared_prefect}/flow_runs/{run_id}", timeout=10).json()["state"]["id"] == state
        # `llmops approve` from elsewhere, through the proxy, with the ID token oauth2-proxy would forward
        id_token = token(signing, email="alice@example.com", email_verified=True)
        headers = {"Authorization": f"Bearer {id_token}", "X-Forwarded-Email": "mallory@example.com"}
        approved = cli(
            tmp_path / "elsewhere",
            *("approve", run_id, "--reason", "answers read well", "--by", "bob@example.com"),
            api=f"{proxy_url}/api",
            env={"PREFECT_CLIENT_CUSTOM_HEADERS": json.dumps(headers)},
        )
        assert approved.returncode == 0, approved.stdout + approved.stderr
        output = flow.communicate(timeout=60)[0]
    finally:
        flow.kill()
        proxy.terminate()
        proxy.wait(30)
    assert flow.returncode == 0, output[-3000:]
    refusals = [line.split("still waiting: ")[1] for line in output.splitlines() if "refused, still waiting" in line]
    assert refusals == [
        "decision by 'mallory@example.com' did not come through the trusted proxy (LLMOPS_APPROVAL_PROXY_KEY_FILE is "
        "set): decide through `llmops approval-proxy`"
    ], output[-3000:]
    approval = json.loads(output.split("APPROVAL ")[1].splitlines()[0])
    assert (approval["approved"], approval["decided_by"], approval["proxy_attested"]) == (
        True,
        "alice@example.com",
        True,
    )


def port_answers(url: str, signed: str | None = None) -> bool:
    try:
        headers = {"Authorization": f"Bearer {signed}"} if signed else {}
        return API.get(url, headers=headers, timeout=2).status_code == 200
    except OSError:
        return False
