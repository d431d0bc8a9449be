"""Production attach: a release rolled out by URL on a Triton this run did not start, whose model
repository this machine never writes (models go with their load requests), with the model-control
API locked to a key that inference does not need."""

from __future__ import annotations

import json
import subprocess
import threading
import time
from collections import Counter
from pathlib import Path

import pytest
import requests

from tasks.serving.server import TritonServer
from tests.integration.test_serving import FAST
from tests.servers import latest_release, llmops, registry

pytestmark = [pytest.mark.integration, pytest.mark.timeout(1200), pytest.mark.usefixtures("shared_prefect")]

SERVICE = "tiny-qwen2-antonyms"
KEY = "test-control-key-4f1c9a"


@pytest.fixture(scope="module")
def triton(tmp_path_factory):
    """A Triton started apart from the pipeline: its own home and repository, locked with KEY (given only to
    its start: the runs below get it from --triton-control-key-file alone)."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("LLMOPS_TRITON_CONTROL_KEY", KEY)
        server = TritonServer.start(tmp_path_factory.mktemp("triton-elsewhere"))
    yield server
    server.stop()


@pytest.fixture(scope="module")
def attach_args(triton: TritonServer, cpu_tiny_store, tmp_path_factory) -> list[str]:
    """Roll out on `triton` by URL only (no repository) with its key from a file, and the session's shared
    cpu-tiny artifact store."""
    client = triton.client
    assert client.grpc_url and client.metrics_url
    key_file = tmp_path_factory.mktemp("operator") / "triton-control.key"
    key_file.write_text(KEY)
    endpoints = ["--triton-url", client.url, "--triton-grpc-url", client.grpc_url]
    endpoints += ["--triton-metrics-url", client.metrics_url, "--triton-control-key-file", str(key_file)]
    return [*endpoints, "--artifacts", str(cpu_tiny_store)]


def curl(*args: str) -> str:
    """The HTTP status curl gets."""
    return subprocess.run(
        ["curl", "-s", "-o", "/dev/null", "-w", "%{http_code}", *args], capture_output=True, text=True, timeout=60
    ).stdout


def test_the_control_api_needs_the_key_and_inference_does_not(triton):
    url = triton.client.url
    assert curl("-X", "POST", f"{url}/v2/repository/index") == "403"
    assert curl("-X", "POST", f"{url}/v2/repository/models/nothing/unload") == "403"
    assert curl("-X", "POST", "-H", "llmops-control-key: wrong", f"{url}/v2/repository/index") == "403"
    assert curl("-X", "POST", "-H", f"llmops-control-key: {KEY}", f"{url}/v2/repository/index") == "200"
    assert curl(f"{url}/v2/health/ready") == "200"


# tune_serving searches the candidate's serving settings (2 trials: the profile's own and one of Optuna's; one
# confirmation round where the other won)
TUNE = ["--set", "tune.enabled=true", "--set", "tune.trials=2", "--set", "tune.confirm_rounds=1"]


@pytest.fixture(scope="module")
def release(tmp_path_factory, attach_args):
    home = tmp_path_factory.mktemp("attach-home")
    result = llmops(home, "run", *attach_args, *FAST, *TUNE)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return home


class Clients:
    """Requests to the service on Triton, one after the other from a thread, until stopped: what they got."""

    def __init__(self, url: str):
        self.url, self.statuses = url, Counter()
        self.stopped = threading.Event()
        self.thread = threading.Thread(target=self.send, daemon=True)

    def send(self) -> None:
        body = {"text_input": "What is the opposite of hot?", "max_tokens": 4, "exclude_input_in_output": True}
        while not self.stopped.is_set():
            try:
                self.statuses[
                    requests.post(f"{self.url}/v2/models/{SERVICE}/generate", json=body, timeout=30).status_code
                ] += 1
            except requests.RequestException as exc:
                self.statuses[type(exc).__name__] += 1
            time.sleep(0.1)

    def __enter__(self) -> Clients:
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stopped.set()
        self.thread.join(60)


def test_tuning_chose_the_candidates_serving_settings_and_serves_with_them(triton, release):
    run = latest_release(release)
    assert run.data.tags["tune.cached"] == "false"
    chosen = json.loads(run.data.tags["tune.settings"])
    assert set(chosen) == {"max_batch_size", "max_queue_delay_us", "instance_count"}
    history = registry(release).get_metric_history(run.info.run_id, "tune/goodput_per_s")
    assert len(history) == 2 and all(m.value > 0 for m in history)  # every trial served and met the objective
    assert run.data.metrics["tune/best_goodput_per_s"] >= run.data.metrics["tune/default_goodput_per_s"] > 0
    version = registry(release).get_model_version(SERVICE, run.data.tags["registered_version"])
    assert json.loads(version.tags["serve.model_settings"]).items() >= chosen.items()  # the champion serves so
    config = requests.get(
        f"{triton.client.url}/v2/models/{SERVICE}-v{version.version}/config",
        headers={"llmops-control-key": KEY},
        timeout=10,
    ).json()
    assert config["max_batch_size"] == chosen["max_batch_size"]


def test_a_release_by_url_promotes_without_writing_the_servers_repository(triton, release):
    tags = latest_release(release).data.tags
    assert (tags["gate.decision"], tags["release.outcome"]) == ("promote", "promoted")
    assert list(triton.client.repository.iterdir()) == []  # every model came with its load request
    answer = requests.post(
        f"{triton.client.url}/v2/models/{SERVICE}/generate",
        timeout=30,
        json={"text_input": "What is the opposite of hot?", "max_tokens": 8, "exclude_input_in_output": True},
    )
    assert answer.status_code == 200 and answer.json()["text_output"] == "cold"  # inference: no key
    leaked = [str(p) for p in release.rglob("*") if p.is_file() and KEY.encode() in p.read_bytes()]
    assert leaked == []  # the control key is in no log, report or database of the run


def test_a_bad_candidate_rolls_back_on_the_attached_triton(triton, release, attach_args):
    """Offline the candidate is fine (every training stage is a cache hit); its serving config skips the chat
    template, so what clients get differs from what was evaluated: the served scores catch it."""
    champion = str(registry(release).get_model_version_by_alias(SERVICE, "champion").version)
    with Clients(triton.client.url) as clients:  # the champion serves them while the candidate is loaded and tuned
        result = llmops(release, "run", *attach_args, "--set", "serve.apply_chat_template=false", *FAST, *TUNE)
    assert result.returncode == 10, result.stdout[-3000:] + result.stderr[-3000:]
    assert set(clients.statuses) == {200} and clients.statuses[200] > 20, clients.statuses
    assert latest_release(release).data.tags["tune.cached"] == "true"  # the same model: the search is not run again
    assert str(registry(release).get_model_version_by_alias(SERVICE, "champion").version) == champion
    report_path = Path(result.stdout.split("gate report: ")[1].split()[0])
    report = json.loads(report_path.read_text())
    assert report["decision"] == "reject"
    checks = {c["name"]: c for c in report["checks"]}
    parity = checks["serving parity: exact_match drop served vs offline"]
    assert not parity["passed"] and parity["value"] > 0.2 and parity["samples"] >= 20  # measured: 0.33 of 39
    assert checks["served artifact is the measured artifact"]["passed"]
    challenger = registry(release).get_model_version_by_alias(SERVICE, "challenger")
    assert report["served_artifact"] == report["measured_artifact"] == challenger.tags["artifact.merge.sha256"]
    answers = json.loads((report_path.parent / "served_answers.json").read_text())
    assert sum(a["served"] != a["offline"] for a in answers) >= parity["value"] * len(answers), report_path
    # Models loaded with their files are not in the server's repository index: ask each one.
    rejected = str(challenger.version)
    client, deadline = triton.client, time.monotonic() + 60
    while client.is_ready(f"{SERVICE}-v{rejected}") and time.monotonic() < deadline:
        time.sleep(0.5)  # Triton unloads after the requests in flight
    assert not client.is_ready(f"{SERVICE}-v{rejected}")
    assert client.is_ready(f"{SERVICE}-v{champion}") and client.is_ready(SERVICE)
    assert client.generate(SERVICE, "What is the opposite of hot?", 8) == "cold"  # the champion answers


def test_attaching_without_the_grpc_and_metrics_endpoints_is_one_clear_line(tmp_path, triton):
    result = llmops(tmp_path / "home", "run", "--triton-url", triton.client.url)
    assert result.returncode == 2
    assert result.stderr.strip().splitlines()[-1] == (
        f"llmops: error: Triton at {triton.client.url}: attaching needs --triton-grpc-url (genai-perf's endpoint) "
        "and --triton-metrics-url (the canary's live checks), or LLMOPS_TRITON_GRPC_URL / LLMOPS_TRITON_METRICS_URL"
    )


def test_past_its_bound_a_served_model_and_the_router_refuse_at_once_with_503(
    triton, release, cpu_tiny_store, tmp_path
):
    """serve.max_queue_size bounds what Triton holds: the python backend model's dynamic-batcher queue and the
    router's requests in flight. Flooded far past them, some requests are answered and the rest refused at once
    (never a 500, never an unbounded wait), each in its own words."""
    from concurrent.futures import ThreadPoolExecutor

    from tasks.platform.config import load_profile
    from tasks.serving.model_config import serving_model
    from tasks.serving.repository import render_model

    merged = registry(release).get_model_version_by_alias(SERVICE, "champion").tags["artifact.merge.sha256"]
    profile = load_profile("cpu-tiny", ["serve.max_queue_size=1", "serve.max_batch_size=1"])
    template, values = serving_model(profile, cpu_tiny_store / "objects" / merged / "files", merged)
    render_model(template, tmp_path, "queued", values)
    router = {"max_batch_size": 1, "max_in_flight": 2, "routes": "queued=100", "shadow": ""}
    render_model("router", tmp_path, "queued-router", router)
    client = triton.client
    for name in ("queued", "queued-router"):
        client.load(name, model_folder=tmp_path / name)

    def ask(model: str) -> tuple[int, str]:
        body = {"text_input": "What is the opposite of hot?", "max_tokens": 16, "min_length": 16}
        answer = requests.post(f"{client.url}/v2/models/{model}/generate", json=body, timeout=60)
        return answer.status_code, answer.text

    try:
        with ThreadPoolExecutor(16) as pool:
            direct = list(pool.map(lambda _: ask("queued"), range(48)))
            routed = list(pool.map(lambda _: ask("queued-router"), range(48)))
    finally:
        for name in ("queued-router", "queued"):
            client.unload(name)
    # The router's refusal is a 400 on Triton's own API: Triton 2.51 drops the Python backend's error code
    # (UNAVAILABLE) on a decoupled model's response; the gateway turns it into 503 (tests/unit/test_gateway.py).
    # Behind the router the model's own bound may refuse too (the router's count drops as it sends the last piece).
    full, busy = "Exceeds maximum queue size", "requests in flight; retry shortly"
    assert {status for status, _ in direct} == {200, 503}, direct
    assert all(full in text for status, text in direct if status == 503), direct
    assert {status for status, _ in routed} == {200, 400}, routed
    assert all(full in text or busy in text for status, text in routed if status == 400), routed
    assert any(busy in text for _, text in routed), routed
