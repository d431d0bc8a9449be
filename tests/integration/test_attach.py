"""Production attach: a release rolled out by URL on a Triton this run did not start, whose model
repository this machine never writes (models go with their load requests), with the model-control
API locked to a key that inference does not need. The release routes through a temporary gateway of its own in
front of that Triton (the one code path of a release without `llmops serve`); the versions stay Triton's models."""

from __future__ import annotations

import contextlib
import json
import subprocess
import sys
import threading
import time
from collections import Counter
from pathlib import Path

import pytest
import requests

from tasks.serving.server import TritonServer
from tests.integration.test_serving import FAST
from tests.servers import latest_release, llmops, registry, tritons_under

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


def start_serve(home: Path, store: Path, log: Path, *args: str) -> subprocess.Popen:
    """`llmops serve` of `home` on free ports, its output in `log`."""
    from tests.servers import LLMOPS, ROOT, llmops_env

    ports = ["--port", "0", "--control-port", "0", "--triton-http-port", "0", "--triton-grpc-port", "0"]
    ports += ["--metrics-port", "0", "--gateway-metrics-port", "0"]
    with open(log, "w") as out:  # the child keeps its own copy of the descriptor
        return subprocess.Popen(
            [str(LLMOPS), "serve", "--artifacts", str(store), *ports, *args],
            stdout=out,
            stderr=subprocess.STDOUT,
            env=llmops_env(home),
            cwd=ROOT,
            start_new_session=True,
        )


def published(home: Path, serving: subprocess.Popen, log: Path, timeout: float) -> dict:
    """What the serve published (its server.json), once it has; the serve's log where it died or took too long."""
    state_file, deadline = home / "triton" / "server.json", time.monotonic() + timeout
    while not state_file.is_file():
        assert serving.poll() is None and time.monotonic() < deadline, log.read_text()[-3000:]
        time.sleep(0.5)
    return json.loads(state_file.read_text())


def test_the_control_api_needs_the_key_and_inference_does_not(triton):
    url = triton.client.url
    assert curl("-X", "POST", f"{url}/v2/repository/index") == "403"
    assert curl("-X", "POST", f"{url}/v2/repository/models/nothing/unload") == "403"
    assert curl("-X", "POST", "-H", "llmops-control-key: wrong", f"{url}/v2/repository/index") == "403"
    assert curl("-X", "POST", "-H", f"llmops-control-key: {KEY}", f"{url}/v2/repository/index") == "200"
    assert curl(f"{url}/v2/health/ready") == "200"
    # issue 74: verbose logs and request traces (prompts included) are the control key's too
    verbose = '{"log_verbose_level": 1}'
    assert curl("-X", "POST", "-d", verbose, f"{url}/v2/logging") == "403"
    assert curl(f"{url}/v2/trace/setting") == "403"
    assert curl("-H", f"llmops-control-key: {KEY}", f"{url}/v2/logging") == "200"
    assert curl(f"{url}/v2/models/stats") == "200"  # statistics stay open: perf_analyzer reads them
    # issue 74, finding 6: the key it was started with is off its command line once it parsed it (infra/scrub-argv),
    # and still its key
    command = Path(f"/proc/{triton.process.pid}/cmdline").read_bytes()
    assert KEY.encode() not in command and b"llmops-control-key=***" in command


TOY_CONFIG = """backend: "python"
max_batch_size: 0
input [ { name: "x", data_type: TYPE_STRING, dims: [ 1 ] } ]
output [ { name: "y", data_type: TYPE_STRING, dims: [ 1 ] } ]
instance_group [ { count: 1, kind: KIND_CPU } ]
"""


def model_processes(pid: int, model: str) -> list:
    import psutil

    found = []
    for process in psutil.Process(pid).children():
        with contextlib.suppress(psutil.NoSuchProcess):
            if model in " ".join(process.cmdline()):
                found.append(process)
    return found


def held_connections(server: TritonServer, client, model: str, folder: Path) -> int:
    """Of 4 keep-alive connections opened before `client` loads `model` from `folder` (a load made to hang: its model
    process SIGSTOPped as it starts), how many do not answer within 2 s."""
    from tasks.platform.errors import TransientError

    sessions = [requests.Session() for _ in range(4)]
    for session in sessions:
        assert session.get(f"{server.client.url}/v2/health/live", timeout=5).status_code == 200

    def load() -> None:
        with contextlib.suppress(TransientError):  # past its deadline: the thread is a daemon in any case
            client.load(model, timeout=15, model_folder=folder)

    threading.Thread(target=load, daemon=True).start()
    deadline = time.monotonic() + 30
    while not (started := model_processes(server.process.pid, model)):
        assert time.monotonic() < deadline, "the model's process never started"
        time.sleep(0.02)
    for process in started:
        process.suspend()
    time.sleep(1)
    held: list[requests.Session] = []

    def ask(session: requests.Session) -> None:
        try:
            session.get(f"{server.client.url}/v2/health/live", timeout=2)
        except requests.RequestException:
            held.append(session)

    asking = [threading.Thread(target=ask, args=(s,)) for s in sessions]
    for thread in asking:
        thread.start()
    for thread in asking:
        thread.join()
    return len(held)


def test_a_hung_load_leaves_the_connections_clients_hold_answered(tmp_path):
    """tasks/serving/grpc_loads.py: Triton answers an HTTP load on the event thread of the connection that asked, and
    the keep-alive connections opened while it was idle share that thread; a load that hangs holds every one of
    them. The pipeline's loads go over gRPC: those connections answer. The same load over HTTP, on the same Triton,
    holds them: the day Triton stops doing so, this test says it."""
    import dataclasses

    for model in ("toy-grpc", "toy-http"):
        (tmp_path / "models" / model / "1").mkdir(parents=True)
        (tmp_path / "models" / model / "config.pbtxt").write_text(f'name: "{model}"\n{TOY_CONFIG}')
        (tmp_path / "models" / model / "1" / "model.py").write_text(
            "class TritonPythonModel:\n    def execute(self, requests):\n        return []\n"
        )
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("LLMOPS_TRITON_CONTROL_KEY", KEY)
        server = TritonServer.start(tmp_path / "home")
    try:
        over_grpc = dataclasses.replace(server.client, repository=None)  # the model goes with its load request
        over_http = dataclasses.replace(over_grpc, grpc_url=None)
        assert held_connections(server, over_grpc, "toy-grpc", tmp_path / "models" / "toy-grpc") == 0
        assert held_connections(server, over_http, "toy-http", tmp_path / "models" / "toy-http") == 4
    finally:
        server.kill()


def test_the_load_stall_benchmark_prints_both_ways_of_loading_side_by_side():
    """benchmarks/load_stall.py as documented (docs/benchmarks.md), with a short load: one row per round and way, every
    champion request answered (the script fails on any other answer). What it measures is not asserted here."""
    script = Path(__file__).resolve().parents[2] / "benchmarks" / "load_stall.py"
    args = ["--load-s", "1", "--warmup", "0.5", "--rounds", "1", "--concurrency", "2"]
    done = subprocess.run([sys.executable, str(script), *args], capture_output=True, text=True, timeout=180)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    rows = [line.split() for line in done.stdout.splitlines() if line.strip().startswith("1 ")]
    assert [row[1] for row in rows] == ["http", "grpc"] and all(int(row[3]) > 0 for row in rows), done.stdout


# tune_serving searches the candidate's serving settings (2 trials: the profile's own and one of Optuna's; one
# confirmation round where the other won)
TUNE = ["--set", "tune.enabled=true", "--set", "tune.trials=2", "--set", "tune.confirm_rounds=1"]


@pytest.fixture(scope="module")
def release(tmp_path_factory, attach_args):
    home = tmp_path_factory.mktemp("attach-home")
    result = llmops(home, "run", *attach_args, *FAST, *TUNE)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return home


def test_tuning_chose_the_candidates_serving_settings_and_serves_with_them(triton, release):
    run = latest_release(release)
    assert run.data.tags["tune.cached"] == "false"
    chosen = json.loads(run.data.tags["tune.settings"])
    assert set(chosen) == {"max_batch_size", "max_queue_delay_us", "instance_count"}
    history = registry(release).get_metric_history(run.info.run_id, "tune/goodput_per_s")
    assert len(history) == 2 and all(m.value > 0 for m in history)  # every trial served and met the objective
    assert run.data.metrics["tune/best_goodput_per_s"] >= run.data.metrics["tune/default_goodput_per_s"] > 0
    version = registry(release).get_model_version(SERVICE, run.data.tags["registered_version"])
    recorded = json.loads(version.tags["serve.model_settings"])
    assert recorded.items() >= chosen.items()  # the champion serves so
    # what one replica held within the TTFT objective (1000 ms): serve.autoscale's default in_flight target
    met = run.data.metrics["tune/best_ttft_p99_ms"] <= 1000
    assert ("capacity" in recorded) == met, (recorded, run.data.metrics["tune/best_ttft_p99_ms"])
    if met:
        assert recorded["capacity"]["in_flight"] == run.data.metrics["tune/capacity_in_flight"] >= 1
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
    record = json.loads((release / "serving" / f"{SERVICE}.json").read_text())  # what its gateway routed at the end
    assert record["champion"]["name"] == f"{SERVICE}-v{tags['registered_version']}" and record["candidate"] is None
    answer = requests.post(
        f"{triton.client.url}/v2/models/{SERVICE}-v{tags['registered_version']}/generate",
        timeout=30,
        json={"text_input": "What is the opposite of hot?", "max_tokens": 8, "exclude_input_in_output": True},
    )
    assert answer.status_code == 200 and answer.json()["text_output"] == "cold"  # inference: no key
    leaked = [str(p) for p in release.rglob("*") if p.is_file() and KEY.encode() in p.read_bytes()]
    assert leaked == []  # the control key is in no log, report or database of the run


def test_a_bad_candidate_rolls_back_on_the_attached_triton_through_the_serve_in_front_of_it(
    triton, release, attach_args, cpu_tiny_store, tmp_path
):
    """An `llmops serve` of another home fronts the attached Triton (`--triton-url`: it does not own it), started from
    a copy of the deployment record alone (no registry); the release attaches by URL and routes through that serve's
    control API (`--serve-control-url`). Offline the candidate is fine (every training stage is a cache hit); its
    serving config skips the chat template, so what clients get differs from what was evaluated: the served scores
    catch it, and the clients of the serve's gateway get the champion's answers throughout."""
    import os
    import shutil
    import signal

    from tasks.serving.service import ServiceControl

    champion = str(registry(release).get_model_version_by_alias(SERVICE, "champion").version)
    serve_home, log = tmp_path / "serve-home", tmp_path / "serve.log"
    (serve_home / "serving").mkdir(parents=True)
    shutil.copy2(release / "serving" / f"{SERVICE}.json", serve_home / "serving")
    key_file, client = attach_args[attach_args.index("--triton-control-key-file") + 1], triton.client
    assert client.grpc_url and client.metrics_url
    attach = ["--triton-url", client.url, "--triton-grpc-url", client.grpc_url]
    attach += ["--triton-metrics-url", client.metrics_url, "--triton-control-key-file", key_file]
    # The gateway waits as long as its clients do: a stream's next chunk once came after serve.health.between_chunks_s
    # (30 s; a 504, one of 210 answers, in a CI run whose suite took 42 min instead of 29), and the champion's probes
    # may time out as long without it being recovered (reloaded) under its clients
    patient = ["--set", "serve.health.between_chunks_s=90", "--set", "serve.health.probe_timeout_s=30"]
    serving = start_serve(serve_home, cpu_tiny_store, log, *attach, *patient)
    try:
        state = published(serve_home, serving, log, 120)
        serve_key = serve_home / "serving" / "control.key"
        remote = ["--serve-control-url", state["control_url"], "--serve-control-key-file", str(serve_key)]
        # The champion serves them while the candidate is tuned: the search's load tests run on the same Triton and
        # 2 shared cores, and 4 of ~670 answers took over 20 s once (at a load average of 10); none may fail
        with GatewayClients(state["gateway_url"], deadline_s=90) as clients:
            result = llmops(
                release, "run", *attach_args, *remote, "--set", "serve.apply_chat_template=false", *FAST, *TUNE
            )
        assert result.returncode == 10, result.stdout[-3000:] + result.stderr[-3000:]
        assert set(clients.statuses) == {200} and clients.statuses[200] > 20, clients.statuses
        table = ServiceControl(state["control_url"], serve_key.read_text().strip()).table()
        assert table.champion is not None and table.champion.name == f"{SERVICE}-v{champion}"
        assert table.candidate is None and table.describe() == f"{SERVICE}-v{champion}=100"
        assert f"champion v{champion} from the deployment record" in log.read_text()  # not from a registry
    finally:
        os.killpg(serving.pid, signal.SIGTERM)
        serving.wait(60)
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
    assert client.is_ready(f"{SERVICE}-v{champion}")
    assert client.generate(f"{SERVICE}-v{champion}", "What is the opposite of hot?", 8) == "cold"  # the champion


def test_attaching_without_the_grpc_and_metrics_endpoints_is_one_clear_line(tmp_path, triton):
    result = llmops(tmp_path / "home", "run", "--triton-url", triton.client.url)
    assert result.returncode == 2
    assert result.stderr.strip().splitlines()[-1] == (
        f"llmops: error: Triton at {triton.client.url}: attaching needs --triton-grpc-url (genai-perf's endpoint) "
        "and --triton-metrics-url (the canary's live checks), or LLMOPS_TRITON_GRPC_URL / LLMOPS_TRITON_METRICS_URL"
    )


def test_past_its_bound_a_served_model_refuses_at_once_with_503(triton, release, cpu_tiny_store, tmp_path):
    """serve.max_queue_size bounds what Triton holds: the python backend model's dynamic-batcher queue. Flooded far
    past it, some requests are answered and the rest refused at once (never a 500, never an unbounded wait)."""
    from concurrent.futures import ThreadPoolExecutor

    from tasks.platform.config import load_profile
    from tasks.serving.model_config import serving_model
    from tasks.serving.repository import render_model

    merged = registry(release).get_model_version_by_alias(SERVICE, "champion").tags["artifact.merge.sha256"]
    profile = load_profile("cpu-tiny", ["serve.max_queue_size=1", "serve.max_batch_size=1"])
    template, values = serving_model(profile, cpu_tiny_store / "objects" / merged / "files", merged)
    render_model(template, tmp_path, "queued", values)
    client = triton.client
    client.load("queued", model_folder=tmp_path / "queued")

    def ask(model: str) -> tuple[int, str]:
        body = {"text_input": "What is the opposite of hot?", "max_tokens": 16, "min_length": 16}
        answer = requests.post(f"{client.url}/v2/models/{model}/generate", json=body, timeout=60)
        return answer.status_code, answer.text

    try:
        with ThreadPoolExecutor(16) as pool:
            direct = list(pool.map(lambda _: ask("queued"), range(48)))
    finally:
        client.unload("queued")
    assert {status for status, _ in direct} == {200, 503}, direct
    assert all("Exceeds maximum queue size" in text for status, text in direct if status == 503), direct


class GatewayClients:
    """Requests to the service through a gateway, /v2 and streamed /v1, 4 a second, until stopped: every status."""

    def __init__(self, gateway: str, deadline_s: float = 20):
        self.gateway, self.statuses, self.seen, self.deadline_s = gateway, Counter(), [], deadline_s
        self.stopped = threading.Event()
        self.threads = [threading.Thread(target=self.send, args=(kind,), daemon=True) for kind in ("v2", "v1")]

    def send(self, kind: str) -> None:
        while not self.stopped.wait(0.5):
            if kind == "v2":
                path, body = (
                    f"/v2/models/{SERVICE}/generate",
                    {"text_input": "What is the opposite of hot?", "max_tokens": 4},
                )
            else:
                question = [{"role": "user", "content": "What is the opposite of hot?"}]
                path, body = "/v1/chat/completions", {"messages": question, "max_tokens": 4, "stream": True}
            try:
                status = requests.post(f"{self.gateway}{path}", json=body, timeout=self.deadline_s).status_code
            except requests.RequestException as exc:
                status = type(exc).__name__
            self.statuses[status] += 1
            self.seen.append(status)

    def __enter__(self) -> GatewayClients:
        for thread in self.threads:
            thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stopped.set()
        for thread in self.threads:
            thread.join(60)


def test_two_replicas_behind_one_gateway_roll_a_canary_out_across_both_and_outlive_a_hung_load(
    release, cpu_tiny_store, tmp_path
):
    """`llmops serve` with serve.replicas 2 (the python engine) from this home's deployment record: a release through
    its control API has the serve load the candidate on both replicas (POST /control/v1/versions), walks the canary and
    promotes. The candidate's load hangs on the second replica (its model processes SIGSTOPped as they start: Triton
    2.51 waits for them without a deadline, and a retry on that server waits behind them): past the release's
    serve.load_timeout_s, which its load request carries, another replica serves the champion, so the serve SIGKILLs
    this one with its model processes, starts it with the champion, loads the candidate again, and the release
    promotes; clients through the gateway see only 200s and 503s meanwhile,
    but for a request the hung Triton held, which the gateway ends at its deadline (504), and 200s once it serves
    again. Then a soak (closed loops of mixed /v1 streaming and /v2 requests, a tenth of the
    streams hung up on, a 20 s client deadline) sees no request hang and no 5xx, through a canary ramp 10 -> 50 ->
    100 % too, on both replicas."""
    import os
    import signal

    import psutil

    log = tmp_path / "serve.log"
    replicas = ["--set", "serve.replicas=2", "--set", "serve.limits.requests_per_second=0"]
    serving = start_serve(release, cpu_tiny_store, log, *replicas, "--set", "serve.limits.tokens_per_minute=0")
    done = threading.Event()
    try:
        state = published(release, serving, log, 240)
        assert len(state["replicas"]) == 2
        second_url = state["replicas"][1]["url"]
        tritons = tritons_under(serving.pid)
        second = next(p for p in tritons if f"--http-port={second_url.rsplit(':', 1)[1]}" in p.cmdline())
        champions_models, stopped = set(second.children()), []
        # the champion's model processes loaded torch and transformers without scikit-learn or scipy (infra/triton's
        # llm model.py): no library of theirs is mapped into them
        mapped = [Path(f"/proc/{model.pid}/maps").read_text() for model in champions_models]
        assert mapped and all("libtorch" in m and "/scipy" not in m and "/sklearn/" not in m for m in mapped)

        def stop_the_candidates_models() -> None:
            while not done.wait(0.1):
                try:
                    for stub in set(second.children()) - champions_models - set(stopped):
                        stub.suspend()
                        stopped.append(stub)
                except psutil.NoSuchProcess:
                    return  # the serve killed it

        before = str(registry(release).get_model_version_by_alias(SERVICE, "champion").version)
        watcher = threading.Thread(target=stop_the_candidates_models, daemon=True)
        watcher.start()
        # a client's deadline past the gateway's: Triton 2.51 holds a request or two that reach it as the hung load
        # starts (one of 240-900 here, to its other model): the gateway ends it at its deadline, a 504 (a stream with
        # nothing sent yet at serve.health.between_chunks_s, 30 s), or the serve's kill of that Triton does, a 503
        with GatewayClients(state["gateway_url"], deadline_s=150) as clients:
            result = llmops(
                release,
                "run",
                *("--artifacts", str(cpu_tiny_store), *FAST, "--set", "canary.window_s=1.4"),
                *("--set", "serve.load_timeout_s=40"),  # a Python-backend load took up to 21 s under the suite's load
            )  # the same weights under a new profile digest: a new version, no training
        done.set()
        watcher.join()
        output = result.stdout + result.stderr
        assert result.returncode == 0, output[-3000:]
        lines = log.read_text()  # the serve loads the candidate (POST /control/v1/versions) and decides
        told = "did not load within 40s (serve.load_timeout_s); deciding what becomes of the load on Triton"
        assert stopped and f"{told} {second_url}" in lines
        assert f"a release's load hung on Triton {second_url}; starting that Triton again" in lines
        assert "Triton restarted" in lines
        assert not [p for p in stopped if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]  # killed with it
        print("while a replica's load hung and it was restarted:", dict(clients.statuses))
        assert set(clients.statuses) <= {200, 503, 504} and clients.statuses[504] <= 2, clients.statuses
        assert clients.statuses[200] > 20, clients.statuses
        assert clients.seen[-4:] == [200] * 4
        new = str(registry(release).get_model_version_by_alias(SERVICE, "champion").version)
        assert new != before

        def ready(url: str, name: str) -> int:
            return requests.get(f"{url}/v2/models/{name}/ready", timeout=5).status_code

        for replica in [r["url"] for r in state["replicas"]]:
            assert ready(replica, f"{SERVICE}-v{new}") == 200, replica
            deadline = time.monotonic() + 60
            while ready(replica, f"{SERVICE}-v{before}") == 200 and time.monotonic() < deadline:  # after in-flight
                time.sleep(0.5)
            assert ready(replica, f"{SERVICE}-v{before}") != 200, replica

        soak_with_a_ramp(release, state, f"{SERVICE}-v{new}", log)
        metrics = requests.get(f"{state['gateway_metrics_url']}/metrics", timeout=10).text
        for replica in state["replicas"]:
            assert f'llmops_gateway_replica_up{{replica="{replica["url"]}"}} 1.0' in metrics, metrics
    finally:
        done.set()
        os.killpg(serving.pid, signal.SIGTERM)
        serving.wait(60)


def soak_with_a_ramp(home: Path, state: dict, champion: str, log: Path) -> None:
    """CI-sized soaks (tests/soak.py): 20 s at concurrency 8 while the control API walks a second version (another
    name for the champion's model: the routes change, no model loads) 10 -> 50 -> 100 % and back, then the same ramp
    with the second replica SIGKILLed at its first step (issue 60: no request hangs, no 5xx but 503s that say when to
    retry while it is down; the serve starts it again), then 10 s at 32."""
    import asyncio

    from tasks.control.contract import RouteTable, Version
    from tasks.serving.service import ServiceControl, version_counters
    from tests.soak import kill_replica, soak

    control = ServiceControl(state["control_url"], (home / "serving" / "control.key").read_text().strip())
    alias = Version(f"{SERVICE}-v900", champion)
    routes = control.table()

    def ramp(kill: bool = False):
        async def walk() -> None:
            for weight in (10, 50, 100):
                await asyncio.sleep(4)
                if kill and weight == 10:
                    kill_replica(state, 1)
                weights = {champion: 100.0 - weight, alias.name: float(weight)}
                table = RouteTable(SERVICE, routes.champion, alias, weights, release="soak")
                await asyncio.to_thread(control.put_table, table, 600)
            await asyncio.sleep(4)
            await asyncio.to_thread(control.put_table, routes)

        return walk

    restarts = log.read_text().count("Triton restarted")
    for concurrency, seconds, during, killed in (
        (8, 20, ramp(), False),
        (8, 20, ramp(kill=True), True),
        (32, 10, None, False),
    ):
        soaked = asyncio.run(soak(state["gateway_url"], SERVICE, concurrency, seconds, during=during))
        print(f"soak at concurrency {concurrency}{', a replica killed' if killed else ''}: {soaked.summary()}")
        assert soaked.failed == 0 and soaked.hung_up > 0, soaked.summary()
        assert set(soaked.statuses) <= ({200, 503} if killed else {200}), soaked.summary()
        if killed:  # back before the next soak: its watch started it and loaded the table's versions
            deadline = time.monotonic() + 120
            while log.read_text().count("Triton restarted") == restarts:
                assert time.monotonic() < deadline, log.read_text()[-2000:]
                time.sleep(1)
    assert version_counters(control.metrics(), alias.name).ok > 0  # the ramp's version answered
