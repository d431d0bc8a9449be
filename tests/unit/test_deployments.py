"""infra/prefect.yaml, the Kubernetes GPU job template and the remote-stage plumbing, without a cluster."""

import asyncio
import json
import os
import re
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest
import yaml

from tasks.platform.config import HEAVY_STAGES, available_profiles, load_profile
from tasks.platform.errors import ArtifactMissing
from tasks.platform.local_stack import Server
from tasks.platform.stage_cache import RunContext, StageResult, job_variables, run_cached
from tasks.platform.store import Artifact, LocalStore
from tasks.platform.tracking import Tracker

ROOT = Path(__file__).resolve().parents[2]
PREFECT_FILE = ROOT / "infra" / "prefect.yaml"
GPU_TEMPLATE = ROOT / "infra" / "work-pools" / "kubernetes-gpu.json"
GPU_PROFILES = [p for p in available_profiles() if load_profile(p).hardware.accelerator == "cuda"]


def deployments() -> dict[str, dict]:
    return {d["name"]: d for d in yaml.safe_load(PREFECT_FILE.read_text())["deployments"]}


def render_job(profile_name: str) -> dict:
    """The Job manifest the Kubernetes worker would submit for a heavy stage of this profile."""
    from prefect.client.schemas.objects import FlowRun
    from prefect_kubernetes.worker import KubernetesWorkerJobConfiguration

    values = {**job_variables(load_profile(profile_name)), "env": {"LLMOPS_ARTIFACTS": "s3://artifacts/llmops"}}

    async def render():
        config = await KubernetesWorkerJobConfiguration.from_template_and_values(
            json.loads(GPU_TEMPLATE.read_text()), values
        )
        config.prepare_for_flow_run(FlowRun(flow_id=uuid.uuid4(), name="train-abc"))
        return config.job_manifest

    return asyncio.run(render())


def as_kubernetes_job(manifest: dict) -> dict:
    """Round-trip through the Kubernetes client's V1Job model: required fields are enforced and any
    key the Job schema does not know is dropped, so equality means a valid manifest."""
    from kubernetes_asyncio.client import ApiClient

    async def round_trip():
        async with ApiClient() as api:
            return api.sanitize_for_serialization(api._ApiClient__deserialize(manifest, "V1Job"))

    return asyncio.run(round_trip())


def test_there_are_gpu_profiles():
    assert "qwen-7b-qlora-2xa10" in GPU_PROFILES


@pytest.mark.parametrize("profile_name", GPU_PROFILES)
def test_gpu_job_template_renders_a_valid_job_for_each_gpu_profile(profile_name):
    profile = load_profile(profile_name)
    manifest = render_job(profile_name)
    assert json.loads(json.dumps(as_kubernetes_job(manifest)), parse_int=str) == json.loads(
        json.dumps(manifest), parse_int=str
    )
    pod = manifest["spec"]["template"]["spec"]
    container = pod["containers"][0]
    assert container["resources"]["limits"]["nvidia.com/gpu"] == profile.hardware.gpus
    assert container["resources"]["requests"]["nvidia.com/gpu"] == profile.hardware.gpus
    assert container["image"] == profile.hardware.kubernetes.image
    assert pod["nodeSelector"] == profile.hardware.kubernetes.node_selector
    assert pod["tolerations"] == profile.hardware.kubernetes.tolerations
    env = {e["name"]: e["value"] for e in container["env"]}
    assert env["LLMOPS_ARTIFACTS"] == "s3://artifacts/llmops" and "PREFECT__FLOW_RUN_ID" in env
    assert container["args"] == ["prefect", "flow-run", "execute"]
    assert {"name": "dshm", "mountPath": "/dev/shm"} in container["volumeMounts"]
    # the store's and MLflow's credentials reach the stage's pod from a Secret (Prefect passes only its own settings)
    assert container["envFrom"] == [{"secretRef": {"name": "llmops-stage-credentials", "optional": False}}]


def test_cpu_profile_has_no_gpu_job_variables():
    assert job_variables(load_profile("cpu-tiny")) == {}


def test_prefect_yaml_entrypoints_are_flows_with_documented_parameters():
    from prefect.flows import load_flow_from_entrypoint
    from prefect.utilities.callables import parameter_schema

    for name, deployment in deployments().items():
        flow = load_flow_from_entrypoint(str(ROOT / deployment["entrypoint"]))
        schema = parameter_schema(flow.fn).model_dump()
        assert set(deployment.get("parameters", {})) <= set(schema["properties"]), name
        undocumented = [p for p, s in schema["properties"].items() if not s.get("description")]
        assert not undocumented, f"{name}: parameters without a description in the UI form: {undocumented}"
        assert deployment["enforce_parameter_schema"] is True


def test_retrain_trigger_watches_its_own_data_location():
    retrain = deployments()["retrain"]
    (trigger,) = retrain["triggers"]
    assert trigger["expect"] == ["llmops.data.landed"]
    assert trigger["match"]["prefect.resource.id"] == f"llmops.data.{retrain['parameters']['data_source']}*"
    assert retrain["schedules"][0]["cron"]


def test_the_flywheel_pushes_its_harvest_where_the_retrain_deployment_watches():
    flywheel, retrain = deployments()["flywheel"], deployments()["retrain"]
    assert flywheel["parameters"]["data_destination"] == retrain["parameters"]["data_source"]
    assert flywheel["parameters"]["profile"] == retrain["parameters"]["profile"]
    assert flywheel["schedules"][0]["cron"]


def test_the_predict_deployment_names_its_input_version_and_output_and_waits_to_be_turned_on():
    predict = deployments()["predict"]
    assert predict["parameters"]["version"] == "champion"
    assert predict["parameters"]["data_source"].startswith("s3://")
    assert predict["parameters"]["output"].startswith("s3://") and predict["parameters"]["output"].endswith(".jsonl")
    (schedule,) = predict["schedules"]
    assert schedule["cron"] and schedule["active"] is False  # no nightly failures before data_source holds rows


@pytest.mark.parametrize(("pool_type", "expected"), [("kubernetes", "/opt/llmops"), ("process", str(ROOT))])
def test_stage_runs_start_where_their_worker_has_the_project(monkeypatch, pool_type, expected):
    """`prefect deploy` bakes environment placeholders into the pull steps (prefect/cli/deploy/_core.py,
    apply_values on pull_steps): on Kubernetes the deploying checkout's path would not exist in the pod."""
    from prefect.utilities.templating import apply_values

    from flows.deploy import deployment_variables

    for name, value in deployment_variables("llmops-gpu", pool_type).items():
        monkeypatch.setenv(name, value)
    steps = apply_values(deployments()["gpu"]["pull"], {}, remove_notset=False)
    assert steps == [{"prefect.deployments.steps.set_working_directory": {"directory": expected}}]
    if pool_type == "kubernetes":  # each stage image holds the project there
        for dockerfile in (ROOT / "infra" / "images").glob("*.Dockerfile"):
            assert re.search(rf"^WORKDIR {expected}$", dockerfile.read_text(), re.M), dockerfile.name
    release = apply_values(yaml.safe_load(PREFECT_FILE.read_text())["pull"], {}, remove_notset=False)
    assert release == [{"prefect.deployments.steps.set_working_directory": {"directory": str(ROOT)}}]


def test_gpu_profiles_place_heavy_stages_on_the_deployed_stage_flow():
    gpu = deployments()["gpu"]
    assert gpu["entrypoint"] == "flows/remote_stage.py:run_stage"
    for name in GPU_PROFILES:
        placed = load_profile(name).run.remote_stages
        assert placed and set(placed) <= set(HEAVY_STAGES)
        assert set(placed.values()) == {"run-stage/gpu"}


def test_every_placeable_stage_has_a_function_on_the_stage_deployment():
    from flows.remote_stage import STAGE_FUNCTIONS

    assert set(STAGE_FUNCTIONS) == set(HEAVY_STAGES)


def test_stage_result_survives_the_trip_through_flow_parameters():
    result = StageResult(
        "train", Artifact("ab" * 32, "s3://b/objects/abab"), {"loss": 1.5}, False, 2.0, "k", "loss 1.5"
    )
    assert StageResult.from_dict(json.loads(json.dumps(result.as_dict()))) == result


def test_a_cache_only_context_refuses_to_run_a_stage(tmp_path):
    ctx = RunContext(
        load_profile("cpu-tiny"),
        LocalStore(tmp_path / "store"),
        Tracker("sqlite://", "", ""),
        tmp_path,
        cache_only=True,
    )
    ran = []
    with pytest.raises(ArtifactMissing, match="must use the same store"):
        run_cached(ctx, "train", {"x": 1}, lambda out: ran.append(out) or {})
    assert ran == []


def test_server_is_not_alive_when_its_pid_belongs_to_another_program():
    other = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        ours = Server("py", other.pid, "", "", [sys.executable])
        deadline = time.monotonic() + 10
        while not ours.alive() and time.monotonic() < deadline:  # /proc/PID/cmdline right after the fork
            time.sleep(0.05)
        assert ours.alive()
        assert not Server("s3", other.pid, "", "", ["/usr/bin/not-rclone"]).alive()
    finally:
        other.kill()
        other.wait()


def test_stopping_a_service_also_stops_children_that_left_its_process_group(tmp_path):
    """A worker's flow run starts Triton in a session of its own; `stack down` must not orphan it."""
    import psutil

    from tasks.platform.local_stack import start

    script = (
        "import subprocess, sys, time; "
        "subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(120)'], start_new_session=True); "
        "time.sleep(120)"
    )
    server = start("worker", [sys.executable, "-c", script], "", lambda: True, tmp_path)
    child = None
    for _ in range(50):
        children = psutil.Process(server.pid).children()
        if children:
            child = children[0]
            break
        time.sleep(0.1)
    assert child is not None and os.getsid(child.pid) != os.getsid(server.pid)
    server.stop(timeout=5)
    assert not server.alive()
    assert psutil.wait_procs([child], timeout=10)[1] == []


@pytest.mark.skipif(
    not list(Path("/usr/lib/postgresql").glob("*/bin/initdb")), reason="no PostgreSQL (make test-tools installs it)"
)
def test_a_postgres_cluster_whose_password_file_is_gone_is_replaced_not_waited_on(tmp_path, capsys):
    """As root a stack's cluster lives outside its folder (postgres_data_dir): a stack removed and made again at the
    same path found the old cluster, whose password had gone with the old folder, and `stack up` waited 120 s on
    refused logins ("postgres not ready after 120s", seen when pytest reused a removed basetemp's path). Now the
    orphan is replaced by a new cluster with a new password, and the stack says so."""
    from tasks.platform.local_stack.postgres import postgres_data_dir, prepare_postgres

    stack_root = tmp_path / "home" / "stack"
    data_dir, passfile = postgres_data_dir(stack_root), stack_root / "postgres.pgpass"
    try:
        prepare_postgres(data_dir, passfile, stack_root / "logs")
        first = passfile.read_text()
        prepare_postgres(data_dir, passfile, stack_root / "logs")  # the stack's own cluster: kept
        assert passfile.read_text() == first and "starting a new one" not in capsys.readouterr().err
        passfile.unlink()  # as `rm -rf home` leaves it (as root)
        prepare_postgres(data_dir, passfile, stack_root / "logs")
        assert f"{data_dir} holds the cluster of a stack removed from this folder" in capsys.readouterr().err
        assert (data_dir / "PG_VERSION").is_file() and passfile.read_text() != first
    finally:
        import shutil

        shutil.rmtree(data_dir, ignore_errors=True)
