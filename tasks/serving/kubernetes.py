"""serve.autoscale on Kubernetes: a KEDA ScaledObject that scales the Deployment of `llmops triton` pods behind one
gateway (`llmops serve --triton-discover`, infra/kubernetes/serving-autoscale.yaml) on the same signal and target as
`llmops serve` scales its own Tritons (tasks/runtime/autoscale.py), read from Prometheus:

- in_flight: the gateway's `llmops_gateway_requests_in_flight` (requests at the replicas and those waiting for one),
  an AverageValue target: the HPA keeps ceil(in flight / target) pods, as the local policy keeps that many replicas;
- ttft_p90: the p90 of the gateway's `llmops_gateway_time_to_first_token_seconds` over the up window, in ms, a Value
  target: the HPA scales by value / target (a latency does not divide by pods);
- queue_ms: the mean wait in the Triton pods' queues (their own `nv_inference_queue_duration_us` over
  `nv_inference_request_success`), in ms, a Value target.

The windows become the HPA's behavior: a scale-up needs the signal above target over the whole up window, one pod at
a time; a scale-down, below it over the whole down window, one pod at a time. KEDA itself takes the pods to zero and
back (min_replicas 0): after `cooldownPeriod` (the down window) with nothing in flight, and on the first request that
waits at the gateway. The HPA has no `scale_down_below`: it stays within its 10 % tolerance of the target instead.

Fields read from KEDA's source at v2.20 (apis/keda/v1alpha1/scaledobject_types.go L100-182: scaleTargetRef,
pollingInterval, cooldownPeriod, minReplicaCount, maxReplicaCount, advanced.horizontalPodAutoscalerConfig.behavior as
autoscaling/v2's HorizontalPodAutoscalerBehavior; scaletriggers_types.go L28-41: type, name, metadata, metricType;
pkg/scalers/prometheus_scaler.go L48-61: serverAddress, query and threshold required, activationThreshold, and
ignoreNullValues, which makes an empty or NaN result 0, L264-305; a trigger is active above its activationThreshold,
L319, and any active trigger takes a Deployment at zero to one pod, pkg/scaling/executor/scale_scaledobjects.go
L71-73, L247-252).
"""

from __future__ import annotations

from typing import Any

from tasks.platform.config import Profile
from tasks.platform.config.autoscale import AutoscaleSection
from tasks.platform.errors import BadInput
from tasks.serving.versions import service_models_pattern

TRITON_DEPLOYMENT = "llmops-triton"  # the Deployment of `llmops triton` pods (infra/kubernetes/serving-autoscale.yaml)
PROMETHEUS = "http://prometheus.monitoring.svc:9090"
HPA_WINDOW_MAX_S = 3600  # autoscaling/v2: stabilizationWindowSeconds <= 3600, a policy's periodSeconds <= 1800
HPA_PERIOD_MAX_S = 1800
SCRAPE_S = 5  # Prometheus's scrape interval in infra/monitoring/prometheus.yml
MIN_RATE_WINDOW_S = 4 * SCRAPE_S  # a rate() over fewer scrapes is noise
WAKE_ONLY = 1_000_000  # the wake trigger's threshold: never reached, so the HPA scales on the signal alone


def policy_of(profile: Profile) -> AutoscaleSection:
    """The profile's serve.autoscale with its target; a one-line error where it has none."""
    if profile.serve.autoscale is None:
        raise BadInput(
            f"serve.autoscale: not set in profile {profile.name}; set it (in the profile, or --set "
            "serve.autoscale.max_replicas=4) to render what scales its Tritons"
        )
    try:
        return profile.serve.autoscale.with_target(profile.gate.p99_time_to_first_token_ms)
    except ValueError as exc:
        raise BadInput(str(exc)) from None


def in_flight_query(service: str) -> str:
    return f'sum(llmops_gateway_requests_in_flight{{llmops_service="{service}"}})'


def signal_query(service: str, policy: AutoscaleSection) -> tuple[str, str]:
    """The PromQL of the policy's signal for `service`, and how the HPA compares it with the target."""
    window = f"{max(int(policy.scale_up_window_s), MIN_RATE_WINDOW_S)}s"
    versions = f'"{service_models_pattern(service)}"'
    if policy.signal == "in_flight":
        return in_flight_query(service), "AverageValue"
    if policy.signal == "ttft_p90":
        buckets = f"llmops_gateway_time_to_first_token_seconds_bucket{{version=~{versions}}}"
        return f"histogram_quantile(0.9, sum by (le) (rate({buckets}[{window}]))) * 1000", "Value"
    queued = f"sum(rate(nv_inference_queue_duration_us{{model=~{versions}}}[{window}]))"
    answered = f"sum(rate(nv_inference_request_success{{model=~{versions}}}[{window}]))"
    return f"{queued} / {answered} / 1000", "Value"


def prometheus_trigger(name: str, server: str, query: str, threshold: float, metric_type: str) -> dict[str, Any]:
    return {
        "type": "prometheus",
        "name": name,
        "metricType": metric_type,
        "metadata": {
            "serverAddress": server,
            "query": query,
            "threshold": f"{threshold:g}",
            "activationThreshold": "0",  # above 0: active, and a Deployment at zero gets its first pod
            "ignoreNullValues": "true",  # no traffic: an empty or NaN result is 0, not an error
        },
    }


def seconds(window_s: float, most: int, field: str) -> int:
    whole = max(int(round(window_s)), 1)
    if whole > most:
        raise BadInput(f"serve.autoscale.{field} {window_s:g}: a Kubernetes HPA's window is at most {most} s")
    return whole


def behavior(policy: AutoscaleSection) -> dict[str, Any]:
    """One pod at a time each way, each once its window agrees (autoscaling/v2 HorizontalPodAutoscalerBehavior)."""
    up = seconds(policy.scale_up_window_s, HPA_PERIOD_MAX_S, "scale_up_window_s")
    down = seconds(policy.scale_down_window_s, HPA_PERIOD_MAX_S, "scale_down_window_s")
    return {
        "scaleUp": {"stabilizationWindowSeconds": up, "policies": [{"type": "Pods", "value": 1, "periodSeconds": up}]},
        "scaleDown": {
            "stabilizationWindowSeconds": down,
            "policies": [{"type": "Pods", "value": 1, "periodSeconds": down}],
        },
    }


def scaled_object(
    profile: Profile, prometheus: str = PROMETHEUS, deployment: str = TRITON_DEPLOYMENT
) -> dict[str, Any]:
    """The ScaledObject of the profile's serve.autoscale for the Triton pods of `deployment`."""
    policy = policy_of(profile)
    service = profile.registry.model_name
    query, metric_type = signal_query(service, policy)
    assert policy.target is not None
    triggers = [prometheus_trigger(policy.signal.replace("_", "-"), prometheus, query, policy.target, metric_type)]
    if policy.min_replicas == 0 and policy.signal != "in_flight":
        # at zero no first token and no queue is measured: a request waiting at the gateway is what wakes the pods
        triggers.append(prometheus_trigger("wake", prometheus, in_flight_query(service), WAKE_ONLY, "AverageValue"))
    return {
        "apiVersion": "keda.sh/v1alpha1",
        "kind": "ScaledObject",
        "metadata": {
            "name": deployment,  # no namespace: `kubectl -n` gives it, as for the other serving objects
            "labels": {"app.kubernetes.io/name": deployment, "llmops/service": service},
        },
        "spec": {
            "scaleTargetRef": {"apiVersion": "apps/v1", "kind": "Deployment", "name": deployment},
            # how often KEDA asks Prometheus whether to leave or go to zero; never under its scrape interval (5 s)
            "pollingInterval": max(int(round(policy.sample_every_s)), SCRAPE_S),
            "cooldownPeriod": seconds(policy.scale_down_window_s, HPA_WINDOW_MAX_S, "scale_down_window_s"),
            "minReplicaCount": policy.min_replicas,
            "maxReplicaCount": policy.max_replicas,
            "advanced": {"horizontalPodAutoscalerConfig": {"behavior": behavior(policy)}},
            "triggers": triggers,
        },
    }
