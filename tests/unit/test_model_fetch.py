"""A Triton that shares no disk with the serve (a Kubernetes pod of `llmops triton --artifacts s3://...`) fetches a
version's files from the S3 artifact store itself (tasks/serving/model_roots.py), against rclone's real S3 server:
what the model config names is the store object, not the weights; the fetch is checked against the manifest and the
digest; only the named store is fetched from; and files too large for a load request are refused before one is sent.
The pods' real load over Triton is tests/integration/test_serving.py's discovery test."""

import os
from pathlib import Path

import pytest

from tasks.platform.errors import BadInput, CheckFailed
from tests.servers import S3_KEY, S3_SECRET, s3_env

STORE = "s3://artifacts/store"


@pytest.fixture(scope="module")
def s3(tmp_path_factory):
    from tasks.platform.local_stack.s3 import start_s3
    from tasks.platform.ports import free_port

    root = tmp_path_factory.mktemp("s3")
    server = start_s3(root / "data", free_port(), S3_KEY, S3_SECRET, root)
    yield server, root / "data"
    server.stop()


@pytest.fixture
def store(s3, tmp_path, monkeypatch):
    """The serve's S3 store, and this process as the pod: its AWS_* variables, the store it may fetch from."""
    from tasks.platform.store_s3 import S3Store
    from tasks.serving.model_roots import CACHE_ENV, STORE_ENV

    for name, value in s3_env(s3[0].url).items():
        monkeypatch.setenv(name, value)
    monkeypatch.setenv(STORE_ENV, STORE)
    monkeypatch.setenv(CACHE_ENV, str(tmp_path / "pod-cache"))
    return S3Store(STORE, tmp_path / "serve-cache")


def model_folder(root: Path, text: str) -> Path:
    (root / "sub").mkdir(parents=True)
    (root / "config.json").write_text(text)
    (root / "sub" / "weights.bin").write_bytes(os.urandom(4096))
    return root


def test_a_triton_sharing_no_disk_fetches_a_version_from_the_s3_store_itself_checked(store, s3, tmp_path):
    from tasks.serving.model_roots import served_folder

    artifact = store.put_dir(model_folder(tmp_path / "model", '{"a": 1}'))
    args = {"model_repository": str(tmp_path / "repository" / "svc-v1"), "model_version": "1"}
    fetched = Path(served_folder(args, artifact.uri))
    assert fetched == tmp_path / "pod-cache" / artifact.digest
    assert (fetched / "sub" / "weights.bin").read_bytes() == (tmp_path / "model" / "sub" / "weights.bin").read_bytes()
    assert served_folder(args, artifact.uri) == str(fetched)  # the next instance reads the cache

    # a file changed in the store after it was written: refused, and nothing is left in the cache
    other = store.put_dir(model_folder(tmp_path / "other", '{"b": 2}'))
    stored = s3[1] / "artifacts" / "store" / "objects" / other.digest / "files" / "sub" / "weights.bin"
    stored.write_bytes(os.urandom(4096))
    with pytest.raises(ValueError, match=r"^model_dir s3://.*: file sub/weights.bin does not match its sha256$"):
        served_folder(args, other.uri)
    assert sorted(os.listdir(tmp_path / "pod-cache")) == [artifact.digest]

    for elsewhere in ("s3://another-bucket/store/objects/" + artifact.digest, STORE + "/objects/../records/x"):
        with pytest.raises(ValueError, match=r"^adapter_dir s3://.*: not an object of the artifact store this"):
            served_folder(args, elsewhere, "adapter_dir")


def test_a_merged_version_for_a_triton_sharing_no_disk_names_the_store_object_and_carries_no_weights(store, tmp_path):
    from tasks.platform.config import load_profile
    from tasks.serving.client import Triton, load_parameters
    from tasks.serving.models import MergedVersion
    from tasks.serving.repository import rendered_parameter

    artifact = store.put_dir(model_folder(tmp_path / "model", '{"a": 1}'))
    served = MergedVersion(
        version="1",
        name="svc-v1",
        model_dir=store.fetch(artifact.digest),
        artifact_sha256=artifact.digest,
        sources={"merge": artifact.digest},
        store=STORE,
    )
    pod = Triton("http://10.0.0.7:8000", None)  # a pod: no repository of this process's
    assert served.fetched_by(pod) and not served.fetched_by(Triton("http://127.0.0.1:8000", tmp_path))
    repository = tmp_path / "rendered"
    served.render(pod, load_profile("cpu-tiny"), repository)
    assert rendered_parameter(repository / "svc-v1", "model_dir") == artifact.uri
    sent = load_parameters(repository / "svc-v1")
    assert not [name for name in sent if "weights" in name or name.startswith("file:1/model/")], sorted(sent)


def test_files_too_large_for_a_load_request_are_refused_naming_their_size_before_any_is_sent(tmp_path):
    from tasks.serving.client import SENT_FILES_LIMIT, load_parameters

    folder = tmp_path / "svc-v1"
    (folder / "1" / "model").mkdir(parents=True)
    (folder / "config.pbtxt").write_text('name: "svc-v1"\nbackend: "python"\n')
    with open(folder / "1" / "model" / "model.safetensors", "wb") as big:  # sparse: no disk used
        big.truncate(SENT_FILES_LIMIT + 2**20)
    with pytest.raises(CheckFailed, match=r"^model svc-v1: its files are 46\.0 MiB, more than the 45 MiB a load"):
        load_parameters(folder)


def test_a_triton_pod_fetches_only_from_an_s3_store_and_gets_the_store_variables_alone(tmp_path, monkeypatch):
    from flows.triton_pod import store_env
    from tasks.serving.model_roots import CACHE_ENV, STORE_ENV

    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "read-only-secret")
    monkeypatch.setenv("LLMOPS_API_KEYS", "client-keys")
    assert store_env(tmp_path, None) == {}
    env = store_env(tmp_path, STORE + "/")
    assert env[STORE_ENV] == STORE and env[CACHE_ENV] == str(tmp_path / "cache" / "objects")
    assert env["AWS_SECRET_ACCESS_KEY"] == "read-only-secret" and "LLMOPS_API_KEYS" not in env
    with pytest.raises(BadInput, match=r"^--artifacts /srv/store: a Triton that shares no disk fetches from an S3"):
        store_env(tmp_path, "/srv/store")
