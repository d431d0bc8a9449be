"""registry: the candidate becomes a version of the MLflow registered model.

The version's source is the quantized artifact's content-addressed URI in the store; its tags
tie it to the data fingerprint, the profile digest, the code version, the Prefect flow run,
the MLflow run and the sha256 digest of every artifact the run produced. Registering is
idempotent: a version whose artifact digest and profile digest match is reused.
Aliases (`challenger`, `champion`) are moved by the canary and the gate, not here.
"""

from __future__ import annotations

import json
import subprocess

from tasks.evaluate import EvaluationMetrics
from tasks.platform.child_env import program_env
from tasks.platform.project import PROJECT_ROOT
from tasks.platform.stage_cache import RunContext, StageResult, logger
from tasks.platform.tracking import Registered
from tasks.prepare_data import DatasetMetrics
from tasks.quality.contract import CONTRACT_FILE, load_contract


def code_version() -> str:
    """The git commit the run's code came from (with '-dirty' for local edits), else the package version."""
    try:
        env = program_env("git")  # no login of this process reaches git or the hooks it may run
        commit = subprocess.run(
            ["git", "rev-parse", "HEAD"],
            cwd=PROJECT_ROOT,
            capture_output=True,
            text=True,
            check=True,
            timeout=10,
            env=env,
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no"],
            cwd=PROJECT_ROOT,
            capture_output=True,
            text=True,
            timeout=10,
            env=env,
        ).stdout.strip()
        return commit + ("-dirty" if dirty else "")
    except (OSError, subprocess.SubprocessError):
        from importlib.metadata import version

        return f"llmops-release=={version('llmops-release')}"


def lineage_tags(ctx: RunContext, stages: list[StageResult], fingerprint: str, flow_run_id: str) -> dict[str, str]:
    tags = {
        "data.fingerprint": fingerprint,
        "profile.name": ctx.profile.name,
        "profile.digest": ctx.profile.digest,
        "serve.model_settings": json.dumps(ctx.profile.served_settings(), sort_keys=True),
        "code.version": code_version(),
        "prefect.flow_run_id": flow_run_id,
        "mlflow.run_id": ctx.tracker.run_id,
        "train.stage": ctx.profile.train.stage,
        "base_model.source": ctx.profile.base_model.source,  # models:/NAME/N: the release this one tuned further
    }
    for stage in stages:
        if stage.stage == "evaluate":
            metric = ctx.profile.evaluate.metric
            tags[f"metric.{metric}"] = str(EvaluationMetrics.of(stage).candidate[metric])
        if stage.stage == "prepare_data":
            dataset = DatasetMetrics.of(stage)
            if dataset.eval_split:
                tags["data.eval_split"] = dataset.eval_split
            if dataset.eval_fingerprint:
                tags["data.eval_fingerprint"] = dataset.eval_fingerprint
                tags["data.eval_source"] = ctx.profile.data.curated_exam or ""
        if stage.stage == "merge":
            contract = ctx.store.fetch(stage.artifact.digest) / CONTRACT_FILE
            if contract.is_file():
                tags |= load_contract(contract.parent).tags()
        tags[f"artifact.{stage.stage}.sha256"] = stage.artifact.digest
        tags[f"artifact.{stage.stage}.uri"] = stage.artifact.uri
    return tags


def register(
    ctx: RunContext, candidate: StageResult, stages: list[StageResult], fingerprint: str, flow_run_id: str
) -> Registered:
    from mlflow.exceptions import MlflowException

    client = ctx.tracker.client
    name = ctx.profile.registry.model_name
    try:
        client.create_registered_model(name, description="Fine-tuned LLM released by llmops")
    except MlflowException as exc:
        if exc.error_code != "RESOURCE_ALREADY_EXISTS":
            raise
    tags = lineage_tags(ctx, stages, fingerprint, flow_run_id)
    query = (
        f"name = '{name}' and tags.`artifact.{candidate.stage}.sha256` = '{candidate.artifact.digest}' "
        f"and tags.`profile.digest` = '{ctx.profile.digest}'"
    )
    existing = client.search_model_versions(query)
    if existing:
        version = max(existing, key=lambda v: int(v.version))
        logger().info(
            f"registry: {name} version {version.version} already holds artifact {candidate.artifact.digest[:12]}"
        )
        return Registered(name, str(version.version), version.source, True)
    version = client.create_model_version(name, source=candidate.artifact.uri, run_id=ctx.tracker.run_id, tags=tags)
    logger().info(f"registry: registered {name} version {version.version} <- {candidate.artifact.uri}")
    return Registered(name, str(version.version), version.source, False)
