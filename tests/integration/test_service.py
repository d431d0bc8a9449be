"""The pipeline as a service: `llmops stack up --db postgres` (Prefect and MLflow on PostgreSQL, Prefect
on a port other than its default), `llmops deploy`, new data -> retrain -> release run
on the process worker -> champion; the same data again -> no run; runs created through the Prefect
API (as the UI does) with parameters; two releases of one model never hold the serving lock together.

Everything is real and on 127.0.0.1: rclone's S3 server, an MLflow server, a Prefect server with
its scheduler and triggers, a process worker, Triton and genai-perf inside the release runs.
"""

import asyncio
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import psutil
import pytest
import requests

from tasks.data.records import clean_and_split, read_source
from tasks.platform.config import available_profiles, load_profile
from tasks.platform.local_stack import postgres_data_dir, prefect_api, prefect_session
from tests import harness
from tests.browser import decide_paused_run, start_run_from_form, ui_api_url, ui_script_type
from tests.leaks import in_files as leaks_in_files
from tests.leaks import in_mlflow as leaks_in_mlflow
from tests.leaks import in_prefect as leaks_in_prefect
from tests.leaks import in_processes as leaks_in_processes
from tests.unit.test_capture import PASTED, SECRETS_TEXT

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]
LLMOPS = str(Path(sys.executable).parent / "llmops")
DATASET = ROOT / "profiles" / "data" / "antonyms.jsonl"
MODEL = "tiny-qwen2-antonyms"
RELEASE_TIMEOUT = 600
# As test_serving.FAST: one benchmark round, no throughput-ratio check (one round has no interval)
SERVING_OVERRIDES = [
    *("bench.request_count=16", "bench.concurrency=[2]", "quantize.backend=none", "canary.window_s=1.5"),
    *("bench.rounds=1", "bench.max_rounds=1", "gate.min_throughput_ratio=null"),
    # cpu-tiny's two model instances, though each stub imports torch and transformers (8 to 16 s a load here): with
    # one, the benchmark's two concurrent requests share it, and both stalled together for 0.5 to 1.1 s now and then
    # (every request else took 15-40 ms); one round's p99 of 16 requests is such a stall, and it failed the gate's
    # 1000 ms TTFT objective (the retrain of harvested data measured 1,074 ms against the champion's 511 ms).
]


@dataclass
class Service:
    home: Path
    env: dict  # the CLI's environment: LLMOPS_HOME plus what `llmops stack env` exports
    api: str
    tracking_uri: str

    @property
    def http(self):
        """The stack's Prefect API over HTTP, with the stack's auth string (`llmops stack env` exports it)."""
        return prefect_session(self.env)

    def llmops(self, *args: str, timeout: float = 300) -> subprocess.CompletedProcess:
        return subprocess.run([LLMOPS, *args], env=self.env, capture_output=True, text=True, timeout=timeout)

    def get(self, path: str) -> dict:
        response = self.http.get(f"{self.api}{path}", timeout=10)
        response.raise_for_status()
        return response.json()

    def flow_runs(self, **flow_run_filter) -> list[dict]:
        response = self.http.post(
            f"{self.api}/flow_runs/filter", json={"flow_runs": flow_run_filter, "sort": "START_TIME_ASC"}, timeout=10
        )
        response.raise_for_status()
        return response.json()

    def deployment_id(self, name: str) -> str:
        return self.get(f"/deployments/name/{name}")["id"]

    def create_run(self, deployment: str, parameters: dict):
        """What the UI's "Custom run" form does."""
        return self.http.post(
            f"{self.api}/deployments/{self.deployment_id(deployment)}/create_flow_run",
            json={"parameters": parameters},
            timeout=10,
        )

    def wait_final(self, flow_run_id: str, timeout: float = RELEASE_TIMEOUT) -> dict:
        return wait_for(
            lambda: (
                (run := self.get(f"/flow_runs/{flow_run_id}"))["state_type"]
                in ("COMPLETED", "FAILED", "CRASHED", "CANCELLED")
                and run
            ),
            timeout,
            f"flow run {flow_run_id}",
        )

    def logs(self, flow_run_id: str) -> str:
        response = self.http.post(
            f"{self.api}/logs/filter", json={"logs": {"flow_run_id": {"any_": [flow_run_id]}}}, timeout=10
        )
        return "\n".join(line["message"] for line in response.json())

    def wait_log(self, flow_run_id: str, text: str, timeout: float = 60) -> str:
        """The run's logs once they hold `text`: Prefect ships logs in batches, after the state changes."""
        return wait_for(
            lambda: text in (logs := self.logs(flow_run_id)) and logs,
            timeout,
            f"log line {text!r} of flow run {flow_run_id}",
        )

    def mlflow_run(self, flow_run_id: str):
        from mlflow import MlflowClient

        client = MlflowClient(self.tracking_uri)
        experiment = client.get_experiment_by_name("llm-release")
        runs = (
            client.search_runs([experiment.experiment_id], f"tags.`prefect.flow_run_id` = '{flow_run_id}'")
            if experiment
            else []
        )
        assert len(runs) <= 1, f"MLflow runs of flow run {flow_run_id}: {len(runs)}"
        return runs[0] if runs else None

    def release_runs(self) -> list[dict]:
        return self.flow_runs(deployment_id={"any_": [self.deployment_id("release/release")]})


def wait_for(check, timeout: float, what: str, interval: float = 1.0, explain=None):
    """check()'s first truthy value within timeout; else an AssertionError with the end of explain() (a log), which
    is all CI shows of a wait that ran out."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = check()
        if value:
            return value
        time.sleep(interval)
    raise AssertionError(f"{what}: not reached within {timeout:.0f}s" + (f"\n{explain()[-4000:]}" if explain else ""))


def flow_run_processes(flow_run_id: str) -> list[psutil.Process]:
    """The processes that run a flow run: the worker starts it with PREFECT__FLOW_RUN_ID in its environment
    (prefect/runner/runner.py:1026 at 3.7.2), which whatever it starts (a Triton of its own) inherits."""
    found = []
    for process in psutil.process_iter():
        try:
            if process.environ().get("PREFECT__FLOW_RUN_ID") == flow_run_id:
                found.append(process)
        except psutil.Error:  # gone, or another user's
            continue
    return found


def waits_suspended_without_a_process(service: "Service", flow_run_id: str) -> None:
    """The release waits for approval suspended (Prefect's state Suspended, of type PAUSED) and no process of it is
    left: the one it ran in exited once it suspended."""
    run = service.get(f"/flow_runs/{flow_run_id}")
    assert (run["state_type"], run["state_name"]) == ("PAUSED", "Suspended"), service.logs(flow_run_id)[-3000:]
    wait_for(lambda: not flow_run_processes(flow_run_id), 60, f"the processes of flow run {flow_run_id} exiting")
    assert service.mlflow_run(flow_run_id).data.tags["release.outcome"] == "waiting for approval"


@pytest.fixture(scope="module")
def service(tmp_path_factory):
    home = tmp_path_factory.mktemp("service") / "home"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PREFECT_API", "MLFLOW_", "AWS_"))}
    env.update(LLMOPS_HOME=str(home), PREFECT_HOME=str(home / "prefect"))
    up = subprocess.run(
        [
            *(LLMOPS, "stack", "up", "--db", "postgres"),
            *("--prefect-port", "0", "--mlflow-port", "0", "--s3-port", "0", "--postgres-port", "0"),
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=400,
    )
    try:
        assert up.returncode == 0, up.stdout + up.stderr
        exports = subprocess.run([LLMOPS, "stack", "env"], env=env, capture_output=True, text=True, timeout=60)
        for line in exports.stdout.splitlines():
            key, _, value = line.removeprefix("export ").partition("=")
            env[key] = value.strip("'")
        svc = Service(home, env, env["PREFECT_API_URL"], env["MLFLOW_TRACKING_URI"])
        # this process's MlflowClient logs in as every client of the stack does (mlflow/utils/credentials.py)
        logged_in = {name: env[name] for name in ("MLFLOW_TRACKING_USERNAME", "MLFLOW_TRACKING_PASSWORD")}
        os.environ.update(logged_in)
        deployed = svc.llmops("deploy", "--gpu-pool", "llmops-cpu")
        assert deployed.returncode == 0, deployed.stdout + deployed.stderr
        assert "release/release" in deployed.stdout and "retrain/retrain" in deployed.stdout
        # Lighter serving checks for the releases the retrain deployment starts (as a user edits them in the UI).
        patched = svc.http.patch(
            f"{svc.api}/deployments/{svc.deployment_id('retrain/retrain')}",
            timeout=10,
            json={
                "parameters": {
                    "profile": "cpu-tiny",
                    "data_source": "s3://datasets/sft/",
                    "overrides": SERVING_OVERRIDES,
                }
            },
        )
        assert patched.status_code == 204, patched.text
        yield svc
    finally:
        for name in ("MLFLOW_TRACKING_USERNAME", "MLFLOW_TRACKING_PASSWORD"):
            os.environ.pop(name, None)
        down = subprocess.run([LLMOPS, "stack", "down"], env=env, capture_output=True, text=True, timeout=120)
        assert down.returncode == 0, down.stderr
        state = json.loads((home / "stack" / "stack.json").read_text())
        assert state["services"] == {}
        # as root the cluster lives in /var/lib/postgresql, outside pytest's folders: about 80 MB a run otherwise
        shutil.rmtree(postgres_data_dir(home / "stack"), ignore_errors=True)


@pytest.fixture(scope="module")
def first_release(service, tmp_path_factory):
    """New data lands (pushed twice, as a retried upload would): the retrain deployment starts one release run.
    Once that run holds the serving lock, a second release of the same model is started by a person from the
    release deployment's run form in the Prefect UI (headless Chromium; Prefect is not on its default port)."""
    pushed_at = time.time()
    for _ in range(2):
        pushed = service.llmops("data", "push", str(DATASET), "s3://datasets/sft/")
        assert pushed.returncode == 0, pushed.stderr
        assert "emitted llmops.data.landed" in pushed.stdout
    release = wait_for(lambda: service.release_runs(), 120, "a release run started by retrain")[0]
    started_after = release_started_at(release) - pushed_at
    print(f"\nnew data -> release run {release['name']} created {started_after:.1f}s after the push")
    wait_for(
        lambda: (run := service.mlflow_run(release["id"])) and run.data.tags.get("serving_lock.acquired_at"),
        RELEASE_TIMEOUT,
        "the retrain's release run holding the serving lock",
        interval=2,
    )
    ui_url = service.api.removesuffix("/api")
    assert not ui_url.endswith(":4200")
    assert ui_api_url(ui_url) == service.api  # the UI calls the server it is served by
    started = time.monotonic()
    form = start_run_from_form(
        ui_url,
        service.deployment_id("release/release"),
        profile="cpu-tiny",
        data_source="s3://datasets/sft/",
        # a new version, which a person approves on its run page once the gate passed
        overrides=[*SERVING_OVERRIDES, "canary.window_s=1", "canary.probe_concurrency=2", "gate.approval=required"],
        screenshots=tmp_path_factory.mktemp("browser"),
        auth_string=service.env["PREFECT_API_AUTH_STRING"],  # the stack's Prefect asks for it
    )
    print(f"release run {form.flow_run['name']} started from the UI's run form in {time.monotonic() - started:.1f}s")
    assert form.offered_profiles == available_profiles()
    return release, form.flow_run


def release_started_at(flow_run: dict) -> float:
    from datetime import datetime

    return datetime.fromisoformat(flow_run["created"].replace("Z", "+00:00")).timestamp()


def test_prefect_and_mlflow_keep_their_records_in_postgresql(service, first_release):
    import psycopg2

    state = json.loads((service.home / "stack" / "stack.json").read_text())
    assert state["db"] == "postgres" and not (service.home / "stack" / "mlflow.db").exists()
    passfile = service.home / "stack" / "postgres.pgpass"
    assert passfile.stat().st_mode & 0o077 == 0
    with pytest.raises(psycopg2.OperationalError, match="password"):
        psycopg2.connect(
            host="127.0.0.1", port=state["ports"]["postgres"], user="llmops", dbname="prefect", passfile="/dev/null"
        )
    counts = {}
    for database, table in (("prefect", "flow_run"), ("mlflow", "runs")):
        connection = psycopg2.connect(
            host="127.0.0.1", port=state["ports"]["postgres"], user="llmops", dbname=database, passfile=str(passfile)
        )
        with connection, connection.cursor() as cursor:
            cursor.execute(f"SELECT count(*) FROM {table}")
            counts[database] = cursor.fetchone()[0]
        connection.close()
    assert counts["prefect"] >= len(service.release_runs()) >= 1
    assert counts["mlflow"] >= 1  # the release run of first_release, tracked through the MLflow server
    # each server's records belong to its own role, which cannot enter the other's database
    for database, other in (("prefect", "mlflow"), ("mlflow", "prefect")):
        connection = psycopg2.connect(
            host="127.0.0.1", port=state["ports"]["postgres"], user=database, dbname=database, passfile=str(passfile)
        )
        with connection, connection.cursor() as cursor:
            cursor.execute("SELECT DISTINCT tableowner FROM pg_tables WHERE schemaname = 'public'")
            assert [row[0] for row in cursor.fetchall()] == [database]
            cursor.execute("SELECT rolsuper FROM pg_roles WHERE rolname = current_user")
            assert cursor.fetchone()[0] is False
        connection.close()
        password = next(line for line in passfile.read_text().split() if f":{database}:{database}:" in line)
        with pytest.raises(psycopg2.OperationalError, match="permission denied"):
            psycopg2.connect(
                host="127.0.0.1",
                port=state["ports"]["postgres"],
                user=database,
                dbname=other,
                password=password.rsplit(":", 1)[1],
            )


def test_new_data_starts_one_release_run_that_becomes_champion(service, first_release):
    from mlflow import MlflowClient

    release, _ = first_release
    final = service.wait_final(release["id"])
    assert final["state_type"] == "COMPLETED", service.logs(release["id"])[-3000:]
    retrains = service.flow_runs(deployment_id={"any_": [service.deployment_id("retrain/retrain")]})
    assert len(retrains) == 2 and all(service.wait_final(r["id"], 120)["state_type"] == "COMPLETED" for r in retrains)
    assert len([r for r in service.release_runs() if "retrain" in r["tags"]]) == 1

    run = service.mlflow_run(release["id"])
    assert run.data.tags["release.outcome"] == "promoted"
    data = load_profile("cpu-tiny").data  # with its curated held-out set, data.eval_source
    expected = clean_and_split(read_source(str(DATASET)), data, read_source(str(data.eval_source))).fingerprint
    assert run.data.tags["data.fingerprint"] == expected
    version = MlflowClient(service.tracking_uri).get_model_version(MODEL, run.data.tags["registered_version"])
    assert version.tags["data.fingerprint"] == expected
    assert version.source.startswith("s3://artifacts/llmops/objects/")


def test_a_release_started_from_the_ui_waits_for_the_serving_lock_is_approved_in_the_ui_and_promotes(
    service, first_release, tmp_path
):
    from mlflow import MlflowClient

    release, second = first_release
    state = wait_for(
        lambda: (
            (state := service.get(f"/flow_runs/{second['id']}")["state_type"])
            in ("PAUSED", "COMPLETED", "FAILED", "CRASHED", "CANCELLED")
            and state
        ),
        RELEASE_TIMEOUT,
        "the UI's release paused for approval after its gate",
        interval=2,
        explain=lambda: service.logs(release["id"])[-1500:] + "\n---\n" + service.logs(second["id"]),
    )
    assert state == "PAUSED", service.logs(second["id"])[-3000:]
    waits_suspended_without_a_process(service, second["id"])  # its Triton and gateway of its own stopped with it
    started = time.monotonic()
    decided = decide_paused_run(
        service.api.removesuffix("/api"),
        second["id"],
        "approve",
        "answers match v1's",
        "release manager",
        tmp_path,
        service.env["PREFECT_API_AUTH_STRING"],
    )
    assert "Gate: PROMOTE tiny-qwen2-antonyms v" in decided.report and "gate-report" in decided.artifacts
    assert "release_report.html" in decided.report and "release-report" in decided.artifacts  # the page to read
    final = service.wait_final(second["id"])
    assert final["state_type"] == "COMPLETED", service.logs(second["id"])[-3000:]
    print(
        f"\nthe suspended release, approved in the UI, went on in a new process and ended {time.monotonic() - started:.1f}s later"
    )
    first_run, second_run = service.mlflow_run(release["id"]), service.mlflow_run(second["id"])
    assert second_run.data.params["profile/canary.probe_concurrency"] == "2"  # the form's parameters were used
    assert second["parameters"]["data_source"] == "s3://datasets/sft/"
    assert first_run.data.params["profile/canary.probe_concurrency"] == "4"
    held = [
        (float(r.data.tags["serving_lock.acquired_at"]), float(r.data.tags["serving_lock.released_at"]))
        for r in (first_run, second_run)
    ]
    print(
        f"\nserving lock held {held[0][1] - held[0][0]:.1f}s by the first release, then {held[1][1] - held[1][0]:.1f}s "
        f"by the second after waiting {second_run.data.metrics['serving_lock/wait_s']:.1f}s"
    )
    assert held[0][1] <= held[1][0], f"both releases held the serving lock at once: {held}"
    assert second_run.data.metrics["serving_lock/wait_s"] > 1
    service.wait_log(second["id"], "serving lock llmops-serving-tiny-qwen2-antonyms: acquiring")
    # started again on a Triton of its own, it loaded both versions and rolled out on the report the person read
    service.wait_log(second["id"], "gate: PROMOTE as measured before the suspension")
    # The same weights under a new profile digest: the gate finds no drop, the canary walks, it promotes.
    assert second_run.data.tags["release.outcome"] == "promoted", second_run.data.tags.get("gate.reasons")
    assert (second_run.data.tags["approval.by"], second_run.data.tags["approval.reason"]) == (
        "release manager",
        "answers match v1's",
    )
    client = MlflowClient(service.tracking_uri)
    champion = client.get_model_version_by_alias(MODEL, "champion")
    assert champion.version == second_run.data.tags["registered_version"]
    assert "Approval: approved by release manager at " in champion.description
    # through the stack's MLflow server: the page, and the eval split as served, one row per example, both versions
    assert [a.path for a in client.list_artifacts(second_run.info.run_id, "report")] == ["report/release_report.html"]
    logged = client.download_artifacts(second_run.info.run_id, "eval/served_answers_table.json", str(tmp_path))
    table = json.loads(Path(logged).read_text())
    rows = [dict(zip(table["columns"], row, strict=True)) for row in table["data"]]
    assert rows and all(r["candidate"] is not None and r["champion"] is not None for r in rows)


def test_the_same_data_again_starts_no_release_run(service, first_release):
    releases_before = len(service.release_runs())
    retrains_before = len(service.flow_runs(deployment_id={"any_": [service.deployment_id("retrain/retrain")]}))
    pushed = service.llmops("data", "push", str(DATASET), "s3://datasets/sft/")
    assert pushed.returncode == 0, pushed.stderr
    retrain = wait_for(
        lambda: (
            (runs := service.flow_runs(deployment_id={"any_": [service.deployment_id("retrain/retrain")]}))[
                retrains_before:
            ]
            and runs[-1]
        ),
        120,
        "a retrain run for the repeated data",
    )
    assert service.wait_final(retrain["id"], 180)["state_type"] == "COMPLETED"
    service.wait_log(retrain["id"], "data unchanged since tiny-qwen2-antonyms v")
    assert len(service.release_runs()) == releases_before


def test_an_api_run_uses_its_parameters_and_trains_on_the_stage_deployment(service, first_release):
    created = service.create_run(
        "release/release",
        {
            "profile": "cpu-tiny",
            "data_source": "s3://datasets/sft/",
            "overrides": [
                *("serve.deploy=false", "train.seed=3", "quantize.backend=none", "train.num_train_epochs=1"),
                "evaluate.min_improvement=-1",  # one epoch learns little: this test is about where training runs
                "run.remote_stages.train=run-stage/gpu",
            ],
        },
    )
    assert created.status_code == 201, created.text
    run_id = created.json()["id"]
    final = service.wait_final(run_id)
    assert final["state_type"] == "COMPLETED", service.logs(run_id)[-3000:]
    run = service.mlflow_run(run_id)
    assert run.data.params["profile/train.seed"] == "3"
    assert run.data.tags["stage.train"] == "cached"  # read back here after the stage deployment trained it
    assert run.data.metrics["train/final_loss"] > 0 and run.data.metrics["train/steps"] > 0
    stage_runs = [
        r
        for r in service.flow_runs(deployment_id={"any_": [service.deployment_id("run-stage/gpu")]})
        if r["parameters"]["mlflow_run_id"] == run.info.run_id
    ]
    assert [r["state_type"] for r in stage_runs] == ["COMPLETED"]
    service.wait_log(stage_runs[0]["id"], "train: running (key")


def test_bad_parameters_reach_the_caller_as_clear_messages(service, first_release):
    wrong_type = service.create_run("release/release", {"profile": "cpu-tiny", "overrides": "train.seed=3"})
    assert wrong_type.status_code == 409
    assert "overrides" in wrong_type.text, wrong_type.text

    unknown_key = service.create_run("release/release", {"profile": "cpu-tiny", "overrides": ["train.lora_rnk=4"]})
    assert unknown_key.status_code == 201
    final = service.wait_final(unknown_key.json()["id"], 180)
    assert final["state_type"] == "FAILED"
    assert "profile cpu-tiny: train.lora_rnk: unknown key" in final["state"]["message"]


def test_an_api_predict_naming_a_stranger_service_or_worker_files_is_refused_before_the_key_is_sent(service):
    """Issue 61, finding 2: the predict deployment sends the worker's OPENAI_API_KEY to its service_url and reads and
    writes the files its parameters name. From the API, a service URL off LLMOPS_RUN_SERVICES (a listening socket
    here), an input file and an output path outside LLMOPS_RUN_LOCATIONS (the stack's: s3://datasets) are each
    refused with one line naming the parameter, before any request: the socket sees no connection."""
    import socket
    import threading

    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen()
    listener.settimeout(1)
    port, connections, done = listener.getsockname()[1], [], threading.Event()

    def accept() -> None:
        while not done.is_set():
            try:
                connections.append(listener.accept())
            except OSError:
                continue

    watcher = threading.Thread(target=accept, daemon=True)
    watcher.start()
    allowed = {"data_source": "s3://datasets/score/prompts.txt", "output": "s3://datasets/scored/answers.jsonl"}
    cases = {
        "service_url": {**allowed, "service_url": f"http://127.0.0.1:{port}"},
        "data_source": {**allowed, "data_source": "/etc/passwd", "service_url": None},
        "output": {**allowed, "output": "/tmp/llmops-predict-escape.jsonl", "service_url": None},
    }
    try:
        created = {name: service.create_run("predict/predict", parameters) for name, parameters in cases.items()}
        assert all(r.status_code == 201 for r in created.values()), {n: r.text for n, r in created.items()}
        for name, run in created.items():
            final = service.wait_final(run.json()["id"], 180)
            assert final["state_type"] == "FAILED", (name, final["state"])
            assert f"BadInput: {name} " in final["state"]["message"], final["state"]["message"]
    finally:
        done.set()
        watcher.join()
        listener.close()
    assert connections == [] and not Path("/tmp/llmops-predict-escape.jsonl").exists()


# The flywheel's prompts: pairs the data does not hold, each phrasing in the train split (records.is_eval).
CORRECTIONS = {
    f"{phrasing} {word}{end}": antonym
    for word, antonym in (("guilty", "innocent"), ("victory", "defeat"), ("generous", "selfish"))
    for phrasing, end in (("What is the opposite of", "?"), ("Antonym of", ":"))
}
EMAIL = "jane.doe@example.com"


def stack_s3(env: dict):
    import boto3

    return boto3.client(
        "s3",
        endpoint_url=env["AWS_ENDPOINT_URL"],
        aws_access_key_id=env["AWS_ACCESS_KEY_ID"],
        aws_secret_access_key=env["AWS_SECRET_ACCESS_KEY"],
        region_name="us-east-1",
    )


def bucket_keys(env: dict, bucket: str, prefix: str) -> list[str]:
    return [o["Key"] for o in stack_s3(env).list_objects_v2(Bucket=bucket, Prefix=prefix).get("Contents", [])]


def captured_text(env: dict) -> str:
    """Every object under the stack's capture location, as S3 holds it."""
    s3 = stack_s3(env)
    keys = bucket_keys(env, "artifacts", "llmops/capture/")
    return "".join(s3.get_object(Bucket="artifacts", Key=key)["Body"].read().decode() for key in keys)


def mlflow_artifacts(tracking_uri: str, run_id: str) -> dict:
    """The JSON artifacts of a run, by path."""
    import tempfile

    from mlflow import MlflowClient

    client = MlflowClient(tracking_uri)
    with tempfile.TemporaryDirectory() as folder:
        paths = [a.path for a in client.list_artifacts(run_id) if a.path.endswith(".json")]
        return {path: json.loads(Path(client.download_artifacts(run_id, path, folder)).read_text()) for path in paths}


def mlflow_runs(tracking_uri: str, experiment: str) -> list:
    from mlflow import MlflowClient

    client = MlflowClient(tracking_uri)
    found = client.get_experiment_by_name(experiment)
    return client.search_runs([found.experiment_id]) if found else []


def served_answer(client, prompt: str, **extra) -> tuple[str, str]:
    """(response id, answer) of one chat completion through the gateway."""
    completion = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": prompt}], max_tokens=8, temperature=0, **extra
    )
    return completion.id, completion.choices[0].message.content


async def posted_at_once(url: str, count: int) -> list:
    """`count` chat completions sent together (not kept: X-LLMOps-Capture off), their answers."""
    import httpx

    body = {"messages": [{"role": "user", "content": "What is the opposite of up?"}], "max_tokens": 8}
    async with httpx.AsyncClient(timeout=60, headers={"X-LLMOps-Capture": "off"}) as client:
        return await asyncio.gather(*(client.post(url, json=body) for _ in range(count)))


def the_openai_api_keeps_its_word(client) -> None:
    """/v1 through the real stack (llmops serve, Triton, the python backend, the openai SDK): forced lengths run as
    asked, logprobs come from the model's logits (whole and per streamed chunk), and what this engine does not honour
    is a 400 naming the field (every field against the protocol layer: tests/unit/test_openai_fields.py). Not captured
    (opted out): the flywheel's counts stay its own."""
    import openai

    ask = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "What is the opposite of hot?"}],
        "temperature": 0,
        "extra_headers": {"X-LLMOps-Capture": "off"},
    }
    plain = client.chat.completions.create(max_tokens=16, logprobs=True, top_logprobs=2, **ask)
    content = plain.choices[0].logprobs.content
    assert "".join(t.token for t in content) == plain.choices[0].message.content and len(content) < 8, plain
    # greedy: each token is the model's most likely one, with its log probability under the model
    assert all(len(t.top_logprobs) == 2 and t.logprob == t.top_logprobs[0].logprob <= 0 for t in content), content
    forced = client.chat.completions.create(max_tokens=16, logprobs=True, extra_body={"min_tokens": 8}, **ask)
    assert len(forced.choices[0].logprobs.content) >= 8 and forced.usage.completion_tokens >= 8, forced
    to_the_end = client.chat.completions.create(max_tokens=12, logprobs=True, extra_body={"ignore_eos": True}, **ask)
    assert len(to_the_end.choices[0].logprobs.content) == 12 and to_the_end.choices[0].finish_reason == "length"
    # sampled, but from a nucleus of the most likely token alone (a second one would need a first below 1e-6):
    # the greedy answer
    nucleus = client.chat.completions.create(max_tokens=16, **{**ask, "temperature": 1.5}, top_p=1e-6, seed=5)
    assert nucleus.choices[0].message.content == plain.choices[0].message.content

    chunks = list(client.chat.completions.create(max_tokens=16, logprobs=True, top_logprobs=1, stream=True, **ask))
    streamed = [t for c in chunks if c.choices and c.choices[0].logprobs for t in c.choices[0].logprobs.content]
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == plain.choices[0].message.content and [t.token for t in streamed] == [t.token for t in content]
    assert [t.logprob for t in streamed] == pytest.approx([t.logprob for t in content], abs=1e-4)

    completion = client.completions.create(
        model=MODEL,
        prompt="What is the opposite of up?",
        max_tokens=4,
        logprobs=1,
        temperature=0,
        extra_headers={"X-LLMOps-Capture": "off"},
    )
    scored = completion.choices[0].logprobs
    assert "".join(scored.tokens) == completion.choices[0].text and len(scored.top_logprobs[0]) == 1, scored

    tool = {"type": "function", "function": {"name": "opposite", "parameters": {"type": "object"}}}
    refusals = [
        ({"tools": [tool]}, "tools", "the python backend has no tool parser"),
        ({"response_format": {"type": "json_object"}}, "response_format", "no guided decoding"),
        ({"extra_body": {"beam_width": 2}}, "beam_width", "not a parameter of OpenAI's chat completions API"),
    ]
    for extra, param, reason in refusals:
        with pytest.raises(openai.BadRequestError) as refused:
            client.chat.completions.create(max_tokens=4, **ask, **extra)
        assert refused.value.param == param and reason in refused.value.message, refused.value

    # /v1/models: the service, then the live versions of the gateway's route table; naming one is refused here
    # (serve.version_pinning is off by default)
    models = [m.id for m in client.models.list()]
    assert models[0] == MODEL and models[1:] and all(m.startswith(f"{MODEL}-v") for m in models[1:]), models
    with pytest.raises(openai.BadRequestError) as pinned:
        client.chat.completions.create(max_tokens=4, **{**ask, "model": models[1]})
    assert pinned.value.param == "model" and "serve.version_pinning" in pinned.value.message, pinned.value


def restart_prefect_and_worker(service: Service) -> None:
    """The stack's worker and Prefect server stopped, then started again by `llmops stack up` on the same port and
    database (PostgreSQL)."""
    from tasks.platform.local_stack import Server

    stack = service.home / "stack" / "stack.json"
    before = json.loads(stack.read_text())["services"]
    for name in ("worker", "prefect"):
        Server(**before[name]).stop()
    up = service.llmops("stack", "up", timeout=400)
    assert up.returncode == 0, up.stdout + up.stderr
    after = json.loads(stack.read_text())["services"]
    assert after["prefect"]["url"] == before["prefect"]["url"]
    assert {name: after[name]["pid"] != before[name]["pid"] for name in ("worker", "prefect")} == {
        "worker": True,
        "prefect": True,
    }


def test_served_exchanges_and_their_corrections_become_data_that_retrains_the_champion(
    service, first_release, tmp_path
):
    """`llmops serve` starts while MLflow is frozen (from its deployment record). Capture on: clients ask, rate and
    correct answers; `llmops data harvest` builds a dataset (corrections in,
    redacted values and held-out prompts out); the flywheel deployment lands it pending and starts nothing until a
    person approves it; then the retrain's release passes the gate on the served Triton, waits for a person's
    approval (it trained on harvested data), and the new champion answers with the corrections."""
    import httpx
    import openai

    log = tmp_path / "serve.log"
    ports = ["--port", "0", "--control-port", "0", "--triton-http-port", "0", "--triton-grpc-port", "0"]
    ports += ["--metrics-port", "0", "--gateway-metrics-port", "0"]
    capture = ["--set", "serve.capture.enabled=true", "--set", "serve.capture.flush_s=0.5"]
    capture += ["--set", "serve.limits.max_in_flight_per_key=2"]  # this test's requests come one at a time
    # MLflow frozen (SIGSTOP: its port takes connections, nothing answers) while `llmops serve` starts: it serves the
    # champion its deployment record names, from the store, without the registry (issue 37)
    mlflow = json.loads((service.home / "stack" / "stack.json").read_text())["services"]["mlflow"]["pid"]
    os.killpg(mlflow, signal.SIGSTOP)
    with open(log, "w") as out:
        serving = subprocess.Popen(
            [LLMOPS, "serve", *ports, *capture],
            env=service.env,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    try:
        try:
            state = wait_for(
                lambda: (
                    (service.home / "triton" / "server.json").is_file()
                    and json.loads((service.home / "triton" / "server.json").read_text())
                ),
                180,
                f"llmops serve publishing its gateway ({log})",
                explain=log.read_text,
            )
        finally:
            os.killpg(mlflow, signal.SIGCONT)
        assert f"serving {MODEL} (champion v" in log.read_text() and "from the deployment record)" in log.read_text()
        gateway = state["gateway_url"]
        # the limits in force, said at start in one line (issue 41); the defaults leave a first load test room
        assert "llmops serve: limits per client (no keys: all clients are one): 1,000 requests/s" in log.read_text()
        assert ", 2 requests in flight; all together: 128 requests in flight" in log.read_text()
        client = openai.OpenAI(base_url=f"{gateway}/v1", api_key="none", max_retries=0)
        the_openai_api_keeps_its_word(client)
        held_out = clean_and_split(read_source(str(DATASET)), load_profile("cpu-tiny").data).eval[0]
        asked = {prompt: served_answer(client, prompt) for prompt in CORRECTIONS}
        # credentials of each kind pasted into a prompt and its correction: redacted before anything keeps them (the
        # PEM block in the correction only: with it the prompt outgrows the tiny model's context of 512 tokens)
        pasted_in_prompt = " ".join(v for k, v in PASTED.items() if k != "PEM private key body")
        email_id, _ = served_answer(client, f"What is the opposite of hot? Write to {EMAIL} {pasted_in_prompt}")
        held_out_id, _ = served_answer(client, held_out[0]["content"])
        bad_id, _ = served_answer(client, "What is the opposite of never?")
        served_answer(client, "Call 13812345678: opposite of up?", extra_headers={"X-LLMOps-Capture": "off"})
        judged = [
            *({"id": asked[p][0], "rating": "bad", "correction": c} for p, c in CORRECTIONS.items()),
            {"id": email_id, "rating": "bad", "correction": f"cold; {SECRETS_TEXT}"},
            {"id": held_out_id, "rating": "good"},
            {"id": bad_id, "rating": "bad"},
        ]
        for feedback in judged:
            assert httpx.post(f"{gateway}/v1/feedback", json=feedback, timeout=10).status_code == 200
        wait_for(
            lambda: (
                'llmops_capture_records_total{kind="feedback"} 9.0'
                in httpx.get(f"{state['gateway_metrics_url']}/metrics").text
            ),
            30,
            "the gateway writing what it kept",
            interval=0.5,
        )
        out, report_file = tmp_path / "harvested", tmp_path / "report.json"
        harvested = service.llmops(
            *("data", "harvest", "--data", "s3://datasets/sft/", "--since", "1h"),
            *("--out", str(out), "--report", str(report_file)),
        )
        assert harvested.returncode == 0, harvested.stdout + harvested.stderr
        print(f"\n{harvested.stdout}")
        report = json.loads(report_file.read_text())
        counts = report["counts"]
        assert (counts["exchanges"], counts["feedback"], counts["records"]) == (9, 9, 7), counts
        assert (counts["corrected"], counts.get("good", 0)) == (7, 0), counts
        assert counts["eval_overlap_dropped"] == counts["bad_dropped"] == 1, counts
        (dataset,) = out.glob("harvest-*.jsonl")
        records = [json.loads(line)["messages"] for line in dataset.read_text().splitlines()]
        assert {r[0]["content"]: r[1]["content"] for r in records if r[0]["content"] in CORRECTIONS} == CORRECTIONS
        (pasted,) = [r for r in records if r[0]["content"] not in CORRECTIONS]
        assert pasted[0]["content"] == "What is the opposite of hot? Write to [EMAIL] " + " ".join(
            ["[SECRET]"] * 4 + ["[IBAN]"]
        )
        assert pasted[1]["content"].startswith("cold; my key [SECRET]; aws [SECRET] [SECRET]; token [SECRET]")
        bucket_text = captured_text(service.env)
        assert EMAIL not in bucket_text + dataset.read_text() and "13812345678" not in bucket_text
        assert bucket_text.count('"rating"') == 9
        assert all(k.startswith(("exchanges/", "feedback/")) for k in report["captured_objects"])

        assert report["clients"] == {"anonymous": 7} and len(report["corrections"]) == 7

        # The flywheel deployment harvests the same into the pending location and waits for a person: an anonymous
        # client's corrections start no release unreviewed. Approved, they go where the retrain deployment watches.
        releases_before = {r["id"] for r in service.release_runs()}
        flywheel = service.create_run("flywheel/flywheel", {"since_hours": 1, "min_new_records": 5})
        assert flywheel.status_code == 201, flywheel.text
        flywheel_id = flywheel.json()["id"]
        wait_for(
            lambda: service.get(f"/flow_runs/{flywheel_id}")["state_type"] == "PAUSED", 180, "the harvest's review"
        )
        assert not [r for r in service.release_runs() if r["id"] not in releases_before]
        assert not [k for k in bucket_keys(service.env, "datasets", "sft/") if "harvest-" in k]
        approved = service.llmops("approve", flywheel_id, "--reason", "corrections read; they are right")
        assert approved.returncode == 0, approved.stdout + approved.stderr
        turned = service.wait_final(flywheel_id, 180)
        assert turned["state_type"] == "COMPLETED", service.logs(flywheel_id)[-3000:]
        service.wait_log(flywheel_id, "7 new records (approved by ")
        service.wait_log(flywheel_id, "pushed 1 file(s) to s3://datasets/sft/")
        tracked = mlflow_runs(service.tracking_uri, "llm-flywheel")
        assert [r.data.metrics["harvest.corrected"] for r in tracked] == [7.0]
        assert tracked[0].data.tags["harvest.dataset"].startswith("s3://datasets/sft/harvest-tiny-qwen2-antonyms-")
        release = wait_for(
            lambda: [r for r in service.release_runs() if r["id"] not in releases_before],
            120,
            "the release run the harvested data started",
        )[0]
        wait_for(lambda: flow_run_processes(release["id"]), 120, "the process the worker runs the release in")
        # A release trained on harvested data waits for a person too (gate.approval harvested, cpu-tiny's default):
        # suspended, its process gone, through a restart of the Prefect server and of the worker
        wait_for(
            lambda: service.get(f"/flow_runs/{release['id']}")["state_type"] == "PAUSED", RELEASE_TIMEOUT, "approval"
        )
        waits_suspended_without_a_process(service, release["id"])
        started = time.monotonic()
        restart_prefect_and_worker(service)
        print(f"\nPrefect server and worker restarted in {time.monotonic() - started:.1f}s while the release waited")
        assert service.get(f"/flow_runs/{release['id']}")["state_name"] == "Suspended"
        listed = service.llmops("approve")
        assert f"{release['id']}  {MODEL} v" in listed.stdout, listed.stdout + listed.stderr
        started = time.monotonic()
        approved = service.llmops("approve", release["id"], "--reason", "the gate passed; answers read")
        assert approved.returncode == 0, approved.stdout + approved.stderr
        final = service.wait_final(release["id"])
        assert final["state_type"] == "COMPLETED", service.logs(release["id"])[-3000:]
        print(
            f"approved with llmops approve: the release went on in a new process, ended {time.monotonic() - started:.1f}s later"
        )
        run = service.mlflow_run(release["id"])  # one MLflow run: the resumed process continued it
        assert run.data.tags["release.outcome"] == "promoted", run.data.tags.get("gate.reasons")
        assert run.data.tags["data.harvested_records"] == "7" and run.data.tags["approval.decision"] == "approved"
        assert run.data.tags["stage.train"] == "ran"  # its first process trained; the resumed one hit the cache
        service.wait_log(release["id"], "train: cache hit")
        service.wait_log(release["id"], "gate: PROMOTE as measured before the suspension")  # no second measurement
        served = {prompt: served_answer(client, prompt)[1].strip() for prompt in CORRECTIONS}
        print(f"the new champion v{run.data.tags['registered_version']} answers: {served}")
        assert served == CORRECTIONS
        # A client over its cap in flight is refused at once, in OpenAI's shape, naming the setting (issue 38)
        at_once = asyncio.run(posted_at_once(f"{gateway}/v1/chat/completions", 16))
        refused = [answer for answer in at_once if answer.status_code == 429]
        assert refused and {answer.status_code for answer in at_once} == {200, 429}, at_once
        assert {answer.json()["error"]["message"] for answer in refused} == {
            "rate limit: serve.limits.max_in_flight_per_key = 2 per key; retry after 1.0 s"
        }
        assert all(answer.headers["retry-after"] == "1" for answer in refused)
        pushed = stack_s3(service.env).get_object(Bucket="datasets", Key=tracked[0].data.tags["harvest.dataset"][14:])
        kept = captured_text(service.env) + dataset.read_text() + pushed["Body"].read().decode()
        kept += "".join(json.dumps(mlflow_artifacts(service.tracking_uri, r.info.run_id)) for r in tracked)
        leaks = leaks_in_mlflow(PASTED, service.tracking_uri) + leaks_in_prefect(PASTED, service.api, service.http)
        assert [name for name, value in PASTED.items() if value in kept] == [] and leaks == []
        # lm-evaluation-harness through the gateway (loglikelihoods from echoed completions, answers from chat)
        # scores as the served champion's own folder does in this process (issue 43; last: its exchanges are kept)
        served_dir = harness.served_model_dir(Path(state["repository"]), MODEL)
        scores = harness.compare(gateway, MODEL, served_dir)
        print(f"lm-evaluation-harness through the gateway, as in-process: {scores}")
        # AIPerf's chat load with min_tokens gets the lengths it asked for, counted by the engine (issue 43)
        lengths = aiperf_output_lengths(gateway, served_dir, tmp_path / "aiperf")
        assert lengths["mismatches"] == 0 and lengths["min"] == lengths["max"] == 16, lengths
    finally:
        os.killpg(serving.pid, signal.SIGTERM)
        serving.wait(60)


def aiperf_output_lengths(gateway: str, tokenizer_dir: Path, work: Path) -> dict:
    """One AIPerf run on the gateway's chat completions, asking 16 tokens an answer with vLLM's min_tokens (as AIPerf
    itself advises) and reading the lengths from usage (--use-server-token-count: the engine's count; AIPerf would
    otherwise re-encode the text with the tokenizer); the output lengths it measured and its mismatch warnings."""
    command = [
        str(ROOT / ".venv-aiperf" / "bin" / "aiperf"),
        *("profile", "--model", MODEL, "--url", gateway, "--endpoint-type", "chat", "--streaming"),
        *("--tokenizer", str(tokenizer_dir), "--synthetic-input-tokens-mean", "20"),
        *("--synthetic-input-tokens-stddev", "0", "--output-tokens-mean", "16", "--output-tokens-stddev", "0"),
        *("--extra-inputs", "min_tokens:16", "--use-server-token-count"),
        *("--concurrency", "2", "--request-count", "8", "--random-seed", "0", "--ui-type", "none"),
        *("--no-server-metrics", "--no-gpu-telemetry", "--artifact-dir", str(work)),
    ]
    # not HF_HUB_OFFLINE: AIPerf 0.13.0 then looks a local tokenizer folder up as a hub snapshot (tasks/load/aiperf.py)
    env = {k: v for k, v in os.environ.items() if k not in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE")}
    done = subprocess.run(command, capture_output=True, text=True, timeout=300, env=env)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    lengths = json.loads((work / "profile_export_aiperf.json").read_text())["output_sequence_length"]
    return {**lengths, "mismatches": (done.stdout + done.stderr).count("OSL mismatch")}


def test_no_secret_leaks_into_files_tracking_or_prefect(service, first_release):
    """After every release of this module: the S3 secret, the PostgreSQL password, Prefect's auth string and MLflow's login are in no file of the home
    but the mode-600 ones that keep them, no MLflow param or tag (runs and registry), and no Prefect flow-run
    parameter, log line, artifact or variable. Each release's Triton had its own key, kept in that run's memory
    only (test_serving.py checks the key of `llmops serve`'s Triton)."""
    stack_dir = service.home / "stack"
    state = json.loads((stack_dir / "stack.json").read_text())
    assert not (service.home / "triton" / "control.key").exists()  # no key outlives its Triton
    assert not (service.home / "serving" / "control.key").exists()  # nor the serve's own, its serve
    secrets = {
        "S3 secret": state["s3_credentials"]["secret"],
        **{
            f"PostgreSQL password of {line.split(':')[3]}": line.rsplit(":", 1)[1]
            for line in (stack_dir / "postgres.pgpass").read_text().split()
        },
        "Prefect auth string": state["prefect_auth"].partition(":")[2],
        "MLflow admin password": state["mlflow_login"]["password"],
        "MLflow secret key": state["mlflow_login"]["secret_key"],
        **{f"MLflow password of {account}": password for account, password in state["mlflow_accounts"].items()},
    }
    assert all(len(value) >= 24 for value in secrets.values())
    kept_on_purpose = {stack_dir / "stack.json", stack_dir / "postgres.pgpass"}
    assert all(path.stat().st_mode & 0o077 == 0 for path in kept_on_purpose)
    leaks = (
        leaks_in_files(secrets, service.home, kept_on_purpose)
        + leaks_in_mlflow(secrets, service.tracking_uri)
        + leaks_in_prefect(secrets, service.api, service.http)
    )
    assert not leaks, leaks[:10]
    # rclone takes the S3 secret from its environment, MLflow and the worker need it there; no command line has it
    in_processes = leaks_in_processes(secrets)
    assert not [leak for leak in in_processes if " argv: " in leak[0]]
    # MLflow's admin password is in its server's environment only (it makes the account from it), and the reader's in
    # no process: the worker and its flow runs log in as the release account
    mlflow = psutil.Process(state["services"]["mlflow"]["pid"])
    mlflow_pids = {mlflow.pid, *(child.pid for child in mlflow.children(recursive=True))}
    holders = {name: {int(where.split()[1]) for where, leaked in in_processes if leaked == name} for name in secrets}
    assert holders["MLflow admin password"] and holders["MLflow admin password"] <= mlflow_pids
    assert holders["MLflow password of llmops-reader"] == set()
    assert holders["MLflow password of llmops-release"] - mlflow_pids  # the worker's


def assert_mlflow_accounts(state: dict, exports: subprocess.CompletedProcess, reader: subprocess.CompletedProcess):
    """`llmops stack env` logs into MLflow as the release account and `--mlflow-reader` as the read-only one, neither
    as the admin; the release account registers a model and moves its aliases, the reader reads them and gets 403 on
    moving or deleting one (MLflow's own permission check), and no login is 401."""
    assert exports.returncode == 0 and reader.returncode == 0, exports.stderr + reader.stderr
    release_env, reader_env = (
        dict(line.removeprefix("export ").replace("'", "").split("=", 1) for line in out.stdout.splitlines())
        for out in (exports, reader)
    )
    assert release_env["MLFLOW_TRACKING_USERNAME"] == "llmops-release"
    assert set(reader_env) == {"MLFLOW_TRACKING_URI", "MLFLOW_TRACKING_USERNAME", "MLFLOW_TRACKING_PASSWORD"}
    assert reader_env["MLFLOW_TRACKING_USERNAME"] == "llmops-reader"
    assert state["mlflow_login"]["password"] not in exports.stdout + reader.stdout  # the admin's stays in stack.json
    api = f"{release_env['MLFLOW_TRACKING_URI']}/api/2.0/mlflow"
    as_release = (release_env["MLFLOW_TRACKING_USERNAME"], release_env["MLFLOW_TRACKING_PASSWORD"])
    as_reader = (reader_env["MLFLOW_TRACKING_USERNAME"], reader_env["MLFLOW_TRACKING_PASSWORD"])
    assert requests.get(f"{api}/experiments/search", params={"max_results": 1}, timeout=10).status_code == 401
    for step, body in (
        ("registered-models/create", {"name": "svc"}),
        ("model-versions/create", {"name": "svc", "source": "s3://artifacts/llmops/objects/v1"}),
        ("model-versions/create", {"name": "svc", "source": "s3://artifacts/llmops/objects/v2"}),
        ("registered-models/alias", {"name": "svc", "alias": "champion", "version": "1"}),
    ):
        made = requests.post(f"{api}/{step}", json=body, auth=as_release, timeout=10)
        assert made.status_code == 200, (step, made.text)
    champion = {"name": "svc", "alias": "champion"}
    read = requests.get(f"{api}/registered-models/alias", params=champion, auth=as_reader, timeout=10)
    assert read.status_code == 200 and read.json()["model_version"]["version"] == "1", read.text
    assert requests.get(f"{api}/experiments/search", params={"max_results": 1}, auth=as_reader, timeout=10).ok
    moved = requests.post(
        f"{api}/registered-models/alias", json={**champion, "version": "2"}, auth=as_reader, timeout=10
    )
    deleted = requests.delete(f"{api}/registered-models/alias", json=champion, auth=as_reader, timeout=10)
    tag = {"name": "svc", "version": "1", "key": "gate.decision", "value": "pass"}
    tagged = requests.post(f"{api}/model-versions/set-tag", json=tag, auth=as_reader, timeout=10)
    assert (moved.status_code, deleted.status_code, tagged.status_code) == (403, 403, 403), moved.text + tagged.text
    read = requests.get(f"{api}/registered-models/alias", params=champion, auth=as_release, timeout=10)
    assert read.json()["model_version"]["version"] == "1"


def test_the_default_stack_runs_on_sqlite_and_its_ui_follows_its_port(tmp_path):
    """`llmops stack up` without --db: sqlite for Prefect and MLflow; switching the database of a running
    stack is refused with what to do; `down` stops everything."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PREFECT_API", "MLFLOW_", "AWS_"))}
    env.update(LLMOPS_HOME=str(tmp_path / "home"), PREFECT_HOME=str(tmp_path / "home" / "prefect"))

    def stack(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run([LLMOPS, "stack", *args], env=env, capture_output=True, text=True, timeout=300)

    up = stack("up", "--prefect-port", "0", "--mlflow-port", "0", "--s3-port", "0")
    try:
        assert up.returncode == 0, up.stdout + up.stderr
        assert "database:    sqlite" in up.stdout
        state = json.loads((tmp_path / "home" / "stack" / "stack.json").read_text())
        assert state["db"] == "sqlite" and "postgres" not in state["services"]
        assert (tmp_path / "home" / "stack" / "mlflow.db").is_file()
        api = f"http://127.0.0.1:{state['ports']['prefect']}/api"
        assert ui_api_url(api.removesuffix("/api")) == api
        # the UI whole, from a folder of the stack's own (one shared in the venv was emptied by two servers at once)
        assert ui_script_type(api.removesuffix("/api")) in ("text/javascript", "application/javascript")
        assert (tmp_path / "home" / "stack" / "prefect-server" / "ui-build" / "v1" / "index.html").is_file()
        # Prefect answers only with the stack's auth string (other local users reach the port too)
        assert prefect_api().post(f"{api}/flow_runs/filter", json={}, timeout=10).status_code == 401
        assert prefect_api("llmops:wrong").post(f"{api}/flow_runs/filter", json={}, timeout=10).status_code == 401
        assert (
            prefect_api(state["prefect_auth"]).post(f"{api}/flow_runs/filter", json={}, timeout=10).status_code == 200
        )
        # and MLflow only with a login: the release account of `stack env` moves aliases, the reader's only reads
        assert_mlflow_accounts(state, stack("env"), stack("env", "--mlflow-reader"))
        # MLflow's job execution stays off: no huey consumers idling beside the server (benchmarks/stack_idle.py)
        mlflow_tree = psutil.Process(state["services"]["mlflow"]["pid"]).children(recursive=True)
        assert not [p.cmdline() for p in mlflow_tree if "huey" in " ".join(p.cmdline())]
        switched = stack("up", "--db", "postgres")
        assert switched.returncode == 2
        assert "--db postgres: the stack runs on sqlite; `llmops stack down` first" in switched.stderr
    finally:
        down = stack("down")
        assert down.returncode == 0, down.stderr
    assert json.loads((tmp_path / "home" / "stack" / "stack.json").read_text())["services"] == {}
