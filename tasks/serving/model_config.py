"""What a served version's Triton model holds: the template (infra/triton/<kind>) and the values it is rendered with,
per serve.backend. Kept apart from loading (tasks/serving/models.py, tasks/serving/adapters.py), which both render
with it."""

from __future__ import annotations

import json
from pathlib import Path

from tasks.platform.config import Profile
from tasks.serving import vllm as vllm_serving
from tasks.serving.llm_api import llm_args


def llm_values(profile: Profile, model_dir: Path, artifact_sha256: str) -> dict:
    serve = profile.serve
    return {
        "max_batch_size": serve.max_batch_size,
        "max_queue_delay_us": serve.max_queue_delay_us,
        "max_queue_size": serve.max_queue_size,
        "instance_count": serve.instance_count,
        "model_dir": model_dir.resolve(),
        "artifact_sha256": artifact_sha256,
        "apply_chat_template": str(serve.apply_chat_template).lower(),
        "default_max_tokens": serve.default_max_tokens,
        "torch_threads": serve.torch_threads,
        "device": "cuda" if profile.hardware.accelerator == "cuda" else "cpu",
        # bf16 where the GPU has it (Qwen2's fp16 activations overflow); fp32 on the CPU
        "dtype": profile.hardware.compute_dtype if profile.hardware.accelerator == "cuda" else "float32",
    }


def llmapi_values(profile: Profile, kv_tokens: int | None) -> dict[str, object]:
    """infra/triton/llmapi's values beyond those every Python-backend LLM model takes: the LLM() arguments
    build_engine checked the checkpoint under (tasks/serving/llm_api.py), with the canary's KV budget
    (kv_cache_config.max_tokens, tasks/serving/memory_plan.py) as the only addition, and each instance's GPUs."""
    args = llm_args(profile)
    if kv_tokens is not None:
        args["kv_cache_config"] = {**args["kv_cache_config"], "max_tokens": kv_tokens}
    world = args["tensor_parallel_size"] * args["pipeline_parallel_size"]
    # instance i runs on GPUs [i*world, (i+1)*world): "0;1" two single-GPU instances, "0,1" one TP2 instance
    devices = ";".join(",".join(str(i * world + r) for r in range(world)) for i in range(profile.serve.instance_count))
    return {"gpu_device_ids": devices, "llm_args": json.dumps(args, sort_keys=True)}


def serving_model(
    profile: Profile, model_dir: Path, artifact_sha256: str, kv_tokens: int | None = None
) -> tuple[str, dict]:
    """The template (infra/triton/<kind>) and values of a served version's Python-backend model; `kv_tokens`:
    the llmapi model's planned KV cache (tasks/serving/memory_plan.py)."""
    values = llm_values(profile, model_dir, artifact_sha256)
    if profile.serve.backend == "python":
        return "llm", values
    # vLLM and the LLM API batch and schedule themselves: no dynamic batcher, their own threads
    for unused in ("max_queue_delay_us", "max_queue_size", "torch_threads", "device", "dtype"):
        del values[unused]
    if profile.serve.backend == "llmapi":
        return "llmapi", {**values, **llmapi_values(profile, kv_tokens)}
    del values["instance_count"]  # one vLLM engine per model
    return "vllm", {**values, "max_num_seqs": values["max_batch_size"], **vllm_serving.model_values(profile)}
