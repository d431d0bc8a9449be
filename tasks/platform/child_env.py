"""The environment a child process starts with: this process's, less the secrets it does not need.

`os.environ` of an `llmops` process may hold the gateway's API keys, Triton's control key and S3
credentials, and the Prefect and MLflow logins of the local stack; a child that inherits them (tritonserver and the Python-backend stubs it spawns,
genai-perf, rclone, MLflow, Prefect) keeps them in /proc/<pid>/environ, where its logs, crash dumps
and anything it runs can read them. Each place that starts a child builds its environment here and
adds back by name only what that child needs.

The programs that run third-party code on the job's data get an allow-list instead (`program_env`): only the
variables named for that program pass, so a secret nobody listed (a new login, a cloud token) never reaches
LlamaFactory, the TensorRT-LLM commands or git.
"""

from __future__ import annotations

import fnmatch
import os
import secrets
import subprocess
from collections import deque
from collections.abc import Mapping
from pathlib import Path

from tasks.platform.errors import CheckFailed

SECRETS = (
    "LLMOPS_API_KEYS",
    "LLMOPS_TRITON_CONTROL_KEY",
    "AWS_ACCESS_KEY_ID",
    "AWS_SECRET_ACCESS_KEY",
    "AWS_SESSION_TOKEN",
    "RCLONE_AUTH_KEY",
    "PREFECT_API_AUTH_STRING",
    "PREFECT_SERVER_API_AUTH_STRING",
    "MLFLOW_TRACKING_PASSWORD",
    "LLMOPS_JUDGE_API_KEY",  # evaluate.judge's default key variable: the gate's own call needs it, no child does
)


def child_env(extra: Mapping[str, str] | None = None, base: Mapping[str, str] | None = None) -> dict[str, str]:
    """`base` (default: os.environ) without SECRETS, then `extra` (what this child needs, secrets included)."""
    env = {name: value for name, value in (os.environ if base is None else base).items() if name not in SECRETS}
    return {**env, **(extra or {})}


# The locale, the user's folders and the shell's basics: what any program may read.
BASICS = ("PATH", "HOME", "USER", "LOGNAME", "LANG", "LANGUAGE", "LC_*", "TZ", "TMPDIR", "TERM", "PWD")
# Python, torch and the accelerators' runtimes, as a training or TensorRT-LLM process reads them.
COMPUTE = (
    *("PYTHONPATH", "PYTHONHASHSEED", "PYTHONUNBUFFERED", "VIRTUAL_ENV", "LD_LIBRARY_PATH", "LD_PRELOAD"),
    *("OMP_*", "MKL_*", "KMP_*", "TORCH_*", "TORCHINDUCTOR_*", "PYTORCH_*", "CUDA_*", "NVIDIA_*", "NCCL_*", "CUBLAS_*"),
    *(
        "TOKENIZERS_PARALLELISM",
        "HF_HOME",
        "HF_HUB_*",
        "HF_DATASETS_*",
        "HF_ENDPOINT",
        "TRANSFORMERS_*",
        "XDG_CACHE_HOME",
    ),
)
PROGRAMS: dict[str, tuple[str, ...]] = {
    # LlamaFactory's CLI and the torchrun launch it starts (llamafactory/cli.py: FORCE_TORCHRUN, NNODES, NODE_RANK,
    # NPROC_PER_NODE, MASTER_ADDR, MASTER_PORT; its own switches are LLAMAFACTORY_* and a few bare names)
    "llamafactory": (
        *BASICS,
        *COMPUTE,
        *(
            "FORCE_TORCHRUN",
            "NNODES",
            "NODE_RANK",
            "NPROC_PER_NODE",
            "MASTER_ADDR",
            "MASTER_PORT",
            "RDZV_ID",  # launcher.py:85-112: a c10d rendezvous (tasks/training/launch.py), and elastic node counts
            "MIN_NNODES",
            "MAX_NNODES",
            "MAX_RESTARTS",
            "RANK",
            "WORLD_SIZE",
        ),
        *("LLAMAFACTORY_*", "DISABLE_VERSION_CHECK", "ACCELERATE_*", "BITSANDBYTES_*", "DS_*", "WANDB_DISABLED"),
    ),
    # quantize (ModelOpt) and build_engine's check (TensorRT-LLM's LLM API), with the MPI world a TP x PP run starts
    "tensorrt_llm": (*BASICS, *COMPUTE, "TLLM_*", "TRTLLM_*", "OMPI_*", "PMIX_*", "PMI_*", "UCX_*", "MODELOPT_*"),
    "git": (*BASICS, "GIT_DIR", "GIT_WORK_TREE", "GIT_CEILING_DIRECTORIES"),
    # evaluate.engine vllm: vLLM's offline engine answering the eval split (tasks/runners/vllm_answers.py)
    "vllm": (*BASICS, *COMPUTE, "VLLM_*"),
    # tritonserver and the model processes it starts (infra/triton/*/1/model.py: vLLM, TensorRT-LLM's LLM API and
    # its MPI workers, OpenAI Triton's kernel cache); what a model reads of ours (the model roots, the adapter maps)
    # comes as the start's own variables. A deny-list let the OpenAI key, HF_TOKEN and a judge's key reach every
    # stub (issue 74).
    "tritonserver": (
        *BASICS,
        *COMPUTE,
        *("VLLM_*", "TLLM_*", "TRTLLM_*", "OMPI_*", "PMIX_*", "PMI_*", "UCX_*", "MODELOPT_*", "TRITON_*", "NUMBA_*"),
    ),
}


def program_env(program: str, extra: Mapping[str, str] | None = None, base: Mapping[str, str] | None = None) -> dict:
    """`base` (default: os.environ) with only the variables PROGRAMS[program] names (shell patterns), then `extra`
    (what this start needs; nothing of it may be a secret of SECRETS)."""
    allowed = PROGRAMS[program]
    source = os.environ if base is None else base
    env = {k: v for k, v in source.items() if k not in SECRETS and any(fnmatch.fnmatchcase(k, p) for p in allowed)}
    return {**env, **(extra or {})}


def write_secret(path, text: str) -> None:
    """Write `text` to `path`, mode 600 from its creation (never readable by others, not even for an instant),
    replacing it atomically: a reader sees the old file or the new one, whole."""
    staged = f"{path}.{secrets.token_hex(6)}.partial"
    fd = os.open(staged, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        with os.fdopen(fd, "w") as out:
            out.write(text)
        os.replace(staged, path)
    except BaseException:
        if os.path.exists(staged):
            os.unlink(staged)
        raise


def run_logged(command: list[str], log_file: Path, what: str, log, env: dict, cwd: Path, echo: bool = True) -> None:
    """Run a program in `env`, its output to log_file (and, with `echo`, each line to the run log as `what: ...`); a
    failure is CheckFailed naming its exit code, the log file and its last lines."""
    log.info(f"{what}: {' '.join(command)}")
    last: deque[str] = deque(maxlen=5)
    with open(log_file, "w") as sink:
        process = subprocess.Popen(
            command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=cwd, env=env
        )
        assert process.stdout is not None  # stdout=PIPE
        for line in process.stdout:
            sink.write(line)
            if line.strip():
                last.append(line.strip()[:300])
                if echo:
                    log.info(f"{what}: {line.rstrip()[:300]}")
        code = process.wait()
    if code != 0:
        raise CheckFailed(f"{what} failed (exit {code}; full log {log_file}): {' | '.join(last)}")
