"""Which store an `--artifacts` value names: a local folder (the default, under LLMOPS_HOME) or an S3 bucket."""

from __future__ import annotations

from pathlib import Path
from urllib.parse import urlparse

from tasks.platform.errors import BadInput
from tasks.platform.store import ArtifactStore, LocalStore
from tasks.platform.store_s3 import S3Store


def open_store(artifacts: str | None, home: Path) -> ArtifactStore:
    if artifacts and artifacts.startswith("s3://"):
        return S3Store(artifacts, home / "cache" / "objects")
    if artifacts and "://" in artifacts and not artifacts.startswith("file://"):
        raise BadInput(f"--artifacts {artifacts}: expected a folder, file:// or s3:// URI")
    if not artifacts:
        return LocalStore(home / "store")
    return LocalStore(Path(urlparse(artifacts).path) if artifacts.startswith("file://") else Path(artifacts))
