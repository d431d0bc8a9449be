"""Profile sections of the serving artifact: quantization (quantize stage) and the TensorRT-LLM runtime
arguments the build_engine check loads it under (the same ones Triton's llmapi model serves with)."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, field_validator

from tasks.platform.config.base import FILE_ONLY, Section

# Data-center Blackwell GPUs (compute capability 10.x: NVFP4 tensor cores), as hardware.gpu_type names them.
BLACKWELL = ("B100", "B200", "B300", "GB200", "GB300")
# The group sizes TensorRT-LLM's PyTorch backend runs INT4-AWQ with: W4A16_AWQ_LinearMethod.apply calls the CUTLASS
# fpA_intB fine-grained GEMM, which throws "Only group size 64 and 128 supported for fine grained kernels."
# (NVIDIA/TensorRT-LLM cpp/tensorrt_llm/kernels/cutlass_kernels/fpA_intB_gemm/fpA_intB_gemm_template.h @03cff08
# L141-143, generic_mixed_gemm_kernelLauncher); W4A16_AWQ_LinearMethod.create_weights
# (tensorrt_llm/_torch/modules/linear.py, 1.x) raises unless in_features % group_size == 0.
AWQ_GROUP_SIZES = (64, 128)


def is_blackwell(gpu_type: str | None) -> bool:
    return gpu_type is not None and gpu_type.upper().replace("NVIDIA ", "").startswith(BLACKWELL)


def awq_indivisible(group_size: int, hidden_size: int, intermediate_size: int, tensor_parallel: int) -> list[str]:
    """The linear-layer input widths of a Qwen2/Llama-shaped model that an INT4-AWQ group size does not divide: every
    projection reads hidden_size (o_proj: the heads' width, hidden_size in these models) or intermediate_size
    (down_proj); tensor parallelism splits o_proj's and down_proj's inputs across the GPUs (row parallel)."""
    widths: dict[str, float] = {"hidden_size": hidden_size, "intermediate_size": intermediate_size}
    if tensor_parallel > 1:
        widths |= {f"{name} / {tensor_parallel} GPUs": width / tensor_parallel for name, width in list(widths.items())}
    return [f"{name} {width:g}" for name, width in widths.items() if width % group_size]


class ModelOptQuantize(Section):
    """NVIDIA ModelOpt post-training quantization of the merged model into a Hugging Face checkpoint
    (hf_quant_config.json, config.json quantization_config) that TensorRT-LLM's PyTorch backend loads (and vLLM, in
    fp8 or nvfp4)."""

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
    awq_block_size: Literal[64, 128] = Field(
        128,
        description="Group size of int4_awq weights: 64 or 128, the only ones TensorRT-LLM's INT4-AWQ kernels run; "
        "every linear layer's input width (hidden and intermediate size, each divided by "
        "engine.tensor_parallel_size) must be a multiple of it.",
    )

    @field_validator("awq_block_size", mode="before")
    @classmethod
    def _kernel_group_size(cls, value: object) -> object:
        if value not in AWQ_GROUP_SIZES or isinstance(value, bool):
            raise ValueError(
                f"{value}: TensorRT-LLM's INT4-AWQ (W4A16) kernels run group size 64 or 128 only "
                "(CUTLASS fpA_intB fine-grained kernels)"
            )
        return value


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
