"""serve.backend vllm: the vLLM serving environment, the model values, and room for two engines.

vLLM's CPU build needs transformers and starlette releases that LlamaFactory's pins exclude, so it
lives in an environment of its own (.venv-vllm, made by infra/local/setup-vllm.sh). tritonserver's
Python backend runs its stub with the interpreter it finds first on PATH (tasks/serving/server.py),
so a Triton for vLLM models starts with that environment's bin first; the router model needs only
numpy, which that environment has too.
"""

from __future__ import annotations

import os
from pathlib import Path

import psutil

from tasks.platform.config import Profile
from tasks.platform.errors import BadInput, CheckFailed
from tasks.platform.project import PROJECT_ROOT

DEFAULT_ENVIRONMENT = PROJECT_ROOT / ".venv-vllm"
GIB = 1 << 30


def environment(profile: Profile) -> Path:
    """The venv holding vLLM, checked: a missing one fails here with what to run, not as a Triton load error."""
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
    return {
        "PATH": os.pathsep.join([str(venv / "bin"), os.environ.get("PATH", "")]),
        "VIRTUAL_ENV": str(venv),
        "VLLM_CACHE_ROOT": str(home / "vllm-cache"),
        "VLLM_NO_USAGE_STATS": "1",
        "VLLM_CONFIGURE_LOGGING": "0",  # Triton's log keeps vLLM's warnings without its per-request info lines
    }


def model_values(profile: Profile) -> dict[str, object]:
    """infra/triton/vllm's values beyond those every Python-backend LLM model takes (tasks/serving/models.py)."""
    cfg = profile.serve.vllm
    return {
        "dtype": cfg.dtype,
        "kv_cache_memory_bytes": int(cfg.kv_cache_gb * GIB),
        "enforce_eager": str(cfg.enforce_eager).lower(),
    }


def require_room(profile: Profile, name: str) -> None:
    """A vLLM engine on this machine needs its KV cache and its overhead free before it loads: a canary that
    would push the machine into the OOM killer (and take the serving champion with it) stops here instead."""
    cfg = profile.serve.vllm
    needed = (cfg.kv_cache_gb + cfg.engine_overhead_gb) * GIB
    available = psutil.virtual_memory().available
    if available < needed:
        raise CheckFailed(
            f"canary: {name} needs about {needed / GIB:.2f} GiB (serve.vllm.kv_cache_gb {cfg.kv_cache_gb} + "
            f"engine_overhead_gb {cfg.engine_overhead_gb}) but {available / GIB:.2f} GiB is free; lower "
            "serve.vllm.kv_cache_gb or free memory"
        )
