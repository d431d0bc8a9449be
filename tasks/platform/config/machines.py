"""Profile sections of where the work runs: the accelerator, the Kubernetes GPU pool, retries and remote stages."""

from __future__ import annotations

from typing import Any, Literal, get_args

from pydantic import Field, model_validator

from tasks.platform.config.base import FILE_ONLY, Section

# Stages that need the profile's accelerator; each may run on a deployment of its own (run.remote_stages).
HeavyStage = Literal["train", "evaluate", "merge", "quantize", "build_engine"]
HEAVY_STAGES: tuple[str, ...] = get_args(HeavyStage)


class KubernetesSection(Section):
    """Job variables for the Kubernetes GPU work pool (infra/work-pools/kubernetes-gpu.json)."""

    image: str | None = Field(
        None, description="Image of the stage jobs that stage_images does not name.", json_schema_extra=FILE_ONLY
    )
    stage_images: dict[HeavyStage, str] = Field(
        {},
        description="One image per heavy stage (infra/images/): LlamaFactory's for train, evaluate and merge, the "
        "NGC TensorRT-LLM image for quantize and build_engine; a stage not named here uses `image`.",
        json_schema_extra=FILE_ONLY,
    )
    namespace: str = Field(
        "default",
        description="Kubernetes namespace of the jobs (its service accounts and secrets are theirs).",
        json_schema_extra=FILE_ONLY,
    )
    node_selector: dict[str, str] = Field({}, description="Node labels the jobs' pods must match.")
    tolerations: list[dict[str, Any]] = Field([], description="Pod tolerations, e.g. of the GPU nodes' taint.")
    cpu_request: str | None = Field(None, description="CPU request of a job's pod (Kubernetes quantity).")
    memory_request: str | None = Field(None, description="Memory request of a job's pod (Kubernetes quantity).")


class HardwareSection(Section):
    """The accelerator the heavy stages need, checked before any stage runs."""

    accelerator: Literal["cpu", "cuda"] = Field("cpu", description="cpu, or cuda for the GPU profiles.")
    gpus: int = Field(
        0, ge=0, description="CUDA GPUs the heavy stages need on their machine, per node (cuda needs 1 or more)."
    )
    nodes: int = Field(
        1,
        ge=1,
        description="Machines the train stage runs on, each with `gpus` GPUs (one process per GPU; one per node on "
        "CPU): every node runs the same `llamafactory-cli train` under torchrun with NNODES/NODE_RANK and a c10d "
        "rendezvous. Where the train stage runs as one process, all nodes start on its machine (a rehearsal, or "
        "one box split per node). Evaluate, merge, quantize and serving use one node.",
    )
    gpu_type: str | None = Field(
        None, description='e.g. "A10", "H100": documentation and the engine cache key\'s expected architecture.'
    )
    gpu_memory_gb: float | None = Field(
        None,
        gt=0,
        description="Memory of one GPU as sold, in decimal GB: the canary's memory plan (tasks/serving/memory_plan.py) "
        "uses it, converted to GiB, only for a gpu_type it does not know (it knows what A10, L4, L40S, H100 and H200 "
        "really report).",
    )
    compute_dtype: Literal["float32", "bfloat16", "float16"] = Field(
        "float32",
        description="The dtype evaluate and merge run the model in: float32 on CPU; bfloat16 (or float16 without "
        "bf16) on CUDA, where a 7-14B model in fp32 would not fit or take hours.",
    )
    kubernetes: KubernetesSection = KubernetesSection()

    @model_validator(mode="after")
    def _gpus_match_accelerator(self) -> HardwareSection:
        if self.accelerator == "cuda" and self.gpus < 1:
            raise ValueError("accelerator cuda needs gpus >= 1")
        return self

    @property
    def processes_per_node(self) -> int:
        """Training processes on one node: one per GPU, or one on CPU."""
        return max(self.gpus, 1)

    @property
    def world_size(self) -> int:
        """Training processes across all nodes (torchrun's WORLD_SIZE)."""
        return self.nodes * self.processes_per_node


class RunSection(Section):
    """How the release flow runs its stages: retries, store outages, remote stages, the serving lock."""

    retries: int = Field(
        3,
        ge=0,
        description="Prefect task retries for transient faults, with exponential backoff from retry_delay_s and "
        "jitter; the default (5, 10, 20 s) outlasts the restart of a server (S3, MLflow, Triton).",
    )
    retry_delay_s: float = Field(5.0, ge=0, description="Seconds before the first retry; doubles with each retry.")
    storage_outage_s: float = Field(
        600,
        ge=0,
        description="Seconds an unreachable store is waited for before a stage fails (checkpoint uploads retry in "
        "the background; a stage's final artifact is retried this long).",
    )
    remote_stages: dict[HeavyStage, str] = Field(
        {},
        description="Heavy stages run as flow runs of a Prefect deployment, e.g. {train: run-stage/gpu}; their "
        "machines must share the s3:// store and MLflow. Empty: all in this process (`--set 'run.remote_stages={}'`).",
    )
    serving_lock_timeout_s: float = Field(
        3600,
        gt=0,
        description="Longest wait, in seconds, for another release of the same service to finish deploying "
        "(queued behind it); behind a release that waits for approval, a release fails at once instead.",
    )
