"""A chaos soak of `llmops serve` (issue 73): releases back to back on one serve while clients load it and faults
strike at random, and after every release the checks that say nothing was left split, divergent or half-broken.

The soak starts `llmops serve` itself on --home (a home with a champion, made with the same serving settings: the
Python backend, merged versions, two instances; `make run` with them, or the command below), with --replicas
replicas and the default leases. Throughout, closed-loop clients (tests/soak.py) at --concurrency send mixed OpenAI
streaming chat and /v2 generate requests, a tenth of the streams hanging up after the first chunk, each with a 20 s
deadline. Releases follow one another, each of a kind drawn at random:

    good      a new version (a new profile digest; every stage a cache hit) that the gate passes: exit 0
    rejected  the same, with a latency bound no version meets (gate.p99_request_latency_ms 0.5): exit 10
    killed    SIGKILLed (its whole process group) at a random point of its rollout
    stopped   SIGSTOPped once its candidate has a live share, for its lease and 10 s more, then SIGCONTed: exit 6
    hangs     (with --kinds naming it) the candidate's first model process SIGSTOPped as its load starts: the serve
              takes the load for hung past serve.load_timeout_s (20 s here) and abandons it on its last replica
              serving the champion (exit 3), or restarts that replica and loads again where another serves (exit 0)

and with each, at a random time, one fault (or none): a replica's tritonserver SIGKILLed, one of the champion's
model processes SIGKILLed, or the serve itself SIGKILLed and started again; with --servers, MLflow stopped for 30 s
too (SIGKILL, then the same server started again on the same port). Once a release ended and the service
settled (canary.lease_s and a reconcile round), the checks: the release ended with a defined exit code (never 1,
never hung); no candidate is routed; each replica holds only what the record routes; the record's champion is the
registry's; the answers of the last seconds all name that champion (x-llmops-version). The table at the end: the
releases by kind and outcome, the faults with the seconds until requests stopped failing, the requests by status,
and every check that failed.

    LLMOPS_HOME=/tmp/chaos/home llmops run --artifacts /tmp/chaos/store --set serve.backend=python \\
        --set serve.lora=merged --set serve.instance_count=2
    .venv/bin/python benchmarks/chaos.py --home /tmp/chaos/home --artifacts /tmp/chaos/store [--minutes 60]
        [--replicas 1] [--concurrency 8] [--seed 0] [--kinds good,rejected,killed,stopped,hangs]
    .venv/bin/python benchmarks/chaos.py --home /tmp/chaos/s3-home --servers [--minutes 60] [...]

--servers: the soak runs an S3 (`rclone serve s3` over HOME/s3) and an MLflow tracking server (over HOME/mlflow.db)
of its own, as `llmops stack` does, and the serve and every release use them (the store s3://artifacts/chaos, the
registry on the server: a tracking server needs an S3 store). On a new home it first makes the champion there with
the command above's settings. Only then can MLflow be a fault.

It stops by itself after --minutes (the release then running is waited for), and exits 1 where a check failed.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import contextlib
import json
import os
import random
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from tests.soak import Soaked, kill_replica, soak  # noqa: E402

LLMOPS = ROOT / ".venv" / "bin" / "llmops"
SERVING = ["--set", "serve.backend=python", "--set", "serve.lora=merged", "--set", "serve.instance_count=2"]
FAST = [  # the suite's lighter release: the same code paths in less time (tests/integration/test_serving.py)
    *("--set", "bench.concurrency=[2]", "--set", "bench.request_count=16", "--set", "bench.rounds=1"),
    *("--set", "bench.max_rounds=1", "--set", "gate.min_throughput_ratio=null", "--set", "quantize.backend=none"),
]
KINDS = ("good", "rejected", "killed", "stopped")  # drawn by default; `hangs` too where --kinds names it
ALL_KINDS = (*KINDS, "hangs")
FAULTS = (None, "tritonserver", "model process", "serve")
WITH_SERVERS = (*FAULTS, "mlflow")  # drawn with --servers
MLFLOW_DOWN_S = 30
S3_STORE = "s3://artifacts/chaos"
DEFINED = {0, 3, 4, 5, 6, 10}  # docs/user-guide.md's exit codes of a release that ended as it says; 1 is a bug
EXPECTED = {"good": {0}, "rejected": {10}, "killed": {-9}, "stopped": {6}, "hangs": {0, 3}}  # with no fault
RELEASE_TIMEOUT_S = 900


@dataclass
class Outcome:
    kind: str
    fault: str | None
    code: int | None
    seconds: float
    recovered_s: float | None = None  # from the fault to the last failed request after it
    broken: list[str] = field(default_factory=list)  # the checks that failed


if TYPE_CHECKING:
    from tasks.platform.local_stack import Server


class Servers:
    """With --servers: an S3 and an MLflow tracking server of the soak's own, on one port each the whole soak; the
    MLflow server stopped as a fault and started again on its port."""

    def __init__(self, home: Path):
        import secrets

        from tasks.platform.local_stack import s3_env, start_s3
        from tasks.platform.ports import free_port

        self.home, self.logs, self.port = home, home / "chaos-servers", free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        secret = secrets.token_hex(16)
        self.s3 = start_s3(home / "s3", free_port(), "chaos", secret, self.logs)
        self.s3_env = s3_env(self.s3.url, "chaos", secret)
        self.mlflow: Server | None = None
        self.restarted: threading.Thread | None = None

    def start_mlflow(self) -> None:
        from tasks.platform.local_stack import start_mlflow

        self.mlflow = start_mlflow(f"sqlite:///{self.home / 'mlflow.db'}", self.port, self.s3_env, self.logs)

    def down_for(self, seconds: float) -> None:
        """MLflow SIGKILLed (its workers with it: down, as a crashed server or a lost network is), and started again
        after `seconds` off the caller's thread: the release goes on meanwhile."""
        if self.mlflow is not None and self.mlflow.alive():
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.mlflow.pid, signal.SIGKILL)
            if self.mlflow.process is not None:
                self.mlflow.process.wait(30)
        self.restarted = threading.Thread(target=self.start_again, args=(seconds,), daemon=True)
        self.restarted.start()

    def start_again(self, after_s: float) -> None:
        from tasks.platform.errors import CheckFailed

        time.sleep(after_s)
        for attempt in range(3):  # its start may outlast start_mlflow's 180 s on 2 cores under the soak's load
            try:
                self.start_mlflow()
                return
            except CheckFailed as exc:  # what start() raises for a server that did not come up
                print(f"chaos: MLflow did not start again (try {attempt + 1} of 3): {exc}", flush=True)

    def back(self) -> None:
        """Once a server stopped as a fault is up again (before the checks and the next release)."""
        if self.restarted is not None:
            self.restarted.join()
            self.restarted = None

    def env(self) -> dict:
        return {**self.s3_env, "MLFLOW_TRACKING_URI": self.url}

    def stop(self) -> None:
        self.back()
        for server in (self.mlflow, self.s3):
            if server is not None:
                server.stop()


class Serve:
    """The `llmops serve` of the soak: started, SIGKILLed, started again on the same ports (its clients' URL)."""

    def __init__(self, home: Path, artifacts: str, replicas: int, servers: Servers | None = None):
        from tasks.platform.ports import free_port

        self.home, self.artifacts, self.replicas, self.servers = home, artifacts, replicas, servers
        self.process: subprocess.Popen | None = None
        self.state: dict = {}
        self.starts = 0
        names = ("port", "control-port", "triton-http-port", "triton-grpc-port", "metrics-port", "gateway-metrics-port")
        self.ports = [f"--{name}={free_port()}" for name in names]

    def start(self) -> dict:
        """`llmops serve` (again), published: as a supervisor (systemd, a Deployment) starts it, with the server.json
        of one that died left in place."""
        settings = ["--set", "serve.limits.requests_per_second=0", "--set", "serve.limits.tokens_per_minute=0"]
        settings += ["--set", "serve.limits.max_in_flight=0", *SERVING, "--set", f"serve.replicas={self.replicas}"]
        for attempt in range(5):  # a port the dead serve's sockets held may take a moment to free
            log = self.home / f"chaos-serve-{self.starts}.log"
            self.starts += 1
            with open(log, "w") as out:
                self.process = subprocess.Popen(
                    [str(LLMOPS), "serve", "--artifacts", self.artifacts, *self.ports, *settings],
                    stdout=out, stderr=subprocess.STDOUT, cwd=ROOT, start_new_session=True, env=self.env(),
                )  # fmt: skip
            published, deadline = self.home / "triton" / "server.json", time.monotonic() + 300
            while self.process.poll() is None and time.monotonic() < deadline:
                with contextlib.suppress(OSError, ValueError):
                    state = json.loads(published.read_text())
                    if state.get("pid") == self.process.pid:
                        self.state = state
                        return state
                time.sleep(0.5)
            if self.process.poll() is None:
                raise RuntimeError(f"llmops serve did not publish within 300 s: {log.read_text()[-500:]}")
            if attempt < 4:
                time.sleep(2)
        raise RuntimeError(f"llmops serve did not start again: {log.read_text()[-500:]}")

    def kill(self) -> None:
        """SIGKILL for the serve; once its Tritons died with it (PR_SET_PDEATHSIG) and freed the ports."""
        import psutil

        assert self.process is not None
        children = psutil.Process(self.process.pid).children(recursive=True)
        os.killpg(self.process.pid, signal.SIGKILL)
        self.process.wait(30)
        psutil.wait_procs(children, timeout=60)

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGTERM)
            self.process.wait(120)

    def env(self) -> dict:
        """The serve's and each release's: this home, and the soak's S3 and MLflow server where it runs them."""
        return {**os.environ, "LLMOPS_HOME": str(self.home), **(self.servers.env() if self.servers else {})}

    def service(self):
        from tasks.serving.publication import published_service

        return published_service(self.home, self.state["service"])


def strike(fault: str, serve: Serve) -> None:
    """One fault, now."""
    if fault == "tritonserver":
        kill_replica(serve.state, random.randrange(len(serve.state["replicas"])))
    elif fault == "model process":
        kill_a_champion_instance(serve)
    elif fault == "serve":
        serve.kill()
        serve.start()
    elif fault == "mlflow":
        assert serve.servers is not None
        serve.servers.down_for(MLFLOW_DOWN_S)


def kill_a_champion_instance(serve: Serve) -> None:
    import psutil

    service = serve.service()
    champion = service.control.table().champion if service else None
    assert serve.process is not None and champion is not None
    for process in psutil.Process(serve.process.pid).children(recursive=True):
        with contextlib.suppress(psutil.NoSuchProcess):
            arguments = process.cmdline()
            if arguments and "triton_python_backend_stub" in arguments[0] and arguments[-2].startswith(champion.model):
                process.kill()
                return


def release(serve: Serve, kind: str, number: int, log: Path) -> subprocess.Popen:
    """`llmops run` of kind `kind`: a new version (canary.window_s makes a new profile digest)."""
    settings = [*SERVING, *FAST, "--set", f"canary.window_s={1.5 + number / 1000:.3f}"]
    if kind == "rejected":
        settings += ["--set", "gate.p99_request_latency_ms=0.5"]
    if kind == "hangs":
        settings += ["--set", "serve.load_timeout_s=20"]
    with open(log, "w") as out:
        return subprocess.Popen(
            [str(LLMOPS), "run", "--artifacts", serve.artifacts, *settings],
            stdout=out, stderr=subprocess.STDOUT, cwd=ROOT, start_new_session=True, env=serve.env(),
        )  # fmt: skip


def hang_a_candidate_process(serve: Serve) -> bool:
    """The first model process of a version the table does not name as champion, SIGSTOPped as it starts (Triton 2.51
    waits for it without a deadline): True once one was."""
    import psutil

    service = serve.service()
    champion = service.control.table().champion if service else None
    if serve.process is None or champion is None:
        return False
    for process in psutil.Process(serve.process.pid).children(recursive=True):
        with contextlib.suppress(psutil.NoSuchProcess):
            arguments = process.cmdline()  # STUB MODEL_PY SHM ... INSTANCE DEFAULT: the instance is <model>_<i>_<j>
            if arguments and "triton_python_backend_stub" in arguments[0]:
                model = arguments[-2].rsplit("_", 2)[0]
                if model != champion.model and model.startswith(serve.state["service"]):
                    process.suspend()
                    return True
    return False


def candidate_live(serve: Serve) -> bool:
    with contextlib.suppress(Exception):
        service = serve.service()
        table = service.control.table() if service else None
        return bool(table and table.candidate and table.weights.get(table.candidate.name))
    return False


def run_one(
    serve: Serve, kind: str, fault: str | None, number: int, lease_s: float, done: threading.Event
) -> tuple[int | None, float, float]:
    """One release and its fault: its exit code (None: it hung, or the soak was cut short), its seconds, when the
    fault struck."""
    log = serve.home / f"chaos-release-{number}.log"
    started = time.monotonic()
    process = release(serve, kind, number, log)
    fault_at = started + random.uniform(10, 60)
    kill_at = started + random.uniform(20, 90) if kind == "killed" else None
    struck, stopped, hung = None, False, False
    while process.poll() is None and time.monotonic() - started < RELEASE_TIMEOUT_S and not done.is_set():
        now = time.monotonic()
        if fault and struck is None and now > fault_at:
            strike(fault, serve)
            struck = now
        if kill_at and now > kill_at:
            os.killpg(process.pid, signal.SIGKILL)
        if kind == "hangs" and not hung:
            with contextlib.suppress(Exception):
                hung = hang_a_candidate_process(serve)
        if kind == "stopped" and not stopped and candidate_live(serve):
            os.killpg(process.pid, signal.SIGSTOP)
            time.sleep(lease_s + 10)
            os.killpg(process.pid, signal.SIGCONT)
            stopped = True
        time.sleep(0.1 if kind == "hangs" and not hung else 0.5)
    if process.poll() is None:
        os.killpg(process.pid, signal.SIGKILL)
        process.wait(30)
        return None, time.monotonic() - started, struck or 0.0
    return process.returncode, time.monotonic() - started, struck or 0.0


def champion_on_the_servers(serve: Serve) -> None:
    """The champion the soak starts from, in the soak's S3 and registry: made by a release of the soak's serving
    settings where the home has none (a few minutes); refused where the home's champion lives in another store."""
    from mlflow import MlflowClient
    from mlflow.exceptions import MlflowException

    from tasks.platform.config import load_profile

    model = load_profile("cpu-tiny").registry.model_name
    assert serve.servers is not None
    try:
        champion = MlflowClient(serve.servers.url).get_model_version_by_alias(model, "champion")
    except MlflowException:
        champion = None
    if champion is not None:
        if not champion.source.startswith(f"{S3_STORE}/"):
            sys.exit(f"--servers: {serve.home}'s champion v{champion.version} is in {champion.source}, not in the "
                     f"soak's {S3_STORE}: a new --home, please")  # fmt: skip
        return
    print(
        f"chaos: making the champion on the soak's S3 and MLflow server ({serve.home / 'chaos-seed.log'})", flush=True
    )
    with open(serve.home / "chaos-seed.log", "w") as out:
        made = subprocess.run([str(LLMOPS), "run", "--artifacts", S3_STORE, *SERVING], stdout=out,
                              stderr=subprocess.STDOUT, cwd=ROOT, env=serve.env(), timeout=RELEASE_TIMEOUT_S)  # fmt: skip
    if made.returncode != 0:
        sys.exit(f"chaos: the first release ended in exit {made.returncode}: {serve.home / 'chaos-seed.log'}")


def checks(serve: Serve, soaked: Soaked, since: float) -> list[str]:
    """What must hold once a rollout ended and the service settled."""
    from tests.servers import registry

    service = serve.service()
    if service is None:
        return ["the serve published no service"]
    table, broken = service.control.table(), []
    if table.candidate is not None or set(table.weights) != {table.champion.name if table.champion else ""}:
        broken.append(f"routes left split: {table.weights}")
    routed = table.models()
    for replica in service.control.held():
        extra = sorted(set(replica["models"] or ()) - routed)
        if extra:
            broken.append(f"{replica['url']} holds what nothing routes: {extra}")
    alias = registry(serve.home).get_model_version_by_alias(serve.state["service"], "champion").version
    if table.champion is None or table.champion.source.get("version") != str(alias):
        broken.append(f"the record's champion {table.champion and table.champion.name} is not the registry's v{alias}")
    answered = {version for at, status, version in list(soaked.events) if at > since and status == 200}
    if table.champion and answered - {table.champion.name}:
        broken.append(f"answers from {sorted(answered - {table.champion.name})} after the rollout ended")
    return broken


def recovered_after(soaked: Soaked, struck: float, until: float) -> float | None:
    """Seconds from the fault to the last failed request before `until`; None: no request failed."""
    failed = [at for at, status, _ in list(soaked.events) if struck <= at <= until and status != 200]
    return max(failed) - struck if failed else None


def drive(
    serve: Serve,
    soaked: Soaked,
    minutes: float,
    done: threading.Event,
    rows: list[Outcome],
    kinds: tuple[str, ...],
    faults: tuple[str | None, ...] = FAULTS,
) -> None:
    from tasks.platform.config import load_profile

    lease_s = load_profile("cpu-tiny").canary.lease_s
    ends_at, number = time.monotonic() + minutes * 60, 0
    try:
        while time.monotonic() < ends_at and not done.is_set():
            number += 1
            kind, fault = random.choice(kinds), random.choice(faults)
            code, seconds, struck = run_one(serve, kind, fault, number, lease_s, done)
            if serve.servers is not None:
                serve.servers.back()
            if done.is_set():  # the clients ended (an error): no check means anything now
                return
            time.sleep(lease_s + 10)  # the lease of a release that died, and a reconcile round
            settled = time.monotonic()
            time.sleep(5)
            outcome = Outcome(kind, fault, code, seconds)
            outcome.recovered_s = recovered_after(soaked, struck, settled) if struck else None
            outcome.broken = checks(serve, soaked, settled)
            defined = DEFINED | ({-9} if kind == "killed" else set())
            if code not in defined or (fault is None and kind != "killed" and code not in EXPECTED[kind]):
                outcome.broken.append(f"exit {code} ({'none' if fault is None else fault} struck)")
            rows.append(outcome)
            print(f"release {number} ({kind}, fault {fault}): exit {code} in {seconds:.0f} s; "
                  f"{'; '.join(outcome.broken) or 'every check held'}", flush=True)  # fmt: skip
    finally:
        done.set()


def table(rows: list[Outcome], soaked: Soaked) -> str:
    lines = [
        "| release | fault | releases | exit codes | failures stopped after (s) | checks failed |",
        "|---|---|---|---|---|---|",
    ]
    groups: dict[tuple[str, str], list[Outcome]] = collections.defaultdict(list)
    for row in rows:
        groups[(row.kind, row.fault or "none")].append(row)
    for (kind, fault), group in sorted(groups.items()):
        codes = collections.Counter(str(r.code) for r in group)
        recovered = [r.recovered_s for r in group if r.recovered_s is not None]
        worst = f"{max(recovered):.1f}" if recovered else "-"
        broken = sum(bool(r.broken) for r in group)
        lines.append(f"| {kind} | {fault} | {len(group)} | {dict(codes)} | {worst} | {broken} |")
    statuses = dict(soaked.statuses)
    lines.append(f"\n{sum(statuses.values())} requests: {statuses}; hung {soaked.hung}, failed {soaked.failed}, "
                 f"503s without Retry-After {soaked.unadvised}, {soaked.hung_up} hung up on purpose")  # fmt: skip
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--home", type=Path, required=True)
    parser.add_argument("--artifacts", help="the home's store, a folder (without --servers)")
    parser.add_argument(
        "--servers",
        action="store_true",
        help=f"an S3 and an MLflow server of the soak's own ({S3_STORE}); MLflow stopped for {MLFLOW_DOWN_S} s is "
        "then a fault too",
    )
    parser.add_argument("--minutes", type=float, default=60)
    parser.add_argument("--replicas", type=int, default=1)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--kinds", default=",".join(KINDS), help=f"the kinds of release drawn, of {','.join(ALL_KINDS)}"
    )
    args = parser.parse_args()
    kinds = tuple(args.kinds.split(","))
    if not kinds or set(kinds) - set(ALL_KINDS):
        parser.error(f"--kinds: some of {','.join(ALL_KINDS)}")
    if bool(args.servers) == bool(args.artifacts):
        parser.error("--artifacts FOLDER (the home's store) or --servers (the soak's own S3 and MLflow server)")
    random.seed(args.seed)
    servers = Servers(args.home) if args.servers else None
    serve = Serve(args.home, args.artifacts or S3_STORE, args.replicas, servers)
    rows: list[Outcome] = []
    done = threading.Event()
    soaked = Soaked(record=True)
    faults = WITH_SERVERS if servers else FAULTS
    driver = threading.Thread(target=drive, args=(serve, soaked, args.minutes, done, rows, kinds, faults))
    try:
        if servers is not None:
            servers.start_mlflow()
            champion_on_the_servers(serve)
        state = serve.start()
        driver.start()
        seconds = args.minutes * 60 + RELEASE_TIMEOUT_S + 120  # until the driver is done
        asyncio.run(soak(state["gateway_url"], state["service"], args.concurrency, seconds, seed=args.seed,
                         stop=done.is_set, into=soaked))  # fmt: skip
        driver.join()
    finally:
        done.set()
        serve.stop()
        if servers is not None:
            servers.stop()
    print("\n" + table(rows, soaked))
    broken = [f"release {n} ({r.kind}): {b}" for n, r in enumerate(rows, 1) for b in r.broken]
    print("\n".join(broken) or "every check held after every release")
    sys.exit(1 if broken or soaked.failed else 0)


if __name__ == "__main__":
    main()
