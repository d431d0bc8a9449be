"""The TensorRT-LLM LLM API arguments a profile serves with: one definition for the build_engine check
(tasks/runners/tensorrt_llm_check.py calls `LLM(model=..., **llm_args(profile))`) and for the served llmapi
model (infra/triton/llmapi/1/model.py, rendered by tasks/serving/model_config.py:llmapi_values), so the check
measures the runtime configuration users get. Upstream's own Triton llmapi model takes the same keys from its
model.yaml (every key but triton_config goes to `LLM(**kwargs)`).

Each key is a field of TensorRT-LLM's tensorrt_llm/llmapi/llm_args.py: BaseLlmArgs (`extra="forbid"`: an
unknown key fails at LLM(), not silently) and its KvCacheConfig. The serving image, tritonserver
26.07-trtllm-python-py3, ships 1.2.1; the tag v1.2.1 could not be read here (the stored copy of
NVIDIA/TensorRT-LLM holds tensorrt_llm/version.py only at b35ac1b64368513d215c57d2ed01d62d910df8da,
__version__ "1.2.0rc2", the closest 1.2.x), so the field names below are those of the 1.2 line: re-check them
at v1.2.1 when the repository can be read there. The caller adds `model` (the checkpoint folder), which differs
per machine; the canary's memory plan adds only kv_cache_config.max_tokens (the smaller of it and
free_gpu_memory_fraction applies); neither changes what the model computes.
"""

from __future__ import annotations

from typing import Any

from tasks.platform.config import Profile


def max_input_len(profile: Profile) -> int:
    """The longest prompt served: as long as training allowed (train.cutoff_len counts prompt and answer,
    so a prompt can take all of it), not the longest prompt of the eval split."""
    return profile.train.cutoff_len


def llm_args(profile: Profile) -> dict[str, Any]:
    engine = profile.engine
    args: dict[str, Any] = {
        # BaseLlmArgs.backend (deprecated, default None); Triton's llmapi model.yaml sets "pytorch", the only
        # backend once the TensorRT-engine backend was removed on main in July 2026 (NVIDIA/TensorRT-LLM#15767,
        # #15918; docs/source/legacy/tensorrt-backend-removal.md), first in a 1.3 or 1.4 release.
        "backend": "pytorch",
        "tensor_parallel_size": engine.tensor_parallel_size,  # BaseLlmArgs.tensor_parallel_size: int = 1
        "pipeline_parallel_size": engine.pipeline_parallel_size,  # BaseLlmArgs.pipeline_parallel_size: int = 1
        "max_batch_size": engine.max_batch_size,  # BaseLlmArgs.max_batch_size: Optional[int] = 2048
        "max_num_tokens": engine.max_num_tokens,  # BaseLlmArgs.max_num_tokens: Optional[int] = 8192
        # BaseLlmArgs.max_input_len: Optional[int] = 1024 unless set: a 4096-token training cutoff needs it. The
        # PyTorch executor reads it from the LLM's arguments (1.1/1.2 llmapi/llm.py _TorchLLM._build_model:
        # `self._executor_cls.create(..., llm_args=self.args)`; the update_executor_config(max_input_len=...) cited
        # here before was the 0.17/0.18 LLM's).
        "max_input_len": max_input_len(profile),
        # BaseLlmArgs.max_seq_len: Optional[int] = None (None: the model config's max_position_embeddings).
        "max_seq_len": max_input_len(profile) + engine.max_output_len,
        "max_beam_width": engine.max_beam_width,  # BaseLlmArgs.max_beam_width: Optional[int] = 1
        "enable_chunked_prefill": engine.enable_chunked_prefill,  # BaseLlmArgs.enable_chunked_prefill: bool = False
        # KvCacheConfig.free_gpu_memory_fraction: Optional[float] = 0.9 (ge 0, le 1); KvCacheConfig.dtype "auto"
        # reads an FP8 KV cache from the checkpoint's hf_quant_config.json (kv_cache_quant_algo).
        "kv_cache_config": {
            "free_gpu_memory_fraction": engine.free_gpu_memory_fraction,
            "enable_block_reuse": engine.enable_block_reuse,  # KvCacheConfig.enable_block_reuse: bool = True
        },
    }
    return args | dict(engine.extra_args)
