"""Run profiles: YAML data validated by pydantic, overridable with `--set a.b=value`.

Every section forbids unknown keys so a typo (`lora_rnk`) is an error naming its path,
not a silently ignored setting.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Annotated, Any, Literal, get_args

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from tasks.platform.errors import BadInput
from tasks.platform.project import PROJECT_ROOT

PROFILES_DIR = PROJECT_ROOT / "profiles"


class Section(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


class TinyModel(Section):
    """Shape of the locally made Qwen2 base used where no model hub is reachable."""

    vocab_size: int = Field(512, ge=64)
    hidden_size: int = Field(64, ge=8)
    num_hidden_layers: int = Field(2, ge=1)
    num_attention_heads: int = Field(2, ge=1)
    num_key_value_heads: int = Field(1, ge=1)
    intermediate_size: int = Field(128, ge=8)
    pretrain_steps: int = Field(300, ge=0)
    pretrain_learning_rate: float = Field(3e-3, gt=0)
    pretrain_batch_size: int = Field(32, ge=1)
    seed: int = 0


class BaseModelSection(Section):
    # "tiny-qwen2" builds a model locally; anything else is a hub id, a local folder or s3:// URI.
    source: str = "tiny-qwen2"
    tiny: TinyModel = TinyModel()


class DataSection(Section):
    source: str
    # A fixed held-out set (file, folder or s3://) used as the eval split instead of the hash split of `source`.
    eval_source: str | None = None
    format: Literal["auto", "alpaca", "sharegpt", "openai"] = "auto"
    eval_fraction: float = Field(0.15, gt=0, lt=1)
    split_salt: str = "v1"


class TrainSection(Section):
    """LlamaFactory SFT arguments, under LlamaFactory's own names."""

    stage: Literal["sft"] = "sft"
    finetuning_type: Literal["lora", "full", "freeze"] = "lora"
    template: str = "chatml"
    lora_rank: int = Field(8, ge=1)
    lora_alpha: int | None = None
    lora_dropout: float = Field(0.0, ge=0, lt=1)
    lora_target: str = "all"
    quantization_bit: Literal[4, 8] | None = None
    quantization_method: Literal["bnb", "hqq", "eetq"] = "bnb"
    double_quantization: bool = True
    cutoff_len: int = Field(128, ge=8)
    per_device_train_batch_size: int = Field(8, ge=1)
    gradient_accumulation_steps: int = Field(1, ge=1)
    learning_rate: float = Field(5e-3, gt=0)
    num_train_epochs: float = Field(3.0, gt=0)
    max_steps: int = -1
    lr_scheduler_type: str = "cosine"
    warmup_ratio: float = Field(0.0, ge=0, lt=1)
    logging_steps: int = Field(5, ge=1)
    save_steps: int = Field(50, ge=1)
    seed: int = 42
    bf16: bool = False
    fp16: bool = False
    deepspeed: str | None = None
    # Any further LlamaFactory argument, passed through as is (LlamaFactory validates it).
    extra_args: dict[str, Any] = {}


class EvaluateSection(Section):
    """The task metric the gate decides on, and how sure it must be (tasks/quality/metrics.py, tasks/quality/stats.py)."""

    # exact_match, rouge_l, bleu_4 (higher is better) or answer_loss (lower is better); all are logged.
    metric: Literal["exact_match", "rouge_l", "bleu_4", "answer_loss"] = "exact_match"
    max_new_tokens: int = Field(8, ge=1)
    max_samples: int = Field(256, ge=1)
    # The candidate must beat the base by at least this much on the task metric.
    min_improvement: float = 0.2
    # None: checks use the point difference. A level such as 0.9: they use the paired bootstrap
    # interval's bound (improvement's lower bound, a drop's upper bound).
    confidence: float | None = Field(None, gt=0, lt=1)
    bootstrap_resamples: int = Field(2000, ge=100)
    seed: int = 0
    # Fewer eval samples than this: no decision, a message saying to add data.
    min_samples: int = Field(20, ge=1)


class MergeSection(Section):
    # max |logits(base+adapter) - logits(merged)|: 1e-3 in float32; in bfloat16 the merged weights are
    # rounded to 8 bits of mantissa, so the GPU profiles allow more (tests/unit/test_merge.py measures it)
    tolerance: float = Field(1e-3, ge=0)
    probe_samples: int = Field(16, ge=1)


class TensorRTLLMQuantize(Section):
    """A TensorRT-LLM checkpoint from the merged model: TensorRT-LLM's examples/quantization/quantize.py
    (NVIDIA ModelOpt for fp8/int4_awq/int8_sq/w4a8_awq; plain conversion for full_prec/int8_wo/int4_wo)."""

    qformat: Literal["full_prec", "fp8", "int4_awq", "w4a8_awq", "int8_sq", "int8_wo", "int4_wo"] = "full_prec"
    kv_cache_dtype: Literal["fp8", "int8"] | None = None
    dtype: Literal["float16", "bfloat16"] = "float16"
    calib_size: int = Field(512, ge=1)
    calib_max_seq_length: int = Field(512, ge=16)
    awq_block_size: int = Field(128, ge=16)
    tp_size: int = Field(1, ge=1)
    pp_size: int = Field(1, ge=1)
    # The examples folder of the pinned TensorRT-LLM release (NGC TensorRT-LLM images ship it here).
    examples_dir: str = "/app/tensorrt_llm/examples"


class QuantizeSection(Section):
    backend: Literal["onnx-int8", "none", "tensorrt-llm"] = "onnx-int8"
    opset: int = 18
    tensorrt_llm: TensorRTLLMQuantize = TensorRTLLMQuantize()
    # Largest task-metric drop (merged -> quantized) the stage accepts.
    max_accuracy_drop: float = Field(0.05, ge=0)


class EngineSection(Section):
    """`trtllm-build` arguments under TensorRT-LLM's own names (used when quantize.backend is tensorrt-llm)."""

    max_batch_size: int = Field(64, ge=1)
    max_input_len: int = Field(1024, ge=1)
    max_seq_len: int = Field(2048, ge=2)
    max_num_tokens: int = Field(8192, ge=1)
    max_beam_width: int = Field(1, ge=1)
    gemm_plugin: str = "auto"
    gpt_attention_plugin: str = "auto"
    # trtllm-build's --kv_cache_type (--paged_kv_cache is deprecated upstream: tensorrt_llm/commands/build.py)
    kv_cache_type: Literal["paged", "continuous", "disabled"] = "paged"
    remove_input_padding: bool = True
    context_fmha: bool = True
    use_paged_context_fmha: bool = True
    use_fp8_context_fmha: bool = False
    multiple_profiles: bool = True
    workers: int = Field(1, ge=1)
    # Any further trtllm-build flag, e.g. {reduce_fusion: enable}; trtllm-build validates it.
    extra_args: dict[str, Any] = {}

    @model_validator(mode="after")
    def _lengths_fit(self) -> EngineSection:
        if self.max_input_len >= self.max_seq_len:
            raise ValueError("max_input_len must be below max_seq_len (room for output tokens)")
        return self


class VllmServing(Section):
    """vLLM engine settings (serve.backend vllm); names follow vLLM's AsyncEngineArgs."""

    # The Python environment holding vLLM that tritonserver runs its Python models with: a venv folder.
    # None: the repository's .venv-vllm, built CUDA-free by `make setup-vllm` (infra/local/setup-vllm.sh).
    environment: str | None = None
    # KV cache reserved per engine (vLLM's kv_cache_memory_bytes); the canary runs two engines side by side.
    kv_cache_gb: float = Field(0.25, gt=0)
    # Memory one engine takes besides its KV cache (weights, activations, its worker processes): with
    # kv_cache_gb, what the canary checks is free before it loads a second engine. Measured on cpu-tiny:
    # 1.55 GiB proportional set size over the stub, engine core and worker after a request, KV cache
    # included as far as touched; 1.5 + 0.25 covers it (README, "Choosing the engine for cpu-tiny").
    engine_overhead_gb: float = Field(1.5, ge=0)
    dtype: str = "auto"  # the checkpoint's own dtype (float32 for cpu-tiny); bfloat16/float16 on GPUs
    # No torch.compile / CUDA graphs: starts in ~20 s instead of ~40 s on CPU; turn off on GPUs for speed.
    enforce_eager: bool = True


class TritonTensorRTLLM(Section):
    """The tensorrtllm backend's model parameters (Triton's inflight_batcher_llm layout)."""

    batching_strategy: Literal["inflight_fused_batching", "V1"] = "inflight_fused_batching"
    batch_scheduler_policy: Literal["max_utilization", "guaranteed_no_evict"] = "guaranteed_no_evict"
    kv_cache_free_gpu_mem_fraction: float = Field(0.9, gt=0, le=1)
    enable_kv_cache_reuse: bool = False
    enable_chunked_context: bool = False
    decoupled: bool = True  # streaming responses; genai-perf --streaming needs it
    max_queue_delay_us: int = Field(0, ge=0)
    preprocessing_instances: int = Field(1, ge=1)
    bls_instances: int = Field(1, ge=1)  # the entry model that detokenizes (infra/triton/tensorrtllm/bls)
    # The TensorRT-LLM release of the serving image's tensorrtllm backend (NGC tritonserver:25.06-trtllm-
    # python-py3 ships 0.20.0). Each engine's build version is checked against it before anything loads:
    # mismatched engine and backend versions are the backend's most reported failure.
    server_version: str = "0.20.0"


class ListenSection(Section):
    """Where `llmops serve` listens (flags of the same names override these). Port 0: any free port.
    Release runs that start a Triton of their own use free ports on 127.0.0.1 whatever these say."""

    # The gateway clients call: OpenAI-compatible /v1 and Triton's generate API, with API keys and TLS.
    host: str = "127.0.0.1"
    port: int = Field(8080, ge=0, le=65535)
    # Triton itself: its HTTP port carries the locked control API that release runs use, and inference
    # without client keys, so it stays on 127.0.0.1 unless release jobs run elsewhere (Kubernetes).
    triton_host: str = "127.0.0.1"
    triton_http_port: int = Field(8000, ge=0, le=65535)
    triton_grpc_port: int = Field(8001, ge=0, le=65535)
    triton_metrics_port: int = Field(8002, ge=0, le=65535)
    # TLS for the gateway: PEM files (paths are not secrets; the key file's content is).
    tls_cert: str | None = None
    tls_key: str | None = None
    max_request_bytes: int = Field(1 << 20, ge=1024)
    # Triton deaths in a row (each within a minute of its start) before `llmops serve` gives up.
    restart_limit: int = Field(5, ge=0)

    @model_validator(mode="after")
    def _tls_pair(self) -> ListenSection:
        if (self.tls_cert is None) != (self.tls_key is None):
            raise ValueError("tls_cert and tls_key go together")
        return self


class ServeSection(Section):
    """Triton serving of the candidate and the champion."""

    # false: stop after registering the candidate (a training-only pipeline); no Triton, no gate.
    deploy: bool = True
    # python: the merged model in a Python-backend model (CPU, or CUDA with torch);
    # tensorrtllm: the TensorRT-LLM engine behind preprocessing -> tensorrt_llm, entered through a BLS model;
    # vllm: the merged model in vLLM's async engine (continuous batching) inside a Python-backend model.
    backend: Literal["python", "tensorrtllm", "vllm"] = "python"
    tensorrtllm: TritonTensorRTLLM = TritonTensorRTLLM()
    vllm: VllmServing = VllmServing()
    # None: the nvidia-pytriton binary (CPU). A path or name: an NGC/system tritonserver.
    triton_binary: str | None = None
    artifact: Literal["merged"] = "merged"
    instance_count: int = Field(1, ge=1)
    max_batch_size: int = Field(8, ge=1)
    max_queue_delay_us: int = Field(2000, ge=0)
    torch_threads: int = Field(1, ge=1)
    default_max_tokens: int = Field(16, ge=1)
    apply_chat_template: bool = True
    load_timeout_s: float = Field(300, gt=0)
    listen: ListenSection = ListenSection()


class CanarySection(Section):
    """Traffic steps of the rollout; each step is watched for `window_s` before the next."""

    steps: list[int] = [10, 50, 100]
    window_s: float = Field(3.0, gt=0)
    probe_concurrency: int = Field(4, ge=1)
    max_error_rate: float = Field(0.0, ge=0, le=1)
    max_mean_latency_ms: float = Field(2000, gt=0)
    # A Prometheus that scrapes the serving Triton (infra/monitoring/prometheus.yml): the candidate's
    # requests, failures and latency in each window are read from it instead of from Triton directly.
    prometheus_url: str | None = None

    @model_validator(mode="after")
    def _steps_rise_to_100(self) -> CanarySection:
        if (
            not self.steps
            or any(not 0 < s <= 100 for s in self.steps)
            or self.steps != sorted(self.steps)
            or self.steps[-1] != 100
        ):
            raise ValueError("steps must be rising percentages in (0, 100] ending at 100")
        return self


class BenchSection(Section):
    """genai-perf load, the same for champion and candidate."""

    concurrency: list[int] = [1, 4]
    input_tokens: int = Field(16, ge=1)
    output_tokens: int = Field(8, ge=1)
    request_count: int = Field(32, ge=1)
    warmup_request_count: int = Field(2, ge=0)

    @model_validator(mode="after")
    def _concurrency_positive(self) -> BenchSection:
        if not self.concurrency or min(self.concurrency) < 1:
            raise ValueError("concurrency must list levels >= 1")
        return self


class GateSection(Section):
    """Promotion thresholds; read by the benchmark gate."""

    p99_request_latency_ms: float | None = Field(None, gt=0)
    p99_time_to_first_token_ms: float | None = Field(None, gt=0)
    max_error_rate: float = Field(0.0, ge=0, le=1)
    # Absolute request rate at the highest bench concurrency (e.g. a 120 QPS target).
    min_requests_per_s: float | None = Field(None, gt=0)
    min_throughput_ratio: float | None = Field(None, gt=0)
    # On evaluate.metric: how much worse than the champion the candidate may score (served scores).
    max_task_metric_drop: float = Field(0.02, ge=0)
    # On evaluate.metric: how much worse the served candidate may score than the same model offline
    # (a chat template, tokenizer or stop-token mismatch between training and serving shows here).
    max_serving_parity_drop: float = Field(0.05, ge=0)
    max_quantization_accuracy_drop: float = Field(0.05, ge=0)


# Stages that need the profile's accelerator; each may run on a deployment of its own (run.remote_stages).
HeavyStage = Literal["train", "evaluate", "merge", "quantize", "build_engine"]
HEAVY_STAGES: tuple[str, ...] = get_args(HeavyStage)


class KubernetesSection(Section):
    """Job variables for the Kubernetes GPU work pool (infra/work-pools/kubernetes-gpu.json)."""

    image: str | None = None
    # One image per heavy stage (infra/images/): LlamaFactory's environment for train, evaluate and merge,
    # the NGC TensorRT-LLM image for quantize and build_engine; a stage not named here uses `image`.
    stage_images: dict[HeavyStage, str] = {}
    namespace: str = "default"
    node_selector: dict[str, str] = {}
    tolerations: list[dict[str, Any]] = []
    cpu_request: str | None = None
    memory_request: str | None = None


class HardwareSection(Section):
    accelerator: Literal["cpu", "cuda"] = "cpu"
    gpus: int = Field(0, ge=0)
    # e.g. "A10", "H100": documentation and the engine cache key's expected architecture
    gpu_type: str | None = None
    # Memory of one GPU: the canary's memory plan (tasks/serving/memory_plan.py) fits champion and candidate in it.
    gpu_memory_gb: float | None = Field(None, gt=0)
    # The dtype evaluate and merge run the model in, on the accelerator: float32 on CPU; bfloat16 (or
    # float16 where a GPU has no bf16) on CUDA, where a 7-14B model in fp32 would not fit or take hours.
    compute_dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    kubernetes: KubernetesSection = KubernetesSection()

    @model_validator(mode="after")
    def _gpus_match_accelerator(self) -> HardwareSection:
        if self.accelerator == "cuda" and self.gpus < 1:
            raise ValueError("accelerator cuda needs gpus >= 1")
        return self


class RegistrySection(Section):
    model_name: str = Field(min_length=1)


class RunSection(Section):
    # Prefect task retries for transient faults: exponential backoff from retry_delay_s, with jitter.
    # The default (5, 10, 20 s) outlasts the restart of a server (S3, MLflow, Triton).
    retries: int = Field(3, ge=0)
    retry_delay_s: float = Field(5.0, ge=0)
    # How long a store that cannot be reached is waited for before a stage fails: checkpoint uploads
    # retry in the background while training goes on, and a stage's final artifact is retried this long.
    storage_outage_s: float = Field(600, ge=0)
    # Heavy stages that run as flow runs of a Prefect deployment (e.g. `run-stage/gpu` on the GPU
    # work pool) rather than inside the release flow's process, e.g. {train: run-stage/gpu}.
    # Empty on one machine; `--set 'run.remote_stages={}'` runs a GPU profile on one GPU machine.
    # The machines of that pool must share the artifact store (s3://) and the MLflow server.
    remote_stages: dict[HeavyStage, str] = {}
    # Longest wait for another release of the same model to finish deploying/promoting.
    serving_lock_timeout_s: float = Field(3600, gt=0)


class Profile(Section):
    name: str
    description: str = ""
    hardware: HardwareSection = HardwareSection()
    base_model: BaseModelSection = BaseModelSection()
    data: DataSection
    train: TrainSection = TrainSection()
    evaluate: EvaluateSection = EvaluateSection()
    merge: MergeSection = MergeSection()
    quantize: QuantizeSection = QuantizeSection()
    engine: EngineSection = EngineSection()
    serve: ServeSection = ServeSection()
    canary: CanarySection = CanarySection()
    bench: BenchSection = BenchSection()
    gate: GateSection = GateSection()
    registry: RegistrySection
    run: RunSection = RunSection()

    @model_validator(mode="after")
    def _backends_fit(self) -> Profile:
        trt = self.quantize.backend == "tensorrt-llm"
        if trt and self.hardware.accelerator != "cuda":
            raise ValueError("quantize.backend tensorrt-llm needs hardware.accelerator cuda")
        if (self.serve.backend == "tensorrtllm") != trt:
            raise ValueError(
                "serve.backend tensorrtllm and quantize.backend tensorrt-llm go together "
                "(the engine is what the tensorrtllm backend serves)"
            )
        if self.serve.backend == "vllm" and self.hardware.accelerator == "cuda" and not self.serve.vllm.environment:
            raise ValueError(
                "serve.backend vllm on cuda needs serve.vllm.environment: a venv with a CUDA build of vLLM "
                "(make setup-vllm builds the CPU one)"
            )
        world = self.quantize.tensorrt_llm.tp_size * self.quantize.tensorrt_llm.pp_size
        if trt and world > self.hardware.gpus:
            raise ValueError(
                f"quantize.tensorrt_llm tp_size x pp_size = {world} exceeds hardware.gpus {self.hardware.gpus}"
            )
        return self

    @property
    def digest(self) -> str:
        return sha256_json(self.model_dump(mode="json"))


def sha256_json(value: Any) -> str:
    return hashlib.sha256(json.dumps(value, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def available_profiles() -> list[str]:
    return sorted(p.stem for p in PROFILES_DIR.glob("*.yaml"))


# A flow's profile parameter: the shipped profiles are its schema's choices, so the Prefect UI's run
# form offers them and a deployment's server refuses another name (HTTP 409); a direct call
# (`llmops run --profile my.yaml`) still takes a YAML path, as the schema does not bind Python callers.
ProfileName = Annotated[str, Field(json_schema_extra={"enum": available_profiles()})]


def profile_path(name_or_path: str) -> Path:
    candidate = Path(name_or_path)
    if candidate.suffix in (".yaml", ".yml") or candidate.exists():
        if not candidate.is_file():
            raise BadInput(f"profile file {name_or_path}: not found")
        return candidate
    named = PROFILES_DIR / f"{name_or_path}.yaml"
    if not named.is_file():
        raise BadInput(f"profile {name_or_path}: not found (available: {', '.join(available_profiles())})")
    return named


def parse_override(text: str) -> tuple[list[str], Any]:
    key, sep, raw = text.partition("=")
    if not sep or not key.strip():
        raise BadInput(f"--set {text}: expected key=value, e.g. train.learning_rate=1e-4")
    # YAML typing so that 1e-4, true, null and [a, b] mean what they look like.
    return key.strip().split("."), yaml.safe_load(raw) if raw.strip() else ""


def apply_override(data: dict, path: list[str], value: Any, text: str) -> None:
    node = data
    for part in path[:-1]:
        child = node.setdefault(part, {})
        if not isinstance(child, dict):
            raise BadInput(f"--set {text}: {'.'.join(path[:-1])} is not a section")
        node = child
    node[path[-1]] = value


def format_validation_error(source: str, err: ValidationError) -> str:
    parts = []
    for item in err.errors():
        where = ".".join(str(p) for p in item["loc"]) or "(top level)"
        what = "unknown key" if item["type"] == "extra_forbidden" else item["msg"].removeprefix("Value error, ")
        parts.append(f"{where}: {what}")
    return f"{source}: " + "; ".join(parts)


def load_profile(name_or_path: str = "cpu-tiny", overrides: Sequence[str] = (), data: str | None = None) -> Profile:
    path = profile_path(name_or_path)
    label = f"profile {name_or_path}"
    try:
        raw = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        line = f" line {mark.line + 1}" if mark else ""
        raise BadInput(f"profile file {path}{line}: invalid YAML") from exc
    if not isinstance(raw, dict):
        raise BadInput(f"profile file {path}: expected a mapping at the top level")
    # A relative local data path in a profile file is relative to that file (one given on the command line, to the cwd).
    data_section = raw.get("data")
    section: dict = data_section if isinstance(data_section, dict) else {}
    for field in ("source", "eval_source"):
        value = section.get(field)
        if isinstance(value, str) and "://" not in value and not Path(value).is_absolute():
            section[field] = str((path.parent / value).resolve())
    for text in overrides:
        keys, value = parse_override(text)
        apply_override(raw, keys, value, text)
    if data:
        raw.setdefault("data", {})["source"] = data
    try:
        return Profile.model_validate(raw)
    except ValidationError as err:
        raise BadInput(format_validation_error(label, err)) from None


def local_stages(profile: Profile) -> list[str]:
    """The accelerator-bound stages this process runs itself (the others run on their deployments)."""
    return [s for s in HEAVY_STAGES if s not in profile.run.remote_stages] + (["serve"] if profile.serve.deploy else [])


def check_machine(profile: Profile, stages: list[str]) -> None:
    """A GPU profile on a machine without its GPUs fails here, before any stage does work."""
    if profile.hardware.accelerator != "cuda" or not stages:
        return
    import torch

    found = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if found < profile.hardware.gpus:
        raise BadInput(
            f"profile {profile.name}: {', '.join(stages)} need(s) {profile.hardware.gpus} CUDA GPU(s) "
            f"(hardware.gpus), this machine has {found}; run it on a GPU machine, place those stages on "
            f"the GPU pool (run.remote_stages), or pick a CPU profile (llmops profiles list)"
        )
