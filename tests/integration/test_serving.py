"""Canary, gate, promotion and rollback on a real Triton (nvidia-pytriton binary) with real genai-perf.

One LLMOPS_HOME for the module: the first run releases v1 (no champion: deployed directly after
the gate), `llmops serve` then keeps the champion served, and later runs roll candidates out on
that server while a bounded client load runs through the router.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import threading
import time
from pathlib import Path

import pytest
import requests

from tests.servers import LLMOPS, ROOT, latest_release, llmops, llmops_env, registry

pytestmark = [pytest.mark.integration, pytest.mark.timeout(1200)]

SERVICE = "tiny-qwen2-antonyms"
# Lighter load than the profile's defaults: the same code paths in less CI time.
FAST = ["--set", "bench.concurrency=[2]", "--set", "bench.request_count=16", "--set", "canary.window_s=1.5"]


@pytest.fixture(scope="module")
def home(tmp_path_factory):
    return tmp_path_factory.mktemp("serving-home")


@pytest.fixture(scope="module")
def run(home, cpu_tiny_store):
    """`llmops run ARGS` on this module's home, with the session's shared cpu-tiny artifact store."""

    def release(*args: str):
        return llmops(home, "run", "--artifacts", str(cpu_tiny_store), *args, *FAST)

    return release


def champion(home: Path) -> str:
    return str(registry(home).get_model_version_by_alias(SERVICE, "champion").version)


@pytest.fixture(scope="module")
def first_release(run):
    result = run()
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return result


@pytest.fixture(scope="module")
def server(home, first_release, cpu_tiny_store):
    with open(home / "serve.log", "w") as log:  # the child keeps its own copy of the descriptor
        process = subprocess.Popen(
            [str(LLMOPS), "serve", "--artifacts", str(cpu_tiny_store)],
            stdout=log,
            stderr=subprocess.STDOUT,
            env=llmops_env(home),
            cwd=ROOT,
            start_new_session=True,
        )
    state = home / "triton" / "server.json"
    deadline = time.monotonic() + 180
    while not state.is_file():
        assert process.poll() is None and time.monotonic() < deadline, (home / "serve.log").read_text()[-3000:]
        time.sleep(0.5)
    yield json.loads(state.read_text())
    os.killpg(process.pid, signal.SIGTERM)
    process.wait(60)
    assert not state.exists()  # serve cleans up after itself


def served_by(home: Path, server: dict):
    """A client of the Triton `llmops serve` runs for `home`, with its model-control key."""
    from tasks.triton import Triton, control_key

    return Triton(
        server["url"], Path(server["repository"]), server["metrics_url"], server["grpc_url"], control_key(home)
    )


def ready_models(triton, expected: list[str], timeout: float = 60) -> list[str]:
    """Triton unloads asynchronously (after requests in flight): poll until the set settles."""
    deadline = time.monotonic() + timeout
    while True:
        names = triton.loaded_models()
        if names == sorted(expected) or time.monotonic() > deadline:
            return names
        time.sleep(0.5)


class Load:
    """A bounded client load on the router: fixed number of requests, stops by itself."""

    def __init__(self, url: str, requests_total: int = 4000, concurrency: int = 3):
        self.url, self.left, self.lock = url, requests_total, threading.Lock()
        self.ok, self.failed, self.errors = 0, 0, []
        self.threads = [threading.Thread(target=self.client) for _ in range(concurrency)]
        self.stop = threading.Event()

    def client(self):
        while not self.stop.is_set():
            with self.lock:
                if self.left == 0:
                    return
                self.left -= 1
            try:
                response = requests.post(
                    f"{self.url}/v2/models/{SERVICE}/generate",
                    timeout=30,
                    json={"text_input": "What is the opposite of hot?", "max_tokens": 4},
                )
                good = response.status_code == 200 and "text_output" in response.json()
            except requests.RequestException as exc:
                good, response = False, exc
            with self.lock:
                self.ok += good
                self.failed += not good
                if not good:
                    self.errors.append(str(getattr(response, "text", response))[:200])
            time.sleep(0.02)

    def __enter__(self):
        for t in self.threads:
            t.start()
        return self

    def __exit__(self, *exc):
        self.stop.set()
        for t in self.threads:
            t.join(60)


def test_first_release_is_gated_and_promoted(home, first_release):
    tags = latest_release(home).data.tags
    assert (tags["gate.decision"], tags["release.outcome"]) == ("promote", "promoted")
    assert champion(home) == "1"
    report = json.loads(Path(first_release.stdout.split("gate report: ")[1].split()[0]).read_text())
    assert report["decision"] == "promote" and report["champion_version"] is None
    run = registry(home).get_run(registry(home).get_model_version(SERVICE, "1").tags["mlflow.run_id"])
    for metric in (
        "benchmark/candidate_c2_latency_p99_ms",
        "benchmark/candidate_c2_ttft_p99_ms",
        "benchmark/candidate_c2_itl_avg_ms",
        "benchmark/candidate_c2_output_tokens_per_s",
        "benchmark/candidate_c2_requests_per_s",
        "gate/passed",
    ):
        assert metric in run.data.metrics, metric
    assert run.data.metrics["benchmark/candidate_c2_request_count"] == 16
    artifacts = {a.path for a in registry(home).list_artifacts(run.info.run_id, "benchmark")}
    assert "benchmark/latency_throughput.png" in artifacts


def test_served_model_answers_generate_and_generate_stream(home, server):
    url = server["url"]
    prompt = {"text_input": "What is the opposite of hot?", "max_tokens": 8, "exclude_input_in_output": True}
    through_router = requests.post(f"{url}/v2/models/{SERVICE}/generate", json=prompt, timeout=30).json()["text_output"]
    direct = requests.post(f"{url}/v2/models/{SERVICE}-v1/generate", json=prompt, timeout=30).json()["text_output"]
    assert through_router == direct == "cold"  # the fine-tuned answer, greedy
    system = json.dumps([{"role": "system", "content": "Answer with one word."}])  # a client's system prompt
    with_system = requests.post(
        f"{url}/v2/models/{SERVICE}/generate", json={**prompt, "chat_history": system}, timeout=30
    )
    assert with_system.status_code == 200 and isinstance(with_system.json()["text_output"], str), with_system.text
    stream = requests.post(
        f"{url}/v2/models/{SERVICE}/generate_stream", json={**prompt, "stream": True}, timeout=30, stream=True
    )
    events = [json.loads(line[5:]) for line in stream.iter_lines() if line.startswith(b"data:")]
    assert "".join(e["text_output"] for e in events) == "cold" and len(events) >= 2


def test_a_model_that_fails_to_load_leaves_the_champion_serving(home, server, tmp_path):
    from tasks.canary import Served, install_model
    from tasks.config import load_profile
    from tasks.errors import CheckFailed

    triton = served_by(home, server)
    broken = Served("999", f"{SERVICE}-v999", tmp_path / "no-model-here")
    with pytest.raises(CheckFailed, match=f"model {SERVICE}-v999 failed to load"):
        install_model(triton, load_profile("cpu-tiny"), broken)
    assert triton.generate(SERVICE, "What is the opposite of hot?", 4) == "cold"
    assert f"{SERVICE}-v999" not in triton.loaded_models()


def test_good_candidate_rolls_out_and_is_promoted_with_no_failed_request(home, server, run):
    with Load(server["url"]) as load:
        result = run("--set", "train.seed=7")
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert latest_release(home).data.tags["release.outcome"] == "promoted"
    new = champion(home)
    assert new != "1"
    for weight in (10, 50, 100):
        assert f"canary: {weight}% to {SERVICE}-v{new}" in result.stdout + result.stderr
    expected = [SERVICE, f"{SERVICE}-v{new}"]
    assert ready_models(served_by(home, server), expected) == sorted(expected)  # old champion unloaded
    assert load.failed == 0, load.errors[:5]
    assert load.ok > 50


def test_bad_candidate_is_rejected_and_rolled_back_while_the_champion_serves(home, server, run):
    before = champion(home)
    with Load(server["url"]) as load:
        result = run("--set", "train.num_train_epochs=1", "--set", "evaluate.min_improvement=0")
    assert result.returncode == 10, result.stdout[-3000:] + result.stderr[-3000:]
    last = result.stderr.strip().splitlines()[-1]
    # The one-epoch candidate's task metric collapses; on 2 shared cores its throughput ratio may fail too.
    assert last.startswith("llmops: rejected: candidate rejected: ") and "task metric drop vs champion" in last
    assert champion(home) == before  # no alias moved
    rejected = registry(home).get_model_version_by_alias(SERVICE, "challenger")
    assert str(rejected.version) != before and rejected.tags["gate.decision"] == "reject"
    expected = [SERVICE, f"{SERVICE}-v{before}"]
    assert ready_models(served_by(home, server), expected) == sorted(expected)  # candidate unloaded
    assert load.failed == 0, load.errors[:5]
    report = result.stdout.split("gate report: ")[1].split()[0]
    gate = llmops(home, "gate", report)
    assert gate.returncode == 10 and "FAIL  task metric drop vs champion" in gate.stdout


def test_canary_breach_rolls_back_automatically_with_no_failed_request(home, server, run):
    """The gate passes (permissive thresholds) but the live check breaches at the first step."""
    before = champion(home)
    with Load(server["url"]) as load:
        result = run(
            "--set",
            "train.num_train_epochs=1",
            "--set",
            "evaluate.min_improvement=0",
            "--set",
            "gate.max_task_metric_drop=1",
            "--set",
            "canary.max_mean_latency_ms=0.001",
        )
    assert result.returncode == 10, result.stdout[-3000:] + result.stderr[-3000:]
    output = result.stdout + result.stderr
    tags = latest_release(home).data.tags
    assert (tags["gate.decision"], tags["release.outcome"]) == ("promote", "rolled_back")
    assert "-> BREACH: candidate mean latency" in output and "canary: 50%" not in output  # stopped at 10%
    assert (
        result.stderr.strip().splitlines()[-1] == "llmops: rejected: candidate rolled back: canary breach (see the log)"
    )
    assert champion(home) == before
    expected = [SERVICE, f"{SERVICE}-v{before}"]
    assert ready_models(served_by(home, server), expected) == sorted(expected)
    assert load.failed == 0, load.errors[:5]


def test_a_candidate_served_with_a_broken_prompt_encoding_fails_parity_and_the_champion_keeps_serving(
    home, server, run
):
    """Offline the candidate is fine (every training stage is a cache hit); its serving config skips the chat
    template, so what clients get differs from what was evaluated: the served scores catch it."""
    before = champion(home)
    with Load(server["url"]) as load:
        result = run("--set", "serve.apply_chat_template=false")
    assert result.returncode == 10, result.stdout[-3000:] + result.stderr[-3000:]
    rejected = registry(home).get_model_version_by_alias(SERVICE, "challenger")
    report = json.loads(Path(result.stdout.split("gate report: ")[1].split()[0]).read_text())
    checks = {c["name"]: c for c in report["checks"]}
    parity = checks["serving parity: exact_match drop served vs offline"]
    assert not parity["passed"] and parity["value"] > 0.2 and parity["samples"] >= 20  # measured: 0.33 of 39
    assert checks["served artifact is the measured artifact"]["passed"]
    assert report["served_artifact"] == report["measured_artifact"] == rejected.tags["artifact.merge.sha256"]
    answers = json.loads(
        (
            Path(report_path := result.stdout.split("gate report: ")[1].split()[0]).parent / "served_answers.json"
        ).read_text()
    )
    assert sum(a["served"] != a["offline"] for a in answers) >= parity["value"] * len(answers), report_path
    assert champion(home) == before and str(rejected.version) != before  # no alias moved
    expected = [SERVICE, f"{SERVICE}-v{before}"]
    assert ready_models(served_by(home, server), expected) == sorted(expected)  # candidate unloaded, champion serving
    assert (
        requests.post(
            f"{server['url']}/v2/models/{SERVICE}/generate",
            timeout=30,
            json={
                "text_input": "What is the opposite of hot?",
                "max_tokens": 8,
                "exclude_input_in_output": True,
            },
        ).json()["text_output"]
        == "cold"
    )
    assert load.failed == 0, load.errors[:5]
