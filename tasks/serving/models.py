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
import tempfile
import time
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import requests

from tasks.platform.config import Profile
from tasks.platform.errors import BadInput, CheckFailed
from tasks.platform.stage_cache import logger
from tasks.quality.contract import CONTRACT_FILE, load_contract, read_contract, require_same
from tasks.serving import memory_plan, tensorrt_llm
from tasks.serving import vllm as vllm_serving
from tasks.serving.client import Triton
from tasks.serving.repository import render_model


@dataclass
class Served:
    version: str
    name: str
    model_dir: Path  # the merged model: tokenizer for genai-perf, the champion's task score
    engine_root: Path | None = None  # build_engine's artifact (engine/, tokenizer/) on the GPU path
    artifact_sha256: str = ""  # the store artifact this model serves: the engine on the GPU path, else the merged model


def model_name(service: str, version: str) -> str:
    return f"{service}-v{version}"


def llm_values(profile: Profile, model_dir: Path, artifact_sha256: str) -> dict:
    serve = profile.serve
    return {
        "max_batch_size": serve.max_batch_size,
        "max_queue_delay_us": serve.max_queue_delay_us,
        "instance_count": serve.instance_count,
        "model_dir": model_dir.resolve(),
        "artifact_sha256": artifact_sha256,
        "apply_chat_template": str(serve.apply_chat_template).lower(),
        "default_max_tokens": serve.default_max_tokens,
        "torch_threads": serve.torch_threads,
        "device": "cuda" if profile.hardware.accelerator == "cuda" else "cpu",
    }


def serving_model(profile: Profile, model_dir: Path, artifact_sha256: str) -> tuple[str, dict]:
    """The template (infra/triton/<kind>) and values of a served version's Python-backend model."""
    values = llm_values(profile, model_dir, artifact_sha256)
    if profile.serve.backend != "vllm":
        return "llm", values
    # vLLM batches and schedules itself: no dynamic batcher, one engine per model, its own threads
    for unused in ("max_queue_delay_us", "instance_count", "torch_threads", "device"):
        del values[unused]
    return "vllm", {**values, **vllm_serving.model_values(profile)}


def tensorrtllm_models(
    profile: Profile, name: str, engine_root: Path, artifact_sha256: str, kv_tokens: int
) -> dict[str, tuple[str, dict]]:
    """The four Triton models of one tensorrtllm candidate, {model name: (template, values)}; the
    composing models carry the candidate's name, and the engine path is this candidate's own."""
    serve, trt = profile.serve, profile.serve.tensorrtllm
    world = profile.engine.world_size
    # instance i runs on GPUs [i*world, (i+1)*world): "0;1" two single-GPU instances, "0,1" one TP2 instance
    devices = ";".join(",".join(str(i * world + r) for r in range(world)) for i in range(serve.instance_count))
    tokenizer = str((engine_root / "tokenizer").resolve())
    names = {"pre": f"{name}-pre", "trtllm": f"{name}-trtllm"}
    return {
        names["pre"]: (
            "tensorrtllm/preprocessing",
            {
                "max_batch_size": serve.max_batch_size,
                "instance_count": trt.preprocessing_instances,
                "tokenizer_dir": tokenizer,
                "apply_chat_template": str(serve.apply_chat_template).lower(),
                "artifact_sha256": artifact_sha256,
                "default_max_tokens": serve.default_max_tokens,
            },
        ),
        names["trtllm"]: (
            "tensorrtllm/tensorrt_llm",
            {
                "max_batch_size": serve.max_batch_size,
                "decoupled": str(trt.decoupled).lower(),
                "max_queue_delay_us": trt.max_queue_delay_us,
                "instance_count": serve.instance_count,
                "batching_strategy": trt.batching_strategy,
                "engine_dir": str((engine_root / "engine").resolve()),
                "batch_scheduler_policy": trt.batch_scheduler_policy,
                "kv_cache_free_gpu_mem_fraction": trt.kv_cache_free_gpu_mem_fraction,
                "max_tokens_in_paged_kv_cache": kv_tokens,
                "enable_kv_cache_reuse": str(trt.enable_kv_cache_reuse).lower(),
                "enable_chunked_context": str(trt.enable_chunked_context).lower(),
                "max_beam_width": profile.engine.max_beam_width,
                "gpu_device_ids": devices,
            },
        ),
        name: (
            "tensorrtllm/bls",
            {
                "max_batch_size": serve.max_batch_size,
                "instance_count": trt.bls_instances,
                "preprocessing_model": names["pre"],
                "tensorrt_llm_model": names["trtllm"],
                "engine_decoupled": str(trt.decoupled).lower(),
                "tokenizer_dir": tokenizer,
            },
        ),
    }


@contextmanager
def model_folders(triton: Triton) -> Iterator[Path]:
    """Where model folders are rendered: the server's repository when this machine shares it, else a
    temporary folder whose models go with their load requests (nothing is written on the server's side)."""
    if triton.repository is not None:
        yield triton.repository
        return
    with tempfile.TemporaryDirectory(prefix="llmops-models-") as folder:
        yield Path(folder)


def load_rendered(triton: Triton, name: str, folder: Path, timeout: float) -> None:
    triton.load(name, timeout=timeout, model_folder=None if triton.repository is not None else folder / name)


def install_model(triton: Triton, profile: Profile, served: Served) -> float:
    """Load a served version (and the models it calls) unless it is loaded; returns the seconds its load took
    (0 when it was loaded already): a vLLM engine takes ~20 s on CPU, part of what a rollout costs."""
    if triton.is_ready(served.name):
        return 0.0
    with model_folders(triton) as repository:
        if profile.serve.backend == "tensorrtllm":
            if served.engine_root is None:
                raise CheckFailed(
                    f"{served.name}: serve.backend tensorrtllm, but the version has no build_engine artifact"
                )
            if triton.repository is None:
                raise BadInput(
                    f"Triton at {triton.url}: a tensorrtllm model needs the server's model repository "
                    "(--triton-repository on a shared filesystem): engines are not sent with load requests"
                )
            engine_dir = served.engine_root / "engine"
            tensorrt_llm.require_serving_version(engine_dir, profile.serve.tensorrtllm.server_version, triton.url)
            if profile.hardware.gpu_memory_gb is None:
                raise BadInput(
                    f"profile {profile.name}: hardware.gpu_memory_gb is needed to plan the canary's GPU memory"
                )
            kv_tokens = memory_plan.kv_tokens_for_canary(
                memory_plan.footprint(engine_dir), profile.hardware.gpu_memory_gb, served.name
            )
            logger().info(f"canary: {served.name} gets a KV cache of {kv_tokens} tokens (room for a second engine)")
            # The models the entry BLS calls are loaded first, by name: Triton loads an ensemble's
            # composing models with it, but not the models a BLS calls.
            for model, (template, values) in tensorrtllm_models(
                profile, served.name, served.engine_root, served.artifact_sha256, kv_tokens
            ).items():
                render_model(template, repository, model, values)
                if model != served.name:
                    load_rendered(triton, model, repository, profile.serve.load_timeout_s)
        else:
            # No shared filesystem: the model's weights and tokenizer travel inside its folder (1/model).
            shipped = triton.repository is None
            template, values = serving_model(profile, served.model_dir, served.artifact_sha256)
            folder = render_model(
                template, repository, served.name, {**values, "model_dir": "model"} if shipped else values
            )
            if shipped:
                shutil.copytree(served.model_dir, folder / "1" / "model")
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
    """The tokenizer the rendered serving config names (its chat template, EOS/pad ids: the end_id/pad_id the
    tensorrtllm preprocessing sends) must keep the contract training recorded (tasks/quality/contract.py)."""
    if not (served.model_dir / CONTRACT_FILE).is_file():
        return  # registered before contracts were recorded
    model, key = (
        (f"{served.name}-pre", "tokenizer_dir")
        if profile.serve.backend == "tensorrtllm"
        else (served.name, "model_dir")
    )
    config = repository / model / "config.pbtxt"
    found = re.search(rf'key: "{key}", value: {{ string_value: "([^"]*)" }}', config.read_text())
    if found is None:
        raise CheckFailed(f"train/serve contract: {config} names no {key}")
    named = Path(found.group(1))
    tokenizer_dir = named if named.is_absolute() else repository / model / "1" / named  # shipped with the model
    require_same(
        load_contract(served.model_dir),
        read_contract(tokenizer_dir, served.model_dir),
        f"the serving config {config} ({key} {found.group(1)})",
    )


def set_routes(triton: Triton, profile: Profile, service: str, weights: Mapping[str, float]) -> None:
    routes = ",".join(f"{name}={weight:g}" for name, weight in weights.items() if weight > 0)
    with model_folders(triton) as repository:
        render_model("router", repository, service, {"max_batch_size": profile.serve.max_batch_size, "routes": routes})
        load_rendered(triton, service, repository, profile.serve.load_timeout_s)
    logger().info(f"canary: router {service} -> {routes}")


def triton_unload_quietly(triton: Triton, name: str) -> None:
    """Unload a served version, and the models its tensorrtllm entry BLS calls (not dependents to Triton)."""
    for model in (name, f"{name}-pre", f"{name}-trtllm"):
        if model != name and not triton.is_ready(model):
            continue
        try:
            triton.unload(model)
        except requests.RequestException:
            pass
