"""Content-addressed artifact store: a local folder by default, S3 (boto3) in production.

An artifact is a folder. Its digest is the sha256 of its manifest (every file's relative path,
size and sha256), so identical outputs share one object and a digest names exact content.

Atomicity: a local object is assembled in a temporary folder and renamed into place; an S3
object's manifest is written last, and an object without a manifest does not exist.
Reads verify every file's sha256 before the content is used.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar
from urllib.parse import urlparse

from tasks.platform.config import sha256_json
from tasks.platform.errors import ArtifactMissing, BadInput, is_transient

MANIFEST = "manifest.json"
T = TypeVar("T")


@dataclass(frozen=True)
class StoredObject:
    """An object of the store as garbage collection sees it: its size and when it was written (epoch seconds)."""

    digest: str
    bytes: int
    written: float


@dataclass(frozen=True)
class StoredRecord:
    namespace: str
    key: str
    written: float
    record: dict


@dataclass(frozen=True)
class Artifact:
    digest: str
    uri: str

    def as_dict(self) -> dict:
        return {"digest": self.digest, "uri": self.uri}


def file_sha256(path: Path) -> str:
    with open(path, "rb") as fh:
        return hashlib.file_digest(fh, "sha256").hexdigest()


def build_manifest(folder: Path) -> dict:
    files = {}
    for path in sorted(p for p in folder.rglob("*") if p.is_file()):
        rel = path.relative_to(folder).as_posix()
        files[rel] = {"size": path.stat().st_size, "sha256": file_sha256(path)}
    if not files:
        raise ValueError(f"{folder}: refusing to store an empty artifact")
    return {"files": files}


def verify_folder(folder: Path, manifest: dict, label: str) -> None:
    for rel, meta in manifest["files"].items():
        path = folder / rel
        if not path.is_file():
            raise ArtifactMissing(f"artifact {label}: file {rel} is missing")
        if path.stat().st_size != meta["size"] or file_sha256(path) != meta["sha256"]:
            raise ArtifactMissing(f"artifact {label}: file {rel} does not match its sha256")


def s3_client():
    import boto3
    from botocore.config import Config

    # Endpoint and credentials come from the standard AWS variables/profile (AWS_ENDPOINT_URL,
    # AWS_ACCESS_KEY_ID, ...). Standard retry mode backs off on throttling and 5xx itself.
    # Response checksums only where a call asks for them: botocore 1.44 wraps a GetObject body that carries an
    # x-amz-checksum header in a StreamingChecksumBody even when the status is a 5xx, and its error parser then fails
    # on it (AttributeError, boto/botocore#3680) instead of retrying; each file we read is checked against its
    # manifest's sha256 anyway.
    attempts = int(os.environ.get("AWS_MAX_ATTEMPTS", "3"))
    config = Config(
        retries={"mode": "standard", "max_attempts": attempts},
        connect_timeout=5,
        read_timeout=60,
        response_checksum_validation="when_required",
    )
    return boto3.client("s3", config=config)


def split_s3_uri(uri: str) -> tuple[str, str]:
    parsed = urlparse(uri)
    if parsed.scheme != "s3" or not parsed.netloc:
        raise BadInput(f"{uri}: expected s3://bucket/prefix")
    return parsed.netloc, parsed.path.strip("/")


class ArtifactStore:
    """Interface shared by the local and S3 stores."""

    uri: str

    def put_dir(self, folder: Path) -> Artifact:
        raise NotImplementedError

    def exists(self, digest: str) -> bool:
        raise NotImplementedError

    def fetch(self, digest: str) -> Path:
        raise NotImplementedError

    def put_record(self, namespace: str, key: str, record: dict) -> None:
        raise NotImplementedError

    def get_record(self, namespace: str, key: str) -> dict | None:
        raise NotImplementedError

    # What `llmops store gc` needs (tasks/platform/store_gc.py).
    def size(self, digest: str) -> int | None:
        """Bytes of an object's files (from its manifest); None when it is not in the store."""
        raise NotImplementedError

    def objects(self) -> list[StoredObject]:
        raise NotImplementedError

    def delete(self, digest: str) -> None:
        raise NotImplementedError

    def records(self) -> list[StoredRecord]:
        raise NotImplementedError

    def delete_record(self, namespace: str, key: str) -> None:
        raise NotImplementedError

    def local_folders(self) -> list[Path]:
        """Folders of this machine the store writes to (free space is checked there before a stage)."""
        return []


class LocalStore(ArtifactStore):
    def __init__(self, root: Path):
        self.root = root.resolve()
        self.uri = self.root.as_uri()
        # Digests verified by this process: several stages read the same base model in one run,
        # and re-hashing a multi-GB model for each would be repeated I/O on the hot path.
        self._verified: set[str] = set()

    def _object(self, digest: str) -> Path:
        return self.root / "objects" / digest

    def artifact(self, digest: str) -> Artifact:
        return Artifact(digest, self._object(digest).as_uri())

    def put_dir(self, folder: Path) -> Artifact:
        manifest = build_manifest(folder)
        digest = sha256_json(manifest)
        target = self._object(digest)
        if not self.exists(digest):
            staging = self.root / "objects" / f".tmp-{uuid.uuid4().hex}"
            try:
                # Hard links where the stage's folder is on the store's filesystem (LLMOPS_HOME's work/ and store/
                # are): the bytes are written once, not twice. Stages never change a file in place once stored.
                shutil.copytree(folder, staging / "files", copy_function=link_or_copy)
                (staging / MANIFEST).write_text(json.dumps(manifest, indent=1))
                if target.exists():  # an incomplete object left behind: replace it whole
                    shutil.rmtree(target)
                os.rename(staging, target)
            finally:
                shutil.rmtree(staging, ignore_errors=True)
        return self.artifact(digest)

    def exists(self, digest: str) -> bool:
        target = self._object(digest)
        manifest_path = target / MANIFEST
        if not manifest_path.is_file():
            return False
        manifest = json.loads(manifest_path.read_text())
        return all(
            (target / "files" / rel).is_file() and (target / "files" / rel).stat().st_size == meta["size"]
            for rel, meta in manifest["files"].items()
        )

    def fetch(self, digest: str) -> Path:
        target = self._object(digest)
        if not (target / MANIFEST).is_file():
            raise ArtifactMissing(f"artifact {digest[:12]}: not in store {self.uri}")
        manifest = json.loads((target / MANIFEST).read_text())
        files = target / "files"
        still_whole = all(
            (files / rel).is_file() and (files / rel).stat().st_size == meta["size"]
            for rel, meta in manifest["files"].items()
        )
        if digest not in self._verified or not still_whole:
            verify_folder(files, manifest, digest[:12])
            self._verified.add(digest)
        return files

    def _record(self, namespace: str, key: str) -> Path:
        return self.root / "records" / namespace / f"{key}.json"

    def put_record(self, namespace: str, key: str, record: dict) -> None:
        path = self._record(namespace, key)
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".tmp-")
        try:
            with os.fdopen(fd, "w") as fh:
                json.dump(record, fh, indent=1)
            os.replace(tmp, path)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)  # a full disk leaves no half-written record behind
            raise

    def get_record(self, namespace: str, key: str) -> dict | None:
        path = self._record(namespace, key)
        return json.loads(path.read_text()) if path.is_file() else None

    def size(self, digest: str) -> int | None:
        manifest_path = self._object(digest) / MANIFEST
        if not manifest_path.is_file():
            return None
        return sum(meta["size"] for meta in json.loads(manifest_path.read_text())["files"].values())

    def objects(self) -> list[StoredObject]:
        folder = self.root / "objects"
        if not folder.is_dir():
            return []
        found = []
        for entry in folder.iterdir():
            if entry.is_dir() and not entry.name.startswith("."):
                size = sum(p.stat().st_size for p in entry.rglob("*") if p.is_file())
                found.append(StoredObject(entry.name, size, entry.stat().st_mtime))
        return found

    def delete(self, digest: str) -> None:
        shutil.rmtree(self._object(digest), ignore_errors=True)
        self._verified.discard(digest)

    def records(self) -> list[StoredRecord]:
        folder = self.root / "records"
        found = []
        for path in sorted(folder.rglob("*.json")) if folder.is_dir() else []:
            if path.name.startswith("."):
                continue
            namespace = path.parent.relative_to(folder).as_posix()
            try:
                record = json.loads(path.read_text())
            except ValueError:
                record = {}
            found.append(StoredRecord(namespace, path.stem, path.stat().st_mtime, record))
        return found

    def delete_record(self, namespace: str, key: str) -> None:
        self._record(namespace, key).unlink(missing_ok=True)

    def leftovers(self) -> list[Path]:
        """Temporary folders and files of writes that never finished (a process killed mid-write)."""
        return [p for p in self.root.rglob(".tmp-*")] if self.root.is_dir() else []

    def local_folders(self) -> list[Path]:
        return [self.root]


def link_or_copy(source: str, target: str) -> str:
    """shutil.copytree's copy_function: a hard link, or a copy where linking is not possible (another filesystem)."""
    try:
        os.link(source, target)
    except OSError:
        shutil.copy2(source, target)
    return target


def outlast_outage(
    what: str,
    call: Callable[[], T],
    outage_s: float,
    warn: Callable[[str], None],
    keep_trying: Callable[[], bool] = lambda: True,
    sleep: Callable[[float], None] = time.sleep,
) -> T:
    """`call()`, retried while the store is unreachable (transient faults only) for up to `outage_s`:
    exponential backoff with full jitter (1 s doubling up to 30 s), so many clients coming back
    after a storage restart do not hit it in step. `keep_trying()` false ends the retries early (a
    newer checkpoint superseded this one); `sleep` may return early for the same reason."""
    from tenacity import Retrying, retry_if_exception, stop_after_delay, wait_random_exponential

    def log_retry(state) -> None:
        fault = state.outcome.exception()
        warn(
            f"{what}: store unreachable ({type(fault).__name__}); retry {state.attempt_number} in "
            f"{state.next_action.sleep:.1f}s, for up to {outage_s:.0f}s (run.storage_outage_s)"
        )

    retrying = Retrying(
        retry=retry_if_exception(lambda exc: is_transient(exc) and keep_trying()),
        wait=wait_random_exponential(multiplier=1, max=30),
        stop=stop_after_delay(outage_s),
        before_sleep=log_retry,
        sleep=sleep,
        reraise=True,
    )
    return retrying(call)
