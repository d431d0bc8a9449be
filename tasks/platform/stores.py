"""Which store an `--artifacts` value names: a local folder (the default, under LLMOPS_HOME) or an S3 bucket."""

from __future__ import annotations

import os
from pathlib import Path
from urllib.parse import urlparse

from tasks.platform.errors import BadInput
from tasks.platform.store import ArtifactStore, LocalStore
from tasks.platform.store_s3 import S3Store


def default_services(tracking_uri: str | None, artifacts: str | None) -> tuple[str | None, str | None]:
    """The MLflow tracking URI and the artifact store a release uses. Unset: what the environment names (MLflow's own
    MLFLOW_TRACKING_URI, LLMOPS_ARTIFACTS), as a worker of the local stack or a cluster sets it; else (None) the
    sqlite/local defaults under LLMOPS_HOME."""
    return tracking_uri or os.environ.get("MLFLOW_TRACKING_URI") or None, artifacts or os.environ.get(
        "LLMOPS_ARTIFACTS"
    ) or None


def open_store(artifacts: str | None, home: Path) -> ArtifactStore:
    if artifacts and artifacts.startswith("s3://"):
        return S3Store(artifacts, home / "cache" / "objects")
    if artifacts and "://" in artifacts and not artifacts.startswith("file://"):
        raise BadInput(f"--artifacts {artifacts}: expected a folder, file:// or s3:// URI")
    if not artifacts:
        return LocalStore(home / "store")
    return LocalStore(Path(urlparse(artifacts).path) if artifacts.startswith("file://") else Path(artifacts))


def refuse_a_local_store_for_a_tracking_server(tracking_uri: str | None, artifacts: str | None, home: Path) -> None:
    """A release registers its candidate's store URI as the model version's source. An MLflow tracking server refuses
    a local path there unless it lies in the run's own artifact folder (mlflow 3.17.2, mlflow/server/handlers.py
    `_validate_source_run`, INVALID_PARAMETER_VALUE), which a content-addressed store never is; and a path on this
    machine is nothing a serve elsewhere could read. Refused before the run starts, not at register after training.
    A sqlite or database URI is this machine's own registry, which takes the local store."""
    if not tracking_uri or urlparse(tracking_uri).scheme not in ("http", "https"):
        return
    store = open_store(artifacts, home)
    if not isinstance(store, LocalStore):
        return
    raise BadInput(
        f"--artifacts (LLMOPS_ARTIFACTS): the local store {store.root} cannot hold what the MLflow server at "
        f"{tracking_uri} registers (it refuses a path on this machine as a model version's source): give an "
        "s3://bucket/prefix store, or leave --tracking-uri (MLFLOW_TRACKING_URI) unset for the registry under "
        "LLMOPS_HOME"
    )
