"""The artifact store on S3 (boto3): objects under `<prefix>/objects/<digest>/`, the manifest written last, so that
an object without a manifest does not exist; records under `<prefix>/records/`. Downloads are verified, then renamed
into a local cache (`$LLMOPS_HOME/cache/objects`)."""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path

from tasks.platform.config import sha256_json
from tasks.platform.errors import ArtifactMissing
from tasks.platform.store import (
    MANIFEST,
    Artifact,
    ArtifactStore,
    StoredObject,
    StoredRecord,
    build_manifest,
    s3_client,
    split_s3_uri,
    verify_folder,
)


class S3Store(ArtifactStore):
    def __init__(self, uri: str, cache_dir: Path):
        self.bucket, self.prefix = split_s3_uri(uri)
        self.uri = uri.rstrip("/")
        self.cache_dir = cache_dir
        self.client = s3_client()

    def _key(self, *parts: str) -> str:
        return "/".join(p for p in (self.prefix, *parts) if p)

    def artifact(self, digest: str) -> Artifact:
        return Artifact(digest, f"s3://{self.bucket}/{self._key('objects', digest)}")

    def _manifest(self, digest: str) -> dict | None:
        from botocore.exceptions import ClientError

        try:
            body = self.client.get_object(Bucket=self.bucket, Key=self._key("objects", digest, MANIFEST))["Body"]
        except ClientError as err:
            if err.response["Error"]["Code"] in ("NoSuchKey", "404"):
                return None
            raise
        return json.loads(body.read())

    def _listing(self, digest: str) -> dict[str, int]:
        prefix = self._key("objects", digest, "files") + "/"
        sizes = {}
        for page in self.client.get_paginator("list_objects_v2").paginate(Bucket=self.bucket, Prefix=prefix):
            for item in page.get("Contents", []):
                sizes[item["Key"][len(prefix) :]] = item["Size"]
        return sizes

    def put_dir(self, folder: Path) -> Artifact:
        manifest = build_manifest(folder)
        digest = sha256_json(manifest)
        if not self.exists(digest):
            for rel in manifest["files"]:
                self.client.upload_file(str(folder / rel), self.bucket, self._key("objects", digest, "files", rel))
            self.client.put_object(
                Bucket=self.bucket, Key=self._key("objects", digest, MANIFEST), Body=json.dumps(manifest).encode()
            )
        return self.artifact(digest)

    def exists(self, digest: str) -> bool:
        manifest = self._manifest(digest)
        if manifest is None:
            return False
        sizes = self._listing(digest)
        return all(sizes.get(rel) == meta["size"] for rel, meta in manifest["files"].items())

    def fetch(self, digest: str) -> Path:
        local = self.cache_dir / digest
        if local.is_dir():  # verified when it was downloaded, and renamed into place only then
            return local
        manifest = self._manifest(digest)
        if manifest is None:
            raise ArtifactMissing(f"artifact {digest[:12]}: not in store {self.uri}")
        from botocore.exceptions import ClientError

        self.cache_dir.mkdir(parents=True, exist_ok=True)
        staging = Path(tempfile.mkdtemp(dir=self.cache_dir, prefix=".tmp-"))
        try:
            for rel in manifest["files"]:
                dest = staging / rel
                dest.parent.mkdir(parents=True, exist_ok=True)
                try:
                    self.client.download_file(self.bucket, self._key("objects", digest, "files", rel), str(dest))
                except ClientError as err:
                    if err.response["Error"]["Code"] in ("NoSuchKey", "404"):
                        raise ArtifactMissing(f"artifact {digest[:12]}: file {rel} is missing") from None
                    raise
            verify_folder(staging, manifest, digest[:12])
            os.rename(staging, local)
        finally:
            shutil.rmtree(staging, ignore_errors=True)
        return local

    def put_record(self, namespace: str, key: str, record: dict) -> None:
        self.client.put_object(
            Bucket=self.bucket, Key=self._key("records", namespace, f"{key}.json"), Body=json.dumps(record).encode()
        )

    def get_record(self, namespace: str, key: str) -> dict | None:
        from botocore.exceptions import ClientError

        try:
            body = self.client.get_object(Bucket=self.bucket, Key=self._key("records", namespace, f"{key}.json"))
        except ClientError as err:
            if err.response["Error"]["Code"] in ("NoSuchKey", "404"):
                return None
            raise
        return json.loads(body["Body"].read())

    def _list(self, prefix: str):
        for page in self.client.get_paginator("list_objects_v2").paginate(Bucket=self.bucket, Prefix=prefix):
            yield from page.get("Contents", [])

    def size(self, digest: str) -> int | None:
        manifest = self._manifest(digest)
        return None if manifest is None else sum(meta["size"] for meta in manifest["files"].values())

    def objects(self) -> list[StoredObject]:
        prefix = self._key("objects") + "/"
        sizes: dict[str, int] = {}
        written: dict[str, float] = {}
        for item in self._list(prefix):
            digest = item["Key"][len(prefix) :].split("/", 1)[0]
            sizes[digest] = sizes.get(digest, 0) + item["Size"]
            written[digest] = max(written.get(digest, 0.0), item["LastModified"].timestamp())
        return [StoredObject(d, sizes[d], written[d]) for d in sizes]

    def delete(self, digest: str) -> None:
        # The manifest first: without it the object does not exist, whatever is left of its files.
        self.client.delete_object(Bucket=self.bucket, Key=self._key("objects", digest, MANIFEST))
        keys = [item["Key"] for item in self._list(self._key("objects", digest) + "/")]
        for i in range(0, len(keys), 1000):
            self.client.delete_objects(
                Bucket=self.bucket, Delete={"Objects": [{"Key": k} for k in keys[i : i + 1000]], "Quiet": True}
            )
        shutil.rmtree(self.cache_dir / digest, ignore_errors=True)

    def records(self) -> list[StoredRecord]:
        prefix = self._key("records") + "/"
        found = []
        for item in self._list(prefix):
            namespace, _, name = item["Key"][len(prefix) :].rpartition("/")
            if not name.endswith(".json"):
                continue
            record = json.loads(self.client.get_object(Bucket=self.bucket, Key=item["Key"])["Body"].read())
            found.append(StoredRecord(namespace, name.removesuffix(".json"), item["LastModified"].timestamp(), record))
        return found

    def delete_record(self, namespace: str, key: str) -> None:
        self.client.delete_object(Bucket=self.bucket, Key=self._key("records", namespace, f"{key}.json"))

    def local_folders(self) -> list[Path]:
        return [self.cache_dir]
