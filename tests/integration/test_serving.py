"""Canary, gate, promotion and rollback on a real Triton (nvidia-pytriton binary) with real genai-perf,
every version served by vLLM's engine (serve.backend vllm, from .venv-vllm) behind the gateway, which routes.

One LLMOPS_HOME for the module: the first run releases v1 (no champion: deployed directly after
the gate, through a temporary gateway of its own), `llmops serve` then keeps the champion served, and later runs
roll candidates out on that service through its control API while a bounded client load runs through its gateway. The Python-backend engine (the
cpu-tiny default) serves in test_release, test_attach, test_service and test_quality_gate.
"""

from __future__ import annotations

import collections
import contextlib
import functools
import json
import os
import re
import signal
import subprocess
import threading
import time
from pathlib import Path

import pytest
import requests

from tasks.runtime.gateway.probes import DEAD_AGAIN_S
from tests.abuse import Probe, leaked, probe, table
from tests.servers import LLMOPS, ROOT, latest_release, llmops, llmops_env, registry, tritons_under

pytestmark = [pytest.mark.integration, pytest.mark.timeout(1200), pytest.mark.usefixtures("shared_prefect")]

SERVICE = "tiny-qwen2-antonyms"
# Lighter load than the profile's defaults: the same code paths in less CI time. No ONNX int8 artifact: on
# CPU the merged model is what serves (the quantize stage has its own tests in test_release.py).
# One benchmark round and no throughput-ratio check: one round has no interval to decide on, and the
# check's verdicts are pinned in tests/unit/test_serving.py; the good candidate's test runs it on rounds.
FAST = [
    *("--set", "bench.concurrency=[2]", "--set", "bench.request_count=16", "--set", "canary.window_s=1.5"),
    *("--set", "bench.rounds=1", "--set", "bench.max_rounds=1", "--set", "gate.min_throughput_ratio=null"),
    *("--set", "quantize.backend=none"),
]


# For `llmops run` and `llmops serve` alike: one vLLM engine of the base model serves every version as its LoRA
# adapter (serve.lora adapter), so no candidate starts a second engine. Merged engines: the second service's test.
ENGINE = ["--set", "serve.backend=vllm", "--set", "serve.lora=adapter"]
MERGED = ["--set", "serve.lora=merged"]
BASE = f"{SERVICE}-base"


def engine_processes(server: dict) -> set[int]:
    """The vLLM engine cores under `llmops serve` (vLLM titles each process VLLM::EngineCore)."""
    import psutil

    found = set()
    for process in psutil.Process(server["serve_pid"]).children(recursive=True):
        try:
            if "EngineCore" in " ".join(process.cmdline()):
                found.add(process.pid)
        except psutil.NoSuchProcess:
            pass
    return found


@pytest.fixture(scope="module")
def home(tmp_path_factory):
    return tmp_path_factory.mktemp("serving-home")


@pytest.fixture(scope="module")
def run(home, cpu_tiny_store):
    """`llmops run ARGS` on this module's home, with the session's shared cpu-tiny artifact store. A test's
    own `--set`s come last, so they win over FAST's (the breach test's 6 s window was cut to FAST's 1.5 s,
    too short for its client to meet the candidate)."""

    def release(*args: str):
        return llmops(home, "run", "--artifacts", str(cpu_tiny_store), *FAST, *ENGINE, *args)

    return release


def champion(home: Path) -> str:
    return str(registry(home).get_model_version_by_alias(SERVICE, "champion").version)


@pytest.fixture(scope="module")
def first_release(run):
    result = run()
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return result


API_KEYS = {"team-a": "key-team-a-0123456789abcdef", "team-b": "key-team-b-0123456789abcdef"}


@pytest.fixture(scope="module")
def tls(tmp_path_factory) -> tuple[Path, Path]:
    """A self-signed certificate for 127.0.0.1, made here; clients trust exactly it."""
    folder = tmp_path_factory.mktemp("tls")
    cert, key = folder / "cert.pem", folder / "key.pem"
    subprocess.run(
        [
            *("openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "2", "-subj", "/CN=localhost"),
            *("-keyout", str(key), "-out", str(cert), "-addext", "subjectAltName=DNS:localhost,IP:127.0.0.1"),
        ],
        check=True,
        capture_output=True,
    )
    return cert, key


def start_serve(
    home: Path,
    store: Path | str,
    tls: tuple[Path, Path],
    log: Path,
    *args: str,
    within: tuple = (),
    env: dict | None = None,
) -> subprocess.Popen:
    """`llmops serve ARGS` on free ports; `within`: the command it runs under (unshare ...), `env`: more variables."""
    keys = home / "api-keys"
    keys.write_text("".join(f"{name}: {key}\n" for name, key in API_KEYS.items()))
    keys.chmod(0o600)
    ports = ["--port", "0", "--control-port", "0", "--triton-http-port", "0", "--triton-grpc-port", "0"]
    ports += ["--metrics-port", "0", "--gateway-metrics-port", "0"]
    with open(log, "w") as out:  # the child keeps its own copy of the descriptor
        return subprocess.Popen(
            [
                *within,
                str(LLMOPS),
                "serve",
                "--artifacts",
                str(store),
                *ports,
                "--tls-cert",
                str(tls[0]),
                "--tls-key",
                str(tls[1]),
                *ENGINE,
                *args,
            ],
            stdout=out,
            stderr=subprocess.STDOUT,
            env={**llmops_env(home), "LLMOPS_API_KEYS_FILE": str(keys), **(env or {})},
            cwd=ROOT,
            start_new_session=True,
        )


def wait_published(home: Path, process: subprocess.Popen, log: Path, timeout: float = 180) -> dict:
    state = home / "triton" / "server.json"
    deadline = time.monotonic() + timeout
    while not state.is_file():
        assert process.poll() is None and time.monotonic() < deadline, log.read_text()[-3000:]
        time.sleep(0.5)
    return json.loads(state.read_text())


@pytest.fixture(scope="module")
def server(home, first_release, cpu_tiny_store, tls):
    process = start_serve(home, cpu_tiny_store, tls, home / "serve.log")
    yield {**wait_published(home, process, home / "serve.log"), "serve_pid": process.pid}
    os.killpg(process.pid, signal.SIGTERM)
    process.wait(60)
    assert not (home / "triton" / "server.json").exists()  # serve cleans up after itself
    assert not (home / "triton" / "control.key").exists()  # the key lived as long as its Triton
    assert not (home / "serving" / "control.key").exists()  # and the serve's own, as long as the serve
    assert json.loads((home / "serving" / f"{SERVICE}.json").read_text())["champion"]  # the record stays


def served_by(home: Path, server: dict):
    """A client of the Triton `llmops serve` runs for `home`, with its model-control key."""
    from tasks.serving.client import Triton, control_key

    return Triton(
        server["url"], Path(server["repository"]), server["metrics_url"], server["grpc_url"], control_key(home)
    )


def routed_by(home: Path, server: dict):
    """A client of the control API of the `llmops serve` that runs for `home`, with the serve's own key."""
    from tasks.serving.service import ServiceControl

    return ServiceControl(server["control_url"], (home / "serving" / "control.key").read_text().strip())


def ready_models(triton, expected: list[str], timeout: float = 60) -> list[str]:
    """Triton unloads asynchronously (after requests in flight): poll until the set settles."""
    deadline = time.monotonic() + timeout
    while True:
        names = triton.loaded_models()
        if names == sorted(expected) or time.monotonic() > deadline:
            return names
        time.sleep(0.5)


LIVE_STATES = ("LOADING", "READY")  # Triton's repository index states of a model being or done loading


class Load:
    """A bounded client load on the service's gateway: 200 requests at a steady 5 per second from 3 clients, about 40
    seconds. It starts when Triton begins loading the candidate next to the champion, the heaviest moment of a
    rollout on a shared machine, and lasts into the gate's benchmark. The weight steps that follow are checked by
    the canary's own probes (every step logs its requests and failures) and, in the breach test, by the openai
    client. Started with the run, it only slowed training and the run's first torch import (52 s once). Paced,
    not a closed loop: 3 clients sending as fast as answers came (about 2000 requests in 30 s) next to genai-perf
    starved the router's Python stub of the 2 cores for over a second once, and Triton then failed 42 requests
    with "Stub process is not healthy" (python_backend fails a request whose message to the stub waits 1 s
    while the stub's health thread has not run). At 15 per second (600 requests) every candidate release here took
    15 to 40 s longer than at 8 (this module: 442 to 470 s, then 373 s), and at 8 the module still took 413 to 424 s
    in CI, for the same proof: no request fails while the candidate loads, is benchmarked and rolls out."""

    def __init__(
        self,
        server: dict,
        triton,
        gateway_tls: tuple[Path, Path],
        requests_total: int = 200,
        concurrency: int = 3,
        per_s: float = 5,
    ):
        """Through the gateway, the service's own clients' way (a shadow window copies what it answers)."""
        self.url, self.left, self.lock = server["gateway_url"], requests_total, threading.Lock()
        self.request = {"verify": str(gateway_tls[0]), "headers": {"Authorization": f"Bearer {API_KEYS['team-b']}"}}
        self.ok, self.failed, self.errors = 0, 0, []
        self.answers: collections.Counter[str] = collections.Counter()  # what the clients got
        self.answered_by: list[tuple[float, str]] = []  # (monotonic time, the version its x-llmops-version named)
        self.interval_s = concurrency / per_s
        self.threads = [threading.Thread(target=self.client) for _ in range(concurrency)]
        self.stop = threading.Event()
        self.triton = triton
        self.served_before = self.versions_loading_or_ready()

    def versions_loading_or_ready(self) -> set[str]:
        index = requests.post(
            f"{self.triton.url}/v2/repository/index", json={}, headers=self.triton.control_headers(), timeout=10
        ).json()
        return {m["name"] for m in index if m["name"].startswith(f"{SERVICE}-v") and m.get("state") in LIVE_STATES}

    def rollout_started(self) -> bool:
        while not self.versions_loading_or_ready() - self.served_before:
            if self.stop.wait(0.2):
                return False
        return True

    def client(self):
        if not self.rollout_started():
            return
        next_at = time.monotonic()
        while not self.stop.wait(max(0.0, next_at - time.monotonic())):
            next_at += self.interval_s
            with self.lock:
                if self.left == 0:
                    return
                self.left -= 1
            try:
                response = requests.post(
                    f"{self.url}/v2/models/{SERVICE}/generate",
                    timeout=30,
                    json={"text_input": "What is the opposite of hot?", "max_tokens": 4},
                    **self.request,
                )
                good = response.status_code == 200 and "text_output" in response.json()
            except requests.RequestException as exc:
                good, response = False, exc
            with self.lock:
                if good:
                    self.answers[response.json()["text_output"]] += 1
                    self.answered_by.append((time.monotonic(), response.headers.get("x-llmops-version", "")))
                self.ok += good
                self.failed += not good
                if not good:
                    self.errors.append(str(getattr(response, "text", response))[:200])

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
    # the table ends with the release report's path (the rejected release's test below opens one in a browser)
    written = next(line for line in first_release.stdout.splitlines() if line.startswith("report "))
    page = Path(written.split()[-1]).read_text()
    assert "PROMOTED" in page and page.count('<section id="') == 10
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
    assert run.data.metrics["canary/candidate_load_s"] > 0  # the adapter model's load, part of what a rollout costs
    output = first_release.stdout + first_release.stderr
    assert f"canary: {BASE} loaded in" in output and f"canary: {SERVICE}-v1 loaded in" in output  # engine, adapter
    table = first_release.stdout.split("MLflow run:")[0].splitlines()
    rows = {line.split()[0]: line.split()[1:] for line in table if line and not line.startswith(("stage", "-"))}
    assert rows["deploy_canary"][:1] == ["ran"] and f"{SERVICE}-v1 next to no champion" in " ".join(
        rows["deploy_canary"]
    )
    assert rows["benchmark"][0] == "ran" and "candidate p99" in " ".join(rows["benchmark"])  # the final table's rows


def test_the_versions_are_adapters_on_one_vllm_engine_of_the_base_model(home, server):
    triton = served_by(home, server)
    base = triton.model_config(BASE)
    assert {"kv_cache_memory_bytes", "max_num_seqs", "enforce_eager"} <= set(base["parameters"])
    assert base["parameters"]["enable_lora"]["string_value"] == "true"
    assert "dynamic_batching" not in base  # vLLM schedules; Triton's batcher stays out of its way
    version = triton.model_config(f"{SERVICE}-v1")["parameters"]
    assert version["base_model"]["string_value"] == BASE
    tags = registry(home).get_model_version(SERVICE, "1").tags
    served = f"{tags['artifact.train.sha256']}@{tags['artifact.base_model.sha256']}"
    assert version["artifact_sha256"]["string_value"] == served  # the adapter on its base, as the gate checks
    assert len(engine_processes(server)) == 1
    # on CPU the model runs in the engine core itself: no worker process polling a queue beside it (its probes
    # every 2 s kept one busy, half a core; tasks/serving/vllm.py)
    import psutil

    processes = psutil.Process(server["serve_pid"]).children(recursive=True)
    assert not [p for p in processes if "VLLM::Worker" in " ".join(p.cmdline())]


def test_served_model_answers_generate_and_generate_stream(home, server, tls):
    """Through the gateway (the service's name, drawn from its table), as the base engine answers with v1's adapter
    named; and the base engine takes an adapter's name only, never its files: a request naming a path is refused,
    and so is a name no version's model registered."""
    gateway, url = server["gateway_url"], server["url"]
    client = {"verify": str(tls[0]), "headers": {"Authorization": f"Bearer {API_KEYS['team-a']}"}, "timeout": 30}
    prompt = {"text_input": "What is the opposite of hot?", "max_tokens": 8, "exclude_input_in_output": True}
    routed = requests.post(f"{gateway}/v2/models/{SERVICE}/generate", json=prompt, **client).json()["text_output"]
    direct = requests.post(
        f"{url}/v2/models/{BASE}/generate", json={**prompt, "lora_name": f"{SERVICE}-v1"}, timeout=30
    )
    assert routed == direct.json()["text_output"] == "cold"  # the fine-tuned answer, greedy
    system = json.dumps([{"role": "system", "content": "Answer with one word."}])  # a client's system prompt
    with_system = requests.post(
        f"{gateway}/v2/models/{SERVICE}/generate", json={**prompt, "chat_history": system}, **client
    )
    assert with_system.status_code == 200 and isinstance(with_system.json()["text_output"], str), with_system.text
    stream = requests.post(
        f"{gateway}/v2/models/{SERVICE}/generate_stream", json={**prompt, "stream": True}, stream=True, **client
    )
    events = [json.loads(line[5:]) for line in stream.iter_lines() if line.startswith(b"data:")]
    assert "".join(e["text_output"] for e in events) == "cold" and len(events) >= 2
    named_path = {**prompt, "lora_name": f"{SERVICE}-v1", "lora_path": "/tmp"}
    refused = requests.post(f"{url}/v2/models/{BASE}/generate", json=named_path, timeout=30)
    assert refused.status_code == 400 and "lora_path" in refused.text, refused.text
    unknown = requests.post(f"{url}/v2/models/{BASE}/generate", json={**prompt, "lora_name": "x-v9"}, timeout=30)
    assert unknown.status_code == 400 and "adapter 'x-v9' is not loaded" in unknown.text, unknown.text


def test_a_model_that_fails_to_load_leaves_the_champion_serving(home, server, tmp_path):
    from tasks.platform.config import load_profile
    from tasks.platform.errors import CheckFailed
    from tasks.serving.models import MergedVersion, install_model

    triton = served_by(home, server)
    broken = MergedVersion(version="999", name=f"{SERVICE}-v999", model_dir=tmp_path / "no-model-here")
    with pytest.raises(CheckFailed, match=f"model {SERVICE}-v999 failed to load"):
        install_model(triton, load_profile("cpu-tiny", ["serve.backend=vllm"]), broken)
    assert routed_by(home, server).generate(SERVICE, "What is the opposite of hot?", 4) == "cold"
    assert f"{SERVICE}-v999" not in triton.loaded_models()


def openai_client(server: dict, tls, key: str = API_KEYS["team-a"]):
    import ssl

    import httpx
    import openai

    trusted = ssl.create_default_context(cafile=str(tls[0]))  # the test's certificate and no other
    return openai.OpenAI(
        base_url=f"{server['gateway_url']}/v1", api_key=key, http_client=httpx.Client(verify=trusted), max_retries=0
    )


QUESTION = [{"role": "user", "content": "What is the opposite of hot?"}]


def test_the_openai_client_gets_the_champions_answer_over_tls_with_its_key(home, server, tls):
    assert server["gateway_url"].startswith("https://127.0.0.1:")
    client = openai_client(server, tls)
    # the service, then its live versions (the gateway's route table): the champion alone here
    assert [m.id for m in client.models.list().data] == [SERVICE, f"{SERVICE}-v{champion(home)}"]

    chat = client.chat.completions.create(model=SERVICE, messages=QUESTION, max_tokens=8)
    assert chat.choices[0].message.content == "cold"  # the fine-tuned answer, as /generate gives it
    assert chat.choices[0].finish_reason == "stop"
    assert chat.usage.prompt_tokens > 0 and chat.usage.completion_tokens >= 1

    chunks = list(client.chat.completions.create(model=SERVICE, messages=QUESTION, max_tokens=8, stream=True))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == "cold"
    assert chunks[-1].choices[0].finish_reason == "stop" and chunks[-1].usage.completion_tokens >= 1

    with_system = client.chat.completions.create(
        model=SERVICE, messages=[{"role": "system", "content": "Answer with one word."}, *QUESTION], max_tokens=8
    )
    assert isinstance(with_system.choices[0].message.content, str)
    stopped = client.chat.completions.create(model=SERVICE, messages=QUESTION, max_tokens=8, stop=["ol"])
    assert stopped.choices[0].message.content == "c" and stopped.choices[0].finish_reason == "stop"
    completion = client.completions.create(model=SERVICE, prompt="What is the opposite of hot?", max_tokens=4)
    assert isinstance(completion.choices[0].text, str) and completion.usage.completion_tokens >= 1
    vllm_keeps_the_openai_fields(client)
    other_team = openai_client(server, tls, API_KEYS["team-b"])  # each client its own key
    assert (
        other_team.chat.completions.create(model=SERVICE, messages=QUESTION, max_tokens=8).choices[0].message.content
        == "cold"
    )


def test_predict_answers_a_dataset_in_input_order_as_the_endpoint_does_and_resumes_without_resending(
    home, server, tls, tmp_path
):
    """`llmops predict` against this module's `llmops serve` (its public /v1, TLS, a client key): a run interrupted
    with Ctrl-C leaves a valid partial output, the rerun answers only the rest (each row written once), the
    malformed line goes to the errors file with its line number, the output follows the input's order, and each
    answer is the one the openai client gets from the endpoint for the same prompt."""
    records = [
        json.loads(line) for line in (ROOT / "profiles" / "data" / "antonyms-eval.jsonl").read_text().splitlines()
    ]
    lines = [json.dumps(r) for r in records[:30]]
    lines.insert(6, '{"instruction": "What is the opposite of up?", "output": ')  # line 7: cut off
    data, out = tmp_path / "tickets.jsonl", tmp_path / "answers.jsonl"
    data.write_text("\n".join(lines) + "\n")
    env = {**llmops_env(home), "OPENAI_API_KEY": API_KEYS["team-b"], "SSL_CERT_FILE": str(tls[0])}
    command = [str(LLMOPS), "predict", "--data", str(data), "--out", str(out), *ENGINE]

    with open(tmp_path / "first.log", "w") as log:  # SIGINT as a terminal's Ctrl-C sends it, even where the
        first = subprocess.Popen(  # tests run in a background job, whose children inherit SIGINT ignored
            [*command, "--concurrency", "1"], stdout=log, stderr=subprocess.STDOUT, env=env, cwd=ROOT,
            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
        )  # fmt: skip
    partial = tmp_path / ".answers.jsonl.partial"
    deadline = time.monotonic() + 120
    while not (partial.is_file() and len(partial.read_text().splitlines()) >= 5):
        assert first.poll() is None and time.monotonic() < deadline, (tmp_path / "first.log").read_text()[-3000:]
        time.sleep(0.05)
    first.send_signal(signal.SIGINT)
    assert first.wait(60) == 130, (tmp_path / "first.log").read_text()[-3000:]
    kept = [json.loads(line) for line in out.read_text().splitlines()]
    assert 5 <= len(kept) < 30 and not partial.exists()

    rerun = subprocess.run(command, capture_output=True, text=True, env=env, cwd=ROOT, timeout=300)
    assert rerun.returncode == 2, rerun.stderr[-3000:]  # the malformed row: bad input, after answering the rest
    assert f"{30 - len(kept)} answered" in rerun.stderr and f"{len(kept)} already in {out}" in rerun.stderr
    assert "rows/s" in rerun.stderr and "1 not answered" in rerun.stderr.splitlines()[-1]
    answers = [json.loads(line) for line in out.read_text().splitlines()]
    expected_ids = [str(n) for n in range(1, 32) if n != 7]  # the input's line numbers, in its order, once each
    assert [a["id"] for a in answers] == expected_ids and answers[: len(kept)] == kept
    (error,) = [json.loads(line) for line in (tmp_path / "answers.errors.jsonl").read_text().splitlines()]
    assert (error["id"], error["line"], error["kind"]) == ("7", 7, "unreadable") and "invalid JSON" in error["error"]
    assert all(a["finish_reason"] in ("stop", "length") and a["tokens"] >= 1 and a["latency_s"] > 0 for a in answers)

    client = openai_client(server, tls, API_KEYS["team-b"])
    for answer, record in zip(answers, records[:30], strict=True):
        prompt = f"{record['instruction']}\n\n{record['input']}" if record["input"] else record["instruction"]
        assert answer["prompt"] == prompt and answer["reference"] == record["output"]
        served = client.chat.completions.create(model=SERVICE, messages=[{"role": "user", "content": prompt}])
        assert answer["answer"] == served.choices[0].message.content, answer


def test_the_predict_flow_scores_an_s3_location_into_an_s3_output_as_the_command_does(home, server, tls, tmp_path):
    """The `predict` deployment's flow (infra/prefect.yaml), run on this module's Prefect server: rows from an S3
    prefix answered by the champion into an S3 object, the same answers `llmops predict` writes; a rerun with every
    row there sends none."""
    from tasks.platform.local_stack import start_s3
    from tests.servers import S3_KEY, S3_SECRET, free_port, s3_env

    records = (ROOT / "profiles" / "data" / "antonyms-eval.jsonl").read_text().splitlines()[:8]
    s3 = start_s3(tmp_path / "s3", free_port(), S3_KEY, S3_SECRET, tmp_path)
    try:
        (tmp_path / "s3" / "datasets" / "score").mkdir(parents=True)
        (tmp_path / "s3" / "datasets" / "score" / "tickets.jsonl").write_text("\n".join(records) + "\n")
        env = {
            **llmops_env(home), **s3_env(s3.url), "OPENAI_API_KEY": API_KEYS["team-a"], "SSL_CERT_FILE": str(tls[0])
        }  # fmt: skip
        flow = (
            "from flows.predict import predict; "
            "print(predict('s3://datasets/score/', 's3://datasets/scored/answers.jsonl', concurrency=4))"
        )
        for _ in range(2):
            ran = subprocess.run(
                [str(LLMOPS.parent / "python"), "-c", flow], capture_output=True, text=True, env=env, cwd=ROOT
            )
            assert ran.returncode == 0, ran.stderr[-3000:]
        assert "predict: 0 answered" in ran.stdout and "8 already in" in ran.stdout
        scored = [json.loads(line) for line in (tmp_path / "s3" / "datasets" / "scored" / "answers.jsonl").open()]
        assert not (tmp_path / "s3" / "datasets" / "scored" / "answers.errors.jsonl").exists()
    finally:
        s3.stop()
    data = tmp_path / "tickets.jsonl"
    data.write_text("\n".join(records) + "\n")
    env = {**llmops_env(home), "OPENAI_API_KEY": API_KEYS["team-a"], "SSL_CERT_FILE": str(tls[0])}
    command = subprocess.run(
        [str(LLMOPS), "predict", "--data", str(data), *ENGINE], capture_output=True, text=True, env=env, cwd=ROOT
    )
    assert command.returncode == 0, command.stderr[-3000:]
    assert scored == [
        json.loads(line) | {"latency_s": scored[i]["latency_s"]}
        for i, line in enumerate((tmp_path / "tickets.answers.jsonl").open())
    ]


def vllm_keeps_the_openai_fields(client) -> None:
    """On vLLM (an adapter on its engine): forced lengths (SamplingParams.min_tokens), logprobs (whole and per
    streamed chunk), a json_schema answer that validates 20 times in 20 (vLLM's structured outputs), and tool calls
    (vllm_answers_tool_calls; the python backend refuses tools: tests/integration/test_service.py)."""
    import jsonschema

    ask = {"model": SERVICE, "messages": QUESTION, "temperature": 0}
    plain = client.chat.completions.create(max_tokens=16, logprobs=True, top_logprobs=2, **ask)
    content = plain.choices[0].logprobs.content
    assert "".join(t.token for t in content) == plain.choices[0].message.content == "cold", plain
    assert all(len(t.top_logprobs) == 2 and t.logprob == t.top_logprobs[0].logprob <= 0 for t in content), content
    forced = client.chat.completions.create(max_tokens=16, logprobs=True, extra_body={"min_tokens": 8}, **ask)
    assert len(forced.choices[0].logprobs.content) >= 8, forced
    to_the_end = client.chat.completions.create(max_tokens=12, logprobs=True, extra_body={"ignore_eos": True}, **ask)
    assert len(to_the_end.choices[0].logprobs.content) == 12 and to_the_end.choices[0].finish_reason == "length"
    chunks = list(client.chat.completions.create(max_tokens=16, logprobs=True, stream=True, **ask))
    streamed = [t.token for c in chunks if c.choices and c.choices[0].logprobs for t in c.choices[0].logprobs.content]
    assert streamed == [t.token for t in content]

    schema = {
        "type": "object",
        "properties": {"answer": {"type": "string", "enum": ["cold", "warm", "hot"]}},
        "required": ["answer"],
        "additionalProperties": False,
    }
    response_format = {"type": "json_schema", "json_schema": {"name": "antonym", "schema": schema}}
    for seed in range(20):  # sampled, so that the tries differ
        shaped = client.chat.completions.create(
            model=SERVICE, messages=QUESTION, max_tokens=32, temperature=1.0, seed=seed, response_format=response_format
        )
        jsonschema.validate(json.loads(shaped.choices[0].message.content), schema)
    vllm_answers_tool_calls(client, ask)

    # completions: the prompt raw, echoed and scored token by token (vLLM's prompt_logprobs), the first with none, as
    # lm-evaluation-harness's loglikelihood reads it (token_logprobs[ctxlen:-1]; tests/harness.py, on the python backend)
    prompt = "What is the opposite of hot? cold"
    echoed = client.completions.create(model=SERVICE, prompt=prompt, max_tokens=1, logprobs=1, echo=True, temperature=0)
    scored = echoed.choices[0].logprobs
    assert echoed.choices[0].text.startswith(prompt) and "".join(scored.tokens).startswith(prompt), echoed
    assert scored.token_logprobs[0] is None and scored.top_logprobs[0] is None, scored
    assert len(scored.tokens) == echoed.usage.prompt_tokens + 1  # every prompt token, then the one made
    assert all(lp <= 0 for lp in scored.token_logprobs[1:]) and all(len(t) >= 1 for t in scored.top_logprobs[1:])


OPPOSITE = {
    "type": "function",
    "function": {
        "name": "opposite",
        "description": "Look up the opposite of a word.",
        "parameters": {
            "type": "object",
            "properties": {"word": {"type": "string", "enum": ["cold", "warm", "hot"]}},
            "required": ["word"],
            "additionalProperties": False,
        },
    },
}
SPELL = {
    "type": "function",
    "function": {
        "name": "spell",
        "parameters": {
            "type": "object",
            "properties": {"letters": {"type": "integer", "minimum": 1, "maximum": 9}},
            "required": ["letters"],
            "additionalProperties": False,
        },
    },
}


def vllm_answers_tool_calls(client, ask: dict) -> None:
    """Through the openai SDK, a named tool_choice and "required" each answer parsed tool calls whose arguments
    validate against their tool's parameters (guided decoding), whole and streamed (the deltas gathered by the SDK's
    own accumulator); tool_choice auto on cpu-tiny's template, which renders no tools, is a 400 naming tools."""
    import jsonschema
    import openai
    from openai.lib.streaming.chat import ChatCompletionStreamState

    tools = [OPPOSITE, SPELL]
    parameters = {t["function"]["name"]: t["function"]["parameters"] for t in tools}
    named = {"type": "function", "function": {"name": "opposite"}}
    asks = [
        ({"tool_choice": named}, "stop"),  # as vLLM's server ends a named call
        ({"tool_choice": "required", "parallel_tool_calls": False}, "tool_calls"),
        ({"tool_choice": "required"}, "tool_calls"),
    ]
    for choice, finish in asks:
        whole = client.chat.completions.create(tools=tools, max_tokens=96, **choice, **ask)
        state = ChatCompletionStreamState(input_tools=tools)
        for chunk in client.chat.completions.create(tools=tools, max_tokens=96, stream=True, **choice, **ask):
            state.handle_chunk(chunk)
        for answer in (whole, state.get_final_completion()):
            assert answer.choices[0].finish_reason == finish, (choice, answer)
            calls = answer.choices[0].message.tool_calls
            assert calls and (len(calls) == 1 or choice.get("parallel_tool_calls") is not False), (choice, answer)
            for call in calls:
                assert call.type == "function" and call.id.startswith("call_")
                if choice["tool_choice"] == named:
                    assert call.function.name == "opposite"
                jsonschema.validate(json.loads(call.function.arguments), parameters[call.function.name])
        assert [c.function.arguments for c in whole.choices[0].message.tool_calls] == [
            c.function.arguments for c in state.get_final_completion().choices[0].message.tool_calls
        ]  # greedy: the same calls, streamed or not
    with pytest.raises(openai.BadRequestError) as refused:
        client.chat.completions.create(max_tokens=4, tools=tools, **ask)  # tool_choice auto, the default
    assert refused.value.param == "tools" and "does not render tools" in refused.value.message


def curl(server: dict, tls, path: str, *args: str) -> tuple[int, dict | str]:
    """curl against the gateway, trusting the test's certificate; (status, JSON body or text)."""
    result = subprocess.run(
        [
            "curl",
            "-sS",
            "--cacert",
            str(tls[0]),
            "-o",
            "-",
            "-w",
            "\n%{http_code}",
            *args,
            f"{server['gateway_url']}{path}",
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    body, _, status = result.stdout.rpartition("\n")
    try:
        return int(status), json.loads(body)
    except ValueError:
        return int(status or 0), body + result.stderr


def test_the_gateway_refuses_bad_requests_in_each_apis_own_shape(server, tls, tmp_path):
    chat = "/v1/chat/completions"
    as_json = ["-H", "Content-Type: application/json"]
    key = ["-H", f"Authorization: Bearer {API_KEYS['team-a']}"]
    question = json.dumps({"messages": QUESTION, "max_tokens": 8})

    assert curl(server, tls, "/health/ready")[0] == 200  # probes need no key
    status, body = curl(server, tls, chat, *as_json, "-d", question)
    assert status == 401 and body["error"]["type"] == "authentication_error", body
    status, body = curl(server, tls, chat, *as_json, "-H", "Authorization: Bearer not-a-key", "-d", question)
    assert status == 401 and body["error"]["code"] == "invalid_api_key", body
    status, body = curl(server, tls, chat, *as_json, *key, "-d", question)
    assert status == 200 and body["choices"][0]["message"]["content"] == "cold", body

    too_many = json.dumps({"messages": QUESTION, "max_tokens": 100000})
    status, body = curl(server, tls, chat, *as_json, *key, "-d", too_many)
    assert status == 400 and body["error"]["code"] == "context_length_exceeded", body
    assert body["error"]["param"] == "max_tokens" and "512" in body["error"]["message"]
    # Under the context alone, not with the prompt: the model itself refuses, and says how many fit.
    status, body = curl(server, tls, chat, *as_json, *key, "-d", json.dumps({"messages": QUESTION, "max_tokens": 510}))
    assert status == 400 and "exceed the model's context of 512 tokens" in body["error"]["message"], body

    big = tmp_path / "big.json"
    big.write_text(json.dumps({"messages": [{"role": "user", "content": "x" * (2 << 20)}]}))
    status, body = curl(server, tls, chat, *as_json, *key, "--data-binary", f"@{big}")
    assert status == 413 and "over the limit" in body["error"]["message"], body
    # A form-encoded body of 4 MiB crashes Triton 2.51 (server#5840): it never reaches it.
    status, body = curl(server, tls, chat, *key, "--data-binary", f"@{big}")
    assert status == 415, body

    generate = f"/v2/models/{SERVICE}/generate"
    prompt = json.dumps(
        {"text_input": "What is the opposite of hot?", "max_tokens": 8, "exclude_input_in_output": True}
    )
    status, body = curl(server, tls, generate, *as_json, "-d", prompt)
    assert status == 401 and isinstance(body["error"], str), body  # Triton's shape on /v2
    status, body = curl(server, tls, generate, *as_json, *key, "-d", prompt)
    assert status == 200 and body["text_output"] == "cold", body
    plain = subprocess.run(
        ["curl", "-sS", server["gateway_url"].replace("https://", "http://") + "/health/live"],
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert plain.returncode != 0 or "200" not in plain.stdout  # no plain HTTP on the TLS port


def test_abuse_gets_an_answer_in_each_apis_shape_and_metrics_count_it_per_client(server, tls):
    """The abuse probe (tests/abuse.py, issue 22's suite, issue 61's token forms and issue 73's control routes: 50 cases) against the running gateway, each answered in its
    API's shape with the service ready after it and no key in any answer; rate limits are in the unit tests."""
    target = Probe(server["gateway_url"], SERVICE, API_KEYS["team-a"], str(tls[0]), list(API_KEYS.values()))
    results = probe(target)
    print(table(results))
    assert all(result.ok for result in results), table(results)
    assert not leaked(target, results)
    key = ["-H", f"Authorization: Bearer {API_KEYS['team-a']}"]
    answer, _ = curl(server, tls, "/metrics", *key)  # not on the clients' port, not even with a key: it names clients
    assert answer == 404
    assert server["gateway_metrics_url"].startswith("http://127.0.0.1:")  # its own listener, loopback
    metrics = requests.get(f"{server['gateway_metrics_url']}/metrics", timeout=10).text  # no key needed, none shown
    assert 'llmops_gateway_requests_total{client="team-a"' in metrics, metrics
    assert all(secret not in metrics for secret in API_KEYS.values())


class ThroughTheGateway:
    """Clients of the gateway's two APIs, one request each every 0.2 s, keeping every status and body: what
    they meet while Triton is killed and restarted (issue 22: only answers or 503s in the API's shape)."""

    def __init__(self, server: dict, tls):
        self.server, self.tls, self.stop = server, tls, threading.Event()
        self.seen: list[tuple[str, int, object]] = []
        self.threads = [threading.Thread(target=self.client, args=(path,)) for path in self.bodies]

    bodies = {
        f"/v2/models/{SERVICE}/generate": {"text_input": "What is the opposite of hot?", "max_tokens": 4},
        "/v1/chat/completions": {"model": SERVICE, "messages": QUESTION, "max_tokens": 4},
    }

    def client(self, path: str):
        while not self.stop.wait(0.2):
            try:
                response = requests.post(
                    f"{self.server['gateway_url']}{path}",
                    json=self.bodies[path],
                    headers={"Authorization": f"Bearer {API_KEYS['team-b']}"},
                    verify=str(self.tls[0]),
                    timeout=30,
                )
                body = response.json() if "json" in response.headers.get("content-type", "") else response.text
                self.seen.append((path, response.status_code, body))
            except requests.RequestException as exc:
                self.seen.append((path, 0, str(exc)))

    def __enter__(self):
        for thread in self.threads:
            thread.start()
        return self

    def __exit__(self, *exc):
        self.stop.set()
        for thread in self.threads:
            thread.join(60)


def in_the_apis_shape(path: str, body) -> bool:
    if path.startswith("/v1/"):
        return isinstance(body, dict) and set(body.get("error", {})) == {"message", "type", "param", "code"}
    return isinstance(body, dict) and isinstance(body.get("error"), str)


def status_of(process) -> str | None:
    """The process's status (psutil's), None once it is gone."""
    import psutil

    try:
        return process.status()
    except psutil.NoSuchProcess:
        return None


def test_triton_killed_under_load_gives_clients_only_503s_until_it_is_restarted_with_the_champion(home, server, tls):
    import psutil

    from tasks.serving.publication import published_service

    tritons = tritons_under(server["serve_pid"])
    assert len(tritons) == 1
    engines = [p for p in tritons[0].children(recursive=True) if " ".join(p.cmdline()).startswith("VLLM::EngineCore")]
    assert engines, "no vLLM engine process under the serving Triton"
    stubs = tritons[0].children()  # the model processes
    with ThroughTheGateway(server, tls) as clients:
        time.sleep(1)  # answered before the kill
        tritons[0].kill()
        deadline = time.monotonic() + 180
        found_while_restarting = []  # what a release started now would attach to (open_service asks this first)
        while "Triton restarted" not in (home / "serve.log").read_text():
            assert time.monotonic() < deadline, (home / "serve.log").read_text()[-3000:]
            found_while_restarting.append(published_service(home, SERVICE) is not None)
            time.sleep(0.5)
        time.sleep(1)  # answered again after the restart
    # issue 73: a release started during the restart rolls out on the serve, never on a second service of its own
    assert found_while_restarting and all(found_while_restarting), found_while_restarting
    statuses = collections.Counter(status for _, status, _ in clients.seen)
    print("while Triton was killed and restarted:", dict(statuses))
    assert set(statuses) <= {200, 503} and statuses[503] > 0, statuses
    assert all(in_the_apis_shape(path, body) for path, status, body in clients.seen if status == 503)
    assert [status for _, status, _ in clients.seen[-2:]] == [200, 200] and clients.seen[0][1] == 200
    assert curl(server, tls, "/health/ready")[0] == 200
    # vLLM's engine core is the Triton stub's child: the model's watcher kills it, and the vLLM stub, once its Triton is
    # gone (that stub was seen stuck in its own exit, 1 run in 2, before its watcher killed it too); the other stubs
    # end with their Triton. Killed, a process may stay a zombie (no memory, a pid) until its parent reaps it
    _, alive = psutil.wait_procs([*engines, *stubs], timeout=30)
    running = [p for p in alive if status_of(p) not in (psutil.STATUS_ZOMBIE, None)]
    assert not running, f"{running[0].name()} {running[0].pid} outlived its Triton ({status_of(running[0])})"
    assert routed_by(home, server).generate(SERVICE, "What is the opposite of hot?", 4) == "cold"  # same ports
    assert (
        openai_client(server, tls)
        .chat.completions.create(model=SERVICE, messages=QUESTION, max_tokens=8)
        .choices[0]
        .message.content
        == "cold"
    )


def second_service(home: Path, store: Path, tls, folder: Path, *args: str) -> tuple[subprocess.Popen, list]:
    """Another `llmops serve` of the same champion (a copy of the registry, its own home and ports),
    published; with its tritonserver process."""
    import shutil

    other = folder / "home"
    other.mkdir()
    shutil.copy2(home / "mlflow.db", other / "mlflow.db")
    process = start_serve(other, store, tls, folder / "serve.log", *args)
    try:
        # room for one start of Triton again after a load past serve.load_timeout_s (90 s): seen on a slow machine
        wait_published(other, process, folder / "serve.log", timeout=300)
        tritons = tritons_under(process.pid)
        assert len(tritons) == 1
    except BaseException:  # not left serving (and loading engines) beside the rest of the suite
        os.killpg(process.pid, signal.SIGTERM)
        process.wait(60)
        raise
    return process, tritons


def test_a_hung_champion_load_starts_triton_again_and_serve_exits_4_when_triton_keeps_dying(
    home, server, cpu_tiny_store, tls, tmp_path
):
    """The champion's load hangs (the model processes of the first Triton SIGSTOPped as they start: Triton 2.51 waits
    for them without a deadline): past serve.load_timeout_s, `llmops serve` kills that Triton with them, starts it
    again and serves. Killed again within a minute of that start, it is past serve.listen.restart_limit (1): exit 4,
    with one line."""
    import shutil
    import threading

    import psutil

    other = tmp_path / "home"
    other.mkdir()
    shutil.copy2(home / "mlflow.db", other / "mlflow.db")
    log = tmp_path / "serve.log"
    # a Python-backend load took up to 21 s under the suite's load: the timeout must let the second Triton's load through
    limits = ("--set", "serve.listen.restart_limit=1", "--set", "serve.load_timeout_s=40")
    process = start_serve(other, cpu_tiny_store, tls, log, *limits, "--set", "serve.backend=python", *MERGED)
    stopped: list[psutil.Process] = []
    done = threading.Event()

    def stop_the_first_tritons_models() -> None:
        first = None
        while not done.wait(0.1):
            tritons = tritons_under(process.pid)
            first = first or (tritons[0] if tritons else None)
            for stub in first.children() if first is not None and first.is_running() else []:
                if stub not in stopped:
                    stub.suspend()
                    stopped.append(stub)

    watcher = threading.Thread(target=stop_the_first_tritons_models, daemon=True)
    watcher.start()
    try:
        wait_published(other, process, log)
        done.set()
        watcher.join()
        lines = log.read_text()
        assert (
            stopped and "did not load within 40s (serve.load_timeout_s); starting that Triton again (1 of 1)" in lines
        )
        assert not [p for p in stopped if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]  # killed with it
        (triton,) = tritons_under(process.pid)
        triton.kill()
        assert process.wait(60) == 4
    finally:
        done.set()
        if process.poll() is None:  # a failed check leaves no service behind (its Triton dies with it)
            process.kill()
    last = log.read_text().strip().splitlines()[-1]
    assert last.startswith("llmops: error: Triton died 2 times in a row (serve.listen.restart_limit 1)"), last


@pytest.fixture(scope="module")
def prometheus(server, tls, tmp_path_factory):
    """A real Prometheus (Debian's) with the shipped config and alert rules, scraping the serving Triton and the
    gateway (over its TLS, trusting the test's certificate) every second (the shipped 5 s is too slow for this
    module's 1.5 s canary windows)."""
    import yaml

    from tasks.platform.ports import free_port

    folder = tmp_path_factory.mktemp("prometheus")
    config = yaml.safe_load((ROOT / "infra" / "monitoring" / "prometheus.yml").read_text())
    config["global"].update(scrape_interval="1s", evaluation_interval="1s")
    config["rule_files"] = [str(ROOT / "infra" / "monitoring" / "alerts.yml")]
    config["scrape_configs"][0]["static_configs"][0]["targets"] = [server["metrics_url"].split("/")[2]]
    (gateway,) = [job for job in config["scrape_configs"] if job["job_name"] == "llmops-gateway"]
    gateway["static_configs"][0]["targets"] = [server["gateway_metrics_url"].split("/")[2]]  # its metrics listener
    (folder / "prometheus.yml").write_text(yaml.safe_dump(config))
    url = f"http://127.0.0.1:{free_port()}"
    with open(folder / "prometheus.log", "w") as log:
        process = subprocess.Popen(
            [
                "/usr/bin/prometheus",
                f"--config.file={folder / 'prometheus.yml'}",
                f"--storage.tsdb.path={folder / 'data'}",
                f"--web.listen-address={url.split('//')[1]}",
            ],
            stdout=log,
            stderr=subprocess.STDOUT,
        )
    try:
        deadline = time.monotonic() + 60
        while not (scraped(url, "triton") and scraped(url, "llmops-gateway")):
            assert process.poll() is None and time.monotonic() < deadline, (folder / "prometheus.log").read_text()[
                -2000:
            ]
            time.sleep(0.5)
        yield url
    finally:
        process.terminate()
        process.wait(30)


def scraped(url: str, job: str) -> bool:
    try:
        result = requests.get(f"{url}/api/v1/query", params={"query": f'up{{job="{job}"}}'}, timeout=5).json()
    except (requests.RequestException, ValueError):
        return False
    return bool(result.get("data", {}).get("result")) and result["data"]["result"][0]["value"][1] == "1"


def test_good_candidate_measured_by_aiperf_rolls_out_and_is_promoted_with_no_failed_request(
    home, server, run, prometheus, tls
):
    """AIPerf measures (bench.tool aiperf: 3 profile runs per model, goodput under the gate's TTFT objective), and the
    gate decides on the runs' intervals; the canary's live checks come from Prometheus (`canary.prometheus_url`,
    scraping the gateway's per-version counters), as in production. Each weight step takes effect through the
    control API, without a model load."""
    before, engines = champion(home), engine_processes(server)
    with Load(server, served_by(home, server), tls) as load:
        # the same weights under a new profile digest: a new version, and no training in this test's time
        result = run(
            *("--set", "canary.probe_concurrency=3", "--set", f"canary.prometheus_url={prometheus}"),
            *("--set", "gate.min_throughput_ratio=0.2", "--set", "bench.tool=aiperf"),
            *("--set", "gate.min_goodput_ratio=0.2"),
            # 16 requests at concurrency 2 is half a second of load: one stall of the 2 shared cores (the client load
            # runs beside it) makes a run's p99 and rate an outlier, and 3 pairs cannot tell. 48 per run, and a
            # second round of 3 pairs when the first straddles the threshold, as bench.max_rounds allows in profiles.
            *("--set", "bench.request_count=48", "--set", "bench.max_rounds=2"),
        )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    release_run = latest_release(home)
    assert release_run.data.tags["release.outcome"] == "promoted"
    assert release_run.data.tags["bench.tool"] == "aiperf"
    new = champion(home)
    assert new != "1"
    output = result.stdout + result.stderr
    old, candidate = f"{SERVICE}-v{before}", f"{SERVICE}-v{new}"
    # A round is three pairs of single AIPerf runs, the first of each pair alternating
    pairs = re.findall(r"benchmark: round (\d) run (\d)/3 at concurrency 2: (\S+), then (\S+) \(aiperf", output)
    assert pairs[:3] == [("1", "1", old, candidate), ("1", "2", candidate, old), ("1", "3", old, candidate)]
    assert pairs[3:] in ([], [("2", "1", candidate, old), ("2", "2", old, candidate), ("2", "3", candidate, old)])
    # AIPerf's own files: one export per run, each with its goodput under the TTFT objective
    work = home / "work" / "benchmark" / release_run.info.run_id
    for model in (old, candidate):
        runs = sorted(work.glob(f"{model}-c2-round1-run[123]/profile_export_aiperf.json"))
        assert len(runs) == 3, sorted(work.iterdir())
        assert all(json.loads(path.read_text())["goodput"]["avg"] > 0 for path in runs)
    assert release_run.data.metrics["benchmark/candidate_goodput_per_s"] > 0
    # Every check on the runs says its interval and sample size: one sample per pair of runs, one per candidate run
    report = json.loads(Path(output.split("gate report: ")[1].split()[0]).read_text())
    checks = {c["name"]: c for c in report["checks"]}
    for name in ("throughput ratio vs champion", "goodput ratio vs champion", "p99 time to first token (ms)"):
        assert checks[name]["passed"] and checks[name]["samples"] == len(pairs), checks[name]
        low, high = checks[name]["interval"]
        assert low <= checks[name]["value"] <= high
    assert checks["throughput ratio vs champion"]["interval"][0] >= 0.2
    # the service walked the rollout, pausing after each window for the release's own analysis on Prometheus
    rollout = json.loads((home / "serving" / f"{SERVICE}.json").read_text())["rollout"]
    assert (rollout["phase"], rollout["await_decision"]) == ("promoted", True), rollout
    assert [w["weight"] for w in rollout["windows"]] == [10, 50, 100] and all(w["requests"] for w in rollout["windows"])
    for weight in (10, 50, 100):
        step = next(line for line in output.splitlines() if f"canary: {weight}% to {SERVICE}-v{new}" in line)
        assert step.rstrip().endswith("(checked on Prometheus too)"), step
        assert " 0 requests mean" not in step  # Prometheus saw the candidate's requests
        in_effect_ms = float(re.search(r"\(in effect in (\d+) ms\)", step).group(1))
        # a table swapped in the gateway, no model loaded again (a router reload took 1.2 to 1.3 s): the control call's
        # round trip, 12 ms on an idle machine, 124 ms once on these 2 cores at a load of 9 (tests/unit/test_routes.py
        # holds it under 50 ms in-process)
        assert in_effect_ms < 1000, step
    # The candidate was an adapter on the one engine: loaded in about a second, and no engine process started
    assert f"canary: {SERVICE}-v{new} loaded in" in output and f"(adapter on {BASE})" in output
    expected = [BASE, f"{SERVICE}-v{new}"]
    assert ready_models(served_by(home, server), expected) == sorted(expected)  # old champion unloaded
    assert engine_processes(server) == engines
    assert load.failed == 0, load.errors[:5]
    assert load.ok > 50
    # A PromQL query returns the served versions side by side, as the Grafana dashboard shows them (the gateway's
    # counters: on Triton, every adapter version is the base engine's requests).
    series = requests.get(
        f"{prometheus}/api/v1/query",
        params={"query": 'sum by (version) (increase(llmops_gateway_version_requests_total{outcome="ok"}[10m]))'},
        timeout=10,
    ).json()["data"]["result"]
    served = {s["metric"]["version"]: float(s["value"][1]) for s in series}
    assert served.get(f"{SERVICE}-v{new}", 0) > 0 and served.get(f"{SERVICE}-v1", 0) > 0, served
    p99 = requests.get(
        f"{prometheus}/api/v1/query",
        params={"query": f'nv_inference_request_summary_us{{model="{BASE}",quantile="0.99"}}'},
        timeout=10,
    ).json()["data"]["result"]
    assert p99, "Triton exports no latency summaries (--metrics-config summary_latencies=true)"


def test_the_scaled_objects_queries_give_keda_one_number_from_prometheus_scraping_the_service(server, tls, prometheus):
    """What `llmops profiles autoscaler` renders for this service, on each signal, asked of a real Prometheus that
    scraped the gateway and Triton while 2 clients sent requests: KEDA's Prometheus scaler takes a result of one
    series, or none (`ignoreNullValues`: 0), and refuses several (prometheus_scaler.go L264-305)."""
    from tasks.platform.config import load_profile
    from tasks.serving.kubernetes import scaled_object

    with ClosedLoop(server["gateway_url"], tls, clients=2) as load:
        time.sleep(6)  # scraped every second: first tokens inside the queries' 20 s windows
    assert load.failed == 0 and load.ok > 0
    values = {}
    for kind, extra in (("in_flight", []), ("ttft_p90", []), ("queue_ms", ["serve.autoscale.target=50"])):
        profile = load_profile("cpu-tiny", [f"serve.autoscale.signal={kind}", *extra])
        for trigger in scaled_object(profile, prometheus)["spec"]["triggers"]:
            metadata = trigger["metadata"]
            answer = requests.get(f"{metadata['serverAddress']}/api/v1/query", params={"query": metadata["query"]})
            body = answer.json()
            assert answer.ok and body["status"] == "success", (metadata["query"], body)
            assert len(body["data"]["result"]) <= 1, body["data"]["result"]
            values[kind] = [float(series["value"][1]) for series in body["data"]["result"]]
    assert len(values["in_flight"]) == 1 and values["in_flight"][0] >= 0  # the gateway's gauge, scraped
    assert len(values["ttft_p90"]) == 1 and values["ttft_p90"][0] > 0, values  # the module's requests' first tokens


def test_a_release_stopped_at_its_10_percent_step_loses_its_live_share_within_its_lease_then_is_fenced_off(
    home, server, cpu_tiny_store, tls, tmp_path
):
    """Issue 60, findings 1 and 3, and issue 73's liveness lease. Release A is SIGSTOPped (all its processes) with its
    candidate at its 10% step, answering live clients: from the serve's side, as good as dead. Its ownership and its
    hold on the routes lapse within the default canary.lease_s (15 s; 600 s before, when a candidate kept 25 requests
    a second for minutes), the gateway routes the champion alone, and no client gets an answer from the candidate
    (each answer's x-llmops-version says who answered) a second past the lease; within one reconcile round more
    `llmops serve`'s reconciler unloads A's candidate (an adapter holding one of the engine's serve.vllm.max_loras 2
    slots) and counts it on /metrics. Release B (this test, through the release's own client) takes the service over
    with the next epoch and routes it. A, resumed, is refused at its next write: it ends with exit 6 and one line
    naming B, and B's routes and ownership are untouched. Clients at concurrency 8 see only 200s throughout. A's
    stages are cache hits (a new profile digest)."""
    from tasks.platform.config import load_profile
    from tasks.serving.ownership import Ownership

    lease_s = load_profile("cpu-tiny").canary.lease_s
    before, triton, control = champion(home), served_by(home, server), routed_by(home, server)
    held = triton.loaded_models()
    at_ten = ("--set", "canary.steps=[10,100]", "--set", "canary.window_s=40")  # held at 10% past the lease
    command = [str(LLMOPS), "run", "--artifacts", str(cpu_tiny_store), *FAST, *ENGINE, *at_ten]
    output = tmp_path / "release-a.log"
    with open(output, "w") as log:
        release = subprocess.Popen(
            command, env=llmops_env(home), cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
        )
    second = None
    try:
        with Load(server, triton, tls, requests_total=100_000, concurrency=8, per_s=8) as load:
            deadline = time.monotonic() + 400
            while not ((table := control.table()).candidate and table.weights.get(table.candidate.name)):
                assert release.poll() is None and time.monotonic() < deadline, output.read_text()[-3000:]
                time.sleep(0.2)
            candidate, first_epoch = table.candidate.name, table.owner.epoch
            assert table.weights[candidate] == 10 and candidate in triton.loaded_models()
            while not any(version == candidate for _, version in list(load.answered_by)):  # live: it answers clients
                assert time.monotonic() < deadline, "the candidate at 10% answered no client"
                time.sleep(0.1)
            os.killpg(release.pid, signal.SIGSTOP)
            stopped_at = time.monotonic()
            while control.table().candidate is not None:
                assert time.monotonic() - stopped_at < lease_s + 5, control.table()
                time.sleep(0.1)
            unrouted_s = time.monotonic() - stopped_at
            settled = ready_models(triton, held, timeout=lease_s + 30)
            unloaded_s = time.monotonic() - stopped_at
            assert settled == held, f"{candidate} still loaded {unloaded_s:.0f}s after A stopped: {settled}"
            table = control.table()
            assert table.candidate is None and table.weights == {table.champion.name: 100.0}
            second = Ownership(routed_by(home, server), SERVICE, "release-b", lease_s=120)
            second.take(timeout_s=5)
            assert second.epoch == first_epoch + 1
            routes = second.control.set_weights({table.champion.name: 100.0}, "release-b", 120)
            os.killpg(release.pid, signal.SIGCONT)
            code = release.wait(300)
            after = control.table()
            answered = list(load.answered_by)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(release.pid, signal.SIGKILL)
        release.wait(30)
        if second is not None:
            second.give_up()
    lines = output.read_text().strip().splitlines()
    assert code == 6, lines[-20:]
    assert lines[-1].startswith("llmops: error: ") and "release-b" in lines[-1], lines[-1]
    assert (after.release, after.updated_at, after.weights) == ("release-b", routes.updated_at, routes.weights)
    assert (after.owner.release, after.owner.epoch) == ("release-b", second.epoch) and champion(home) == before
    metrics = requests.get(f"{server['gateway_metrics_url']}/metrics", timeout=10).text
    assert f'llmops_serve_reconcile_actions_total{{action="unload",model="{candidate}"}} 1.0' in metrics
    assert load.failed == 0 and load.ok > 50, (load.ok, load.errors[:5])
    by_candidate = [at - stopped_at for at, version in answered if version == candidate]
    assert by_candidate and min(by_candidate) < 0, "the candidate answered no client at its 10% step"
    late = [round(t, 1) for t in by_candidate if t > lease_s + 1]
    assert not late and unrouted_s <= lease_s + 1, (late, unrouted_s)
    assert {version for _, version in answered} <= {candidate, f"{SERVICE}-v{before}"}
    print(
        f"\n{candidate} at 10%: {sum(t > 0 for t in by_candidate)} answers after its release stopped, none past "
        f"{max([0, *by_candidate]):.1f}s; out of the routes {unrouted_s:.1f}s and unloaded {unloaded_s:.1f}s after "
        f"(lease {lease_s:g}s); {load.ok} requests, none failed"
    )


def test_a_candidate_whose_load_hangs_on_the_last_replica_is_abandoned_while_the_champion_serves_throughout(
    home, server, cpu_tiny_store, tls, tmp_path
):
    """Issue 60, finding 2: the candidate's model process is SIGSTOPped as it starts, on the serve's one replica, so
    its load hangs (Triton 2.51 waits for it without a deadline). The serve loads it, takes it for hung past the
    release's serve.load_timeout_s (its load request carries it), and never restarts the Triton serving the champion
    for a candidate: it ends the candidate's model processes and the load is abandoned. The release ends with one line (exit 3), unretried; clients at concurrency 8
    get only 200s (the load went over gRPC: over HTTP it held the gateway's pooled connection to Triton, and one
    client request in 4 of 6 runs got no answer; tasks/serving/grpc_loads.py); the champion's engine is the one it
    was. A new profile digest: stages are cache hits."""
    import psutil

    before, triton, engines = champion(home), served_by(home, server), engine_processes(server)
    held, decided = triton.loaded_models(), "(serve.load_timeout_s); deciding what becomes of the load"
    decided_before = (home / "serve.log").read_text().count(decided)

    def stubs() -> dict[int, str]:
        found = {}
        for process in psutil.Process(server["serve_pid"]).children(recursive=True):
            with contextlib.suppress(psutil.NoSuchProcess):
                arguments = process.cmdline()
                if arguments and "triton_python_backend_stub" in arguments[0]:  # MODEL_PY SHM ... INSTANCE DEFAULT
                    found[process.pid] = arguments[-2]
        return found

    serving_stubs, stopped, done = stubs(), [], threading.Event()

    def stop_the_candidates_model_processes() -> None:
        while not done.wait(0.05):
            for pid, instance in stubs().items():
                if pid not in serving_stubs and pid not in stopped and instance.startswith(f"{SERVICE}-v"):
                    with contextlib.suppress(psutil.NoSuchProcess):
                        psutil.Process(pid).suspend()
                        stopped.append(pid)

    watcher = threading.Thread(target=stop_the_candidates_model_processes, daemon=True)
    watcher.start()
    try:
        with Load(server, triton, tls, requests_total=100_000, concurrency=8, per_s=8) as load:
            hung = ("--set", "serve.load_timeout_s=15")
            result = llmops(home, "run", "--artifacts", str(cpu_tiny_store), *FAST, *ENGINE, *hung, timeout=600)
    finally:
        done.set()
        watcher.join()
    lines = (result.stdout + result.stderr).strip().splitlines()
    assert result.returncode == 3, lines[-30:]
    assert lines[-1].startswith("llmops: error: canary: ") and lines[-1].endswith(
        "the load abandoned; the champion served throughout"
    ), lines[-1]
    served = (home / "serve.log").read_text()  # the serve loads the candidate and decides: no second try
    assert served.count(decided) == decided_before + 1
    assert stopped and not [p for p in stopped if psutil.pid_exists(p) and psutil.Process(p).status() != "zombie"]
    assert "its model processes ended" in served
    assert triton.loaded_models() == held and champion(home) == before and engine_processes(server) == engines
    assert load.ok > 50 and load.failed == 0, (load.ok, load.errors[:5])
    print(f"\nthe hung candidate was abandoned; {load.ok} client requests, none failed")


# A candidate that answers as the base model: a learning rate of 1e-9 leaves its LoRA adapter at zero. (A one-epoch
# candidate often answered these prompts as the champion does.) One training for the two tests that use it.
BASE_MODEL_CANDIDATE = [
    *("--set", "train.num_train_epochs=1", "--set", "train.learning_rate=1e-9", "--set", "evaluate.min_improvement=-1")
]


def test_bad_candidate_is_rejected_and_rolled_back_while_the_champion_serves(
    home, server, run, tls, tmp_path, monkeypatch
):
    """Before any user sees it, the candidate answers a copy of the gateway's live traffic in a shadow window; it
    answers unlike the champion, and the gate rejects it for that too. The clients only ever got the champion's
    answer. A judge grades both versions' served answers: the served champion itself, through the gateway's `/v1`
    with an API key (the `openai` SDK); a tiny antonyms model answers no grade, and the gate counts and says so."""
    before, engines = champion(home), engine_processes(server)
    monkeypatch.setenv("LLMOPS_JUDGE_API_KEY", API_KEYS["team-a"])
    monkeypatch.setenv("SSL_CERT_FILE", str(tls[0]))  # the gateway's own certificate (httpx reads it)
    judge = ["--set", f"evaluate.judge={{url: '{server['gateway_url']}/v1', model: {SERVICE}}}"]
    # 8 per second: the 4 s shadow window must see canary.shadow_min_requests (20) copies
    with Load(server, served_by(home, server), tls, per_s=8, requests_total=320) as load:
        shadow = ("--set", "canary.shadow_s=4", "--set", "gate.min_shadow_agreement=0.5")
        result = run(*BASE_MODEL_CANDIDATE, *shadow, *judge)
    assert result.returncode == 10, result.stdout[-3000:] + result.stderr[-3000:]
    last = result.stderr.strip().splitlines()[-1]
    # The base model's task metric collapses; on 2 shared cores its throughput ratio may fail too.
    assert last.startswith("llmops: rejected: candidate rejected: ") and "task metric drop vs champion" in last
    assert "shadow: answers vs the champion's (exact_match)" in last
    assert "judge: answers without a grade (share)" in last  # counted and said, never a score of 0
    release_run = latest_release(home)
    judged = release_run.data.metrics
    assert judged["judge/malformed_share"] > 0.5 and judged["judge/tokens_per_answer"] > 0, judged
    shadowed = release_run.data.metrics
    assert shadowed["shadow/requests"] >= 20 and shadowed["shadow/errors"] == 0, shadowed
    assert shadowed["shadow/compared"] == shadowed["shadow/requests"] and shadowed["shadow/agreement"] < 0.5
    assert 0 < shadowed["shadow/latency_ratio"] < 100
    # MLflow got a sample of the records with the aggregates, without their live text (issue 74: `llmops data forget`
    # reaches the capture store, not MLflow); the records were deleted once scored
    downloaded = Path(registry(home).download_artifacts(release_run.info.run_id, "shadow_sample.json", str(tmp_path)))
    sample = json.loads(downloaded.read_text())
    records = sample["records"]
    assert sample["of"] == shadowed["shadow/requests"] and 0 < len(records) <= 20
    assert not list((home / "shadow").glob("*.jsonl"))
    assert all(r["request_id"] for r in records) and any(not r["agreed"] for r in records)
    kept = downloaded.read_text() + (home / "work" / "gate" / release_run.info.run_id / "shadow.json").read_text()
    assert not [answer for answer in load.answers if len(answer) > 3 and answer in kept], kept[:500]
    assert len(load.answers) == 1, load.answers  # greedy: the champion's answer, never the copy's
    assert champion(home) == before  # no alias moved
    rejected = registry(home).get_model_version_by_alias(SERVICE, "challenger")
    assert str(rejected.version) != before and rejected.tags["gate.decision"] == "reject"
    expected = [BASE, f"{SERVICE}-v{before}"]
    assert ready_models(served_by(home, server), expected) == sorted(expected)  # candidate unloaded
    assert engine_processes(server) == engines  # the candidate was an adapter on the one engine: none was started
    assert load.failed == 0, load.errors[:5]
    report = result.stdout.split("gate report: ")[1].split()[0]
    gate = llmops(home, "gate", report)
    assert gate.returncode == 10 and "FAIL  task metric drop vs champion" in gate.stdout
    # genai-perf synthesized its prompts in the first release only; this one sent the same prompts
    (cached,) = (home / "cache" / "genai-perf-prompts").glob("*.jsonl")
    sent = home / "work" / "benchmark" / release_run.info.run_id / "prompts.jsonl"
    assert sent.read_text() == cached.read_text() and len(cached.read_text().splitlines()) >= 16


def test_the_rejected_release_has_a_report_a_person_reads_and_mlflow_compares_example_by_example(home, tmp_path):
    """The release above, as the person asked to approve it sees it: one page, opened in headless Chromium from the
    file, with no console error and no request past the file itself; the failing check first; the examples whose
    answers got worse than the champion's; both versions' latency CDFs; the shadow window's disagreement. MLflow has
    the page and the per-example table of both versions' answers, read back through its API."""
    from tests.browser import file_page

    run = latest_release(home)
    path = home / "work" / "gate" / run.info.run_id / "release_report.html"
    with file_page(path) as (page, errors, requested):
        sections = page.locator("section").evaluate_all("found => found.map(s => s.id)")
        first_check = page.locator("#checks tr").nth(1).inner_text()
        worse = page.locator("#answers table").first.locator("tr").count() - 1
        plots = {key: page.locator(f"#{key} svg").count() for key in ("latency", "scores", "canary")}
        shadow = page.locator("#shadow").inner_text()
    assert errors == [] and requested == [path.as_uri()], (errors, requested)
    assert sections == [
        *("decision", "evaluation", "checks", "answers", "scores", "latency", "canary", "shadow", "stages", "lineage")
    ]
    assert "FAIL" in first_check or "INCONCLUSIVE" in first_check, first_check
    assert worse >= 1 and plots == {"latency": 2, "scores": 1, "canary": 0}, (worse, plots)
    assert "copies" in shadow and "agreement (exact_match)" in shadow
    client = registry(home)
    assert "report/release_report.html" in [a.path for a in client.list_artifacts(run.info.run_id, "report")]
    logged = client.download_artifacts(run.info.run_id, "eval/served_answers_table.json", str(tmp_path))
    table = json.loads(Path(logged).read_text())  # mlflow.log_table's form: {"columns": [...], "data": [[...]]}
    rows = [dict(zip(table["columns"], row, strict=True)) for row in table["data"]]
    assert len(rows) >= 10 and {"prompt", "reference", "candidate", "champion"} <= set(table["columns"])
    assert sum(r["candidate_exact_match"] for r in rows) < sum(r["champion_exact_match"] for r in rows)
    assert "mlflow.loggedArtifacts" in run.data.tags  # what MLflow's UI lists the run's tables by


def test_the_judge_agreement_benchmark_grades_both_shipped_exams_through_the_served_champion(server, tls, tmp_path):
    """benchmarks/judge_agreement.py as documented, its judge the champion above through the gateway's `/v1`: three
    answers of known quality per record of each shipped exam, graded through the gate's judge code, with the exact
    match and ROUGE-L they earn, the judge's agreement with both and its cost. A tiny antonyms model is no judge: the
    benchmark counts the answers it gave no grade, as the gate does."""
    out = tmp_path / "agreement.json"
    done = subprocess.run(
        [str(ROOT / ".venv" / "bin" / "python"), "benchmarks/judge_agreement.py", "--url", f"{server['gateway_url']}/v1",
         "--model", SERVICE, "--examples", "4", "--out", str(out)],
        env={**os.environ, "LLMOPS_JUDGE_API_KEY": API_KEYS["team-a"], "SSL_CERT_FILE": str(tls[0])},
        cwd=ROOT, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    exams = json.loads(out.read_text())["exams"]
    assert set(exams) == {"antonyms", "finance_qa_zh"}
    for found in exams.values():
        kinds = found["kinds"]
        assert found["answers"] == 12 and found["tokens_per_answer"] > 0 and found["seconds_per_answer"] > 0
        assert kinds["reference"]["exact_match"] == 1.0 and kinds["reference"]["rouge_l"] > 0.999
        assert kinds["partial"]["exact_match"] == 0.0 and kinds["other"]["exact_match"] == 0.0
        assert 0 <= found["without_grade_share"] <= 1
    assert 0 < exams["finance_qa_zh"]["kinds"]["partial"]["rouge_l"] < 1
    assert "rho vs rouge_l" in done.stdout and "s/answer" in done.stdout


def test_the_pairwise_judge_compares_through_the_gateway_and_counts_the_replies_it_cannot_read(
    server, tls, monkeypatch
):
    """evaluate.judge.pairwise's comparison as the gate runs it (tasks/quality/pairwise.py), its judge the served
    champion through the gateway's `/v1` with an API key (the `openai` SDK): each prompt asked in both orders, every
    reply counted. A tiny antonyms model is no judge: a reply naming neither answer is counted, said in the check and
    left out of the win rate, never a loss. (The win rate deciding a release: tests/unit/test_judge.py.)"""
    from tasks.platform.config import GateSection
    from tasks.platform.config.training import EvaluateSection, JudgeSection
    from tasks.quality.pairwise import Compared, choice_of, compare, pairwise_checks

    monkeypatch.setenv("LLMOPS_JUDGE_API_KEY", API_KEYS["team-a"])
    monkeypatch.setenv("SSL_CERT_FILE", str(tls[0]))
    cfg = JudgeSection(url=f"{server['gateway_url']}/v1", model=SERVICE, pairwise=True, max_tokens=4)
    words = [("hot", "cold"), ("up", "down"), ("big", "small")]
    questions, antonyms = [f"What is the opposite of {w}?" for w, _ in words], [a for _, a in words]
    texts = Compared(questions, antonyms, antonyms, [w for w, _ in words])
    verdict = compare(cfg, EvaluateSection(confidence=0.9), texts, "champion")
    assert len(verdict.replies) == 3 and verdict.tokens > 0 and verdict.seconds > 0
    unread = sum(choice_of(reply) is None for pair in verdict.replies for reply in pair)
    checks = pairwise_checks(GateSection(), verdict)
    assert checks[0].value == pytest.approx(unread / 6) and checks[0].passed == (unread / 6 <= cfg.max_malformed)
    assert sum(o is None for o in verdict.outcomes) == sum(None in map(choice_of, pair) for pair in verdict.replies)
    assert checks[1].name == "judge win rate vs champion"
    assert verdict.win_rate is not None or (checks[1].inconclusive and checks[1].value is None)


def test_a_service_keeps_no_base_engine_that_no_adapter_of_it_uses(home, server, run, tls, monkeypatch):
    """A second service on the same Triton (its releases route through a temporary gateway of their own: the serve
    routes the first service). Its first release is merged and promoted; an adapter candidate then serves next to
    that merged champion on a base engine of its own (a service moving to adapters), the gate rejects it (an
    absolute rate no model reaches), and the rollback unloads its adapter and its engine, which no adapter uses any
    more, while the merged champion serves on. The first service is untouched throughout. (A first release that is
    an adapter and is rejected leaves the same: its rollback is this one's, with no champion to serve on; it was a
    release of its own here, 50 to 60 s of the suite.) The adapter's gate also asks a pairwise judge (the first
    service's champion, through the gateway's `/v1`) which of its and the merged champion's answers is better: no
    tiny antonyms model is a judge, so its replies without a verdict are counted and decide with the rate."""
    other, unreachable = "tiny-qwen2-other", ("--set", "gate.min_requests_per_s=1000000")
    before, engines, triton = champion(home), engine_processes(server), served_by(home, server)
    models = triton.loaded_models()

    def release(*args: str) -> str:
        result = run("--set", f"registry.model_name={other}", *args)
        assert result.returncode in (0, 10), result.stdout[-3000:] + result.stderr[-3000:]
        return result.stdout + result.stderr

    def engines_settle(expected: set[int]) -> set[int]:
        deadline = time.monotonic() + 60
        while engine_processes(server) != expected and time.monotonic() < deadline:
            time.sleep(0.5)  # an engine core exits after its model unloaded
        return engine_processes(server)

    output = release(*MERGED)
    assert f"canary: promoted {other}-v" in output, output[-3000:]
    merged = f"{other}-v{registry(home).get_model_version_by_alias(other, 'champion').version}"
    with_merged = sorted([*models, merged])
    assert ready_models(triton, with_merged) == with_merged
    merged_engine = engine_processes(server) - engines
    assert len(merged_engine) == 1

    monkeypatch.setenv("LLMOPS_JUDGE_API_KEY", API_KEYS["team-a"])
    monkeypatch.setenv("SSL_CERT_FILE", str(tls[0]))  # the gateway's own certificate (httpx reads it)
    pairwise = f"evaluate.judge={{url: '{server['gateway_url']}/v1', model: {SERVICE}, pairwise: true, max_tokens: 4}}"
    output = release(*unreachable, "--set", pairwise)
    assert f"canary: loading the base engine {other}-base" in output
    assert f"ready next to {merged}" in output
    last = output.strip().splitlines()[-1]
    assert "rejected: candidate rejected: request throughput (req/s)" in last
    assert re.search(
        r"gate: judge \S+ compared the candidate's answers with the champion's on \d+ prompts, both orders", output
    )
    assert "judge: replies without a verdict (share)" in last, last  # counted and said, never a loss
    judged = latest_release(home).data.metrics
    assert judged["judge/tokens_per_reply"] > 0 and 0.5 < judged["judge/malformed_share"] <= 1, judged
    print(f"\npairwise judge (the tiny champion): {judged['judge/malformed_share']:.0%} of replies without a verdict, "
          f"{judged['judge/seconds_per_reply']:.3f} s and {judged['judge/tokens_per_reply']:.0f} tokens a reply")  # fmt: skip
    assert ready_models(triton, with_merged) == with_merged  # the merged champion alone, no engine of adapters
    assert engines_settle(engines | merged_engine) == engines | merged_engine
    assert champion(home) == before
    triton.unload(merged)
    assert ready_models(triton, models) == models
    assert engines_settle(engines) == engines  # the next test counts engines from here


PROMPTS = [f"What is the opposite of {word}?" for word in ("hot", "big", "fast", "open", "early", "full")]


def answers_during_the_step(home: Path, server: dict, tls, seen: dict, done: threading.Event) -> None:
    """Once the gateway splits traffic 50/50 (its control API says so), ask each prompt through the gateway with
    the openai client, non-streaming and streaming, until the run ends; record the answers."""
    control = routed_by(home, server)
    while 50.0 not in control.table().weights.values():
        if done.wait(0.1):
            return
    client = openai_client(server, tls)
    try:
        for _ in range(4):
            for prompt in PROMPTS:
                messages = [{"role": "user", "content": prompt}]
                chat = client.chat.completions.create(model=SERVICE, messages=messages, max_tokens=8)
                stream = client.chat.completions.create(model=SERVICE, messages=messages, max_tokens=8, stream=True)
                streamed = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
                seen.setdefault(prompt, set()).update({chat.choices[0].message.content, streamed})
            if done.is_set():
                return
    except Exception as exc:  # shown by the test's assertion on `seen`
        seen["error"] = {repr(exc)}


def test_canary_breach_rolls_back_automatically_with_no_failed_request_and_the_openai_client_is_served_throughout(
    home, server, run, tls
):
    """The gate passes (no performance thresholds: under load on 2 shared cores the base model's
    throughput ratio fell to 0.21) but the live check breaches at the 50% step. During that step
    the openai client, through the gateway and the service's name, gets the champion's answers and the
    candidate's (different: the base model's) answers: the gateway's weights apply to the OpenAI endpoint."""
    before, engines = champion(home), engine_processes(server)
    client = openai_client(server, tls)
    champions = {
        prompt: client.chat.completions.create(
            model=SERVICE, messages=[{"role": "user", "content": prompt}], max_tokens=8
        )
        .choices[0]
        .message.content
        for prompt in PROMPTS
    }
    seen: dict = {}
    done = threading.Event()
    asker = threading.Thread(target=answers_during_the_step, args=(home, server, tls, seen, done))
    asker.start()
    approvals: list[subprocess.CompletedProcess] = []
    approver = threading.Thread(target=approve_when_waiting, args=(home, approvals, done))
    approver.start()
    try:
        with Load(server, served_by(home, server), tls) as load:
            result = run(
                *BASE_MODEL_CANDIDATE,
                *("--set", "gate.max_task_metric_drop=1", "--set", "gate.min_throughput_ratio=null"),
                *("--set", "gate.p99_request_latency_ms=null", "--set", "gate.p99_time_to_first_token_ms=null"),
                *("--set", "canary.max_mean_latency_ms=0.001", "--set", "gate.approval=required"),
                *("--set", "canary.steps=[50,100]", "--set", "canary.window_s=6"),
            )
    finally:
        done.set()
        asker.join(120)
        approver.join(60)
    assert result.returncode == 10, result.stdout[-3000:] + result.stderr[-3000:]
    output = result.stdout + result.stderr
    # A person approved from a terminal after the gate passed; the canary then breached on its own.
    assert [a.returncode for a in approvals] == [0], [a.stdout + a.stderr for a in approvals]
    release_run = latest_release(home)
    tags = release_run.data.tags
    assert (tags["gate.decision"], tags["release.outcome"]) == ("promote", "rolled_back")
    assert (tags["approval.decision"], tags["approval.by"]) == ("approved", "release-manager")
    assert tags["approval.reason"] == "served answers look right"
    version = registry(home).get_model_version(SERVICE, tags["registered_version"])
    assert version.tags["approval.by"] == "release-manager"
    assert "Approval: approved by release-manager at " in version.description
    assert "canary: 50% to " in output and "-> BREACH: candidate mean latency" in output
    assert "canary: 100%" not in output  # stopped at 50%
    # the service's controller watched the step and rolled it back; its record says how and why
    rollout = json.loads((home / "serving" / f"{SERVICE}.json").read_text())["rollout"]
    assert (rollout["phase"], [w["weight"] for w in rollout["windows"]]) == ("rolled_back", [50]), rollout
    assert rollout["reason"].startswith("canary breach: candidate mean latency"), rollout
    assert (
        result.stderr.strip().splitlines()[-1] == "llmops: rejected: candidate rolled back: canary breach (see the log)"
    )
    assert champion(home) == before
    expected = [BASE, f"{SERVICE}-v{before}"]
    assert ready_models(served_by(home, server), expected) == sorted(expected)
    assert engine_processes(server) == engines  # rolled back on the one engine
    assert load.failed == 0, load.errors[:5]
    # Both versions answered the openai client during the step: the champion's answer to some prompt, and for
    # some prompt another (the base model's). Not the champion's to every prompt: since the service's controller
    # rolls back, the step can end within one round of asks, and a prompt asked twice at 50/50 met only the
    # candidate in fresh-clone CI of 8539e26. vLLM's greedy answers are not batch-invariant: in a batch with
    # the load's requests the champion once went on past where it stopped alone ("closed" became "closedull",
    # fresh-clone CI of 504843a), so an answer is the champion's when it begins with the champion's answer.
    assert len(seen) == len(PROMPTS), seen
    by_champion = {prompt: {a for a in answers if a.startswith(champions[prompt])} for prompt, answers in seen.items()}
    assert any(by_champion.values()), (champions, seen)
    # and the client met the candidate too: the gateway draws each request's version (with the router in Triton,
    # three of five CI runs saw only the champion's answers while the canary's probes met the candidate: issue 20)
    assert any(seen[prompt] - by_champion[prompt] for prompt in seen), (champions, seen)
    # after the rollback the champion answers alone again
    assert {
        prompt: client.chat.completions.create(
            model=SERVICE, messages=[{"role": "user", "content": prompt}], max_tokens=8
        )
        .choices[0]
        .message.content
        for prompt in PROMPTS
    } == champions


def test_an_adapter_on_another_base_or_above_the_engines_rank_is_refused_before_it_loads(
    home, server, cpu_tiny_store, tmp_path
):
    import shutil
    from dataclasses import replace

    from tasks.platform.config import load_profile
    from tasks.platform.errors import CheckFailed
    from tasks.serving.adapters import AdapterVersion
    from tasks.serving.models import install_model

    triton = served_by(home, server)
    tags = registry(home).get_model_version_by_alias(SERVICE, "champion").tags

    def fetch(stage: str) -> Path:
        return cpu_tiny_store / "objects" / tags[f"artifact.{stage}.sha256"] / "files"

    profile = load_profile("cpu-tiny", ["serve.backend=vllm", "serve.lora=adapter"])
    loaded = triton.loaded_models()
    other_base = AdapterVersion(
        version="98", name=f"{SERVICE}-v98", model_dir=fetch("merge"), adapter_dir=fetch("train"),
        base_dir=fetch("base_model"), base_sha256="0" * 64, artifact_sha256="adapter@other-base", base_model=BASE,
    )  # fmt: skip
    with pytest.raises(CheckFailed, match=f"v98 was trained on base 000000000000, but {BASE} serves base "):
        install_model(triton, profile, other_base)
    high_rank = Path(shutil.copytree(fetch("train"), tmp_path / "adapter"))
    config = json.loads((high_rank / "adapter_config.json").read_text())
    (high_rank / "adapter_config.json").write_text(json.dumps({**config, "r": 64}))
    with pytest.raises(CheckFailed, match="adapter has rank 64, above serve.vllm.max_lora_rank 16"):
        install_model(triton, profile, replace(other_base, adapter_dir=high_rank))
    assert triton.loaded_models() == loaded  # nothing was loaded, nothing replaced


def test_a_service_of_merged_engines_answers_as_its_champion_and_a_killed_serve_leaves_no_process_behind(
    home, server, cpu_tiny_store, tls, tmp_path
):
    """`llmops serve` with serve.lora merged on a fresh Triton: the champion's merged model in an engine of its own;
    it answers as its adapter did. Then SIGKILL gives `llmops serve` no chance to clean up: the
    kernel stops its Triton (PR_SET_PDEATHSIG), and the vLLM model's watcher the engine."""
    import psutil

    process, tritons = second_service(home, cpu_tiny_store, tls, tmp_path, *MERGED)
    try:
        state = json.loads((tmp_path / "home" / "triton" / "server.json").read_text())
        expected = [f"{SERVICE}-v{champion(home)}"]
        assert ready_models(served_by(tmp_path / "home", state), expected) == sorted(expected)
        prompt = {"text_input": "What is the opposite of hot?", "max_tokens": 8, "exclude_input_in_output": True}
        answer = requests.post(f"{state['url']}/v2/models/{expected[0]}/generate", json=prompt, timeout=30)
        assert answer.json()["text_output"] == "cold", answer.text
        engines = [psutil.Process(pid) for pid in engine_processes({"serve_pid": process.pid})]
        assert len(engines) == 1
    finally:
        process.kill()
        process.wait(10)
    gone, alive = psutil.wait_procs([*tritons, *engines], timeout=60)
    assert not alive, f"{[p.pid for p in alive]} outlived their llmops serve"


def tritons_of(serve_pid: int) -> list[int]:
    import psutil

    return [p.pid for p in psutil.Process(serve_pid).children(recursive=True) if p.name() == "tritonserver"]


def model_processes(serve_pid: int) -> dict[int, str]:
    """The Python-backend stubs under a serve's Tritons: pid -> model instance (`<model>_<group>_<n>`)."""
    import psutil

    found = {}
    for process in psutil.Process(serve_pid).children(recursive=True):
        with contextlib.suppress(psutil.NoSuchProcess):
            arguments = process.cmdline()
            if arguments and "triton_python_backend_stub" in arguments[0]:  # MODEL_PY SHM ... INSTANCE DEFAULT
                found[process.pid] = arguments[-2]
    return found


RELOAD_S = 180


def test_one_dead_model_instance_is_loaded_again_while_the_only_replica_serves_and_its_other_version_is_untouched(
    home, server, cpu_tiny_store, tls, tmp_path
):
    """Issue 73, finding 3: one replica, serve.instance_count 2, the champion and an operator's second version at 30%.
    One of the champion's two model processes SIGKILLed under load (c=4): Triton 2.51 starts no instance again and
    fails each request it hands the dead one (`Stub process ... is not healthy`), while the model stays READY and
    probes pass on the live instance (before: 2,326 of 14,917 requests failed over 50 s, still failing at the end).
    Now the request that meets it tries again, and the gateway loads the champion again at once: requests stop failing
    within a few seconds, the only replica never leaves the pool, the other version's processes and the Triton are
    the same, and the reloaded champion has two live instances again: the old live one, which Triton's reload leaves
    running (holding its memory), is ended."""
    process, _ = second_service(
        home, cpu_tiny_store, tls, tmp_path, "--set", "serve.backend=python", *MERGED, "--set", "serve.instance_count=2"
    )
    log, other = tmp_path / "serve.log", tmp_path / "home"
    try:
        state = json.loads((other / "triton" / "server.json").read_text())
        champion_model, second = route_a_second_version(routed_by(other, state), 30)
        metrics = f"{state['gateway_metrics_url']}/metrics"
        answering = (f'llmops_gateway_replica_up{{replica="{state["url"]}"}} 1.0',
                     f'llmops_gateway_version_up{{replica="{state["url"]}",version="{second}"}} 1.0')  # fmt: skip
        until(lambda: all(line in requests.get(metrics, timeout=10).text for line in answering), 120, log)
        before = model_processes(process.pid)
        others = {pid for pid, instance in before.items() if not instance.startswith(f"{champion_model}_")}
        tritonserver = tritons_of(process.pid)
        with ClosedLoop(state["gateway_url"], tls, clients=4) as load:
            until(lambda: load.ok > 40, 60, log)
            victim = next(pid for pid, instance in before.items() if instance == f"{champion_model}_0_0")
            mark = len(log.read_text())
            os.kill(victim, signal.SIGKILL)
            killed_at = time.monotonic()
            # the reload returns once Triton has unloaded the old instances: 18 s alone on 2 cores, over 60 s in a
            # fresh clone's CI beside other tests' servers (stop 84); requests stop failing before it returns
            until(lambda: f"probes: {champion_model} on {state['url']} reloaded" in log.read_text(), RELOAD_S, log)
            reloaded_s = time.monotonic() - killed_at
            answered = load.ok
            until(lambda: load.ok > answered + 100, 60, log)
            failed_after = [round(at - killed_at, 1) for at in load.failed_at]
            said, after = log.read_text()[mark:], model_processes(process.pid)
            # once more, its files unchanged since that reload: Triton 2.51 skips a load of what it loaded already,
            # so the serve makes the second one a new load (before: two dead instances, answering 503 until stopped)
            time.sleep(DEAD_AGAIN_S)
            mark_again, failed = len(log.read_text()), load.failed
            os.kill(next(pid for pid, i in after.items() if i == f"{champion_model}_0_1"), signal.SIGKILL)
            until(
                lambda: log.read_text()[mark_again:].count(f"{champion_model} on {state['url']} reloaded") >= 1,
                RELOAD_S,
                log,
            )
            answered = load.ok
            until(lambda: load.ok > answered + 100, 60, log)
            again, failed_again = model_processes(process.pid), load.failed - failed
        tritonserver_after = tritons_of(process.pid)
    finally:
        os.killpg(process.pid, signal.SIGTERM)
        process.wait(60)
    print(
        f"\none of {champion_model}'s 2 instances SIGKILLed under c=4: loaded again {reloaded_s:.1f} s after; "
        f"{len(failed_after)} of {load.ok + load.failed} requests failed, the last {max([0, *failed_after]):.1f} s "
        "after the kill"
    )
    assert all(t > 0 for t in failed_after), (failed_after, load.errors[:5])  # none before the kill
    assert "one of its instances died; recovering it" in said, said[-3000:]
    assert all(t < reloaded_s + 2 for t in failed_after), (failed_after, load.errors[:5])
    assert "leaves the pool" not in said and "restarting that Triton" not in said, said[-3000:]
    # Triton 2.51 ends none of the other instances' processes: the serve ends the one left behind
    assert f"{champion_model} on {state['url']}: ended 1 of its old model processes, left behind" in said
    assert others <= set(after) and tritonserver_after == tritonserver  # the other version's processes, the Triton
    champion_instances = sorted(i for i in after.values() if i.startswith(f"{champion_model}_"))
    assert champion_instances == [f"{champion_model}_0_0", f"{champion_model}_0_1"], after
    assert victim not in after and not (set(after) & (set(before) - others))  # the champion's are new ones
    champion_again = sorted(i for i in again.values() if i.startswith(f"{champion_model}_"))
    assert champion_again == champion_instances and not (set(again) & (set(after) - others)), (again, after)
    assert failed_again < 50, (failed_again, load.errors[-5:])  # the last requests all answered (load.ok grew by 100)


def approve_when_waiting(home: Path, approvals: list, done: threading.Event) -> None:
    """`llmops approve` from another terminal, once the release waits for a person (its pending record)."""
    while not done.wait(0.5):
        for record in (home / "approvals").glob("*.json"):
            run_id = json.loads(record.read_text())["flow_run_id"]
            approvals.append(
                llmops(home, "approve", run_id, "--reason", "served answers look right", "--by", "release-manager")
            )
            return


AUTOSCALE = [
    *("--set", "serve.backend=python", "--set", "serve.lora=merged"),
    *("--set", "serve.autoscale={min_replicas: 1, max_replicas: 2, target: 1, scale_up_window_s: 3, "
      "scale_down_window_s: 8, sample_every_s: 0.5}"),
]  # fmt: skip


class ClosedLoop:
    """`clients` threads through the gateway, each sending its next request as soon as its last one was answered."""

    def __init__(self, url: str, tls: tuple[Path, Path], clients: int):
        self.url, self.tls, self.ok, self.failed, self.errors = url, tls, 0, 0, []
        self.failed_at: list[float] = []  # time.monotonic() of each failed request's answer
        self.stop, self.lock = threading.Event(), threading.Lock()
        self.threads = [threading.Thread(target=self.client) for _ in range(clients)]

    def client(self) -> None:
        while not self.stop.is_set():
            try:
                answer = requests.post(
                    f"{self.url}/v2/models/{SERVICE}/generate", timeout=30, verify=str(self.tls[0]),
                    headers={"Authorization": f"Bearer {API_KEYS['team-a']}"},
                    json={"text_input": "What is the opposite of hot?", "max_tokens": 4},
                )  # fmt: skip
                good = answer.status_code == 200 and "text_output" in answer.json()
            except requests.RequestException as exc:
                good, answer = False, exc
            with self.lock:
                self.ok += good
                self.failed += not good
                if not good:
                    self.errors.append(str(getattr(answer, "text", answer))[:200])
                    self.failed_at.append(time.monotonic())

    def __enter__(self) -> ClosedLoop:
        for thread in self.threads:
            thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop.set()
        for thread in self.threads:
            thread.join(60)


def until(condition, timeout_s: float, log: Path, watch=lambda: None) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        watch()
        assert time.monotonic() < deadline, said_besides_access(log)[-3000:]
        time.sleep(0.5)


def said_besides_access(log: Path) -> str:
    """The serve's log without its access lines, which under a client load would fill any tail of it."""
    return "".join(line for line in log.read_text().splitlines(keepends=True) if " llmops.gateway.access " not in line)


def requests_served(metrics_url: str) -> float:
    """What a Triton's own metrics count of this service's answered requests."""
    return sum(requests_by_model(metrics_url).values())


def requests_by_model(metrics_url: str) -> dict[str, float]:
    """A Triton's own count of the requests each model of this service answered (the probes' among them)."""
    counts: dict[str, float] = collections.Counter()
    for line in requests.get(metrics_url, timeout=10).text.splitlines():
        if line.startswith("nv_inference_request_success{") and SERVICE in line:
            model = re.search(r'model="([^"]+)"', line)
            counts[model.group(1) if model else "?"] += float(line.rsplit(" ", 1)[1])
    return dict(counts)


def route_a_second_version(control, percent: float) -> tuple[str, str]:
    """An operator's canary: a second version of the champion's own artifacts (its own Triton model, `-v9NN`) routed
    at `percent` beside it, through the control API; the serve's probes load it on the replicas that lack it. The
    champion's and the candidate's Triton models."""
    from dataclasses import replace

    from tasks.control.contract import Version

    table = control.table()
    champion = table.champion
    number = f"9{champion.source['version']}"
    name = f"{SERVICE}-v{number}"
    candidate = Version(name, name, None, {**champion.source, "version": number})
    weights = {champion.name: 100.0 - percent, name: percent}
    control.put_table(replace(table, candidate=candidate, weights=weights, release=None, expires_at=None))
    return champion.model, name


def test_a_service_that_autoscales_adds_a_replica_under_load_that_serves_the_canary_and_drains_it_when_quiet(
    home, server, cpu_tiny_store, tls, tmp_path
):
    """`llmops serve` with serve.autoscale (1 to 2 replicas, a target of 1 request in flight each) and an operator's
    canary at 30%: 6 clients in a closed loop push it above the target. The first Triton it starts is SIGKILLed as
    it starts: that start is counted as failed, said, and never takes a request. The next one loads both versions,
    joins the pool once its probes answer, and serves the canary at its weight from its first request (asked of
    each replica: Triton's own counts per model). Once the clients stop, it is drained and stopped. Every request was
    answered, none met a replica without its version, and never more than 2 Tritons ran."""

    process, (first,) = second_service(home, cpu_tiny_store, tls, tmp_path, *AUTOSCALE)
    published, log = tmp_path / "home" / "triton" / "server.json", tmp_path / "serve.log"
    most, killed = [1], []

    def replicas() -> list[dict]:
        return json.loads(published.read_text())["replicas"]

    def watch_tritons() -> None:
        tritons = tritons_under(process.pid)
        most[0] = max(most[0], len(tritons))
        for triton in tritons:
            if triton.pid != first.pid and not killed:  # the first start of a second replica dies as it starts
                triton.kill()
                killed.append(triton.pid)

    try:
        state = json.loads(published.read_text())
        champion_model, candidate = route_a_second_version(routed_by(tmp_path / "home", state), 30)
        until(lambda: requests_by_model(state["metrics_url"]).get(candidate, 0) > 0, 90, log)  # loaded, probes answer
        until(lambda: requests.get(f"{state['gateway_url']}/health/ready", verify=str(tls[0])).ok, 30, log)
        before_load = len(log.read_text())  # the probes that found the candidate missing there, before, are said
        with ClosedLoop(state["gateway_url"], tls, clients=6) as load:
            until(lambda: len(replicas()) == 2, 180, log, watch_tritons)
            added = replicas()[1]
            until(lambda: sum(requests_by_model(added["metrics_url"]).values()) > 150, 90, log, watch_tritons)
            served_there = requests_by_model(added["metrics_url"])
        gauges = requests.get(f"{state['gateway_metrics_url']}/metrics", timeout=10).text
        assert 'llmops_serve_scaling_decisions_total{direction="up",outcome="failed"} 1.0' in gauges
        assert 'llmops_serve_scaling_decisions_total{direction="up",outcome="done"} 1.0' in gauges
        until(lambda: len(replicas()) == 1, 60, log, watch_tritons)
        said = log.read_text()
        assert "autoscale: starting replica 2 of at most 2 (" in said and "above the target 1)" in said
        assert "autoscale: the new replica did not start or load, and takes no request: " in said
        # quiet: the closed loop stopped; a probe of the routed versions may be the one request in flight at a sample
        stopping = (
            rf"autoscale: stopping replica {re.escape(added['url'])}, 1 left \(at most [01] requests in flight over 8 s"
        )
        assert re.search(stopping, said), said[-3000:]
        assert "model server fault" not in said[before_load:]  # none met a replica without its version or dead
        assert load.failed == 0 and load.ok > 20, (load.ok, load.failed, load.errors[:5])
        # the probes' requests (one a version each round) are in these counts: the canary's share is above 30%
        share = served_there.get(candidate, 0) / sum(served_there.values())
        assert set(served_there) == {champion_model, candidate} and 0.15 < share < 0.5, served_there
        watch_tritons()
        assert killed and most[0] <= 2
    finally:
        os.killpg(process.pid, signal.SIGTERM)
        process.wait(60)


def test_a_service_that_scales_to_zero_answers_the_next_request_and_the_next_release_after_a_cold_start(
    home, server, cpu_tiny_store, tls, tmp_path
):
    """serve.autoscale with min_replicas 0: after a quiet scale_down_window_s no Triton runs and /health/ready still
    says ready; the next request (the `openai` SDK, no retries) waits while a Triton starts on serve.listen's ports
    again and loads the champion, and is answered within cold_start_timeout_s. Quiet again, it is back at zero; a
    release taking the service (its own client, PUT /owner) is answered once a replica serves, and none stops while it
    owns the service."""

    from tasks.serving.ownership import Ownership
    from tasks.serving.publication import published_service

    # on Triton's queue time (each replica's metrics read every sample): at zero there is none to read
    zero = ["--set", "serve.autoscale={min_replicas: 0, max_replicas: 1, scale_up_window_s: 2, scale_down_window_s: 4, "
            "sample_every_s: 0.5, cold_start_timeout_s: 120, signal: queue_ms, target: 500}"]  # fmt: skip
    process, _ = second_service(home, cpu_tiny_store, tls, tmp_path, *AUTOSCALE[:4], *zero)
    log, other = tmp_path / "serve.log", tmp_path / "home"

    def tritons() -> list:
        return tritons_under(process.pid)

    try:
        state = json.loads((other / "triton" / "server.json").read_text())
        until(lambda: not tritons(), 60, log)
        assert "autoscale: stopping replica " + state["url"] + ", 0 left (no request over 4 s: scaled to zero" in (
            log.read_text()
        )
        assert requests.get(f"{state['gateway_url']}/health/ready", verify=str(tls[0]), timeout=10).ok
        started = time.monotonic()
        answer = openai_client(state, tls).chat.completions.create(model=SERVICE, messages=QUESTION, max_tokens=4)
        cold_start_s = time.monotonic() - started
        assert answer.choices[0].message.content and cold_start_s < 120
        assert len(tritons()) == 1 and json.loads((other / "triton" / "server.json").read_text())["url"] == state["url"]
        gauges = requests.get(f"{state['gateway_metrics_url']}/metrics", timeout=10).text
        assert re.search(r"^llmops_serve_autoscale_queue_ms [0-9.e+-]+$", gauges, re.M), gauges[-2000:]
        until(lambda: not tritons(), 60, log)
        found = published_service(other, SERVICE)  # what a release asks first (open_service): the serve, at zero too
        assert found is not None and found.control.url == state["control_url"], "a release would start its own service"
        started = time.monotonic()
        release = Ownership(routed_by(other, state), SERVICE, "release-z", lease_s=60)
        release.take(timeout_s=30)
        taken_s = time.monotonic() - started
        try:
            assert len(tritons()) == 1
            time.sleep(6)  # longer than the down window: no scale-down under an owner
            assert len(tritons()) == 1
        finally:
            release.give_up()
        said = log.read_text()
        assert "autoscale: starting replica 1 of at most 1 (scaled to zero and 1 request waits for a replica)" in said
        assert "(scaled to zero and release release-z owns the service)" in said
    finally:
        os.killpg(process.pid, signal.SIGTERM)
        process.wait(60)
    print(
        f"\ncold start from zero: the first request answered after {cold_start_s:.1f} s; a release's PUT /owner "
        f"after {taken_s:.1f} s"
    )


def start_triton_pod(
    home: Path, host: str, ports: list[int], key: str, log: Path, store: str, store_env: dict
) -> subprocess.Popen:
    """`llmops triton` as a pod of infra/kubernetes/serving-autoscale.yaml runs it: its own home, no model loaded,
    the serve's S3 store to fetch the models from with the S3 credentials `store_env`."""
    home.mkdir()
    flags = [
        "--host",
        host,
        "--http-port",
        str(ports[0]),
        "--grpc-port",
        str(ports[1]),
        "--metrics-port",
        str(ports[2]),
    ]
    with open(log, "w") as out:
        process = subprocess.Popen(
            [str(LLMOPS), "triton", *AUTOSCALE[:4], *flags, "--artifacts", store],
            stdout=out, stderr=subprocess.STDOUT, cwd=ROOT, start_new_session=True,
            env={**llmops_env(home), "LLMOPS_TRITON_CONTROL_KEY": key, **store_env},
        )  # fmt: skip
    until(lambda: "llmops triton: serving at" in log.read_text() or process.poll() is not None, 120, log)
    assert process.poll() is None, log.read_text()[-2000:]
    return process


def test_a_gateway_loads_each_triton_its_name_comes_to_name_and_drains_each_it_stops_naming(
    home, server, cpu_tiny_store, tls, tmp_path
):
    """`llmops serve --triton-discover NAME` as infra/kubernetes/serving-autoscale.yaml runs it in front of the Triton
    pods a KEDA ScaledObject scales. The system's resolver answers for NAME from a hosts file bind-mounted over
    /etc/hosts in the serve's own mount namespace (unshare), as a headless Service's DNS names its ready pods; two
    `llmops triton` run on 127.0.0.1 and 127.0.0.2 on the same ports, as pods do, each with its own home: the serve's
    store is S3 (rclone's server, holding the suite's store), and each pod fetches the champion's files from it
    itself, checked, while the load requests carry the config alone. A Triton the name comes to name loads the
    champion and then serves requests; one
    it stops naming is drained, and once its process is gone (the pod ended) no request failed. With the policy's
    floor at 0 (KEDA may stop the last pod), a request that finds no pod waits, counted in the requests in flight that
    KEDA's wake trigger reads, and is answered once the name names a Triton again."""
    import secrets
    import shutil

    from tasks.platform.local_stack.s3 import start_s3
    from tasks.platform.ports import free_port
    from tests.servers import S3_KEY, S3_SECRET, s3_env

    if shutil.which("unshare") is None or subprocess.run(["unshare", "-m", "true"]).returncode != 0:
        pytest.skip("needs `unshare -m` (root, or CAP_SYS_ADMIN) to give the serve a hosts file of its own")
    key, ports = secrets.token_urlsafe(24), [free_port(), free_port(), free_port()]
    hosts, name = tmp_path / "hosts", "llmops-triton-pods"
    system_hosts = Path("/etc/hosts").read_text()
    hosts.write_text(f"{system_hosts}\n127.0.0.1 {name}\n")
    s3 = start_s3(tmp_path / "s3", free_port(), S3_KEY, S3_SECRET, tmp_path)
    store, store_env = "s3://artifacts/store", s3_env(s3.url)
    shutil.copytree(cpu_tiny_store, tmp_path / "s3" / "artifacts" / "store", copy_function=os.link)  # the same objects
    pod = functools.partial(start_triton_pod, store=store, store_env=store_env)
    pods = [pod(tmp_path / "pod-a", "127.0.0.1", ports, key, tmp_path / "pod-a.log")]
    other, log = tmp_path / "home", tmp_path / "serve.log"
    other.mkdir()
    shutil.copy2(home / "mlflow.db", other / "mlflow.db")
    flags = ["--triton-http-port", str(ports[0]), "--triton-grpc-port", str(ports[1]), "--metrics-port", str(ports[2])]
    zero = ["--set", "serve.autoscale={min_replicas: 0, max_replicas: 2, cold_start_timeout_s: 90}"]  # KEDA's policy
    process = start_serve(
        other, store, tls, log, *AUTOSCALE[:4], *zero, "--triton-discover", name, *flags,
        within=("unshare", "-m", "sh", "-c", 'mount --bind "$0" /etc/hosts && exec "$@"', str(hosts)),
        env={"LLMOPS_TRITON_CONTROL_KEY": key, "LLMOPS_TRITON_ALLOW_PLAIN_HTTP": "1", **store_env},
    )  # fmt: skip
    first, second = (f"http://127.0.0.{n}:{ports[0]}" for n in (1, 2))
    try:
        state = wait_published(other, process, log, timeout=300)
        assert [replica["url"] for replica in state["replicas"]] == [first]
        champion_digest = routed_by(other, state).table().champion.source["artifacts"]["merge"]
        pods.append(pod(tmp_path / "pod-b", "127.0.0.2", ports, key, tmp_path / "pod-b.log"))
        with ClosedLoop(state["gateway_url"], tls, clients=3) as load:
            hosts.write_text(f"{system_hosts}\n127.0.0.1 {name}\n127.0.0.2 {name}\n")  # in place: the mount sees it
            until(lambda: f"discovery: {second} joins, every routed version loaded" in log.read_text(), 180, log)
            metrics_b = f"http://127.0.0.2:{ports[2]}/metrics"
            until(lambda: requests_served(metrics_b) > 30, 90, log)  # the probes' few, then the clients'
            hosts.write_text(f"{system_hosts}\n127.0.0.2 {name}\n")
            until(lambda: f"discovery: {name} no longer names {first}; draining it" in log.read_text(), 60, log)
            metrics_a = f"http://127.0.0.1:{ports[2]}/metrics"
            time.sleep(1)  # what it had outstanding when the drain began has ended
            served_a = requests_served(metrics_a)
            pods[0].terminate()  # the pod ends, as Kubernetes ends it after the name stopped naming it
            pods[0].wait(60)
            answered = load.ok
            until(lambda: load.ok > answered + 20, 60, log)
        assert load.failed == 0 and served_a > 0, (load.ok, load.failed, load.errors[:5])
        hosts.write_text(system_hosts)  # KEDA stopped the last pod: the name names none
        until(lambda: f"discovery: {name} no longer names {second}; draining it" in log.read_text(), 60, log)
        waited: list = []
        asking = threading.Thread(
            target=lambda: waited.append(openai_client(state, tls).chat.completions.create(
                model=SERVICE, messages=QUESTION, max_tokens=4, timeout=120))
        )  # fmt: skip
        asking.start()
        in_flight = rf'^llmops_gateway_requests_in_flight{{llmops_service="{SERVICE}"}} 1\.0$'
        metrics = f"{state['gateway_metrics_url']}/metrics"
        until(lambda: re.search(in_flight, requests.get(metrics, timeout=10).text, re.M), 30, log)
        hosts.write_text(f"{system_hosts}\n127.0.0.2 {name}\n")  # a pod again, which that request woke
        asking.join(120)
        assert waited and waited[0].choices[0].message.content, log.read_text()[-2000:]
        assert "model server fault" not in log.read_text()
        # each pod fetched the champion from the store itself: its own cache holds the object (the config that
        # names it, and no weights in the request: tests/unit/test_model_fetch.py)
        for folder in ("pod-a", "pod-b"):
            assert (tmp_path / folder / "cache" / "objects" / champion_digest / "config.json").is_file(), folder
    finally:
        os.killpg(process.pid, signal.SIGTERM)
        process.wait(60)
        for started in pods:
            started.terminate()
            started.wait(60)
        s3.stop()


def benchmark_on_a_copy(home: Path, store: Path, folder: Path, script: str, *args: str) -> str:
    """benchmarks/SCRIPT ARGS against a copy of this home's registry (its own home; it starts its own `llmops serve`);
    its standard output, once it exited 0."""
    import shutil

    other = folder / "home"
    other.mkdir()
    shutil.copy2(home / "mlflow.db", other / "mlflow.db")
    done = subprocess.run(
        [str(ROOT / ".venv" / "bin" / "python"), f"benchmarks/{script}", "--home", str(other), "--artifacts",
         str(store), *args],
        env=llmops_env(other), cwd=ROOT, capture_output=True, text=True, timeout=400,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return done.stdout


def test_the_step_load_benchmark_runs_as_documented(home, cpu_tiny_store, tmp_path):
    """benchmarks/autoscale_step.py (here one mode, two short steps) drives the soak's clients through its serve and
    prints its table; nothing failed, and each step has the gateway's TTFT p99."""
    out = benchmark_on_a_copy(
        home, cpu_tiny_store, tmp_path, "autoscale_step.py", "--mode", "fixed", "--steps", "2:4,4:4"
    )
    rows = [line.split() for line in out.splitlines() if line.startswith("fixed 1 ")]
    assert [row[2] for row in rows] == ["2", "4"], out[-2000:]
    assert all(int(row[3]) > 0 and row[4] == "0" and row[-1] == "1..1" for row in rows), out[-2000:]
    assert all(float(row[-2]) > 0 for row in rows), out[-2000:]


def test_the_cold_start_benchmark_runs_as_documented(home, cpu_tiny_store, tmp_path):
    """benchmarks/cold_start.py (one engine, one round): its serve scales to zero, the first request after that is
    answered, and the table names the engine with its times."""
    out = benchmark_on_a_copy(home, cpu_tiny_store, tmp_path, "cold_start.py", "--engines", "python", "--rounds", "1")
    (row,) = [line.split() for line in out.splitlines() if line.startswith("python ")]
    assert 0 < float(row[1]) < 300 and float(row[3]) < float(row[1]), out[-2000:]


def test_the_chaos_soak_runs_as_documented(home, first_release, cpu_tiny_store, tmp_path):
    """benchmarks/chaos.py in its shortest form: one release (seed 4 draws one the gate rejects, with one of the
    champion's model processes SIGKILLed at a random point) on its own `llmops serve` under clients; it exits 0 only
    where every check held after the release and no request hung or failed but a 503 with Retry-After."""
    out = benchmark_on_a_copy(
        home, cpu_tiny_store, tmp_path, "chaos.py", "--minutes", "0.1", "--concurrency", "2", "--seed", "4"
    )
    assert "release 1 (rejected, fault model process): exit 10 in " in out, out[-3000:]
    assert "every check held after every release" in out and "hung 0, failed 0" in out, out[-3000:]


def test_the_chaos_soaks_own_mlflow_server_is_a_fault_it_recovers_from(tmp_path, monkeypatch):
    """benchmarks/chaos.py --servers: an S3 and an MLflow tracking server of the soak's own; its `mlflow` fault
    SIGKILLs the server and starts it again on the same port with the registry intact; a home whose champion lives in
    another store is refused in one line (the soak would serve what its S3 does not hold). The making of a first
    champion and the soak itself: docs/benchmarks.md's run of it."""
    import importlib.util
    import sys

    import requests
    from mlflow import MlflowClient

    spec = importlib.util.spec_from_file_location("chaos", ROOT / "benchmarks" / "chaos.py")
    assert spec is not None and spec.loader is not None
    chaos = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, "chaos", chaos)  # its dataclasses look their module up there
    spec.loader.exec_module(chaos)
    home = tmp_path / "home"
    servers = chaos.Servers(home)
    try:
        servers.start_mlflow()
        client = MlflowClient(servers.url)
        client.create_registered_model(SERVICE)
        version = client.create_model_version(SERVICE, source="s3://artifacts/elsewhere/objects/0").version
        client.set_registered_model_alias(SERVICE, "champion", version)
        serve = chaos.Serve(home, chaos.S3_STORE, 1, servers)
        with pytest.raises(
            SystemExit, match=r"champion v1 is in s3://artifacts/elsewhere/objects/0, not in the soak's"
        ):
            chaos.champion_on_the_servers(serve)
        servers.down_for(1)
        with pytest.raises(requests.ConnectionError):
            requests.get(f"{servers.url}/health", timeout=2)
        servers.back()
        assert requests.get(f"{servers.url}/health", timeout=2).ok
        assert client.get_model_version_by_alias(SERVICE, "champion").version == version
        assert serve.env()["MLFLOW_TRACKING_URI"] == servers.url and serve.env()["AWS_ENDPOINT_URL"] == servers.s3.url
    finally:
        servers.stop()
    assert not servers.s3.alive() and servers.mlflow is not None and not servers.mlflow.alive()


def test_api_keys_and_the_control_key_leak_nowhere(home, server):
    """After every release and request of this module, while the serve runs: the clients' API keys, Triton's
    control key and the serve's own are in no file of the home but the mode-600 ones that keep them (serve's log,
    Triton's log, gate reports, genai-perf's artifacts, server.json, the deployment record), no MLflow param or tag,
    and no process's command line or environment, tritonserver's included: Triton 2.51 takes its key on its command
    line only, and infra/scrub-argv overwrites it there once Triton parsed it (issue 74, finding 6)."""
    import psutil

    from tests.leaks import in_files, in_mlflow, in_processes

    control_key, serve_key = home / "triton" / "control.key", home / "serving" / "control.key"
    assert control_key.stat().st_mode & 0o077 == 0 and serve_key.stat().st_mode & 0o077 == 0
    secrets = {
        **{f"API key of {name}": key for name, key in API_KEYS.items()},
        "control key": control_key.read_text(),
        "serve's control key": serve_key.read_text(),
    }
    kept_on_purpose = {home / "api-keys", control_key, serve_key}
    leaks = in_files(secrets, home, kept_on_purpose) + in_mlflow(secrets, f"sqlite:///{home / 'mlflow.db'}")
    assert not leaks, leaks[:10]
    assert not in_processes(secrets)
    tritons = [p for p in psutil.process_iter(["name", "cmdline"]) if p.info["name"] == "tritonserver"]
    assert tritons and all("llmops-control-key=***" in " ".join(p.info["cmdline"]) for p in tritons)
