"""The whole run profile: every section, the checks that span sections, and the digest stage caches key on."""

from __future__ import annotations

import hashlib
import json
from typing import Any, ClassVar

from pydantic import Field, model_validator

from tasks.platform.config.base import Section
from tasks.platform.config.flywheel import FlywheelSection
from tasks.platform.config.machines import HardwareSection, RunSection
from tasks.platform.config.quantize import (
    BLACKWELL,
    EngineSection,
    QuantizeSection,
    awq_indivisible,
    is_blackwell,
)
from tasks.platform.config.release import BenchSection, CanarySection, GateSection, RegistrySection, TuneSection
from tasks.platform.config.serving import ServeSection
from tasks.platform.config.training import (
    BaseModelSection,
    DataSection,
    EvaluateSection,
    MergeSection,
    TrainSection,
)


class Profile(Section):
    """A run profile: YAML in profiles/ validated by this schema, overridable with `--set a.b=value`."""

    name: str = Field(description="The profile's name (its file name in profiles/); names the MLflow run release-NAME.")
    description: str = Field("", description="One line that `llmops profiles list` shows.")
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
    tune: TuneSection = TuneSection()
    gate: GateSection = GateSection()
    flywheel: FlywheelSection = FlywheelSection()
    registry: RegistrySection
    run: RunSection = RunSection()

    @model_validator(mode="after")
    def _deepspeed_on_cuda(self) -> Profile:
        if self.train.deepspeed is not None and self.hardware.accelerator != "cuda":
            raise ValueError(
                "train.deepspeed needs hardware.accelerator cuda (DeepSpeed is in the GPU train image, not the CPU "
                "environment)"
            )
        return self

    @model_validator(mode="after")
    def _backends_fit(self) -> Profile:
        if self.quantize.backend == "modelopt" and self.hardware.accelerator != "cuda":
            raise ValueError("quantize.backend modelopt needs hardware.accelerator cuda")
        nvfp4 = self.quantize.backend == "modelopt" and self.quantize.modelopt.qformat == "nvfp4"
        if nvfp4 and not is_blackwell(self.hardware.gpu_type):
            raise ValueError(
                f"quantize.modelopt.qformat nvfp4 needs a Blackwell GPU (hardware.gpu_type one of "
                f"{', '.join(BLACKWELL)}), not {self.hardware.gpu_type}: use fp8 or int4_awq"
            )
        self._awq_groups_fit()
        if self.serve.backend == "llmapi":
            return self._llmapi_fits()
        return self

    def _awq_groups_fit(self) -> None:
        """int4_awq on the tiny base, whose shape the profile holds: every layer's input width must be a multiple of
        the group size (a hub model's shape is checked by the quantize stage, from its config.json)."""
        modelopt = self.quantize.modelopt
        if (
            self.quantize.backend != "modelopt"
            or modelopt.qformat != "int4_awq"
            or self.base_model.source != "tiny-qwen2"
        ):
            return
        tiny = self.base_model.tiny
        bad = awq_indivisible(
            modelopt.awq_block_size, tiny.hidden_size, tiny.intermediate_size, self.engine.tensor_parallel_size
        )
        if bad:
            raise ValueError(
                f"quantize.modelopt.awq_block_size {modelopt.awq_block_size} does not divide {', '.join(bad)} of "
                "base_model.tiny: TensorRT-LLM needs every INT4-AWQ layer's input width to be a multiple of it"
            )

    def _llmapi_fits(self) -> Profile:
        """serve.backend llmapi: tensorrt_llm.LLM loads the quantize stage's checkpoint as it is."""
        if self.hardware.accelerator != "cuda":
            raise ValueError("serve.backend llmapi needs hardware.accelerator cuda")
        if self.quantize.backend not in ("modelopt", "none"):
            raise ValueError(
                f"serve.backend llmapi loads a Hugging Face checkpoint: quantize.backend modelopt or none, "
                f"not {self.quantize.backend}"
            )
        engine = self.engine
        if engine.world_size > self.hardware.gpus:
            raise ValueError(
                f"engine tensor_parallel_size x pipeline_parallel_size = {engine.world_size} exceeds "
                f"hardware.gpus {self.hardware.gpus}"
            )
        if engine.max_num_tokens < self.train.cutoff_len and not engine.enable_chunked_prefill:
            raise ValueError(
                f"engine.max_num_tokens {engine.max_num_tokens} is below train.cutoff_len {self.train.cutoff_len}: "
                "a prompt as long as training allows would not fit one step (raise it, or enable_chunked_prefill)"
            )
        return self

    @model_validator(mode="after")
    def _autoscale_has_a_target(self) -> Profile:
        if self.serve.autoscale is not None:
            self.serve.autoscale.with_target(self.gate.p99_time_to_first_token_ms)
        return self

    @model_validator(mode="after")
    def _preference_runs_split_their_own_pairs(self) -> Profile:
        """dpo and kto are judged on their own pairs' held-out prompts; preference_accuracy and reward_margin need pairs
        (dpo)."""
        stage = self.train.stage
        if stage != "sft" and self.data.eval_source is not None:
            raise ValueError(
                f"data.eval_source with train.stage {stage}: a preference run's exam is its own data's held-out "
                "prompts (split by prompt); set data.eval_source null"
            )
        if self.evaluate.metric in ("preference_accuracy", "reward_margin") and stage != "dpo":
            raise ValueError(
                f"evaluate.metric {self.evaluate.metric} with train.stage {stage}: it is scored on preference pairs "
                "(chosen/rejected), which train.stage dpo trains on"
            )
        return self

    @model_validator(mode="after")
    def _unreviewed_harvests_are_safe(self) -> Profile:
        """flywheel.review rules pushes harvests no person read: only with what keeps a client from writing the
        next release's answers, its history, or its exam. A preference profile needs neither of the last two: its
        trainer labels the last answers alone (LlamaFactory 0.9.5 data/processor/pairwise.py:47-68, encode_oneturn
        puts every earlier turn in the prompt), and its exam is its own pairs' held-out prompts, which no harvested
        pair enters (tasks/data/preferences.py)."""
        if self.flywheel.review != "rules":
            return self
        preference = self.train.stage != "sft"
        missing = [
            name
            for name, ok in (
                ("serve.capture.trusted_clients", bool(self.serve.capture.trusted_clients)),
                ("train.mask_history true", self.train.mask_history or preference),
                ("data.eval_source (a curated held-out set)", self.data.curated_exam is not None or preference),
            )
            if not ok
        ]
        if missing:
            raise ValueError(f"flywheel.review rules needs {', '.join(missing)}")
        return self

    @model_validator(mode="after")
    def _eval_engine_fits(self) -> Profile:
        """evaluate.engine vllm: one vLLM engine of the base model, with serve.vllm's settings, loads the adapter."""
        if self.evaluate.engine != "vllm":
            return self
        vllm = self.serve.vllm
        if self.train.lora_rank > vllm.max_lora_rank:
            raise ValueError(
                f"evaluate.engine vllm: train.lora_rank {self.train.lora_rank} exceeds serve.vllm.max_lora_rank "
                f"{vllm.max_lora_rank}, the largest adapter the eval engine loads"
            )
        if self.hardware.accelerator != "cuda" and vllm.kv_cache_gb is None:
            raise ValueError("evaluate.engine vllm on CPU needs serve.vllm.kv_cache_gb (the engine's KV cache, GiB)")
        return self

    @model_validator(mode="after")
    def _vllm_fits(self) -> Profile:
        if self.serve.backend != "vllm":
            return self
        self._vllm_reads_the_checkpoint()
        vllm = self.serve.vllm
        if self.hardware.accelerator != "cuda":
            if vllm.kv_cache_gb is None:
                raise ValueError("serve.vllm.kv_cache_gb: vLLM on CPU needs its KV cache size (GiB)")
            if vllm.tensor_parallel_size != 1:
                raise ValueError("serve.vllm.tensor_parallel_size above 1 needs hardware.accelerator cuda")
        elif vllm.tensor_parallel_size > self.hardware.gpus:
            raise ValueError(
                f"serve.vllm.tensor_parallel_size {vllm.tensor_parallel_size} exceeds hardware.gpus {self.hardware.gpus}"
            )
        share, engines = vllm.gpu_memory_utilization, 1 if self.serve.lora == "adapter" else 2
        if share * engines >= 1 or share > 0.9:
            raise ValueError(
                f"serve.vllm.gpu_memory_utilization {share:g}: "
                + (
                    "a merged canary runs two engines side by side, so below 0.5 (serve.lora adapter runs one)"
                    if engines == 2
                    else "at most 0.9: the engine's CUDA context and the adapters' buffers sit outside its share"
                )
            )
        if self.serve.lora == "adapter":
            self._adapter_serves_what_was_measured()
        return self

    def _adapter_serves_what_was_measured(self) -> None:
        """serve.lora adapter: one base engine for every version, so nothing of a version may be tuned or built
        that the base engine does not serve."""
        if self.tune.enabled:
            raise ValueError(
                "tune.enabled with serve.lora adapter: the engine settings it searches belong to the base engine, "
                "which champion and candidate share (tune on merged releases, then set them for the base)"
            )
        if self.train.lora_rank > self.serve.vllm.max_lora_rank:
            raise ValueError(
                f"train.lora_rank {self.train.lora_rank} exceeds serve.vllm.max_lora_rank "
                f"{self.serve.vllm.max_lora_rank}: the base engine could not serve the adapter"
            )
        if self.quantize.backend == "modelopt":  # tasks/serving/champion.py: an adapter rides the bf16 base
            raise ValueError(
                "serve.lora adapter with quantize.backend modelopt: adapter mode serves the full-precision base "
                "with the adapter, so the quantized checkpoint the quantize stage built and checked would never "
                "serve; set serve.lora merged to serve it, or quantize.backend none to serve the adapter"
            )

    def _vllm_reads_the_checkpoint(self) -> None:
        """vLLM serves a ModelOpt checkpoint it has a reader for: FP8 (ModelOptFp8Config) and, on Blackwell, NVFP4
        (ModelOptNvFp4Config); no INT4-AWQ (vllm 0.27.1 model_executor/layers/quantization/modelopt.py L365-431,
        L1004-1060; config/model.py L1124-1185 detects quant_method modelopt)."""
        if self.quantize.backend != "modelopt":
            return
        if self.quantize.modelopt.qformat == "int4_awq":
            raise ValueError(
                "serve.backend vllm cannot serve quantize.modelopt.qformat int4_awq: vLLM reads ModelOpt's FP8 and "
                "NVFP4 checkpoints, not its INT4-AWQ ones (use fp8, or serve.backend llmapi)"
            )

    @property
    def serves_quantized(self) -> bool:
        """Whether a version serves the quantize stage's artifact rather than the merged model: on llmapi always
        (ModelOpt's checkpoint, or the merged model passed through by quantize.backend none), on vLLM where ModelOpt
        made a checkpoint."""
        return self.serve.backend == "llmapi" or (self.serve.backend == "vllm" and self.quantize.backend == "modelopt")

    # The engine settings that shape how a version serves on llmapi (tensorrt_llm.LLM()'s), recorded with
    # ServeSection.MODEL_SETTINGS: tune_serving searches them.
    ENGINE_MODEL_SETTINGS: ClassVar[tuple[str, ...]] = ("max_batch_size", "max_num_tokens")

    def served_settings(self) -> dict[str, Any]:
        """What shapes how a version serves (a registered version's `serve.model_settings` tag): the serve section's
        MODEL_SETTINGS and vLLM's, and the LLM's batch and token budgets under "engine"."""
        engine = self.engine.model_dump(mode="json", include=set(self.ENGINE_MODEL_SETTINGS))
        return self.serve.model_settings() | {"engine": engine}

    def with_served_settings(self, recorded: dict[str, Any]) -> Profile:
        """This profile serving with recorded settings (served_settings' shape; serve keys may also come flat,
        engine ones as "engine.NAME"); a combination the profile's rules refuse is a ValueError naming it."""
        engine = dict(recorded.get("engine", {}))
        engine |= {key.removeprefix("engine."): value for key, value in recorded.items() if key.startswith("engine.")}
        values = self.model_dump()
        values["serve"] = self.serve.with_model_settings(recorded).model_dump()
        values["engine"] |= {key: engine[key] for key in self.ENGINE_MODEL_SETTINGS if key in engine}
        return type(self).model_validate(values)

    def goodput_objectives(self) -> dict[str, float]:
        """The latency objectives goodput counts against (ms, the benchmark tools' metric names): the gate's
        time to first token and the tune section's inter-token latency; empty where the profile sets neither."""
        found = {}
        if self.gate.p99_time_to_first_token_ms is not None:
            found["time_to_first_token"] = self.gate.p99_time_to_first_token_ms
        if self.tune.inter_token_latency_ms is not None:
            found["inter_token_latency"] = self.tune.inter_token_latency_ms
        return found

    @property
    def digest(self) -> str:
        """sha256 of the resolved values (defaults included); descriptions are not part of it."""
        return sha256_json(self.model_dump(mode="json"))


def sha256_json(value: Any) -> str:
    return hashlib.sha256(json.dumps(value, sort_keys=True, separators=(",", ":")).encode()).hexdigest()
