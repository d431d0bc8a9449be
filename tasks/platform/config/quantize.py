"""Profile sections of the serving artifact: quantization (quantize stage) and the TensorRT-LLM engine build."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, model_validator

from tasks.platform.config.base import Section


class TensorRTLLMQuantize(Section):
    """A TensorRT-LLM checkpoint from the merged model: TensorRT-LLM's examples/quantization/quantize.py
    (NVIDIA ModelOpt for fp8/int4_awq/int8_sq/w4a8_awq; plain conversion for full_prec/int8_wo/int4_wo)."""

    qformat: Literal["full_prec", "fp8", "int4_awq", "w4a8_awq", "int8_sq", "int8_wo", "int4_wo"] = Field(
        "full_prec", description="Weight (and activation) format of the checkpoint; *_wo: weights only, no calibration."
    )
    kv_cache_dtype: Literal["fp8", "int8"] | None = Field(
        None, description="Quantized KV cache; null: the KV cache stays in `dtype`."
    )
    dtype: Literal["float16", "bfloat16"] = Field("float16", description="Activation dtype of the checkpoint.")
    calib_size: int = Field(512, ge=1, description="Calibration samples for the ModelOpt formats.")
    calib_max_seq_length: int = Field(512, ge=16, description="Longest calibration sample in tokens.")
    awq_block_size: int = Field(128, ge=16, description="Group size of the AWQ formats.")
    tp_size: int = Field(1, ge=1, description="Tensor-parallel ranks the checkpoint is split into (GPUs per engine).")
    pp_size: int = Field(1, ge=1, description="Pipeline-parallel ranks; tp_size x pp_size must fit hardware.gpus.")
    examples_dir: str = Field(
        "/app/tensorrt_llm/examples",
        description="The examples folder of the pinned TensorRT-LLM release (NGC TensorRT-LLM images ship it here).",
    )


class QuantizeSection(Section):
    """What the merged model becomes before serving (quantize stage), and the accuracy it may lose."""

    backend: Literal["onnx-int8", "none", "tensorrt-llm"] = Field(
        "onnx-int8",
        description="onnx-int8: an ONNX export with int8 dynamic quantization, checked for accuracy (CPU); "
        "tensorrt-llm: a TensorRT-LLM checkpoint (needs cuda and serve.backend tensorrtllm); none: the merged model as is.",
    )
    opset: int = Field(18, description="ONNX opset of the onnx-int8 export.")
    tensorrt_llm: TensorRTLLMQuantize = TensorRTLLMQuantize()
    max_accuracy_drop: float = Field(
        0.05, ge=0, description="Largest task-metric drop (merged -> quantized) the stage accepts."
    )


class EngineSection(Section):
    """`trtllm-build` arguments under TensorRT-LLM's own names (used when quantize.backend is tensorrt-llm)."""

    max_batch_size: int = Field(64, ge=1, description="Most sequences the engine runs in one batch.")
    max_input_len: int = Field(1024, ge=1, description="Longest prompt in tokens; must be below max_seq_len.")
    max_seq_len: int = Field(2048, ge=2, description="Longest prompt plus output in tokens.")
    max_num_tokens: int = Field(8192, ge=1, description="Most tokens (all sequences together) in one engine step.")
    max_beam_width: int = Field(1, ge=1, description="Largest beam search width; 1: greedy or sampling only.")
    gemm_plugin: str = Field("auto", description="GEMM plugin dtype (auto, float16, bfloat16, fp8 or disable).")
    gpt_attention_plugin: str = Field(
        "auto", description="Attention plugin dtype (auto, float16, bfloat16 or disable)."
    )
    kv_cache_type: Literal["paged", "continuous", "disabled"] = Field(
        "paged",
        description="trtllm-build's --kv_cache_type (--paged_kv_cache is deprecated upstream: "
        "tensorrt_llm/commands/build.py).",
    )
    remove_input_padding: bool = Field(True, description="Pack sequences without padding tokens.")
    context_fmha: bool = Field(True, description="Fused multi-head attention in the context (prompt) phase.")
    use_paged_context_fmha: bool = Field(
        True, description="Context attention over the paged KV cache (needed for KV cache reuse and chunked context)."
    )
    use_fp8_context_fmha: bool = Field(False, description="FP8 context attention (fp8 checkpoints on Hopper or newer).")
    multiple_profiles: bool = Field(
        True, description="Several TensorRT optimization profiles for different batch shapes."
    )
    workers: int = Field(1, ge=1, description="Parallel build processes (one per rank at most).")
    extra_args: dict[str, Any] = Field(
        {}, description="Any further trtllm-build flag, e.g. {reduce_fusion: enable}; trtllm-build validates it."
    )

    @model_validator(mode="after")
    def _lengths_fit(self) -> EngineSection:
        if self.max_input_len >= self.max_seq_len:
            raise ValueError("max_input_len must be below max_seq_len (room for output tokens)")
        return self
