"""Where Triton runs and what it serves now: attach or start one, and load the registry's champion."""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING

from tasks.platform.config import Profile
from tasks.platform.stage_cache import RunContext
from tasks.serving import vllm as vllm_serving
from tasks.serving.adapters import served_artifact
from tasks.serving.client import Triton, TritonTarget
from tasks.serving.models import Served, install_model, model_name, set_routes
from tasks.serving.server import TritonServer, published

if TYPE_CHECKING:
    from tasks.register import Registered


def open_triton(ctx: RunContext, target: TritonTarget | None) -> tuple[Triton, TritonServer | None]:
    """Attach to the target, or to the one `llmops serve` publishes for this LLMOPS_HOME, else start one
    (returned as the second value: the caller stops it). The control key: for a target only the one given
    for it (TritonTarget); for `llmops serve`'s Triton the key file it publishes; a started one makes its own."""
    if target is not None:
        triton = Triton.attach(
            target.url,
            Path(target.repository) if target.repository else None,
            target.metrics_url,
            target.grpc_url,
            target.control_key,
        )
        return triton, None
    serving = published(ctx.home)
    if serving is not None:
        return serving, None
    launcher, env = triton_launch(ctx.profile, ctx.home)
    server = TritonServer.start(ctx.home, ctx.profile.serve.triton_binary, launcher=launcher, extra_env=env)
    return server.client, server


def triton_launch(profile: Profile, home: Path) -> tuple[list[str], dict[str, str]]:
    """The command prefix and environment tritonserver needs for this profile's models. The llmapi model needs
    neither: an LLM spanning GPUs spawns its own MPI workers (infra/triton/llmapi/1/model.py), so tritonserver runs
    as one plain process, without mpirun or the C++ backend's orchestrator flags."""
    if profile.serve.backend == "vllm":
        return [], vllm_serving.triton_env(profile, home)
    return [], {}


def served_version(ctx: RunContext, service: str, version) -> Served:
    """What a registered version serves: the merged model, or the quantize stage's checkpoint (the registered artifact
    itself) on llmapi and on vLLM where ModelOpt made one, or with serve.lora adapter the train stage's adapter on its
    base model (the merged model stays the tokenizer's and the scorers' reference)."""
    merged = version.tags["artifact.merge.sha256"]
    if ctx.profile.serve.lora == "adapter":
        adapter, base = version.tags["artifact.train.sha256"], version.tags["artifact.base_model.sha256"]
        return Served(
            str(version.version),
            model_name(service, str(version.version)),
            ctx.store.fetch(merged),
            artifact_sha256=served_artifact(adapter, base),
            adapter_dir=ctx.store.fetch(adapter),
            base_dir=ctx.store.fetch(base),
            base_sha256=base,
        )
    checkpoint = version.tags["artifact.quantize.sha256"] if ctx.profile.serves_quantized else None
    return Served(
        str(version.version),
        model_name(service, str(version.version)),
        ctx.store.fetch(merged),
        ctx.store.fetch(checkpoint) if checkpoint else None,
        checkpoint or merged,
    )


def champion_version(ctx: RunContext):
    from mlflow.exceptions import MlflowException

    try:
        return ctx.tracker.client.get_model_version_by_alias(ctx.profile.registry.model_name, "champion")
    except MlflowException:
        return None


def is_champion(ctx: RunContext, registered: Registered) -> bool:
    version = champion_version(ctx)
    return version is not None and str(version.version) == registered.version


def serve_champion(ctx: RunContext, triton: Triton) -> Served | None:
    """Champion loaded and the router sending it everything (what `llmops serve` keeps running)."""
    service = ctx.profile.registry.model_name
    version = champion_version(ctx)
    if version is None:
        return None
    champion = served_version(ctx, service, version)
    install_model(triton, released_profile(ctx.profile, version), champion)
    if not triton.is_ready(service):
        set_routes(triton, ctx.profile, service, {champion.name: 100})
    return champion


def released_profile(profile: Profile, version) -> Profile:
    """`profile` with the serving settings `version` was released with (its `serve.model_settings` tag, tuned ones
    included), so the champion serves as it was gated, not with a candidate's settings; versions registered before
    the tag serve with `profile`'s."""
    recorded = version.tags.get("serve.model_settings")
    if not recorded:
        return profile
    return profile.with_served_settings(json.loads(recorded))
