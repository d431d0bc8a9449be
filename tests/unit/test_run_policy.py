"""Run parameters cannot run code: settings that name executables, environments, images or pass-through
arguments come only from profile files on disk (tasks/platform/config/policy.py, docs/security.md)."""

import re
from pathlib import Path

import pytest

from flows.release import release
from flows.remote_stage import run_stage
from tasks.platform.config import (
    check_api_profile,
    check_received_profile,
    file_only_settings,
    load_profile,
    refuse_file_only,
)
from tasks.platform.errors import BadInput
from tasks.platform.project import PROJECT_ROOT

MINIMAL = "name: {name}\ndata: {{source: x.jsonl}}\nregistry: {{model_name: m}}\n"


def test_the_settings_that_run_code_are_marked_file_only():
    assert set(file_only_settings()) == {
        "hardware.kubernetes.image",
        "hardware.kubernetes.stage_images",
        "hardware.kubernetes.namespace",
        "train.deepspeed",
        "train.extra_args",
        "engine.extra_args",
        "serve.vllm.environment",
        "bench.aiperf_environment",  # the aiperf that runs
        "serve.triton_binary",
        "serve.capture.location",  # where users' conversations go: not for whoever starts a run
        # whom the pipeline trusts: whose corrections train, whether harvests go unreviewed
        "serve.capture.trusted_clients",
        "flywheel.review",
        "flywheel.max_client_share",
        "flywheel.min_clients",
        "gate.allowed_signers",  # whose signature approves
        "serve.auth.jwt",  # whose tokens the gateway takes
        "gate.separate_duties",
        "evaluate.judge.api_key_env",  # which of the worker's secrets goes to the judge's endpoint
    }


@pytest.mark.parametrize(
    "override,key",
    [
        ("serve.triton_binary=/tmp/evil", "serve.triton_binary"),
        ("serve.vllm.environment=/tmp/venv", "serve.vllm.environment"),
        ("train.deepspeed=/tmp/ds.json", "train.deepspeed"),
        ("train.extra_args={trust_remote_code: true}", "train.extra_args"),
        ("train.extra_args.trust_remote_code=true", "train.extra_args"),
        ("engine.extra_args.checkpoint_loader=x", "engine.extra_args"),
        ("hardware.kubernetes.image=evil:latest", "hardware.kubernetes.image"),
        ("hardware.kubernetes.stage_images.train=evil:latest", "hardware.kubernetes.stage_images"),
        ("hardware.kubernetes.namespace=kube-system", "hardware.kubernetes.namespace"),
        ("serve={triton_binary: /tmp/evil}", "serve.triton_binary"),  # a whole section as a mapping
        ("serve.vllm={environment: /tmp/venv}", "serve.vllm.environment"),
        # which of the worker's secrets goes to the judge: inside an optional section set as a mapping
        (
            "evaluate.judge={url: 'http://j/v1', model: m, api_key_env: AWS_SECRET_ACCESS_KEY}",
            "evaluate.judge.api_key_env",
        ),
    ],
)
def test_an_override_that_runs_code_is_refused_in_one_line_naming_it(override, key):
    with pytest.raises(BadInput) as refused:
        load_profile("cpu-tiny", [override])
    message = str(refused.value)
    assert "\n" not in message
    assert f": {key} names code to run" in message and message.endswith("put it in a profile file")


def test_other_settings_of_the_same_sections_stay_overridable():
    profile = load_profile("cpu-tiny", ["serve={deploy: false}", "train.seed=3", "hardware.kubernetes.cpu_request=2Gi"])
    assert (profile.serve.deploy, profile.train.seed, profile.hardware.kubernetes.cpu_request) == (False, 3, "2Gi")


def test_every_override_the_integration_tests_use_is_allowed():
    text = "\n".join(p.read_text() for p in (PROJECT_ROOT / "tests").rglob("*.py") if "integration" in p.parts)
    used = sorted(set(re.findall(r'"([a-z_]+(?:\.[a-z_]+)+)=', text)))
    assert "serve.deploy" in used and "run.remote_stages.train" in used  # the scan finds them
    for key in used:
        refuse_file_only(key.split("."), "x", f"{key}=x")


def test_a_profile_file_sets_them(tmp_path):
    own = tmp_path / "own.yaml"
    own.write_text(MINIMAL.format(name="own") + "serve: {triton_binary: /opt/tritonserver/bin/tritonserver}\n")
    assert load_profile(str(own)).serve.triton_binary == "/opt/tritonserver/bin/tritonserver"


def test_an_api_run_takes_a_shipped_profile_and_not_a_path_the_caller_chose(tmp_path, monkeypatch):
    monkeypatch.delenv("LLMOPS_PROFILES_DIR", raising=False)
    check_api_profile("cpu-tiny")
    written = tmp_path / "mine.yaml"
    written.write_text(MINIMAL.format(name="mine"))
    for chosen in (str(written), str(PROJECT_ROOT / "profiles" / "cpu-tiny.yaml"), "../../" + str(tmp_path / "mine")):
        with pytest.raises(BadInput, match=r"a run started through the Prefect API takes a profile of profiles/"):
            check_api_profile(chosen)


def test_a_name_is_never_a_path(tmp_path):
    (tmp_path / "evil.yaml").write_text(MINIMAL.format(name="evil"))
    relative = Path("..") / Path(*[".."] * 10) / str(tmp_path / "evil").lstrip("/")
    with pytest.raises(BadInput, match="not found"):
        load_profile(str(relative))


def test_the_operators_profiles_folder_is_allowed_and_nothing_beside_it(tmp_path, monkeypatch):
    folder, outside = tmp_path / "profiles", tmp_path / "elsewhere.yaml"
    folder.mkdir()
    (folder / "team.yaml").write_text(MINIMAL.format(name="team"))
    outside.write_text(MINIMAL.format(name="elsewhere"))
    (folder / "link.yaml").symlink_to(outside)
    monkeypatch.setenv("LLMOPS_PROFILES_DIR", str(folder))
    check_api_profile("team")
    check_api_profile(str(folder / "team.yaml"))
    assert load_profile("team").name == "team"
    for chosen in (str(outside), str(folder / "link.yaml"), str(folder / ".." / "elsewhere.yaml")):
        with pytest.raises(BadInput, match=r"LLMOPS_PROFILES_DIR \(" + re.escape(str(folder))):
            check_api_profile(chosen)


def test_a_received_profile_passes_where_the_worker_s_file_agrees():
    check_received_profile(load_profile("cpu-tiny"))
    check_received_profile(load_profile("llama3-8b-h100-fp8", ["train.seed=7"]))  # sets several, as its file does


@pytest.mark.parametrize(
    "name,change,phrase",
    [
        ("cpu-tiny", {"serve": {"triton_binary": "/tmp/evil"}}, r"serve\.triton_binary differ\(s\) from .*cpu-tiny"),
        ("llama3-8b-h100-fp8", {"train": {"extra_args": {"trust_remote_code": True}}}, r"train\.extra_args differ"),
        ("nowhere", {"train": {"deepspeed": "/tmp/ds.json"}}, r"no profile file nowhere\.yaml"),
    ],
)
def test_a_received_profile_that_differs_from_the_worker_s_file_is_refused(name, change, phrase):
    # train.deepspeed needs cuda: the profile of no file is a GPU one
    data = load_profile(name if name != "nowhere" else "llama3-8b-h100-fp8").model_dump(mode="json") | {"name": name}
    for section, values in change.items():
        data[section] = data[section] | values
    with pytest.raises(BadInput, match=phrase):
        run_stage.fn("train", data, "/nowhere", "sqlite:///nowhere.db", "run", "0", [])


def test_a_received_profile_of_another_name_with_nothing_that_runs_code_passes():
    data = load_profile("cpu-tiny").model_dump(mode="json") | {"name": "someone-elses"}
    check_received_profile(load_profile("cpu-tiny").model_validate(data))


def test_an_api_started_release_refuses_before_anything_is_created(tmp_path, monkeypatch):
    monkeypatch.setenv("PREFECT__RUNTIME__DEPLOYMENT__ID", "00000000-0000-0000-0000-000000000001")
    monkeypatch.setenv("LLMOPS_HOME", str(tmp_path / "home"))
    written = tmp_path / "mine.yaml"
    written.write_text(MINIMAL.format(name="mine") + "serve: {triton_binary: /tmp/evil}\n")
    with pytest.raises(BadInput, match="takes a profile of profiles/"):
        release.fn(profile=str(written))
    with pytest.raises(BadInput, match="serve.triton_binary names code to run"):
        release.fn(profile="cpu-tiny", overrides=["serve.triton_binary=/tmp/evil"])
    assert not (tmp_path / "home").exists()
