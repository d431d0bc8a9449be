"""Where a served model may read its weights from: its own folder, a folder its Triton's starter allows, or the S3
artifact store its Triton's starter names.

A rendered config names the folder a model loads (`model_dir`, a version's `adapter_dir`). The release and `llmops
serve` write those configs as data (tasks/serving/repository.py), and the process that starts tritonserver names the
folders a model may load from in LLMOPS_MODEL_ROOTS (the artifact store's local folders): a `model_dir` that resolves
anywhere else (a path planted through a config, a link out of the store) is refused by the model itself, before it
reads a byte. Without LLMOPS_MODEL_ROOTS (a Triton someone else started) the operator's layout stands.

A Triton that shares no disk with the serve (a Kubernetes pod of `llmops triton --artifacts s3://...`) is given the
store object itself: `model_dir` is `s3://BUCKET/PREFIX/objects/DIGEST`, which the model fetches with boto3 (the
pod's read-only AWS_* credentials) into LLMOPS_MODEL_CACHE, as KServe's storage initializer does: the manifest
checked against the digest the URI names, every file against the manifest, the folder renamed into place only then
(the store's own layout and checks, tasks/platform/store_s3.py), so a load request carries the config alone. Only an
object of the store LLMOPS_MODEL_STORE names is fetched.

Standard library and boto3 only, and no project import: copied next to every model.py (tasks/serving/repository.py),
and run inside Triton's Python-backend stub.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile

FILE_NAME = "model_roots.py"  # the copy's name in a rendered model's version folder
ROOTS_ENV = "LLMOPS_MODEL_ROOTS"  # os.pathsep-separated folders, set by the process that starts tritonserver
STORE_ENV = "LLMOPS_MODEL_STORE"  # the S3 store (s3://BUCKET/PREFIX) whose objects a model may fetch
CACHE_ENV = "LLMOPS_MODEL_CACHE"  # where fetched objects are kept, one folder per digest
STORE_SCHEME = "s3://"


def served_folder(args: dict, given: str, key: str = "model_dir") -> str:
    """The folder `key` names, as it resolves (relative: inside this model's version folder, where files sent with a
    load request land; an S3 store object: fetched); ValueError where LLMOPS_MODEL_ROOTS is set and it lies outside
    the model's own folder and every root, or where it is an object of a store this Triton may not fetch from."""
    if given.startswith(STORE_SCHEME):
        return fetched(given, key)
    path = os.path.realpath(os.path.join(args["model_repository"], args["model_version"], given))
    if ROOTS_ENV not in os.environ:
        return path
    roots = [os.path.realpath(args["model_repository"])]
    roots += [os.path.realpath(root) for root in os.environ[ROOTS_ENV].split(os.pathsep) if root]
    if not any(path == root or path.startswith(root + os.sep) for root in roots):
        raise ValueError(
            f"{key} {given}: outside this model's folder and the artifact store ({os.pathsep.join(roots)})"
        )
    return path


def fetched(uri: str, key: str) -> str:
    """The store object `uri` (s3://BUCKET/PREFIX/objects/DIGEST) in this machine's cache, fetched and checked first
    where it is not there yet."""
    store = os.environ.get(STORE_ENV, "").rstrip("/")
    objects = f"{store}/objects/"
    digest = uri[len(objects) :] if store and uri.startswith(objects) else ""
    if not digest or "/" in digest or not all(c in "0123456789abcdef" for c in digest):
        raise ValueError(
            f"{key} {uri}: not an object of the artifact store this Triton fetches from "
            f"({store or 'none: start it with --artifacts s3://BUCKET/PREFIX'})"
        )
    cache = os.environ.get(CACHE_ENV) or os.path.join(tempfile.gettempdir(), "llmops-model-cache")
    local = os.path.join(cache, digest)
    if os.path.isdir(local):  # renamed into place only once checked
        return local
    os.makedirs(cache, exist_ok=True)
    bucket, _, prefix = uri[len(STORE_SCHEME) :].partition("/")
    staging = tempfile.mkdtemp(dir=cache, prefix=".tmp-")
    try:
        download(bucket, prefix, digest, staging, f"{key} {uri}")
        try:
            os.rename(staging, local)
        except OSError:  # another instance of this model fetched it meanwhile
            if not os.path.isdir(local):
                raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return local


def download(bucket: str, prefix: str, digest: str, staging: str, label: str) -> None:
    """Every file of the object into `staging`, each checked against the manifest, which is checked against
    `digest` (its sha256, as tasks/platform/config/profile.py:sha256_json computes it)."""
    import boto3
    from botocore.config import Config

    # AWS_ENDPOINT_URL and the read-only credentials from the environment; response checksums off for the 5xx that
    # botocore 1.44 cannot parse with them (tasks/platform/store.py:s3_client), the manifest checks each file.
    config = Config(retries={"mode": "standard"}, response_checksum_validation="when_required")
    client = boto3.client("s3", config=config)
    manifest_bytes = client.get_object(Bucket=bucket, Key=f"{prefix}/manifest.json")["Body"].read()
    manifest = json.loads(manifest_bytes)
    canonical = json.dumps(manifest, sort_keys=True, separators=(",", ":")).encode()
    if hashlib.sha256(canonical).hexdigest() != digest:
        raise ValueError(f"{label}: its manifest is not the one the digest names")
    root = os.path.realpath(staging)
    for rel, meta in manifest["files"].items():
        path = os.path.realpath(os.path.join(root, rel))
        if not path.startswith(root + os.sep):
            raise ValueError(f"{label}: file {rel} lies outside the object")
        os.makedirs(os.path.dirname(path), exist_ok=True)
        client.download_file(bucket, f"{prefix}/files/{rel}", path)
        with open(path, "rb") as fh:
            sha256 = hashlib.file_digest(fh, "sha256").hexdigest()
        if os.path.getsize(path) != meta["size"] or sha256 != meta["sha256"]:
            raise ValueError(f"{label}: file {rel} does not match its sha256")
