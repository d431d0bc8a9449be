"""Profile sections of the serving artifact: quantization (quantize stage) and the TensorRT-LLM runtime
arguments the build_engine check loads it under (the same ones Triton's llmapi model serves with)."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, field_validator

from tasks.platform.config.base import FILE_ONLY, Section

# Data-center Blackwell GPUs (compute capability 10.x: NVFP4 tensor cores), as hardware.gpu_type names them.
BLACKWELL = ("B100", "B200", "B300", "GB200", "GB300")


def is_blackwell(gpu_type: str | None) -> bool:
    return gpu_type is not None and gpu_type.upper().replace("NVIDIA ", "").startswith(BLACKWELL)


class ModelOptQuantize(Section):
    """NVIDIA ModelOpt post-training quantization of the merged model into a Hugging Face checkpoint
    (hf_quant_config.json, config.json quantization_config) that TensorRT-LLM's PyTorch backend and vLLM load."""

    qformat: Literal["fp8", "int4_awq", "nvfp4"] = Field(
        "fp8",
        description="fp8: FP8 (E4M3) weights and activations (Hopper, Ada, Blackwell); int4_awq: 4-bit AWQ weights, "
        "16-bit activations; nvfp4: 4-bit floating point (Blackwell only: hardware.gpu_type).",
    )
    kv_cache_fp8: bool = Field(False, description="Also calibrate an FP8 KV cache (kv_cache_quant_algo FP8).")
    dtype: Literal["float16", "bfloat16"] = Field(
        "bfloat16", description="Dtype the merged model is loaded in and the unquantized layers are exported in."
    )
    calib_size: int = Field(512, ge=1, description="Calibration conversations, from the train split.")
    calib_max_seq_length: int = Field(512, ge=16, description="Longest calibration sample in tokens (longer: cut).")
    awq_block_size: int = Field(128, ge=16, description="Group size of int4_awq weights.")


class QuantizeSection(Section):
    """What the merged model becomes before serving (quantize stage), and the accuracy it may lose."""

    backend: Literal["onnx-int8", "none", "modelopt"] = Field(
        "onnx-int8",
        description="onnx-int8: an ONNX export with int8 dynamic quantization, checked for accuracy (CPU); "
        "modelopt: an NVIDIA ModelOpt Hugging Face checkpoint (needs cuda); none: the merged model as is.",
    )
    opset: int = Field(18, description="ONNX opset of the onnx-int8 export.")
    modelopt: ModelOptQuantize = ModelOptQuantize()
    max_accuracy_drop: float = Field(
        0.05, ge=0, description="Largest task-metric drop (merged -> quantized) the stage accepts."
    )

    @field_validator("backend", mode="before")
    @classmethod
    def _legacy_backend(cls, value: object) -> object:
        if value == "tensorrt-llm":
            raise ValueError(
                "tensorrt-llm (convert_checkpoint / trtllm-build engines) was removed: TensorRT-LLM serves Hugging "
                "Face checkpoints directly; use quantize.backend modelopt (or none)"
            )
        return value


class EngineSection(Section):
    """TensorRT-LLM LLM API arguments (TorchLlmArgs) the quantized checkpoint is checked and served under
    (tasks/serving/llm_api.py renders them). Prompt lengths come from train.cutoff_len."""

    tensor_parallel_size: int = Field(1, ge=1, description="GPUs each layer is split across.")
    pipeline_parallel_size: int = Field(1, ge=1, description="GPUs the layers are spread over in stages.")
    max_batch_size: int = Field(64, ge=1, description="Most sequences in one scheduler step.")
    max_num_tokens: int = Field(
        8192, ge=1, description="Most tokens (all sequences together) in one step; at least train.cutoff_len."
    )
    max_output_len: int = Field(
        512, ge=1, description="Longest answer in tokens; max_seq_len is train.cutoff_len + max_output_len."
    )
    max_beam_width: int = Field(1, ge=1, description="Largest beam search width; 1: greedy or sampling only.")
    free_gpu_memory_fraction: float = Field(
        0.9, gt=0, le=1, description="Share of the GPU memory left after loading the weights that the KV cache takes."
    )
    enable_block_reuse: bool = Field(True, description="Reuse the KV cache of prompt prefixes shared by requests.")
    enable_chunked_prefill: bool = Field(False, description="Split long prompts over several scheduler steps.")
    extra_args: dict[str, Any] = Field(
        {},
        description="Any further LLM() argument, e.g. {enable_attention_dp: true}; the LLM API validates it.",
        json_schema_extra=FILE_ONLY,
    )

    @property
    def world_size(self) -> int:
        return self.tensor_parallel_size * self.pipeline_parallel_size
