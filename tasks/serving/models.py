"""The Triton models of one served version: rendering, loading (with the memory and contract checks before
it) and unloading.

Triton cannot load or unload one version of a model, so each registered version is its own Triton model
(`<service>-v<N>`; with serve.lora adapter, the model that registers its adapter with the base engine). Triton
splits no traffic: the gateway in front of it draws each request's version (tasks/control/contract.py).
"""

from __future__ import annotations

import shutil
import time
from dataclasses import dataclass
from pathlib import Path

import requests

from tasks.platform.config import Profile
from tasks.platform.errors import CheckFailed
from tasks.platform.stage_cache import logger
from tasks.quality.contract import require_kept
from tasks.serving import memory_plan
from tasks.serving import vllm as vllm_serving
from tasks.serving.client import Triton
from tasks.serving.model_config import serving_model
from tasks.serving.repository import load_rendered, model_folders, render_model, rendered_parameter
from tasks.serving.versions import Served, model_name

__all__ = ["MergedVersion", "Served", "install_model", "model_name", "retire", "triton_unload_quietly"]


@dataclass(kw_only=True)
class MergedVersion(Served):
    """A version served by its own merged model (serve.lora merged): one engine per version."""

    checkpoint_dir: Path | None = None  # llmapi: the quantize stage's checkpoint, which the llmapi model loads

    @property
    def serves(self) -> Path:
        """The folder the served model loads (weights and tokenizer)."""
        return self.checkpoint_dir or self.model_dir

    @property
    def serves_digest(self) -> str:
        """The store object of the folder it loads."""
        return self.sources.get("quantize") or self.sources["merge"]

    def install(self, triton: Triton, profile: Profile) -> float:
        with model_folders(triton) as repository:
            template = self.render(triton, profile, repository)
            if template == "vllm" and triton.is_local():
                vllm_serving.require_room(profile, self.name)
            check_serving_contract(repository, profile, self)
            started = time.monotonic()
            load_rendered(triton, self.name, repository, profile.serve.load_timeout_s)
            load_s = time.monotonic() - started
            logger().info(f"canary: {self.name} loaded in {load_s:.1f}s ({profile.serve.backend} backend)")
            return load_s

    def render(self, triton: Triton, profile: Profile, repository: Path) -> str:
        """Its model rendered into `repository` for `triton`; the template's name. A Triton sharing no disk with this
        process fetches the model from the S3 store itself (model_dir: the object's URI), or gets its weights and
        tokenizer inside the model's folder (1/model), sent with the load request."""
        fetched = self.fetched_by(triton)
        shipped = triton.repository is None and not fetched
        kv_tokens = None
        if profile.serve.backend == "llmapi":
            kv_tokens = memory_plan.canary_kv_tokens(profile, self.serves, self.name)
            logger().info(f"canary: {self.name} gets a KV cache of {kv_tokens} tokens (room for a second model)")
        template, values = serving_model(profile, self.serves, self.artifact_sha256, kv_tokens)
        if fetched or shipped:
            values = {**values, "model_dir": self.store_object(self.serves_digest) if fetched else "model"}
        folder = render_model(template, repository, self.name, values)
        if shipped:
            shutil.copytree(self.serves, folder / "1" / "model")
        how = " (fetched by Triton from the store)" if fetched else " (model files sent with the request)"
        logger().info(f"canary: loading {self.name} on Triton {triton.url}" + (how if fetched or shipped else ""))
        return template

    def retire(self, triton: Triton, service: str) -> None:
        triton_unload_quietly(triton, self.name)


def install_model(triton: Triton, profile: Profile, served: Served) -> float:
    """Load a served version (and the models it needs) unless it is loaded; returns the seconds its load took
    (0 when it was loaded already): a vLLM engine takes ~20 s on CPU, part of what a rollout costs."""
    if triton.is_ready(served.name):
        return 0.0
    return served.install(triton, profile)


def check_serving_contract(repository: Path, profile: Profile, served: Served) -> None:
    """The tokenizer the rendered serving config names (its chat template, EOS/pad ids) must keep the contract
    training recorded (tasks/quality/contract.py): on the GPU path, the checkpoint must carry training's tokenizer."""
    model, key = served.name, "model_dir"
    config = repository / model / "config.pbtxt"
    found = rendered_parameter(repository / model, key)
    if not found:
        raise CheckFailed(f"train/serve contract: {config} names no {key}")
    named = Path(found)
    if found.startswith("s3://"):  # the Triton fetches the object this process fetched and checked (served.serves)
        named = served.serves if isinstance(served, MergedVersion) else served.model_dir
    tokenizer_dir = named if named.is_absolute() else repository / model / "1" / named  # shipped with the model
    require_kept(served.model_dir, tokenizer_dir, f"the serving config {config} ({key} {found})", served.model_dir)


def triton_unload_quietly(triton: Triton, name: str) -> None:
    """Unload a model."""
    try:
        triton.unload(name)
    except requests.RequestException:
        pass


def retire(triton: Triton, service: str, served: Served) -> None:
    """Unload a served version (its own way: an adapter's engine goes with its last adapter)."""
    served.retire(triton, service)
