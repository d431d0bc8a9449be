"""The train stage's nodes on Kubernetes: the objects that start `hardware.nodes` pods of the train image.

An existing engine starts and restarts the pods; nothing of ours does a rendezvous or logs into a pod. One of:

- `trainjob`: a Kubeflow Trainer v2 TrainJob on the ClusterTrainingRuntime `llmops-llamafactory`
  (infra/kubernetes/llamafactory-runtime.yaml). Trainer makes a JobSet of `numNodes` pods and gives each pod's
  `node` container torchrun's variables, PET_NNODES, PET_NPROC_PER_NODE, PET_NODE_RANK, PET_MASTER_ADDR and
  PET_MASTER_PORT (its torch plugin); the node program hands them to LlamaFactory under its names.
- `jobset`: a JobSet with one replicated Job of `nodes` indexed pods; JobSet's headless Service names pod 0
  `<name>-node-0-0.<name>`.
- `indexed-job`: an indexed Job (completions = parallelism = nodes) and a headless Service for its pods'
  names; pod 0 is `<name>-0.<name>`.

Every pod runs `python -m flows.train_node` (after the image's entrypoint): the train stage's part of one node,
with NNODES, NPROC_PER_NODE, MASTER_ADDR, MASTER_PORT and NODE_RANK (from the Job's completion index), a static
rendezvous at node 0 so that node 0 holds global rank 0 (it follows the trainer log, stores the checkpoints and
the adapter). The stage's request (profile, store, MLflow run, inputs) is one environment variable; the store's
and MLflow's credentials come from the Secret `llmops-stage-env`, never from the manifest.
"""

from __future__ import annotations

import json
from typing import Any, Literal

from tasks.platform.config import Profile

Launcher = Literal["trainjob", "jobset", "indexed-job"]
LAUNCHERS: tuple[Launcher, ...] = ("trainjob", "jobset", "indexed-job")
RUNTIME = "llmops-llamafactory"  # the ClusterTrainingRuntime in infra/kubernetes/llamafactory-runtime.yaml
NODE_PROGRAM = ["python", "-m", "flows.train_node"]
REQUEST_ENV = "LLMOPS_STAGE_REQUEST"
SECRET = "llmops-stage-env"
RENDEZVOUS_PORT = 29500
COMPLETION_INDEX = "metadata.annotations['batch.kubernetes.io/job-completion-index']"


def master_address(launcher: Launcher, name: str, namespace: str) -> str:
    """Node 0's DNS name, where torchrun's rendezvous is (Trainer sets its own, PET_MASTER_ADDR)."""
    pod = f"{name}-node-0-0" if launcher == "jobset" else f"{name}-0"
    return f"{pod}.{name}.{namespace}.svc"


def node_env(profile: Profile, launcher: Launcher, name: str, request: dict[str, Any]) -> list[dict[str, Any]]:
    hardware = profile.hardware
    env: list[dict[str, Any]] = [
        {"name": REQUEST_ENV, "value": json.dumps(request, sort_keys=True, separators=(",", ":"))},
        {"name": "LLMOPS_HOME", "value": "/var/lib/llmops"},
    ]
    if launcher != "trainjob":  # Trainer gives the node container PET_* itself
        env += [
            {"name": "NNODES", "value": str(hardware.nodes)},
            {"name": "NPROC_PER_NODE", "value": str(hardware.processes_per_node)},
            {"name": "MASTER_ADDR", "value": master_address(launcher, name, hardware.kubernetes.namespace)},
            {"name": "MASTER_PORT", "value": str(RENDEZVOUS_PORT)},
            {"name": "NODE_RANK", "valueFrom": {"fieldRef": {"fieldPath": COMPLETION_INDEX}}},
        ]
    return env


def node_container(profile: Profile, launcher: Launcher, name: str, request: dict[str, Any]) -> dict[str, Any]:
    k8s, gpus = profile.hardware.kubernetes, profile.hardware.gpus
    requests: dict[str, str] = {"nvidia.com/gpu": str(gpus)}
    requests |= {k: v for k, v in (("cpu", k8s.cpu_request), ("memory", k8s.memory_request)) if v}
    return {
        "name": "node",  # Trainer's runtime names the container it configures `node`
        "image": k8s.stage_images.get("train", k8s.image),
        # No command: the image's entrypoint (NGC's, which runs its arguments) stays (infra/images/README.md).
        "args": NODE_PROGRAM,
        "env": node_env(profile, launcher, name, request),
        "envFrom": [{"secretRef": {"name": SECRET}}],
        "ports": [{"name": "rendezvous", "containerPort": RENDEZVOUS_PORT, "protocol": "TCP"}],
        "resources": {"limits": {"nvidia.com/gpu": str(gpus)}, "requests": requests},
        "volumeMounts": [{"name": "dshm", "mountPath": "/dev/shm"}],  # NCCL's buffers
    }


def pod_spec(profile: Profile, launcher: Launcher, name: str, request: dict[str, Any]) -> dict[str, Any]:
    k8s = profile.hardware.kubernetes
    spec: dict[str, Any] = {
        "restartPolicy": "Never",
        "containers": [node_container(profile, launcher, name, request)],
        "volumes": [{"name": "dshm", "emptyDir": {"medium": "Memory"}}],
    }
    if k8s.node_selector:
        spec["nodeSelector"] = dict(k8s.node_selector)
    if k8s.tolerations:
        spec["tolerations"] = list(k8s.tolerations)
    return spec


def indexed_job_spec(profile: Profile, launcher: Launcher, name: str, request: dict[str, Any]) -> dict[str, Any]:
    """All nodes or none: a pod that fails fails the Job (backoffLimit 0); the rerun resumes from the store."""
    nodes = profile.hardware.nodes
    pod = pod_spec(profile, launcher, name, request)
    if launcher == "indexed-job":
        pod["subdomain"] = name  # the headless Service: pod i answers as <name>-i.<name>
    return {
        "completionMode": "Indexed",
        "completions": nodes,
        "parallelism": nodes,
        "backoffLimit": 0,
        "template": {"metadata": {"labels": {"llmops/train": name}}, "spec": pod},
    }


def train_job(profile: Profile, name: str, request: dict[str, Any]) -> list[dict[str, Any]]:
    hardware, k8s = profile.hardware, profile.hardware.kubernetes
    container = node_container(profile, "trainjob", name, request)
    trainer = {
        "numNodes": hardware.nodes,
        "numProcPerNode": hardware.processes_per_node,
        "image": container["image"],
        "args": container["args"],
        "env": container["env"],
        "resourcesPerNode": container["resources"],
    }
    return [
        {
            "apiVersion": "trainer.kubeflow.org/v1alpha1",
            "kind": "TrainJob",
            "metadata": {"name": name, "namespace": k8s.namespace, "labels": {"llmops/train": name}},
            "spec": {"runtimeRef": {"name": RUNTIME, "kind": "ClusterTrainingRuntime"}, "trainer": trainer},
        }
    ]


def job_set(profile: Profile, name: str, request: dict[str, Any]) -> list[dict[str, Any]]:
    spec = indexed_job_spec(profile, "jobset", name, request)
    return [
        {
            "apiVersion": "jobset.x-k8s.io/v1alpha2",
            "kind": "JobSet",
            "metadata": {"name": name, "namespace": profile.hardware.kubernetes.namespace},
            "spec": {
                "network": {"enableDNSHostnames": True, "subdomain": name},
                "failurePolicy": {"maxRestarts": 0},
                "replicatedJobs": [{"name": "node", "replicas": 1, "template": {"spec": spec}}],
            },
        }
    ]


def indexed_job(profile: Profile, name: str, request: dict[str, Any]) -> list[dict[str, Any]]:
    namespace = profile.hardware.kubernetes.namespace
    service = {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": {"name": name, "namespace": namespace},
        "spec": {
            "clusterIP": "None",  # headless: DNS names for the pods, no load balancing
            "publishNotReadyAddresses": True,  # the rendezvous starts before any pod is ready
            "selector": {"llmops/train": name},
            "ports": [{"name": "rendezvous", "port": RENDEZVOUS_PORT, "protocol": "TCP"}],
        },
    }
    job = {
        "apiVersion": "batch/v1",
        "kind": "Job",
        "metadata": {"name": name, "namespace": namespace},
        "spec": indexed_job_spec(profile, "indexed-job", name, request),
    }
    return [service, job]


def train_manifests(profile: Profile, launcher: Launcher, name: str, request: dict[str, Any]) -> list[dict[str, Any]]:
    """The objects that start the train stage's nodes under `launcher`, in the order to create them."""
    render = {"trainjob": train_job, "jobset": job_set, "indexed-job": indexed_job}[launcher]
    return render(profile, name, request)


# Trainer's torch plugin names torchrun's variables PET_* (pkg/constants/constants.go:191-203 at v2.3.0).
PET_NAMES = {
    "NNODES": "PET_NNODES",
    "NPROC_PER_NODE": "PET_NPROC_PER_NODE",
    "NODE_RANK": "PET_NODE_RANK",
    "MASTER_ADDR": "PET_MASTER_ADDR",
    "MASTER_PORT": "PET_MASTER_PORT",
}


def launch_variables(environ: dict[str, str]) -> dict[str, str]:
    """What a node pod hands LlamaFactory's launcher: its multi-node variables under LlamaFactory's names, from
    Trainer's PET_* or the manifest's own; FORCE_TORCHRUN, and no RDZV_ID: a static rendezvous at node 0, whose
    NODE_RANK 0 makes it global rank 0 (llamafactory/launcher.py:113-132)."""
    found = {name: environ.get(name) or environ.get(pet) for name, pet in PET_NAMES.items()}
    missing = [name for name, value in found.items() if not value]
    if missing:
        raise KeyError(f"a train node's pod lacks {', '.join(missing)} (nor PET_* from Kubeflow Trainer)")
    return {"FORCE_TORCHRUN": "1"} | {k: str(v) for k, v in found.items()}
