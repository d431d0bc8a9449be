"""Profile sections of Triton serving: the engine backends, where `llmops serve` listens, and the served model."""

from __future__ import annotations

from typing import Any, ClassVar, Literal

from pydantic import Field, field_validator, model_validator

from tasks.platform.config.auth import AuthSection
from tasks.platform.config.autoscale import AutoscaleSection
from tasks.platform.config.base import FILE_ONLY, TRUST_ONLY, Section


class VllmServing(Section):
    """vLLM engine settings (serve.backend vllm); names follow vLLM's AsyncEngineArgs."""

    environment: str | None = Field(
        None,
        description="The venv holding vLLM that tritonserver runs its Python models with; null: on CPU the "
        "repository's .venv-vllm, built CUDA-free by `make setup-vllm` (infra/local/setup-vllm.sh); on cuda the "
        "Python running llmops, as in NGC's tritonserver:26.08-vllm-python-py3 (vLLM 0.27.1; infra/images/README.md)."
        " Unused with an attached Triton (--triton-url).",
        json_schema_extra=FILE_ONLY,
    )
    kv_cache_gb: float | None = Field(
        0.25,
        gt=0,
        description="KV cache reserved per engine in GiB (vLLM's kv_cache_memory_bytes); the canary runs two engines "
        "side by side. Needed on CPU. On cuda null (vLLM sizes the KV cache within gpu_memory_utilization), or a fixed "
        "size that vLLM takes whatever gpu_memory_utilization says (it then skips its memory profiling).",
    )
    engine_overhead_gb: float = Field(
        1.5,
        ge=0,
        description="GiB one engine takes besides its KV cache (weights, activations, worker processes); with "
        "kv_cache_gb, what the canary checks is free before it loads a second engine (measured on cpu-tiny: 1.55 "
        "GiB, docs/benchmarks.md, 'Choosing the engine for cpu-tiny'). CPU only.",
    )
    dtype: Literal["auto", "half", "float16", "bfloat16", "float", "float32"] = Field(
        "auto",
        description="Model dtype, one of vLLM's (vllm/config/model.py ModelDType); auto: vLLM's choice, the checkpoint's own except that a float32 checkpoint (cpu-tiny's) "
        "is downcast to the platform's first dtype, bfloat16 on CPU (vllm/config/model.py _resolve_auto_dtype); "
        "float32 keeps it; bfloat16/float16 on GPUs.",
    )
    enforce_eager: bool = Field(
        True,
        description="No torch.compile or CUDA graphs: starts in ~20 s instead of ~40 s on CPU; turn off on GPUs for "
        "speed.",
    )
    gpu_memory_utilization: float = Field(
        0.45,
        gt=0,
        lt=1,
        description="cuda: share of each GPU's total memory one engine may take (weights, activations, CUDA graphs, "
        "KV cache); vLLM refuses to start an engine when less than this share is free. A merged canary runs champion "
        "and candidate engines side by side and each engine's CUDA context sits outside its share, so below 0.5; "
        "with serve.lora adapter one engine serves both, so up to 0.9. Unused on CPU.",
    )
    tensor_parallel_size: int = Field(
        1, ge=1, description="cuda: GPUs one engine spans (at most hardware.gpus); both canary engines share them."
    )
    max_lora_rank: Literal[8, 16, 32, 64, 128, 256] = Field(
        16,
        description="serve.lora adapter: the largest LoRA rank the base engine serves (vLLM's max_lora_rank; its "
        "adapter buffers are sized for it); a candidate adapter of a higher rank is refused before it loads.",
    )
    max_loras: int = Field(
        2,
        ge=1,
        description="serve.lora adapter: adapters the base engine holds and batches at once (vLLM's max_loras and "
        "max_cpu_loras): champion and candidate during a canary. A canary that would need more is refused.",
    )


class ListenSection(Section):
    """Where `llmops serve` listens (flags of the same names override these). Port 0: any free port.
    Release runs that start a Triton of their own use free ports on 127.0.0.1 whatever these say."""

    host: str = Field(
        "127.0.0.1",
        description="Address of the gateway clients call: OpenAI-compatible /v1 and Triton's generate API, with API "
        "keys and TLS.",
    )
    port: int = Field(8080, ge=0, le=65535, description="Port of the gateway.")
    control_host: str = Field(
        "127.0.0.1",
        description="Address of the gateway's control API (routes, shadow copies, the deployment record; "
        "authenticated by the serve's own control key): loopback, where release runs of this machine reach it. Off "
        "loopback it needs tls_cert and tls_key, as the key crosses the network.",
    )
    control_port: int = Field(8081, ge=0, le=65535, description="Port of the gateway's control API.")
    gateway_metrics_host: str = Field(
        "127.0.0.1",
        description="Address of the gateway's GET /metrics (its per-client counters, clients by name), on a listener "
        "of its own with no key: the clients' port has no /metrics. Loopback, where this machine's Prometheus "
        "scrapes it; off loopback only where a NetworkPolicy or firewall admits Prometheus alone (Kubernetes).",
    )
    gateway_metrics_port: int = Field(8082, ge=0, le=65535, description="Port of the gateway's /metrics.")
    triton_host: str = Field(
        "127.0.0.1",
        description="Address of Triton itself: its HTTP port carries the locked control API and inference without "
        "client keys, so it stays on 127.0.0.1 unless release jobs run elsewhere (Kubernetes).",
    )
    triton_http_port: int = Field(8000, ge=0, le=65535, description="Triton's HTTP port.")
    triton_grpc_port: int = Field(8001, ge=0, le=65535, description="Triton's gRPC port.")
    triton_metrics_port: int = Field(8002, ge=0, le=65535, description="Triton's Prometheus metrics port.")
    tls_cert: str | None = Field(
        None, description="PEM certificate file of the gateway's TLS; goes with tls_key (null: plain HTTP)."
    )
    tls_key: str | None = Field(
        None, description="PEM private key file of the gateway's TLS (the path is no secret; the file's content is)."
    )
    behind_tls_proxy: bool = Field(
        False,
        description="A proxy in front (an ingress, a load balancer) terminates TLS: a host off loopback may then "
        "serve plain HTTP (--behind-tls-proxy). Otherwise such a host needs tls_cert and tls_key.",
    )
    triton_ports_firewalled: bool = Field(
        False,
        description="Triton's ports are closed to clients by other means (a Kubernetes NetworkPolicy, a firewall "
        "that admits only release jobs and Prometheus): needed for a triton_host off loopback, as Triton answers "
        "inference there without keys (--triton-ports-firewalled).",
    )
    max_request_bytes: int = Field(1 << 20, ge=1024, description="Largest request body the gateway accepts, in bytes.")
    restart_limit: int = Field(
        5,
        ge=0,
        description="Triton deaths in a row (each within a minute of its start) before `llmops serve` gives up.",
    )

    @model_validator(mode="after")
    def _tls_pair(self) -> ListenSection:
        if (self.tls_cert is None) != (self.tls_key is None):
            raise ValueError("tls_cert and tls_key go together")
        return self


class LimitsSection(Section):
    """How much the gateway of `llmops serve` takes from each client (API key; without keys, all clients are one,
    "anonymous") and from all together. Over a client's limit: 429 with Retry-After; over the cap in flight: 503
    with Retry-After. 0 turns a limit off."""

    requests_per_second: float = Field(
        1000,
        ge=0,
        description="Requests per second per API key (a token bucket: bursts up to burst_s seconds' worth). Above "
        "what one key gets from cpu-tiny at concurrency 32 (about 600/s through the gateway), so a first load test "
        "is not refused; it stops a runaway client, while max_in_flight_per_key shares the model among keys.",
    )
    burst_s: float = Field(
        1.0,
        ge=0,
        description="Seconds of requests_per_second a key may send at once (the bucket's size; at least two "
        "requests, so a client pacing itself at its rate is not refused for a little jitter). Larger forgives a "
        "client's uneven pacing; smaller spreads a bursting client's admitted requests, so they do not queue "
        "together at Triton (docs/benchmarks.md, the gateway's cost).",
    )
    tokens_per_minute: int = Field(
        2_000_000,
        ge=0,
        description="Tokens per minute per API key: prompt + completion as the champion's tokenizer counts them "
        "(on /v2, which reports no counts, the request's max_tokens). A request's max_tokens (serve."
        "default_max_tokens where it gives none) is reserved when it is admitted, refused with 429 where the budget "
        "lacks them; once the answer is done the unused part comes back (a failed or abandoned answer keeps only "
        "what it produced) and a prompt over the reservation is charged as a debt. Above what one key uses of "
        "cpu-tiny at concurrency 32, so a first load test is not refused.",
    )
    max_in_flight: int = Field(
        128,
        ge=0,
        description="Requests the gateway answers at once, all clients together; more get 503 at once rather "
        "than a place in Triton's queue.",
    )
    max_in_flight_per_key: int = Field(
        64,
        ge=0,
        description="Requests the gateway answers at once for one API key; more get 429 naming this setting. Half "
        "of max_in_flight by default: one key's long generations cannot hold every place, and a load test of one "
        "key at concurrency 32 stays under it.",
    )


class HealthSection(Section):
    """How the gateway of `llmops serve` keeps any request from hanging and finds a version that stopped answering:
    deadlines on each request to Triton (past them the client gets 504 in its API's shape), a synthetic request to
    every version in the route table every `probe_interval_s` (readiness follows them), and the reload of a model
    whose probes failed `recover_after` times in a row (or the restart of its Triton where the reload fails),
    counted on /metrics."""

    first_byte_s: float = Field(
        120,
        gt=0,
        description="Seconds from sending a request to Triton until its first byte: for a request that does not "
        "stream, the whole answer. Past it: 504.",
    )
    between_chunks_s: float = Field(
        30,
        gt=0,
        description="Seconds between two chunks of a streamed answer. Past it the stream ends with an error event "
        "(504 where nothing was sent yet).",
    )
    probe_interval_s: float = Field(
        2.0,
        ge=0,
        description="Seconds between two synthetic requests (one token) to each version in the route table; 0: no "
        "probes (readiness then asks Triton whether the routed models are loaded).",
    )
    probe_timeout_s: float = Field(10, gt=0, description="Seconds a probe may take before it counts as failed.")
    recover_after: int = Field(
        3,
        ge=1,
        description="Failed probes in a row after which a version clients are routed to has its model loaded again "
        "(its Triton restarted where that fails); a candidate at 0% is left to its release.",
    )
    recover_cooldown_s: float = Field(
        60, ge=0, description="Seconds after a recovery before the same model is recovered again."
    )


class CaptureSection(Section):
    """What the gateway of `llmops serve` keeps of the exchanges it serves, for the next release's data (`llmops data
    harvest`): off by default. Kept: request and response ids, time, client name, the routes serving then, the
    conversation, the answer, token counts, latency and finish reason, after redaction (tasks/data/redact.py), as
    JSONL partitions by service and hour (tasks/data/exchanges.py); feedback (`POST /v1/feedback`) next to them.
    A request with the header `X-LLMOps-Capture: off` is not kept."""

    enabled: bool = Field(False, description="Keep served exchanges and accept feedback on them.")
    location: str | None = Field(
        None,
        description="s3://bucket/prefix, file:// or a folder; null: capture/ in the run's artifact store.",
        json_schema_extra=FILE_ONLY,
    )
    sample_rate: float = Field(1.0, ge=0, le=1, description="Share of exchanges kept (feedback is always kept).")
    redact: list[str] = Field(
        default_factory=list,
        description="Regular expressions replaced by [REDACTED] before anything is written, besides the built-in "
        "patterns (e-mail, phone numbers, card numbers, Chinese ID numbers, US SSNs).",
    )
    retention_days: float = Field(
        30, gt=0, description="Hours older than this are deleted (by the gateway, once an hour, and at its start)."
    )
    trusted_clients: list[str] = Field(
        default_factory=list,
        description="Clients (API key names) whose corrections (`POST /v1/feedback` with a correction) a harvest may "
        "take as the answer to train on; any other client's correction is dropped and counted. Not `anonymous` "
        "(anyone, on a gateway without keys).",
        json_schema_extra=TRUST_ONLY,
    )
    flush_s: float = Field(2.0, gt=0, description="Seconds between writes of the kept records, off the request path.")
    max_pending: int = Field(
        10_000,
        ge=1,
        description="Records held while the store is slow or down; more are dropped and counted "
        "(llmops_capture_dropped_total), never queued without bound nor failing a request.",
    )

    @field_validator("trusted_clients")
    @classmethod
    def _named_clients(cls, clients: list[str]) -> list[str]:
        if "anonymous" in clients:
            raise ValueError("anonymous is whoever reaches a gateway without keys, never a trusted client")
        if any(not c.strip() for c in clients):
            raise ValueError("a trusted client needs a name (its API key's name)")
        return clients

    @field_validator("redact")
    @classmethod
    def _patterns_compile(cls, patterns: list[str]) -> list[str]:
        import re

        for pattern in patterns:
            try:
                re.compile(pattern)
            except re.error as exc:
                raise ValueError(f"pattern {pattern!r} is not a regular expression: {exc}") from None
        return patterns


class ServeSection(Section):
    """Triton serving of the candidate and the champion."""

    deploy: bool = Field(
        True, description="false: stop after registering the candidate (a training-only pipeline); no Triton, no gate."
    )
    backend: Literal["python", "llmapi", "vllm"] = Field(
        "python",
        description="python: the merged model in a Python-backend model (CPU, or CUDA with torch); llmapi: the "
        "quantized Hugging Face checkpoint in TensorRT-LLM's LLM API (PyTorch backend) inside a Python-backend "
        "model (infra/triton/llmapi); vllm: vLLM's async engine inside a Python-backend model, serving the merged "
        "model, or the ModelOpt FP8/NVFP4 checkpoint where quantize.backend is modelopt.",
    )
    vllm: VllmServing = VllmServing()
    lora: Literal["merged", "adapter"] = Field(
        "merged",
        description="What a version serves. merged: its own merged model, one engine per version (a canary runs two). "
        "adapter (serve.backend vllm): one vLLM engine of the base model (`<service>-base`) serves every version's "
        "LoRA adapter by name; a version is a small model forwarding to it with its adapter (infra/triton/adapter), "
        "so a canary loads megabytes, not a second engine. The gate, canary, benchmark and gateway are unchanged.",
    )
    triton_binary: str | None = Field(
        None,
        description="null: the nvidia-pytriton wheel's tritonserver (CPU); a path or name: an NGC/system one.",
        json_schema_extra=FILE_ONLY,
    )
    artifact: Literal["merged"] = Field(
        "merged",
        description="The artifact served: the merged model (python; vllm without ModelOpt); llmapi, and vllm with "
        "quantize.backend modelopt, serve the quantize stage's checkpoint (ModelOpt's, or the merged model passed "
        "through by quantize.backend none).",
    )
    replicas: int = Field(
        1,
        ge=1,
        description="tritonserver processes `llmops serve` starts and balances over (fewest requests outstanding); "
        "every version is loaded on each, so a replica that dies leaves the others serving. The first takes "
        "serve.listen's Triton ports, the others free ones. With serve.autoscale: its min_replicas instead.",
    )
    autoscale: AutoscaleSection | None = Field(None, description="null: serve.replicas, fixed; else scaled by load.")
    instance_count: int = Field(1, ge=1, description="Triton instances of the model (one per GPU on GPU profiles).")
    max_batch_size: int = Field(8, ge=1, description="Most requests Triton batches into one model call.")
    max_queue_delay_us: int = Field(
        2000, ge=0, description="Microseconds Triton holds a request to fill a batch (dynamic batching)."
    )
    max_queue_size: int = Field(
        256,
        ge=1,
        description="Requests a served model holds at once beyond those it computes: Triton's dynamic batcher "
        "queue of the python backend's model, and the requests the router forwards at once. More are refused at "
        "once (503, Retry-After through the gateway) instead of queueing without bound; the gateway's own "
        "limits.max_in_flight (128) comes first for its clients.",
    )
    torch_threads: int = Field(1, ge=1, description="torch threads of each Python-backend instance.")
    default_max_tokens: int = Field(16, ge=1, description="Tokens generated when a request does not say.")
    apply_chat_template: bool = Field(
        True, description="Encode prompts with the tokenizer's chat template, as training did."
    )
    load_timeout_s: float = Field(300, gt=0, description="Seconds a model may take to load in Triton.")
    version_pinning: bool = Field(
        False,
        description="true: a /v1 request may name a live version (`<service>-vN`, listed by GET /v1/models) as its "
        "`model` and be answered by that version alone, outside the routes' weights (to compare champion and "
        "candidate, or reproduce an answer); false: such a request is refused (400) naming this setting.",
    )
    listen: ListenSection = ListenSection()
    auth: AuthSection = AuthSection()
    limits: LimitsSection = LimitsSection()
    health: HealthSection = HealthSection()
    capture: CaptureSection = CaptureSection()

    # What shapes how a version serves (its rendered Triton model), recorded at register so that a later run
    # serves the champion as it was released rather than with the candidate's settings. The backend and
    # the vLLM environment belong to the machine and the Triton this run starts, so they stay this run's.
    MODEL_SETTINGS: ClassVar[tuple[str, ...]] = (
        *("instance_count", "max_batch_size", "max_queue_delay_us", "max_queue_size", "torch_threads"),
        *("default_max_tokens", "apply_chat_template"),
    )

    def model_settings(self) -> dict[str, Any]:
        """The settings of MODEL_SETTINGS and the vLLM engine's, as JSON-ready data."""
        return self.model_dump(mode="json", include=set(self.MODEL_SETTINGS)) | {
            "vllm": self.vllm.model_dump(mode="json", exclude={"environment"})
        }

    def with_model_settings(self, recorded: dict[str, Any]) -> ServeSection:
        """This section with a version's recorded model settings in place of its own."""
        values = self.model_dump()
        values |= {key: recorded[key] for key in self.MODEL_SETTINGS if key in recorded}
        values["vllm"] |= recorded.get("vllm", {})
        return type(self).model_validate(values)

    @model_validator(mode="before")
    @classmethod
    def _legacy_sections(cls, values: Any) -> Any:
        if isinstance(values, dict) and "tensorrtllm" in values:
            raise ValueError(
                "serve.tensorrtllm was removed: serve.backend llmapi takes its tensorrt_llm.LLM() arguments from the "
                "engine section (enable_block_reuse, enable_chunked_prefill, free_gpu_memory_fraction)"
            )
        return values

    @model_validator(mode="after")
    def _adapters_need_vllm(self) -> ServeSection:
        if self.lora == "adapter" and self.backend != "vllm":
            raise ValueError(
                f"lora adapter needs serve.backend vllm (the engine that serves adapters by name), not {self.backend}"
            )
        if self.autoscale is not None and self.replicas != 1:
            raise ValueError("replicas and autoscale: set one (autoscale starts min_replicas)")
        return self

    @field_validator("backend", mode="before")
    @classmethod
    def _legacy_backend(cls, value: object) -> object:
        if value == "tensorrtllm":
            raise ValueError(
                "tensorrtllm (the C++ backend serving TensorRT engines) was removed: use serve.backend llmapi "
                "(TensorRT-LLM's LLM API serving the quantized checkpoint)"
            )
        return value
