"""A location of whole objects, a folder (or file://) or an s3:// prefix: what capture partitions
(tasks/data/exchanges.py) and harvested datasets waiting for review (tasks/data/harvest.py) are kept in.

Each object is written whole, once (a local one through a temporary file renamed in, mode 600 in mode-700
folders: they hold users' conversations), so a reader never sees half of one.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path
from urllib.parse import urlparse

from tasks.platform.errors import BadInput


class Location:
    """Objects under one root, addressed by keys relative to it."""

    uri: str

    def put(self, key: str, text: str) -> None:
        raise NotImplementedError

    def keys(self, prefix: str) -> list[str]:
        raise NotImplementedError

    def get(self, key: str) -> str:
        raise NotImplementedError

    def delete(self, keys: list[str]) -> None:
        raise NotImplementedError

    def uri_of(self, key: str) -> str:
        return f"{self.uri.rstrip('/')}/{key}"


class LocalLocation(Location):
    def __init__(self, root: Path):
        self.root = root
        self.uri = root.as_uri()

    def put(self, key: str, text: str) -> None:
        path = self.root / key
        path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        fd, temporary = tempfile.mkstemp(dir=path.parent, prefix=".tmp-")  # mode 600: live prompts and answers
        with os.fdopen(fd, "w", encoding="utf-8") as out:
            out.write(text)
        os.replace(temporary, path)

    def keys(self, prefix: str) -> list[str]:
        folder = self.root / prefix
        if not folder.is_dir():
            return []
        return sorted(
            p.relative_to(self.root).as_posix() for p in folder.rglob("*") if p.is_file() and p.name[0] != "."
        )

    def get(self, key: str) -> str:
        return (self.root / key).read_text(encoding="utf-8")

    def delete(self, keys: list[str]) -> None:
        for key in keys:
            (self.root / key).unlink(missing_ok=True)
            folder = (self.root / key).parent  # its folder (an hour's), once empty
            if folder != self.root and folder.is_dir() and not any(folder.iterdir()):
                shutil.rmtree(folder, ignore_errors=True)


class S3Location(Location):
    def __init__(self, uri: str):
        from tasks.platform.store import s3_client, split_s3_uri

        self.bucket, self.prefix = split_s3_uri(uri)
        self.uri = uri.rstrip("/")
        self.client = s3_client()

    def _key(self, key: str) -> str:
        return f"{self.prefix.rstrip('/')}/{key}" if self.prefix else key

    def put(self, key: str, text: str) -> None:
        self.client.put_object(Bucket=self.bucket, Key=self._key(key), Body=text.encode())

    def keys(self, prefix: str) -> list[str]:
        full = self._key(prefix)
        found = []
        for page in self.client.get_paginator("list_objects_v2").paginate(Bucket=self.bucket, Prefix=full):
            found += [o["Key"][len(full) - len(prefix) :] for o in page.get("Contents", [])]
        return sorted(found)

    def get(self, key: str) -> str:
        return self.client.get_object(Bucket=self.bucket, Key=self._key(key))["Body"].read().decode()

    def delete(self, keys: list[str]) -> None:
        for start in range(0, len(keys), 1000):  # S3's DeleteObjects takes 1000 keys at most
            batch = [{"Key": self._key(k)} for k in keys[start : start + 1000]]
            self.client.delete_objects(Bucket=self.bucket, Delete={"Objects": batch, "Quiet": True})


def local_root(location: str) -> Path:
    """The folder of a local location (a path or file:// URI); BadInput for any other scheme."""
    if "://" in location and not location.startswith("file://"):
        raise BadInput(f"location {location}: expected a folder, file:// or s3:// URI")
    return Path(urlparse(location).path if location.startswith("file://") else location)


def open_location(location: str) -> Location:
    """s3://bucket/prefix, file:// or a folder."""
    return S3Location(location) if location.startswith("s3://") else LocalLocation(local_root(location))


def same_or_inside(one: str, other: str) -> bool:
    """Whether either location holds the other (or both are the same): s3:// prefixes and folders alike."""

    def normal(location: str) -> str:
        text = location if location.startswith("s3://") else local_root(location).resolve().as_uri()
        return text.rstrip("/") + "/"

    a, b = normal(one), normal(other)
    return a.startswith(b) or b.startswith(a)
