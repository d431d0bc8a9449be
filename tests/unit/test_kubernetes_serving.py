"""infra/kubernetes/serving.yaml (cpu-tiny) and serving-gpu.yaml (a GPU profile): every object is valid for the
Kubernetes client's models, and what it tells `llmops serve` matches what `llmops serve` does (its flags parse, its
probes hit the gateway's health routes on the gateway's port over TLS, its secrets reach the variables the code
reads); the GPU one requests its profile's GPUs on its profile's nodes, in the image that serves that profile."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
import yaml

from flows.cli import build_parser
from tasks.platform.config import load_profile
from tasks.runtime.gateway import API_KEYS_FILE_ENV
from tasks.serving.client import CONTROL_KEY_ENV

KUBERNETES = Path(__file__).resolve().parents[2] / "infra" / "kubernetes"
MANIFESTS = ["serving.yaml", "serving-gpu.yaml"]
MODELS = {"Deployment": "V1Deployment", "Service": "V1Service", "NetworkPolicy": "V1NetworkPolicy"}


def objects(manifest: str = "serving.yaml") -> dict[str, dict]:
    docs = yaml.safe_load_all((KUBERNETES / manifest).read_text())
    return {doc["kind"] + "/" + doc["metadata"]["name"]: doc for doc in docs}


def serve_argv(container: dict) -> list[str]:
    """`llmops serve`'s arguments: after `command` (serving.yaml), or in `args` run by the image's entrypoint."""
    return [*container.get("command", [])[1:], *container["args"][0 if "command" in container else 1 :]]


def round_trip(manifest: dict) -> dict:
    """Through the client's model: unknown keys are dropped and required ones enforced."""
    from kubernetes_asyncio.client import ApiClient

    async def convert():
        async with ApiClient() as api:
            model = api._ApiClient__deserialize(manifest, MODELS[manifest["kind"]])
            return api.sanitize_for_serialization(model)

    return asyncio.run(convert())


@pytest.mark.parametrize("manifest", MANIFESTS)
def test_every_object_is_valid_for_the_kubernetes_models(manifest):
    found = objects(manifest)
    assert set(found) == {
        "Deployment/llmops-serving",
        "Service/llmops-serving",
        "Service/llmops-triton",
        "NetworkPolicy/llmops-serving",
    }
    for manifest in found.values():
        assert round_trip(manifest) == yaml.safe_load(yaml.safe_dump(manifest)), manifest["kind"]


@pytest.mark.parametrize("manifest", MANIFESTS)
def test_the_container_runs_llmops_serve_with_probes_on_its_gateway(manifest):
    pod = objects(manifest)["Deployment/llmops-serving"]["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    args = build_parser().parse_args(serve_argv(container))
    assert args.command == "serve" and args.host == "0.0.0.0" and args.port == 8080
    assert args.tls_cert.startswith("/etc/llmops/tls/")
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert ports == {
        "gateway": args.port,
        "triton-http": args.triton_http_port,
        "triton-grpc": args.triton_grpc_port,
        "metrics": args.triton_metrics_port,
        "gateway-metrics": args.gateway_metrics_port,  # /metrics is not on the gateway's own port
    }
    paths = {name: container[name]["httpGet"] for name in ("startupProbe", "readinessProbe", "livenessProbe")}
    assert {p["port"] for p in paths.values()} == {"gateway"} and {p["scheme"] for p in paths.values()} == {"HTTPS"}
    assert paths["readinessProbe"]["path"] == "/health/ready" and paths["livenessProbe"]["path"] == "/health/live"


@pytest.mark.parametrize("manifest", MANIFESTS)
def test_secrets_come_from_kubernetes_secrets_into_the_variables_the_code_reads(manifest):
    pod = objects(manifest)["Deployment/llmops-serving"]["spec"]["template"]["spec"]
    env = {e["name"]: e for e in pod["containers"][0]["env"]}
    assert env[CONTROL_KEY_ENV]["valueFrom"]["secretKeyRef"]["name"] == "llmops-serving"
    assert env["AWS_SECRET_ACCESS_KEY"]["valueFrom"]["secretKeyRef"]["key"] == "aws-secret-access-key"
    keys_file = Path(env[API_KEYS_FILE_ENV]["value"])
    mounts = {m["name"]: m["mountPath"] for m in pod["containers"][0]["volumeMounts"]}
    volumes = {v["name"]: v for v in pod["volumes"]}
    assert str(keys_file.parent) == mounts["api-keys"]
    assert volumes["api-keys"]["secret"]["items"] == [{"key": "api-keys", "path": keys_file.name}]
    assert all("value" not in e or "KEY" not in e["name"] or e["name"] == API_KEYS_FILE_ENV for e in env.values())


@pytest.mark.parametrize("manifest", MANIFESTS)
def test_only_release_pods_and_prometheus_reach_tritons_own_ports_and_the_gateways_metrics(manifest):
    policy = objects(manifest)["NetworkPolicy/llmops-serving"]["spec"]
    open_to_all = [rule for rule in policy["ingress"] if "from" not in rule]
    assert [p["port"] for rule in open_to_all for p in rule["ports"]] == [8080]
    triton_ports = {p["port"] for rule in policy["ingress"] if "from" in rule for p in rule["ports"]}
    assert triton_ports == {8000, 8001, 8002, 8082}
    (monitoring,) = [rule for rule in policy["ingress"] if "namespaceSelector" in str(rule.get("from"))]
    assert {p["port"] for p in monitoring["ports"]} == {8002, 8082}  # the gateway's metrics: Prometheus alone


@pytest.mark.parametrize("manifest", MANIFESTS)
def test_tritons_python_stubs_get_a_dev_shm_in_memory_above_the_runtimes_64_mib(manifest):
    pod = objects(manifest)["Deployment/llmops-serving"]["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    mounted = {mount["mountPath"]: mount["name"] for mount in container["volumeMounts"]}
    (shm,) = [volume for volume in pod["volumes"] if volume["name"] == mounted["/dev/shm"]]
    assert shm["emptyDir"]["medium"] == "Memory"
    size = shm["emptyDir"]["sizeLimit"]
    assert size.endswith("Gi") and int(size.removesuffix("Gi")) >= 1, size


def test_the_gpu_manifest_serves_its_gpu_profile_on_its_gpus_in_the_image_that_serves_it():
    """serving-gpu.yaml: the profile's GPUs requested and limited, its node selector and the GPU taint's toleration,
    the TensorRT-LLM image (NGC's entrypoint kept: `args`, no `command`), and serving.yaml's Services and policy."""
    from tests.unit.test_images import exec_form, tag

    gpu, cpu = objects("serving-gpu.yaml"), objects()
    pod = gpu["Deployment/llmops-serving"]["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    profile = load_profile(build_parser().parse_args(serve_argv(container)).profile)
    assert profile.hardware.accelerator == "cuda" and profile.serve.backend == "llmapi"
    resources = container["resources"]
    assert (
        resources["requests"]["nvidia.com/gpu"] == resources["limits"]["nvidia.com/gpu"] == str(profile.hardware.gpus)
    )
    assert pod["nodeSelector"] == profile.hardware.kubernetes.node_selector
    assert pod["tolerations"] == profile.hardware.kubernetes.tolerations
    assert container["image"] == tag("trtllm") and "command" not in container
    assert exec_form("trtllm", "ENTRYPOINT") == ["/opt/nvidia/nvidia_entrypoint.sh"]  # it runs the args
    startup = container["startupProbe"]
    assert startup["periodSeconds"] * startup["failureThreshold"] >= profile.serve.load_timeout_s
    assert {k: v for k, v in gpu.items() if not k.startswith("Deployment/")} == {
        k: v for k, v in cpu.items() if not k.startswith("Deployment/")
    }
