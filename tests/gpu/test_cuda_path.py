"""GPU integration: QLoRA on CUDA, and a ModelOpt checkpoint of the tiny model checked on TensorRT-LLM,
through `llmops run`.

Skipped, with the reason printed (pytest -ra), where there is no CUDA GPU or no TensorRT-LLM. Run them
in the GPU images of infra/images/ (a CUDA build of torch; tensorrt_llm and ModelOpt in the TensorRT-LLM image):
    python -m pytest tests/gpu -ra
"""

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
LLMOPS = str(Path(sys.executable).parent / "llmops")


def cuda_gpus() -> int:
    try:
        import torch
    except ImportError:
        return 0
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


needs_cuda = pytest.mark.skipif(cuda_gpus() < 1, reason="no CUDA GPU visible to torch on this machine")
needs_tensorrt_llm = pytest.mark.skipif(
    importlib.util.find_spec("tensorrt_llm") is None or importlib.util.find_spec("modelopt") is None,
    reason="tensorrt_llm or nvidia-modelopt not installed (run in the TensorRT-LLM image)",
)


def has_fp8() -> bool:
    import torch

    return torch.cuda.get_device_capability(0) >= (8, 9)  # Ada, Hopper, Blackwell


ON_ONE_GPU = ["--set", "hardware.accelerator=cuda", "--set", "hardware.gpus=1", "--set", "serve.deploy=false"]


def llmops_run(home: Path, *overrides: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "LLMOPS_HOME": str(home)}
    return subprocess.run(
        [LLMOPS, "run", "--profile", "cpu-tiny", *ON_ONE_GPU, *overrides],
        env=env,
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=1800,
    )


def mlflow_metrics(home: Path) -> dict:
    from mlflow import MlflowClient

    client = MlflowClient(f"sqlite:///{home / 'mlflow.db'}")
    run = client.search_runs([client.get_experiment_by_name("llm-release").experiment_id], max_results=1)[0]
    return run.data.metrics


@needs_cuda
def test_qlora_on_cuda_logs_tokens_per_second_and_gpu_memory(tmp_path):
    done = llmops_run(tmp_path / "home", "--set", "train.quantization_bit=4")
    assert done.returncode == 0, done.stderr[-3000:]
    metrics = mlflow_metrics(tmp_path / "home")
    assert metrics["train/tokens_per_second"] > 0
    assert metrics["evaluate/candidate_exact_match"] > metrics["evaluate/base_exact_match"]
    assert any(k.startswith("system/gpu_0_memory_usage") for k in metrics), sorted(metrics)


@needs_cuda
@needs_tensorrt_llm
def test_a_modelopt_checkpoint_of_the_tiny_model_answers_on_tensorrt_llm_like_the_merged_model(tmp_path):
    """quantize (ModelOpt, FP8 where the GPU has it, else int4 AWQ) then build_engine: the checkpoint loaded
    by the LLM API under the serving arguments answers the eval split within quantize.max_accuracy_drop.
    The tiny model's layers are 64 (hidden) and 128 (MLP) wide: of the group sizes TensorRT-LLM's INT4-AWQ kernels
    run (64, 128), only 64 divides both."""
    qformat = "fp8" if has_fp8() else "int4_awq"
    done = llmops_run(
        tmp_path / "home",
        *("--set", "quantize.backend=modelopt", "--set", f"quantize.modelopt.qformat={qformat}"),
        *("--set", "quantize.modelopt.awq_block_size=64", "--set", "serve.backend=llmapi"),
        *(
            "--set",
            "engine.max_batch_size=8",
            "--set",
            "engine.max_num_tokens=1024",
            "--set",
            "engine.max_output_len=32",
        ),
    )
    assert done.returncode == 0, done.stderr[-3000:]
    metrics = mlflow_metrics(tmp_path / "home")
    assert metrics["build_engine/checkpoint_bytes"] > 0 and metrics["build_engine/load_s"] > 0
    assert metrics["build_engine/accuracy_drop"] <= 0.05
