"""GPU memory of a canary: champion and candidate TensorRT-LLM engines side by side on the same GPUs.

The tensorrtllm backend sizes a model's KV cache from `kv_cache_free_gpu_mem_fraction` of the memory
free *when that model loads*: with 0.9, the champion takes 90% of what is free and the candidate, loaded
next, gets a KV cache too small to serve (or fails to load). So every engine is loaded with an absolute
budget, `max_tokens_in_paged_kv_cache` (the backend uses the smaller of the two limits), planned so that
two engines of its size fit at once:

    per GPU:  2 x weights + 2 x tokens x KV bytes per token  <=  GPU memory x (1 - headroom)

A layout where that leaves less than one full sequence (`max_seq_len` tokens) per engine is refused with
what to change. The engine's sizes come from its own files: the rank*.engine files (weights, per GPU) and
config.json (layers, KV heads, head size, KV cache dtype, parallel mapping).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from tasks.platform.errors import BadInput, CheckFailed

GIB = 1 << 30
DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2, "fp8": 1, "int8": 1}
# Activations, CUDA context, the executor's buffers: kept out of the plan (upstream's default fraction
# leaves 10% of free memory for the same reason).
HEADROOM = 0.15


@dataclass(frozen=True)
class EngineFootprint:
    weights_bytes: int  # per GPU: the largest rank's engine file
    kv_bytes_per_token: int  # per GPU: K and V of every layer this rank holds
    max_seq_len: int


def footprint(engine_dir: Path) -> EngineFootprint:
    try:
        config = json.loads((engine_dir / "config.json").read_text())
        pretrained, build = config["pretrained_config"], config["build_config"]
        mapping = pretrained.get("mapping", {})
        tp, pp = int(mapping.get("tp_size", 1)), int(mapping.get("pp_size", 1))
        heads = int(pretrained["num_attention_heads"])
        kv_heads = int(pretrained.get("num_key_value_heads") or heads)
        head_size = int(pretrained.get("head_size") or pretrained["hidden_size"] // heads)
        layers = int(pretrained["num_hidden_layers"])
        kv_quant = (pretrained.get("quantization") or {}).get("kv_cache_quant_algo")
        kv_dtype = "fp8" if kv_quant in ("FP8", "INT8") else str(pretrained.get("dtype", "float16"))
        max_seq_len = int(build["max_seq_len"])
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise CheckFailed(f"engine {engine_dir}: config.json lacks what the memory plan needs ({exc!r})") from None
    ranks = list(engine_dir.glob("rank*.engine"))
    if not ranks:
        raise CheckFailed(f"engine {engine_dir}: no rank*.engine file")
    per_gpu_kv_heads = max(kv_heads // tp, 1)
    kv_bytes = 2 * -(-layers // pp) * per_gpu_kv_heads * head_size * DTYPE_BYTES.get(kv_dtype, 2)
    return EngineFootprint(max(p.stat().st_size for p in ranks), kv_bytes, max_seq_len)


def kv_tokens_for_canary(engine: EngineFootprint, gpu_memory_gb: float, where: str) -> int:
    """The KV cache budget (tokens) that lets two engines of this size serve side by side on one GPU set."""
    usable = gpu_memory_gb * GIB * (1 - HEADROOM) - 2 * engine.weights_bytes
    tokens = int(usable / 2 // engine.kv_bytes_per_token) if usable > 0 else 0
    if tokens < engine.max_seq_len:
        raise BadInput(
            f"{where}: champion and candidate engines ({engine.weights_bytes / GIB:.1f} GiB of weights per GPU each) "
            f"do not fit side by side on {gpu_memory_gb:g} GB GPUs (hardware.gpu_memory_gb) with a KV cache for "
            f"one {engine.max_seq_len}-token sequence each ({tokens} tokens left): quantize further, shorten "
            "engine.max_seq_len, or give the candidate GPUs of its own"
        )
    return tokens
