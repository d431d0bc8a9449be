"""TensorRT-LLM and ModelOpt, driven through the stage runners in tasks/runners/.

- quantize: NVIDIA ModelOpt post-training quantization of the merged Hugging Face model into a Hugging
  Face checkpoint with hf_quant_config.json (tasks/runners/modelopt_quantize.py). Merging always happens
  first, on the full-precision base: a LoRA adapter cannot be merged into a quantized model.
- check (build_engine stage): the checkpoint loaded by the LLM API (PyTorch backend; TensorRT-LLM builds
  no engines any more) under the arguments Triton serves with (tasks/serving/llm_api.py), answering the
  eval split (tasks/runners/tensorrt_llm_check.py).

Why subprocesses: TensorRT-LLM and ModelOpt pin their own torch/transformers and hold the GPU;
running them out of process keeps the orchestrator's environment and memory clean, and each command
is in the log, so a user can rerun one by hand.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

from tasks.platform import child_env
from tasks.platform.config import ModelOptQuantize
from tasks.platform.errors import BadInput
from tasks.platform.project import PROJECT_ROOT

PINNED_VERSION = "1.2.1"  # nvcr.io/nvidia/tritonserver:26.07-trtllm-python-py3; the `gpu` extra should pin the same


def installed_version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("tensorrt_llm")
    except PackageNotFoundError:
        raise BadInput(
            "tensorrt_llm is not installed here: quantize and build_engine run in the TensorRT-LLM image "
            "(infra/images/trtllm.Dockerfile; hardware.kubernetes.stage_images)"
        ) from None


def gpu_arch() -> str:
    """e.g. 'sm90 NVIDIA H100 80GB HBM3': kernels and quantized formats (FP8, NVFP4) depend on the architecture."""
    import torch

    if not torch.cuda.is_available():
        raise BadInput("build_engine: no CUDA GPU visible; the checkpoint is checked on the GPU it will serve on")
    major, minor = torch.cuda.get_device_capability(0)
    return f"sm{major}{minor} {torch.cuda.get_device_name(0)}"


def quantize_command(
    cfg: ModelOptQuantize, merged_dir: Path, calibration: Path, out_dir: Path, python: str = sys.executable
) -> list[str]:
    """NVIDIA ModelOpt post-training quantization into a Hugging Face checkpoint (tasks/runners/modelopt_quantize.py)."""
    command = [
        python,
        "-m",
        "tasks.runners.modelopt_quantize",
        "--model_dir",
        str(merged_dir),
        "--calibration",
        str(calibration),
        "--output_dir",
        str(out_dir),
        "--qformat",
        cfg.qformat,
        "--dtype",
        cfg.dtype,
    ]
    if cfg.qformat == "int4_awq":
        command += ["--awq_block_size", str(cfg.awq_block_size)]
    return command + (["--kv_cache_fp8"] if cfg.kv_cache_fp8 else [])


def check_command(
    model_dir: Path, llm_args: Path, questions: Path, report: Path, max_new_tokens: int, python: str = sys.executable
) -> list[str]:
    """The checkpoint loaded by the LLM API under the serving arguments, answering the eval questions
    (tasks/runners/tensorrt_llm_check.py). One process: the LLM API spawns its own tensor-parallel ranks."""
    return [
        python,
        "-m",
        "tasks.runners.tensorrt_llm_check",
        "--model_dir",
        str(model_dir),
        "--llm_args",
        str(llm_args),
        "--questions",
        str(questions),
        "--report",
        str(report),
        "--max_new_tokens",
        str(max_new_tokens),
    ]


def command_env() -> dict:
    """A TensorRT-LLM command's environment: the allow-list of tasks/platform/child_env.py, with this project on
    PYTHONPATH for its runners (it reads and writes local folders; this process stores and tracks)."""
    env = child_env.program_env("tensorrt_llm")
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(PROJECT_ROOT), env.get("PYTHONPATH")]))
    return env


def run_logged(command: list[str], log_file: Path, what: str, log) -> None:
    """Run a TensorRT-LLM command, its output to log_file and the run log; a failure names its last lines."""
    child_env.run_logged(command, log_file, what, log, command_env(), PROJECT_ROOT)
