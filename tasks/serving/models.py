"""The Triton models of one served version: rendering, loading (with the memory and contract checks before
it), routing and unloading.

Triton cannot load or unload one version of a model and does not split traffic, so each registered
version is its own Triton model (`<service>-v<N>`), and the router model named `<service>` splits
traffic by weight. Changing weights rewrites the router's config and loads it again; Triton swaps
the router without failing requests in flight.
"""

from __future__ import annotations

import re
import shutil
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import requests

from tasks.platform.config import Profile
from tasks.platform.errors import CheckFailed
from tasks.platform.stage_cache import logger
from tasks.quality.contract import require_kept
from tasks.serving import adapters, memory_plan
from tasks.serving import vllm as vllm_serving
from tasks.serving.client import Triton
from tasks.serving.model_config import serving_model
from tasks.serving.repository import load_rendered, model_folders, render_model


@dataclass
class Served:
    version: str
    name: str
    model_dir: Path  # the merged model: tokenizer for genai-perf, the champion's task score
    checkpoint_dir: Path | None = None  # llmapi: the quantize stage's checkpoint, which the llmapi model loads
    artifact_sha256: str = ""  # the store artifact this model serves: that checkpoint on llmapi, else the merged model
    # serve.lora adapter: the train stage's adapter, the base model it serves on, and that base's artifact
    adapter_dir: Path | None = None
    base_dir: Path | None = None
    base_sha256: str = ""

    @property
    def serves(self) -> Path:
        """The folder the served model loads (weights and tokenizer)."""
        return self.checkpoint_dir or self.model_dir


def model_name(service: str, version: str) -> str:
    return f"{service}-v{version}"


def install_model(triton: Triton, profile: Profile, served: Served) -> float:
    """Load a served version (and the models it calls) unless it is loaded; returns the seconds its load took
    (0 when it was loaded already): a vLLM engine takes ~20 s on CPU, part of what a rollout costs."""
    if triton.is_ready(served.name):
        return 0.0
    if served.adapter_dir is not None:
        return adapters.install_adapter(triton, profile, served, profile.registry.model_name)
    with model_folders(triton) as repository:
        # No shared filesystem: the model's weights and tokenizer travel inside its folder (1/model).
        shipped = triton.repository is None
        kv_tokens = None
        if profile.serve.backend == "llmapi":
            kv_tokens = memory_plan.canary_kv_tokens(profile, served.serves, served.name)
            logger().info(f"canary: {served.name} gets a KV cache of {kv_tokens} tokens (room for a second model)")
        template, values = serving_model(profile, served.serves, served.artifact_sha256, kv_tokens)
        folder = render_model(
            template, repository, served.name, {**values, "model_dir": "model"} if shipped else values
        )
        if shipped:
            shutil.copytree(served.serves, folder / "1" / "model")
        if template == "vllm" and triton.is_local():
            vllm_serving.require_room(profile, served.name)
        check_serving_contract(repository, profile, served)
        logger().info(
            f"canary: loading {served.name} on Triton {triton.url}"
            + (" (model files sent with the request)" if triton.repository is None else "")
        )
        started = time.monotonic()
        load_rendered(triton, served.name, repository, profile.serve.load_timeout_s)
        load_s = time.monotonic() - started
        logger().info(f"canary: {served.name} loaded in {load_s:.1f}s ({profile.serve.backend} backend)")
        return load_s


def check_serving_contract(repository: Path, profile: Profile, served: Served) -> None:
    """The tokenizer the rendered serving config names (its chat template, EOS/pad ids) must keep the contract
    training recorded (tasks/quality/contract.py): on the GPU path, the checkpoint must carry training's tokenizer."""
    model, key = served.name, "model_dir"
    config = repository / model / "config.pbtxt"
    found = re.search(rf'key: "{key}", value: {{ string_value: "([^"]*)" }}', config.read_text())
    if found is None:
        raise CheckFailed(f"train/serve contract: {config} names no {key}")
    named = Path(found.group(1))
    tokenizer_dir = named if named.is_absolute() else repository / model / "1" / named  # shipped with the model
    require_kept(
        served.model_dir, tokenizer_dir, f"the serving config {config} ({key} {found.group(1)})", served.model_dir
    )


def set_routes(
    triton: Triton,
    profile: Profile,
    service: str,
    weights: Mapping[str, float],
    shadow: tuple[str, float] | None = None,
) -> None:
    """Load the service's router with these weights; `shadow` (MODEL, FRACTION): copy that share of the requests
    to MODEL after their answers went out (infra/triton/router/1/model.py)."""
    routes = ",".join(f"{name}={weight:g}" for name, weight in weights.items() if weight > 0)
    mirror = f"{shadow[0]}={shadow[1]:g}" if shadow else ""
    values = {
        "max_batch_size": profile.serve.max_batch_size,
        "max_in_flight": profile.serve.max_queue_size,
        "routes": routes,
        "shadow": mirror,
    }
    with model_folders(triton) as repository:
        render_model("router", repository, service, values)
        load_rendered(triton, service, repository, profile.serve.load_timeout_s)
    logger().info(f"canary: router {service} -> {routes}" + (f"; shadow {mirror}" if shadow else ""))


def triton_unload_quietly(triton: Triton, name: str) -> None:
    """Unload a model."""
    try:
        triton.unload(name)
    except requests.RequestException:
        pass


def retire(triton: Triton, service: str, served: Served) -> None:
    """Unload a served version; an adapter's is then freed in the base engine, and the engine unloaded when no other
    adapter serves on it (a first release rolled back, or a service that stays with merged models)."""
    triton_unload_quietly(triton, served.name)
    if served.adapter_dir is not None:
        adapters.release_adapter(triton, service, served.name)
        base = adapters.base_model_name(service)
        # `served` may still be listed: Triton unloads in the background, after the requests in flight
        if triton.is_ready(base) and not set(adapters.held_adapters(triton, service)) - {served.name}:
            triton_unload_quietly(triton, base)
