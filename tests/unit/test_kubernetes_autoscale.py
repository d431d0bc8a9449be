"""serve.autoscale on Kubernetes (tasks/serving/kubernetes.py, infra/kubernetes/serving-autoscale.yaml): for every GPU
profile, signal and floor, the rendered KEDA ScaledObject is valid for KEDA's API (the model below, written from its
source) with an HPA behavior valid for the Kubernetes client's model, and reads metrics the gateway exports; the
shipped manifest's objects are valid, its ScaledObject is what `llmops profiles autoscaler` prints for the command in
its header, and the gateway, the Triton pods and their Services agree on names and ports."""

from __future__ import annotations

import asyncio
import re
import shlex
import subprocess
from pathlib import Path
from typing import Literal

import pytest
import yaml
from prometheus_client import generate_latest
from pydantic import BaseModel, ConfigDict, Field, model_validator

from flows.cli import build_parser
from tasks.platform.config import available_profiles, load_profile
from tasks.platform.errors import BadInput
from tasks.runtime.discovery import DISCOVER_EVERY_S
from tasks.runtime.gateway.access import GatewayMetrics
from tasks.runtime.gateway.replicas import Replicas
from tasks.serving.client import ALLOW_PLAIN_HTTP_ENV, CONTROL_KEY_ENV
from tasks.serving.kubernetes import WAKE_ONLY, scaled_object
from tasks.serving.versions import service_models_pattern
from tests.unit.test_cli import LLMOPS, cli_env
from tests.unit.test_kubernetes_serving import round_trip, serve_argv

MANIFEST = Path(__file__).resolve().parents[2] / "infra" / "kubernetes" / "serving-autoscale.yaml"
GPU_PROFILES = [p for p in available_profiles() if load_profile(p).hardware.accelerator == "cuda"]
SIGNALS = {"in_flight": [], "ttft_p90": [], "queue_ms": ["serve.autoscale.target=50"]}
TRITON_METRICS = {"nv_inference_queue_duration_us", "nv_inference_request_success"}  # Triton's own, per model


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


# KEDA v2.20's ScaledObject (kedacore/keda apis/keda/v1alpha1/scaledobject_types.go L100-182, scaletriggers_types.go
# L28-51, and the CRD's required fields, config/crd/bases/keda.sh_scaledobjects.yaml L322-378): a key it does not
# have, a missing required one or a wrong type fails.
class ScaleTarget(Strict):
    name: str = Field(min_length=1)
    apiVersion: str | None = None
    kind: str | None = None
    envSourceContainerName: str | None = None


class AuthenticationRef(Strict):
    name: str
    kind: Literal["TriggerAuthentication", "ClusterTriggerAuthentication"] | None = None


class ScaleTrigger(Strict):
    type: str = Field(min_length=1)
    name: str | None = None
    useCachedMetrics: bool | None = None
    metadata: dict[str, str]
    authenticationRef: AuthenticationRef | None = None
    metricType: Literal["AverageValue", "Value"] | None = None  # an external scaler's (pkg/scalers/scaler.go L101-111)


class HorizontalPodAutoscalerConfig(Strict):
    behavior: dict | None = None  # autoscaling/v2 HorizontalPodAutoscalerBehavior: checked by the Kubernetes model
    name: str | None = None


class AdvancedConfig(Strict):
    horizontalPodAutoscalerConfig: HorizontalPodAutoscalerConfig | None = None
    restoreToOriginalReplicaCount: bool | None = None
    scalingModifiers: dict | None = None


class Fallback(Strict):
    failureThreshold: int = Field(ge=0)
    replicas: int = Field(ge=0)
    behavior: Literal["static", "currentReplicas", "currentReplicasIfHigher", "currentReplicasIfLower"] = "static"


class ScaledObjectSpec(Strict):
    scaleTargetRef: ScaleTarget
    pollingInterval: int | None = Field(None, ge=1)
    initialCooldownPeriod: int | None = Field(None, ge=0)
    cooldownPeriod: int | None = Field(None, ge=0)
    idleReplicaCount: int | None = Field(None, ge=0)
    minReplicaCount: int | None = Field(None, ge=0)
    maxReplicaCount: int | None = Field(None, ge=1)
    advanced: AdvancedConfig | None = None
    triggers: list[ScaleTrigger] = Field(min_length=1)
    fallback: Fallback | None = None

    @model_validator(mode="after")
    def _min_at_most_max(self) -> ScaledObjectSpec:  # the CRD's CEL rule, L375-378
        assert (self.minReplicaCount or 0) <= (self.maxReplicaCount or 100), "minReplicaCount above maxReplicaCount"
        return self


class ObjectMeta(Strict):
    name: str = Field(min_length=1, max_length=63 - len("keda-hpa-"))  # the webhook's verifyName: the HPA's name too
    namespace: str | None = None
    labels: dict[str, str] | None = None
    annotations: dict[str, str] | None = None


class ScaledObject(Strict):
    apiVersion: Literal["keda.sh/v1alpha1"]
    kind: Literal["ScaledObject"]
    metadata: ObjectMeta
    spec: ScaledObjectSpec


def check_scaled_object(rendered: dict) -> ScaledObject:
    """Valid for KEDA's API and its admission webhook's checks on triggers (ValidateTriggers: unique names), with the
    Prometheus scaler's required metadata (pkg/scalers/prometheus_scaler.go L48-61) and a behavior the Kubernetes
    client's autoscaling/v2 model keeps whole."""
    from kubernetes_asyncio.client import ApiClient

    parsed = ScaledObject.model_validate(rendered)
    names = [trigger.name for trigger in parsed.spec.triggers]
    assert len(set(names)) == len(names), names
    for trigger in parsed.spec.triggers:
        assert trigger.type == "prometheus" and {"serverAddress", "query", "threshold"} <= set(trigger.metadata)
        float(trigger.metadata["threshold"]), float(trigger.metadata["activationThreshold"])
    behavior = rendered["spec"]["advanced"]["horizontalPodAutoscalerConfig"]["behavior"]

    async def convert():
        async with ApiClient() as api:
            model = api._ApiClient__deserialize(behavior, "V2HorizontalPodAutoscalerBehavior")
            return api.sanitize_for_serialization(model)

    assert asyncio.run(convert()) == behavior
    return parsed


def exported_metric_names(service: str) -> set[str]:
    """The names a gateway of `service` exports on /metrics (its pool's gauge among them)."""
    metrics = GatewayMetrics()
    Replicas([], metrics.registry, service=service)
    metrics.first_tokens.labels(f"{service}-v1").observe(0.1)
    text = generate_latest(metrics.registry).decode()
    return set(re.findall(r"^([a-z_]+)(?:\{|\s)", text, re.M))


@pytest.mark.parametrize("floor", [0, 1])
@pytest.mark.parametrize("signal", SIGNALS)
@pytest.mark.parametrize("profile_name", GPU_PROFILES)
def test_every_gpu_profile_renders_a_valid_scaled_object_on_metrics_the_gateway_exports(profile_name, signal, floor):
    overrides = [f"serve.autoscale.signal={signal}", f"serve.autoscale.min_replicas={floor}", *SIGNALS[signal]]
    profile = load_profile(profile_name, overrides)
    parsed = check_scaled_object(scaled_object(profile))
    spec, policy = parsed.spec, profile.serve.autoscale
    assert (spec.minReplicaCount, spec.maxReplicaCount) == (floor, policy.max_replicas)
    assert spec.scaleTargetRef.kind == "Deployment" and spec.scaleTargetRef.name == "llmops-triton"
    main, *wake = spec.triggers
    target = policy.with_target(profile.gate.p99_time_to_first_token_ms).target
    assert float(main.metadata["threshold"]) == target
    assert main.metricType == ("AverageValue" if signal == "in_flight" else "Value")
    # at zero nothing is measured but the requests waiting at the gateway: they wake the pods, and only that
    assert [w.metadata["threshold"] for w in wake] == (
        [f"{WAKE_ONLY:g}"] if floor == 0 and signal != "in_flight" else []
    )
    service = profile.registry.model_name
    for trigger in spec.triggers:
        used = set(re.findall(r"([a-z_]+)\{", trigger.metadata["query"]))
        assert used and used <= exported_metric_names(service) | TRITON_METRICS, used
        assert service in trigger.metadata["query"] or service_models_pattern(service) in trigger.metadata["query"]


def test_a_policy_an_hpa_cannot_hold_or_no_policy_is_one_line_naming_the_field():
    profile = load_profile("llama3-8b-h100-fp8")
    with pytest.raises(BadInput, match=r"^serve\.autoscale: not set in profile llama3-8b-h100-fp8; set it"):
        scaled_object(profile)
    long = load_profile("llama3-8b-h100-fp8", ["serve.autoscale.scale_down_window_s=2400"])
    with pytest.raises(BadInput, match=r"^serve\.autoscale\.scale_down_window_s 2400: a Kubernetes HPA's window"):
        scaled_object(long)


def objects() -> dict[str, dict]:
    return {f"{doc['kind']}/{doc['metadata']['name']}": doc for doc in yaml.safe_load_all(MANIFEST.read_text())}


def header_command() -> list[str]:
    """The `llmops profiles autoscaler` command the manifest's header gives for its ScaledObject."""
    lines = MANIFEST.read_text().split("what this prints")[1].splitlines()[1:]
    command = " ".join(line.lstrip("#").strip().rstrip("\\") for line in lines[:2])
    return shlex.split(command)


def test_the_manifests_objects_are_valid_and_its_scaled_object_is_what_the_command_in_its_header_prints(tmp_path):
    found = objects()
    assert set(found) == {
        "Deployment/llmops-serving",
        "Deployment/llmops-triton",
        "Service/llmops-serving",
        "Service/llmops-serving-metrics",
        "Service/llmops-triton-pods",
        "NetworkPolicy/llmops-serving",
        "NetworkPolicy/llmops-triton",
        "ScaledObject/llmops-triton",
    }
    for key, manifest in found.items():
        if not key.startswith("ScaledObject/"):
            assert round_trip(manifest) == yaml.safe_load(yaml.safe_dump(manifest)), key
    check_scaled_object(found["ScaledObject/llmops-triton"])
    command = header_command()
    assert command[:3] == ["llmops", "profiles", "autoscaler"], command
    printed = subprocess.run(
        [str(LLMOPS), *command[1:]], capture_output=True, text=True, env=cli_env(tmp_path), timeout=120
    )
    assert printed.returncode == 0, printed.stderr
    assert yaml.safe_load(printed.stdout) == found["ScaledObject/llmops-triton"]
    elsewhere = subprocess.run(
        [str(LLMOPS), *command[1:], "--prometheus", "http://prometheus.other.svc:9090"],
        capture_output=True, text=True, env=cli_env(tmp_path), timeout=120,
    )  # fmt: skip
    addresses = {t["metadata"]["serverAddress"] for t in yaml.safe_load(elsewhere.stdout)["spec"]["triggers"]}
    assert addresses == {"http://prometheus.other.svc:9090"}, elsewhere.stderr


def test_the_gateway_finds_the_triton_pods_by_their_headless_service_on_the_ports_they_listen_on():
    found = objects()
    (gateway,) = found["Deployment/llmops-serving"]["spec"]["template"]["spec"]["containers"]
    pod = found["Deployment/llmops-triton"]["spec"]["template"]["spec"]
    (triton,) = pod["containers"]
    serve_args = build_parser().parse_args(serve_argv(gateway))
    triton_args = build_parser().parse_args(serve_argv(triton))
    assert triton_args.command == "triton" and triton_args.triton_ports_firewalled
    headless = found["Service/llmops-triton-pods"]["spec"]
    assert serve_args.triton_discover == "llmops-triton-pods" and headless["clusterIP"] == "None"
    labels = found["Deployment/llmops-triton"]["spec"]["template"]["metadata"]["labels"]
    assert headless["selector"] == labels
    pod_ports = {p["name"]: p["containerPort"] for p in triton["ports"]}
    assert pod_ports == {
        "triton-http": triton_args.triton_http_port == serve_args.triton_http_port and serve_args.triton_http_port,
        "triton-grpc": triton_args.triton_grpc_port == serve_args.triton_grpc_port and serve_args.triton_grpc_port,
        "metrics": triton_args.triton_metrics_port == serve_args.triton_metrics_port and serve_args.triton_metrics_port,
    }
    assert {p["port"] for p in headless["ports"]} == set(pod_ports.values())
    assert serve_args.profile == triton_args.profile  # the same serve.listen, backend and launch on both sides
    for container in (gateway, triton):
        env = {e["name"]: e for e in container["env"]}
        assert env[CONTROL_KEY_ENV]["valueFrom"]["secretKeyRef"]["key"] == "control-key"
    assert {e["name"]: e.get("value") for e in gateway["env"]}[ALLOW_PLAIN_HTTP_ENV] == "1"
    # the pods fetch from the gateway's store (`llmops triton --artifacts`, LLMOPS_ARTIFACTS) with keys of their own
    gateway_env, triton_env = ({e["name"]: e for e in c["env"]} for c in (gateway, triton))
    assert triton_env["LLMOPS_ARTIFACTS"] == gateway_env["LLMOPS_ARTIFACTS"]
    for name, read_only in (("AWS_ACCESS_KEY_ID", "store-read-access-key-id"), ("AWS_SECRET_ACCESS_KEY", "store-read-secret-access-key")):  # fmt: skip
        assert triton_env[name]["valueFrom"]["secretKeyRef"]["key"] == read_only, name
        assert gateway_env[name]["valueFrom"]["secretKeyRef"]["key"] != read_only, name
    so = found["ScaledObject/llmops-triton"]["spec"]
    assert so["scaleTargetRef"]["name"] == "llmops-triton" and "nvidia.com/gpu" in triton["resources"]["limits"]
    assert "nvidia.com/gpu" not in str(gateway["resources"])  # the gateway takes no GPU


def test_a_stopping_pod_leaves_the_name_before_triton_stops_and_only_the_gateway_reaches_its_control_api():
    found = objects()
    pod = found["Deployment/llmops-triton"]["spec"]["template"]["spec"]
    (triton,) = pod["containers"]
    wait_s = triton["lifecycle"]["preStop"]["sleep"]["seconds"]
    assert wait_s >= 2 * DISCOVER_EVERY_S + 5  # the gateway's next two lookups see it gone (CoreDNS's TTL is 5 s)
    assert pod["terminationGracePeriodSeconds"] >= wait_s + 30  # then Triton's own 10 s exit timeout, and room
    policy = found["NetworkPolicy/llmops-triton"]["spec"]
    (control,) = [rule for rule in policy["ingress"] if {"port": 8000} in rule["ports"]]
    assert control["from"] == [{"podSelector": {"matchLabels": {"app.kubernetes.io/name": "llmops-serving"}}}]
    assert all("ports" in rule and "from" in rule for rule in policy["ingress"])
