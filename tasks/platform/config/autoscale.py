"""serve.autoscale: how many Tritons `llmops serve` runs, by the load its gateway sees (tasks/runtime/autoscale.py)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from tasks.platform.config.base import Section


class AutoscaleSection(Section):
    """Replicas started and stopped by the load: one more when the signal's mean over `scale_up_window_s` is above
    `target` per replica; one fewer when, over the whole `scale_down_window_s`, the most the signal reached would stay
    under `target` on one replica fewer (a burst inside the long window keeps the capacity). A new replica loads every
    routed version before it takes a request; one that leaves is drained first."""

    min_replicas: int = Field(
        1,
        ge=0,
        description="Replicas kept however quiet the service is. 0: scale to zero once no request came over "
        "`scale_down_window_s` (the serve starts with one); the next request waits for a replica, within "
        "`cold_start_timeout_s`, and so does a release that takes the service.",
    )
    max_replicas: int = Field(3, ge=1, description="Replicas never exceeded, whatever the load and however many die.")
    signal: Literal["in_flight", "ttft_p90", "queue_ms"] = Field(
        "in_flight",
        description="in_flight: requests the gateway has outstanding at the replicas, per ready replica. ttft_p90: the "
        "90th percentile of the time to first token the gateway measured (a whole answer's first token is the answer), "
        "in ms. queue_ms: the mean time a request waited in the replicas' Triton queues (Triton's own counters), in ms; "
        "for the Python backend and TensorRT-LLM's, not vLLM's (its engine queues inside itself).",
    )
    target: float | None = Field(
        None,
        gt=0,
        description="The signal's value the policy scales to stay under: requests in flight per replica (default: what "
        "the tune stage measured the champion's replica to hold within gate.p99_time_to_first_token_ms, else 4), "
        "ms of TTFT p90 (default gate.p99_time_to_first_token_ms, the latency objective the tune stage and the gate "
        "hold a version to), or ms of queue time (no default).",
    )
    scale_down_below: float = Field(
        0.5,
        gt=0,
        lt=1,
        description="ttft_p90 and queue_ms: one replica fewer once the signal over the whole scale_down_window_s "
        "stayed under target times this (in_flight needs none: it predicts the load on one replica fewer).",
    )
    scale_up_window_s: float = Field(10.0, gt=0, description="Seconds of samples whose mean decides a scale-up.")
    scale_down_window_s: float = Field(
        60.0, gt=0, description="Seconds of samples whose peak decides a scale-down (longer than the up window)."
    )
    sample_every_s: float = Field(1.0, gt=0, description="Seconds between two samples of the signal.")
    cold_start_timeout_s: float = Field(
        300.0,
        gt=0,
        description="With min_replicas 0: the longest a request (or a release taking the service) that finds no "
        "replica waits for one to start and load every routed version; past it, a 503.",
    )

    def with_target(self, slo_ms: float | None, measured_in_flight: float | None = None) -> AutoscaleSection:
        """This policy with its target: the one set, else the signal's default (`slo_ms`, the gate's TTFT objective,
        for ttft_p90; for in_flight, `measured_in_flight`, the requests in flight the tune stage measured one replica
        to hold within that objective, else 4)."""
        if self.target is not None:
            return self
        if self.signal == "in_flight":
            return self.model_copy(update={"target": float(measured_in_flight or 4.0)})
        if self.signal == "queue_ms":
            raise ValueError(
                "serve.autoscale.target: signal queue_ms needs a target in ms (a request's wait in Triton)"
            )
        if slo_ms is None:
            raise ValueError(
                "serve.autoscale.target: signal ttft_p90 needs a target in ms, or gate.p99_time_to_first_token_ms "
                "to take it from"
            )
        return self.model_copy(update={"target": slo_ms})

    @model_validator(mode="after")
    def _bounds(self) -> AutoscaleSection:
        if self.max_replicas < self.min_replicas:
            raise ValueError(f"max_replicas {self.max_replicas} is below min_replicas {self.min_replicas}")
        if self.scale_down_window_s < self.scale_up_window_s:
            raise ValueError("scale_down_window_s must be at least scale_up_window_s (else it would flap)")
        return self
