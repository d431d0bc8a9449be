"""TensorRT-LLM, driven through its documented, version-pinned command lines.

- checkpoint: `examples/quantization/quantize.py` of the pinned release (NVIDIA ModelOpt for fp8,
  int4_awq, w4a8_awq, int8_sq; a plain conversion for full_prec, int8_wo, int4_wo), from the merged
  Hugging Face model. Merging always happens first, on the full-precision base: a LoRA adapter
  cannot be merged into a quantized model.
- engine: `trtllm-build` on that checkpoint. Tensor/pipeline parallelism is fixed in the checkpoint.
- accuracy: the built engine answers the eval split through `tensorrt_llm.runtime.ModelRunner`
  (tasks/runners/tensorrt_llm_eval.py), under `mpirun` when the engine spans several GPUs.

Why subprocesses: TensorRT-LLM and ModelOpt pin their own torch/transformers and hold the GPU;
running them out of process keeps the orchestrator's environment and memory clean, and the
commands are exactly what NVIDIA's docs show, so a user can rerun one by hand from the log.
"""

from __future__ import annotations

import subprocess
import sys
from collections import deque
from pathlib import Path

from tasks.platform.config import EngineSection, TensorRTLLMQuantize
from tasks.platform.errors import BadInput, CheckFailed
from tasks.platform.project import PROJECT_ROOT

PINNED_VERSION = "0.20.0"  # the `gpu` extra in pyproject.toml pins the same release
MODELOPT_FORMATS = {"fp8", "int4_awq", "w4a8_awq", "int8_sq"}  # these calibrate on data


def installed_version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("tensorrt_llm")
    except PackageNotFoundError:
        raise BadInput(
            "tensorrt_llm is not installed here: quantize and build_engine run in the TensorRT-LLM image "
            "(infra/images/trtllm.Dockerfile; hardware.kubernetes.stage_images)"
        ) from None


def engine_version(engine_dir: Path) -> str:
    """The TensorRT-LLM release an engine was built with: the top-level "version" of its config.json
    (tensorrt_llm/builder.py writes EngineConfig(model.config, build_config, __version__).to_dict())."""
    import json

    try:
        version = json.loads((engine_dir / "config.json").read_text()).get("version")
    except (OSError, ValueError) as exc:
        raise CheckFailed(f"engine {engine_dir}: config.json unreadable ({exc})") from None
    if not isinstance(version, str):
        raise CheckFailed(f"engine {engine_dir}: config.json has no TensorRT-LLM version (built by the legacy API?)")
    return version


def require_serving_version(engine_dir: Path, server_version: str, server: str) -> None:
    """Preflight before any load: an engine runs only on the TensorRT-LLM release that built it."""
    built = engine_version(engine_dir)
    if built != server_version:
        raise CheckFailed(
            f"engine {engine_dir.parent.name} was built with TensorRT-LLM {built}, but Triton at {server} serves "
            f"TensorRT-LLM {server_version} (serve.tensorrtllm.server_version): rebuild the engine with "
            f"{server_version} or serve it on a {built} image"
        )


def triton_launch(world_size: int, instances: int) -> tuple[list[str], dict[str, str]]:
    """How tritonserver must start for tensorrtllm models that span GPUs: (command prefix, environment).

    One GPU per model: a plain process. Tensor/pipeline parallel engines or several instances on their own
    GPUs: the backend's orchestrator mode, where tritonserver is MPI rank 0 alone and the backend spawns
    each model instance's ranks itself (MPI_Comm_spawn), so candidates can still be loaded and unloaded one
    by one. Leader mode (`mpirun -n TP tritonserver`, ranks > 0 loading a fixed model list at start) could
    not load a canary. Upstream: tensorrtllm_backend README "Orchestrator mode" (MPI world size 1, single
    node) and docs/llama_multi_instance.md (`--multi-model` sets TRTLLM_ORCHESTRATOR=1; one `gpu_device_ids`
    set per instance); scripts/launch_triton_server.py runs it as `mpirun --allow-run-as-root -n 1 tritonserver`.
    """
    if world_size == 1 and instances == 1:
        return [], {}
    return ["mpirun", "--allow-run-as-root", "-n", "1"], {
        "TRTLLM_ORCHESTRATOR": "1",
        "TRTLLM_ORCHESTRATOR_SPAWN_PROCESSES": "1",
    }


def gpu_arch() -> str:
    """e.g. 'sm90 NVIDIA H100 80GB HBM3': an engine only runs on the architecture it was built for."""
    import torch

    if not torch.cuda.is_available():
        raise BadInput("build_engine: no CUDA GPU visible; a TensorRT engine is built on the GPU it will run on")
    major, minor = torch.cuda.get_device_capability(0)
    return f"sm{major}{minor} {torch.cuda.get_device_name(0)}"


def flag(value: bool) -> str:
    return "enable" if value else "disable"


def checkpoint_command(
    cfg: TensorRTLLMQuantize, merged_dir: Path, calib_dir: Path, out_dir: Path, python: str = sys.executable
) -> list[str]:
    command = [
        python,
        f"{cfg.examples_dir.rstrip('/')}/quantization/quantize.py",
        "--model_dir",
        str(merged_dir),
        "--dtype",
        cfg.dtype,
        "--qformat",
        cfg.qformat,
        "--output_dir",
        str(out_dir),
        "--tp_size",
        str(cfg.tp_size),
        "--pp_size",
        str(cfg.pp_size),
    ]
    if cfg.kv_cache_dtype:
        command += ["--kv_cache_dtype", cfg.kv_cache_dtype]
    if cfg.qformat in MODELOPT_FORMATS or cfg.kv_cache_dtype:
        # Local calibration data (the training split, {"text": ...} lines): no dataset download.
        command += [
            "--calib_dataset",
            str(calib_dir),
            "--calib_size",
            str(cfg.calib_size),
            "--calib_max_seq_length",
            str(cfg.calib_max_seq_length),
        ]
    if cfg.qformat in ("int4_awq", "w4a8_awq"):
        command += ["--awq_block_size", str(cfg.awq_block_size)]
    return command


def build_args(cfg: EngineSection) -> list[str]:
    args = [
        "--max_batch_size",
        str(cfg.max_batch_size),
        "--max_input_len",
        str(cfg.max_input_len),
        "--max_seq_len",
        str(cfg.max_seq_len),
        "--max_num_tokens",
        str(cfg.max_num_tokens),
        "--max_beam_width",
        str(cfg.max_beam_width),
        "--gemm_plugin",
        cfg.gemm_plugin,
        "--gpt_attention_plugin",
        cfg.gpt_attention_plugin,
        "--kv_cache_type",
        cfg.kv_cache_type,
        "--remove_input_padding",
        flag(cfg.remove_input_padding),
        "--context_fmha",
        flag(cfg.context_fmha),
        "--use_paged_context_fmha",
        flag(cfg.use_paged_context_fmha),
        "--use_fp8_context_fmha",
        flag(cfg.use_fp8_context_fmha),
        "--multiple_profiles",
        flag(cfg.multiple_profiles),
        "--workers",
        str(cfg.workers),
    ]
    for key, value in sorted(cfg.extra_args.items()):
        args += [f"--{key}", flag(value) if isinstance(value, bool) else str(value)]
    return args


def build_command(cfg: EngineSection, checkpoint_dir: Path, out_dir: Path) -> list[str]:
    return ["trtllm-build", "--checkpoint_dir", str(checkpoint_dir), "--output_dir", str(out_dir), *build_args(cfg)]


def eval_command(
    engine_dir: Path,
    tokenizer_dir: Path,
    questions: Path,
    answers: Path,
    max_new_tokens: int,
    world_size: int,
    python: str = sys.executable,
) -> list[str]:
    command = [
        python,
        "-m",
        "tasks.runners.tensorrt_llm_eval",
        "--engine_dir",
        str(engine_dir),
        "--tokenizer_dir",
        str(tokenizer_dir),
        "--questions",
        str(questions),
        "--answers",
        str(answers),
        "--max_new_tokens",
        str(max_new_tokens),
    ]
    # A tensor-parallel engine runs one MPI rank per GPU.
    return ["mpirun", "-n", str(world_size), "--allow-run-as-root", *command] if world_size > 1 else command


def run_logged(command: list[str], log_file: Path, what: str, log) -> None:
    """Run a TensorRT-LLM command, its output to log_file and the run log; a failure names its last lines."""
    log.info(f"{what}: {' '.join(command)}")
    last: deque[str] = deque(maxlen=5)
    with open(log_file, "w") as sink:
        process = subprocess.Popen(
            command,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            cwd=PROJECT_ROOT,
        )
        assert process.stdout is not None  # stdout=PIPE
        for line in process.stdout:
            sink.write(line)
            last.append(line.rstrip())
            if line.strip():
                log.info(f"{what}: {line.rstrip()[:300]}")
        code = process.wait()
    if code != 0:
        raise CheckFailed(f"{what} failed (exit {code}; full log {log_file}): {' | '.join(last)}")
