"""GPU memory of a canary: champion and candidate LLM API models side by side on the same GPUs.

TensorRT-LLM's LLM API sizes a model's KV cache from `kv_cache_config.free_gpu_memory_fraction` of the memory
free *when that model loads* (default 0.9): the champion would take 90% of what is free and the candidate,
loaded next, would get a KV cache too small to serve, or fail to load. So each model also gets an absolute
budget, `kv_cache_config.max_tokens` (KvCacheConfig: when both are set, the smaller applies), planned so
that two models of this size fit at once:

    per GPU:  tritonserver + 2 x (weights + activations + worker reserve + stub context + CUDA graphs)
              + 2 x tokens x KV bytes per token  <=  GPU memory (real GiB) x (1 - fragmentation margin)

Everything besides weights and KV cache is written out rather than hidden in one percentage. TensorRT-LLM itself
never over-commits (KvCacheCreator sizes the KV cache from what is free after its own peak, then takes the smaller
of that and max_tokens: 1.x _torch/pyexecutor/_util.py), so a cost left out here does not crash a load: it leaves
the candidate a smaller KV cache than planned, or, captured after the KV cache, makes CUDA graph capture fail.
- tritonserver (TRITONSERVER_GIB, once per GPU): its own CUDA context and the CUDA memory pool it creates on every
  GPU (`--cuda-memory-pool-byte-size`, 64 MB a GPU by default; its pinned-memory pool is host memory);
- worker reserve (RUNTIME_RESERVE_GIB per model per GPU): the TensorRT-LLM worker process's CUDA context, cuBLAS
  and NCCL workspaces and the PyTorch executor's buffers (sampler and decoder state);
- stub context (CUDA_CONTEXT_GIB per model per GPU): the Triton Python stub that holds the LLM is a CUDA process of
  its own: LLM() argument validation asks torch for the device's properties and count in it
  (BaseLlmArgs.validate_dtype, validate_gpus_per_node), which opens a CUDA context there besides the worker's;
- CUDA graphs (CUDA_GRAPHS_GIB per model per GPU): on by default (TorchLlmArgs.cuda_graph_config), decode-only
  graphs for batch sizes 1-31, 32, 64 and 128 (CudaGraphConfig._generate_cuda_graph_batch_sizes, max_batch_size
  0 -> 128), captured after the KV cache is sized; upstream says "each CUDA graph can use up to 200 MB of extra
  memory" (llm_args.py), the graphs' activations for a decode step are small next to a prefill's, and their
  memory pool is what this reserve holds;
- activations: one layer's forward pass over `max_num_tokens` tokens (the PyTorch backend frees each layer's
  tensors before the next), plus fp32 logits of `max_batch_size` sequences;
- a FRAGMENTATION margin of the GPU: the caching allocator's free-but-split blocks.
The stub and worker contexts are what `make gpu-smoke` measures on its GPU (its `memory` step fails when a
measured one exceeds what is reserved here); the CUDA graphs' pool needs TensorRT-LLM, which the lent GPU machine
cannot carry: docs/gpu.md lists it among the first checks on a GPU box.
A layout that leaves less than one full sequence (`max_seq_len` tokens) per model is refused with what to change.

GPU memory is what the GPU reports (nvidia-smi's total, in GiB), not the size it is sold under: an "80 GB"
H100 has 79.6 GiB, a "24 GB" A10 22.5 GiB. Known types come from GPU_GIB; any other takes
hardware.gpu_memory_gb as decimal GB converted to GiB (which is below what such a GPU reports).
The checkpoint's sizes come from its own files: *.safetensors (weights), config.json (layers, KV heads, head
size, dtype), hf_quant_config.json (ModelOpt's export: an FP8 KV cache).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tasks.platform.config import Profile
from tasks.platform.errors import BadInput, CheckFailed
from tasks.serving.llm_api import llm_args

GIB = 1 << 30
DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2, "fp8": 1, "int8": 1}
# nvidia-smi's memory.total per GPU type, MiB / 1024 (what cudaMemGetInfo reports as total)
GPU_GIB = {
    "A10": 22.49,  # 23028 MiB
    "A10G": 22.49,
    "L4": 22.49,  # 23034 MiB
    "L40S": 44.99,  # 46068 MiB
    "L40": 44.99,
    "H100": 79.65,  # 81559 MiB (SXM and PCIe 80GB)
    "H200": 140.40,  # 143771 MiB
}
RUNTIME_RESERVE_GIB = 1.5  # per model per GPU: the worker's CUDA context, cuBLAS/NCCL workspaces, executor buffers
CUDA_CONTEXT_GIB = 0.5  # per model per GPU: the Triton stub's own CUDA context
CUDA_GRAPHS_GIB = 1.0  # per model per GPU: the decode CUDA graphs' memory pool
TRITONSERVER_GIB = 0.5 + 64 / 1024  # per GPU: tritonserver's CUDA context and its 64 MB CUDA memory pool
FRAGMENTATION = 0.05


@dataclass(frozen=True)
class ModelFootprint:
    """What one served model takes per GPU, besides its KV cache."""

    weights_bytes: int  # this GPU's share of the checkpoint's weights
    activation_bytes: int
    kv_bytes_per_token: int  # K and V of every layer this GPU holds


def gpu_gib(gpu_type: str | None, gpu_memory_gb: float | None, where: str) -> float:
    """The memory one GPU really has, in GiB."""
    if gpu_type and gpu_type.upper() in GPU_GIB:
        return GPU_GIB[gpu_type.upper()]
    if gpu_memory_gb is None:
        raise BadInput(
            f"{where}: hardware.gpu_type {gpu_type!r} is not one of {', '.join(GPU_GIB)} and hardware.gpu_memory_gb "
            "is not set: the canary's memory plan needs one GPU's memory"
        )
    return gpu_memory_gb * 1e9 / GIB


def read_json(path: Path) -> dict[str, Any]:
    try:
        value = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise CheckFailed(f"checkpoint {path.parent}: {path.name} unreadable ({exc})") from None
    if not isinstance(value, dict):
        raise CheckFailed(f"checkpoint {path.parent}: {path.name} is not a JSON object")
    return value


def kv_dtype_bytes(checkpoint_dir: Path, config: dict[str, Any]) -> int:
    """ModelOpt's export names a quantized KV cache in hf_quant_config.json (quantization.kv_cache_quant_algo);
    otherwise the KV cache is in the model's dtype."""
    quant_file = checkpoint_dir / "hf_quant_config.json"
    if quant_file.is_file():
        algo = (read_json(quant_file).get("quantization") or {}).get("kv_cache_quant_algo")
        if algo in ("FP8", "INT8", "NVFP4"):
            return 1
    return DTYPE_BYTES.get(str(config.get("torch_dtype") or config.get("dtype") or "bfloat16"), 2)


def footprint(
    checkpoint_dir: Path, tensor_parallel: int, pipeline_parallel: int, max_num_tokens: int, max_batch_size: int
) -> ModelFootprint:
    config = read_json(checkpoint_dir / "config.json")
    try:
        heads = int(config["num_attention_heads"])
        kv_heads = int(config.get("num_key_value_heads") or heads)
        hidden = int(config["hidden_size"])
        head_size = int(config.get("head_dim") or hidden // heads)
        layers = int(config["num_hidden_layers"])
        intermediate = int(config.get("intermediate_size") or 4 * hidden)
        vocab = int(config["vocab_size"])
    except (KeyError, TypeError, ValueError) as exc:
        raise CheckFailed(
            f"checkpoint {checkpoint_dir}: config.json lacks what the memory plan needs ({exc!r})"
        ) from None
    shards = list(checkpoint_dir.glob("*.safetensors"))
    if not shards:
        raise CheckFailed(f"checkpoint {checkpoint_dir}: no *.safetensors file")
    gpus = tensor_parallel * pipeline_parallel
    weights = -(-sum(p.stat().st_size for p in shards) // gpus)
    kv = 2 * -(-layers // pipeline_parallel) * max(kv_heads // tensor_parallel, 1) * head_size
    activations = max_num_tokens * (2 * intermediate // tensor_parallel + 4 * hidden) * 2 + max_batch_size * vocab * 4
    return ModelFootprint(weights, activations, kv * kv_dtype_bytes(checkpoint_dir, config))


def runtime_gib_per_model() -> float:
    """What each model costs per GPU besides its weights, activations and KV cache."""
    return RUNTIME_RESERVE_GIB + CUDA_CONTEXT_GIB + CUDA_GRAPHS_GIB


def kv_tokens_for_canary(model: ModelFootprint, gpu_memory_gib: float, max_seq_len: int, where: str) -> int:
    """The KV cache budget (tokens) that lets two models of this size serve side by side on one GPU set."""
    per_model = model.weights_bytes + model.activation_bytes + runtime_gib_per_model() * GIB
    usable = gpu_memory_gib * GIB * (1 - FRAGMENTATION) - TRITONSERVER_GIB * GIB - 2 * per_model
    tokens = int(usable / 2 // model.kv_bytes_per_token) if usable > 0 else 0
    if tokens < max_seq_len:
        raise BadInput(
            f"{where}: champion and candidate ({model.weights_bytes / GIB:.1f} GiB of weights, "
            f"{model.activation_bytes / GIB:.1f} GiB of activations and {runtime_gib_per_model():.1f} GiB of runtime "
            f"per GPU each, tritonserver's {TRITONSERVER_GIB:.2f} GiB) do not fit side by side on "
            f"{gpu_memory_gib:.1f} GiB GPUs with a KV cache for one "
            f"{max_seq_len}-token sequence each ({tokens} tokens left): quantize further, lower train.cutoff_len, engine.max_output_len or "
            "engine.max_num_tokens, or give the candidate GPUs of its own"
        )
    return tokens


def canary_kv_tokens(profile: Profile, checkpoint_dir: Path, where: str) -> int:
    """kv_cache_config.max_tokens for one of the canary's two models of this profile's checkpoint."""
    args = llm_args(profile)
    model = footprint(
        checkpoint_dir,
        args["tensor_parallel_size"],
        args["pipeline_parallel_size"],
        args["max_num_tokens"],
        args["max_batch_size"],
    )
    memory = gpu_gib(profile.hardware.gpu_type, profile.hardware.gpu_memory_gb, f"profile {profile.name}")
    return kv_tokens_for_canary(model, memory, args["max_seq_len"], where)
