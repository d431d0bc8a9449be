"""The train stage's nodes on Kubernetes (tasks/training/kubernetes.py): for every GPU profile and every engine
(Kubeflow Trainer's TrainJob, a JobSet, an indexed Job with a headless Service), each rendered object is valid for
its API's models (Kubeflow Trainer's and JobSet's from kubeflow-trainer-api, core ones from the Kubernetes
client), the argv, rank and rendezvous every pod gets are LlamaFactory's multi-node launch, the shipped
ClusterTrainingRuntime is valid, and the 72B profile's objects match their golden files."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest
import yaml

from tasks.platform.config import available_profiles, load_profile
from tasks.training.kubernetes import (
    COMPLETION_INDEX,
    LAUNCHERS,
    NODE_PROGRAM,
    REQUEST_ENV,
    RUNTIME,
    launch_variables,
    train_manifests,
)
from tests.goldens import matches_golden

ROOT = Path(__file__).resolve().parents[2]
GOLDEN = ROOT / "tests" / "golden"
GPU_PROFILES = [p for p in available_profiles() if load_profile(p).hardware.accelerator == "cuda"]
# The nodes of every GPU profile: its own hardware.nodes where it has several, else two
PROFILES = [(p, [] if load_profile(p).hardware.nodes > 1 else ["hardware.nodes=2"]) for p in GPU_PROFILES]
REQUEST = {
    "artifacts": "s3://artifacts/llmops",
    "tracking_uri": "http://mlflow:5000",
    "mlflow_run_id": "0" * 32,
    "experiment_id": "1",
    "inputs": [],
}
CORE_MODELS = {"Job": "V1Job", "Service": "V1Service"}
NGC_ENTRYPOINT = ["/opt/nvidia/nvidia_entrypoint.sh"]  # infra/images/train.Dockerfile's ENTRYPOINT


def round_trip(manifest: dict) -> dict:
    """Through the models of the object's API: a required field missing or of the wrong type fails, and a key the
    schema does not know is dropped, so equality means a valid object."""
    kind = manifest["kind"]
    if kind in CORE_MODELS:
        from kubernetes_asyncio.client import ApiClient

        async def convert():
            async with ApiClient() as api:
                return api.sanitize_for_serialization(api._ApiClient__deserialize(manifest, CORE_MODELS[kind]))

        return asyncio.run(convert())
    from kubeflow_trainer_api import models

    model = {
        "TrainJob": models.TrainerV1alpha1TrainJob,
        "ClusterTrainingRuntime": models.TrainerV1alpha1ClusterTrainingRuntime,
        "JobSet": models.JobsetV1alpha2JobSet,
    }[kind]
    return model.from_dict(manifest).to_dict()


def rendered(profile_name: str, overrides: list[str], launcher: str) -> tuple[object, list[dict]]:
    profile = load_profile(profile_name, overrides)
    request = REQUEST | {"profile": profile.model_dump(mode="json")}
    return profile, train_manifests(profile, launcher, "llmops-train-abc123", request)


def pods(profile, objects: list[dict], launcher: str) -> list[dict]:
    """The pods the engine would start, each with its environment resolved: the completion index a Job gives
    pod i, or what Kubeflow Trainer's torch plugin sets (pkg/runtime/framework/plugins/torch/torch.go:147-170)."""
    nodes, namespace = profile.hardware.nodes, profile.hardware.kubernetes.namespace
    if launcher == "trainjob":
        trainer = objects[0]["spec"]["trainer"]
        container = {"args": trainer["args"], "env": trainer["env"], "image": trainer["image"]}
        pet = {
            "PET_NNODES": str(trainer["numNodes"]),
            "PET_NPROC_PER_NODE": str(trainer["numProcPerNode"]),
            "PET_MASTER_ADDR": f"llmops-train-abc123-node-0-0.llmops-train-abc123.{namespace}.svc",
            "PET_MASTER_PORT": "29400",
        }
        return [
            {
                "container": container,
                "environ": {e["name"]: e["value"] for e in container["env"]} | pet | {"PET_NODE_RANK": str(i)},
            }
            for i in range(trainer["numNodes"])
        ]
    job = (
        objects[-1]["spec"]
        if launcher == "indexed-job"
        else objects[0]["spec"]["replicatedJobs"][0]["template"]["spec"]
    )
    assert job["completionMode"] == "Indexed" and job["completions"] == job["parallelism"] == nodes
    container = job["template"]["spec"]["containers"][0]
    found = []
    for index in range(nodes):
        environ = {}
        for variable in container["env"]:
            if "valueFrom" in variable:
                assert variable["valueFrom"] == {"fieldRef": {"fieldPath": COMPLETION_INDEX}}
                environ[variable["name"]] = str(index)  # what Kubernetes sets for pod `index` of an indexed Job
            else:
                environ[variable["name"]] = variable["value"]
        found.append({"container": container, "environ": environ})
    return found


@pytest.mark.parametrize("launcher", LAUNCHERS)
@pytest.mark.parametrize("profile_name,overrides", PROFILES)
def test_every_pod_gets_llamafactorys_multi_node_launch(profile_name, overrides, launcher):
    profile, objects = rendered(profile_name, overrides, launcher)
    for manifest in objects:
        assert round_trip(manifest) == json.loads(json.dumps(manifest)), manifest["kind"]
    hardware, k8s = profile.hardware, profile.hardware.kubernetes
    started = pods(profile, objects, launcher)
    assert len(started) == hardware.nodes
    for rank, pod in enumerate(started):
        container, environ = pod["container"], pod["environ"]
        assert NGC_ENTRYPOINT + container["args"] == NGC_ENTRYPOINT + NODE_PROGRAM  # after the image's entrypoint
        assert container["image"] == k8s.stage_images.get("train", k8s.image)
        assert json.loads(environ[REQUEST_ENV])["profile"] == profile.model_dump(mode="json")
        launch = launch_variables(environ)
        assert launch["FORCE_TORCHRUN"] == "1" and "RDZV_ID" not in launch  # static: node 0 is global rank 0
        assert launch["NNODES"] == str(hardware.nodes) and launch["NPROC_PER_NODE"] == str(hardware.gpus)
        assert launch["NODE_RANK"] == str(rank)
        assert launch["MASTER_ADDR"] == launch_variables(started[0]["environ"])["MASTER_ADDR"]  # one rendezvous
        assert not any("SECRET" in key or "PASSWORD" in key for key in environ)  # credentials: the Secret only
    assert launch["MASTER_ADDR"].startswith("llmops-train-abc123-") and launch["MASTER_ADDR"].endswith(
        f".{k8s.namespace}.svc"
    )
    if launcher == "indexed-job":
        service, job = objects
        assert (
            service["spec"]["clusterIP"] == "None"
            and service["spec"]["selector"] == job["spec"]["template"]["metadata"]["labels"]
        )
        assert job["spec"]["template"]["spec"]["subdomain"] == service["metadata"]["name"]
        assert launch["MASTER_ADDR"].startswith(f"{job['metadata']['name']}-0.{service['metadata']['name']}.")
    if launcher == "trainjob":
        assert objects[0]["spec"]["runtimeRef"] == {"name": RUNTIME, "kind": "ClusterTrainingRuntime"}


def test_the_shipped_runtime_is_a_valid_cluster_training_runtime_for_the_node_program():
    runtime = yaml.safe_load((ROOT / "infra" / "kubernetes" / "llamafactory-runtime.yaml").read_text())
    assert round_trip(runtime) == runtime and runtime["metadata"]["name"] == RUNTIME
    (node,) = runtime["spec"]["template"]["spec"]["replicatedJobs"]
    assert node["name"] == "node"  # Trainer configures the replicated Job named node
    assert node["template"]["metadata"]["labels"] == {"trainer.kubeflow.org/trainjob-ancestor-step": "trainer"}
    (container,) = node["template"]["spec"]["template"]["spec"]["containers"]
    assert container["name"] == "node" and container["args"] == NODE_PROGRAM and "torch" in runtime["spec"]["mlPolicy"]


def test_a_pod_without_its_launch_variables_names_them():
    with pytest.raises(KeyError, match="lacks NODE_RANK, MASTER_ADDR"):
        launch_variables({"NNODES": "2", "NPROC_PER_NODE": "8", "MASTER_PORT": "29500"})


@pytest.mark.parametrize("launcher", LAUNCHERS)
def test_the_72b_profiles_objects_match_their_golden_files(launcher):
    _, objects = rendered("qwen2.5-72b-lora-2x8xh100", [], launcher)
    for manifest in objects:  # the request (the whole profile) is checked above, not pinned here
        for container in manifest_containers(manifest):
            container["env"] = [
                e if e["name"] != REQUEST_ENV else {"name": REQUEST_ENV, "value": "<request>"} for e in container["env"]
            ]
    text = yaml.safe_dump_all(objects, sort_keys=False, width=120)
    matches_golden(GOLDEN / "qwen2.5-72b-lora-2x8xh100" / f"train-{launcher}.yaml", text)


def manifest_containers(manifest: dict) -> list[dict]:
    if manifest["kind"] == "TrainJob":
        return [manifest["spec"]["trainer"]]
    if manifest["kind"] == "JobSet":
        return manifest["spec"]["replicatedJobs"][0]["template"]["spec"]["template"]["spec"]["containers"]
    if manifest["kind"] == "Job":
        return manifest["spec"]["template"]["spec"]["containers"]
    return []
