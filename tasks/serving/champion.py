"""What the service serves now: the registry's champion, the version a deployment record names, and each as the
service loads it (merged, quantized, or an adapter on its base)."""

from __future__ import annotations

import json
import time
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tasks.control.contract import RouteTable, Version
from tasks.platform.config import Profile
from tasks.platform.errors import CheckFailed
from tasks.platform.stage_cache import RunContext, logger
from tasks.platform.tracking import not_found
from tasks.serving import vllm as vllm_serving
from tasks.serving.adapters import AdapterVersion, base_model_name, served_artifact
from tasks.serving.models import MergedVersion, Served, model_name
from tasks.serving.service import Service

if TYPE_CHECKING:
    from tasks.platform.tracking import Registered


def triton_launch(profile: Profile, home: Path) -> tuple[list[str], dict[str, str]]:
    """The command prefix and environment tritonserver needs for this profile's models. The llmapi model needs
    neither: an LLM spanning GPUs spawns its own MPI workers (infra/triton/llmapi/1/model.py), so tritonserver runs
    as one plain process, without mpirun or the C++ backend's orchestrator flags."""
    if profile.serve.backend == "vllm":
        return [], vllm_serving.triton_env(profile, home)
    return [], {}


def served_version(ctx: RunContext, service: str, version) -> Served:
    """What a registered version serves: the merged model, or the quantize stage's checkpoint (the registered artifact
    itself) on llmapi and on vLLM where ModelOpt made one, or with serve.lora adapter the train stage's adapter
    on its base model (the merged model stays the tokenizer's and the scorers' reference), as this run's profile
    says (serve.lora). A champion already in a service's routes serves as it does there (serving_champion)."""
    tags = version.tags
    recorded = tags.get("serve.model_settings")
    sources = {"merge": tags["artifact.merge.sha256"]}
    if ctx.profile.serve.lora == "adapter":
        sources |= {"train": tags["artifact.train.sha256"], "base_model": tags["artifact.base_model.sha256"]}
    elif ctx.profile.serves_quantized:
        sources["quantize"] = tags["artifact.quantize.sha256"]
    return served_from(ctx, service, str(version.version), sources, json.loads(recorded) if recorded else None)


def served_from(ctx: RunContext, service: str, version: str, sources: dict[str, str], settings: dict | None) -> Served:
    """A version from its store artifacts (by stage), as the registry's tags or a deployment record name them: an
    adapter on its base where they name one (serve.lora adapter), else its merged model. The one place that decides."""
    merged, name = sources["merge"], model_name(service, version)
    store = ctx.store.uri if ctx.store.uri.startswith("s3://") else ""  # a Triton with no disk fetches from S3
    if "train" in sources:
        adapter, base = sources["train"], sources["base_model"]
        return AdapterVersion(
            version=version,
            name=name,
            model_dir=ctx.store.fetch(merged),
            artifact_sha256=served_artifact(adapter, base),
            sources=sources,
            settings=settings,
            store=store,
            adapter_dir=ctx.store.fetch(adapter),
            base_dir=ctx.store.fetch(base),
            base_sha256=base,
            base_model=base_model_name(service),
        )
    checkpoint = sources.get("quantize")
    return MergedVersion(
        version=version,
        name=name,
        model_dir=ctx.store.fetch(merged),
        artifact_sha256=checkpoint or merged,
        sources=sources,
        settings=settings,
        store=store,
        checkpoint_dir=ctx.store.fetch(checkpoint) if checkpoint else None,
    )


def as_route(served: Served) -> Version:
    """A served version as the gateway routes to it, with what loads it again (its artifacts and settings)."""
    source: dict[str, Any] = {"version": served.version, "artifacts": served.sources, "settings": served.settings}
    model, adapter = served.answered_by
    return Version(served.name, model, adapter, source)


def served_of(ctx: RunContext, service: str, version: Version) -> Served:
    """The version a deployment record names, from the store alone (no registry)."""
    source = version.source
    return served_from(ctx, service, str(source["version"]), dict(source["artifacts"]), source.get("settings"))


def champion_version(ctx: RunContext):
    """The registry's champion version; None only where MLflow says there is none (no such model, no such alias).
    Any other failure (unreachable, 5xx, a refused login, a locked database) is raised: read as "no champion" it
    would make this a first release, routed 100% at once with no canary (tasks/platform/errors.py classifies it)."""
    from mlflow.exceptions import MlflowException

    try:
        return ctx.tracker.client.get_model_version_by_alias(ctx.profile.registry.model_name, "champion")
    except MlflowException as exc:
        if not_found(exc):
            return None
        raise


def registry_follows_record(ctx: RunContext, table: RouteTable | None) -> str | None:
    """Where the registry's champion is not the deployment record's, the alias is moved to the record's, which says
    what clients get (the service's controller promotes in the record: a release whose alias write failed, or that
    was stopped or died as its candidate was promoted, leaves the registry behind). One direction only, and while a
    release owns the service only once its rollout is promoted (before, its promotion may be under way). What was
    done, said in one line; None where nothing differed. MLflow's errors are raised (the caller says them)."""
    champion = table.champion if table is not None else None
    if table is None or champion is None or not champion.source.get("version"):
        return None
    if table.owner is not None and not table.owner.expired(time.time()) and not promoted_rollout(table):
        return None
    recorded, registered = str(champion.source["version"]), champion_version(ctx)
    current = None if registered is None else str(registered.version)
    if current == recorded:
        return None
    ctx.tracker.client.set_registered_model_alias(ctx.profile.registry.model_name, "champion", recorded)
    return (
        f"llmops serve: the registry's champion was {'v' + current if current else 'none'}, the deployment record's "
        f"v{recorded}: alias champion -> v{recorded} (the record says what clients get)"
    )


def promoted_rollout(table: RouteTable) -> bool:
    """Whether the table's last rollout ended with its candidate the champion (the controller's own write)."""
    rollout, champion = table.rollout, table.champion
    return (
        rollout is not None
        and rollout.phase == "promoted"
        and champion is not None
        and rollout.candidate == champion.name
    )


def is_champion(ctx: RunContext, registered: Registered) -> bool:
    version = champion_version(ctx)
    return version is not None and str(version.version) == registered.version


def registry_champion(ctx: RunContext) -> Served | None:
    """The registry's champion (alias `champion`), or None before the first release."""
    version = champion_version(ctx)
    return None if version is None else served_version(ctx, ctx.profile.registry.model_name, version)


def serving_champion(ctx: RunContext, service: Service) -> Served | None:
    """The registry's champion as the service serves it now, where its routes name it (a merged champion stays
    merged next to an adapter candidate, whatever this run's serve.lora); else as this run's profile says. Where the
    registry has no champion but the service's table names one, that one (the registry lost its alias, or was
    reset), or names another (a promotion whose alias write failed): the release canaries against what clients get,
    and the deployment record, not the registry, says what that is."""
    champion = registry_champion(ctx)
    routed = service.control.table().champion
    if routed is None or not routed.source:
        return champion
    if champion is not None and routed.name != champion.name:
        logger().warning(
            f"canary: the registry's champion is {champion.name}, the service serves {routed.name}: the candidate is "
            f"measured against {routed.name}, what clients get"
        )
    return served_of(ctx, service.name, routed)


def serve_champion(ctx: RunContext, service: Service, champion: Served | None) -> Served | None:
    """`champion` loaded on every replica of the service and named the champion in its route table (serving every
    request where the table had no champion, or another one)."""
    if champion is None:
        return None
    load_on_service(ctx, service, champion)
    table = service.control.table()
    if table.champion is None or table.champion.name != champion.name:
        champion_route = as_route(champion)
        service.control.put_table(
            replace(RouteTable(service.name), champion=champion_route, weights={champion_route.name: 100.0})
        )
    return champion


def load_on_service(ctx: RunContext, service: Service, served: Served, fresh: bool = False) -> list[dict[str, Any]]:
    """`served` loaded by the service on every replica, from the store with the settings it carries (its route's
    source): per replica, the seconds it took (0: loaded already) and the artifact it serves. `fresh`: unloaded first
    (new settings)."""
    try:
        loaded = service.control.load(as_route(served), ctx.profile.serve.load_timeout_s, len(service.tritons), fresh)
    except CheckFailed as refused:
        raise CheckFailed(f"canary: the service did not load {served.name}: {refused}") from None
    for replica in loaded:
        for line in replica.get("said") or ():
            logger().info(str(line))  # what the service's load said, as the release said it when it loaded itself
    return loaded


def released_profile(profile: Profile, served: Served) -> Profile:
    """`profile` with the serving settings `served` was released with (its `serve.model_settings` tag, tuned ones
    included), so the champion serves as it was gated, not with a candidate's settings; versions registered before
    the tag serve with `profile`'s."""
    return profile.with_served_settings(served.settings) if served.settings else profile
