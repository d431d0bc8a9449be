"""The pipeline as a service: how fast new data starts a release run, and what Prefect costs per task.

1. Prefect overhead per task and per flow call, against a running Prefect server (the local stack's)
   vs Prefect's ephemeral mode (no PREFECT_API_URL: a temporary server in the process), side by side
   with a plain Python call. Each mode runs in a fresh process: N trivial tasks in one flow, and
   M empty flow calls; process start and import time are reported apart.
2. Latency from new data landing to a release run starting: `llmops data push` (upload + event)
   -> the retrain deployment's trigger -> retrain run (fingerprint, dedupe) -> release run created
   -> release run RUNNING on the process worker. Each trial pushes a different dataset (one record
   dropped) and cancels the release run once it runs.

    .venv/bin/python benchmarks/service_latency.py [--tasks 200] [--flows 20] [--trials 3]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import datetime
from pathlib import Path

from tasks.platform.local_stack import prefect_session

ROOT = Path(__file__).resolve().parent.parent
LLMOPS = str(Path(sys.executable).parent / "llmops")
DATASET = ROOT / "profiles" / "data" / "antonyms.jsonl"

PROBE = r"""
import json, sys, time
started = time.perf_counter()
from prefect import flow, task
from prefect.cache_policies import NO_CACHE
imported = time.perf_counter()
n_tasks, n_flows = int(sys.argv[1]), int(sys.argv[2])

def plain(i):
    return i + 1

@task(cache_policy=NO_CACHE, persist_result=False)
def step(i):
    return i + 1

@flow(persist_result=False)
def many_tasks(n):
    started = time.perf_counter()
    for i in range(n):
        step(i)
    return time.perf_counter() - started

@flow(persist_result=False)
def empty():
    return 0

t0 = time.perf_counter(); many_tasks(1); first_flow = time.perf_counter() - t0    # warms the API connection
with_tasks = many_tasks(n_tasks)   # timed inside the flow: task calls only
t0 = time.perf_counter()
for _ in range(n_flows):
    empty()
flows = time.perf_counter() - t0
t0 = time.perf_counter()
for i in range(n_tasks):
    plain(i)
plain_s = time.perf_counter() - t0
print(json.dumps({"import_s": imported - started, "first_flow_s": first_flow,
                  "per_task_ms": with_tasks / n_tasks * 1000, "per_flow_ms": flows / n_flows * 1000,
                  "plain_call_us": plain_s / n_tasks * 1e6}))
"""


def prefect_overhead(env: dict, n_tasks: int, n_flows: int) -> dict:
    started = time.perf_counter()
    done = subprocess.run(
        [sys.executable, "-c", PROBE, str(n_tasks), str(n_flows)], env=env, capture_output=True, text=True, timeout=900
    )
    if done.returncode != 0:
        sys.exit(f"probe failed:\n{done.stderr[-3000:]}")
    result = json.loads(done.stdout.strip().splitlines()[-1])
    result["process_s"] = time.perf_counter() - started
    return result


def timestamp(value: str | None) -> float | None:
    return datetime.fromisoformat(value.replace("Z", "+00:00")).timestamp() if value else None


def data_to_release(env: dict, api: str, trials: int, work: Path) -> list[dict]:
    http = prefect_session(env)  # the stack's Prefect asks for its auth string
    release_id = http.get(f"{api}/deployments/name/release/release", timeout=10).json()["id"]
    lines = DATASET.read_text().splitlines()
    results = []
    for trial in range(trials):
        dataset = work / f"trial-{trial}" / "antonyms.jsonl"
        dataset.parent.mkdir(parents=True)
        dataset.write_text("\n".join(lines[:trial] + lines[trial + 1 :]) + "\n")  # new data: one record fewer
        known = {r["id"] for r in http.post(f"{api}/flow_runs/filter", json={}, timeout=10).json()}
        pushed_at = time.time()
        pushed = subprocess.run(
            [LLMOPS, "data", "push", str(dataset), "s3://datasets/sft/"],
            env=env,
            capture_output=True,
            text=True,
            timeout=120,
        )
        if pushed.returncode != 0:
            sys.exit(f"push failed: {pushed.stderr}")
        pushed_done = time.time()
        run = None
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            runs = http.post(
                f"{api}/flow_runs/filter", json={"flow_runs": {"deployment_id": {"any_": [release_id]}}}, timeout=10
            ).json()
            run = next((r for r in runs if r["id"] not in known and r["start_time"]), None)
            if run:
                break
            time.sleep(0.2)
        if run is None:
            sys.exit("no release run started within 300 s")
        retrain = next(
            r
            for r in http.post(f"{api}/flow_runs/filter", json={}, timeout=10).json()
            if r["id"] not in known and r["id"] != run["id"]
        )
        http.post(
            f"{api}/flow_runs/{run['id']}/set_state",
            timeout=10,
            json={"state": {"type": "CANCELLING", "name": "Cancelling"}, "force": True},
        )
        results.append(
            {
                "push_s": pushed_done - pushed_at,
                "retrain_created_s": timestamp(retrain["created"]) - pushed_at,
                "release_created_s": timestamp(run["created"]) - pushed_at,
                "release_running_s": timestamp(run["start_time"]) - pushed_at,
            }
        )
        wait_cancelled(http, api, run["id"])
    return results


def wait_cancelled(http, api: str, flow_run_id: str) -> None:
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        if http.get(f"{api}/flow_runs/{flow_run_id}", timeout=10).json()["state_type"] in (
            "CANCELLED",
            "COMPLETED",
            "FAILED",
            "CRASHED",
        ):
            return
        time.sleep(0.5)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tasks", type=int, default=200)
    parser.add_argument("--flows", type=int, default=20)
    parser.add_argument("--trials", type=int, default=3)
    args = parser.parse_args()

    work = Path(tempfile.mkdtemp(prefix="llmops-bench-service-"))
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PREFECT_API", "MLFLOW_", "AWS_"))}
    env.update(
        LLMOPS_HOME=str(work / "home"),
        PREFECT_HOME=str(work / "home" / "prefect"),
        PREFECT_SERVER_ANALYTICS_ENABLED="false",
    )
    ephemeral = prefect_overhead({**env, "PREFECT_HOME": str(work / "ephemeral")}, args.tasks, args.flows)

    up = subprocess.run(
        [LLMOPS, "stack", "up", "--prefect-port", "0", "--mlflow-port", "0", "--s3-port", "0"],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    try:
        if up.returncode != 0:
            sys.exit(f"stack up failed:\n{up.stdout}{up.stderr}")
        exports = subprocess.run([LLMOPS, "stack", "env"], env=env, capture_output=True, text=True).stdout
        for line in exports.splitlines():
            key, _, value = line.removeprefix("export ").partition("=")
            env[key] = value.strip("'")
        server = prefect_overhead(env, args.tasks, args.flows)
        deployed = subprocess.run(
            [LLMOPS, "deploy", "--gpu-pool", "llmops-cpu"], env=env, capture_output=True, text=True
        )
        if deployed.returncode != 0:
            sys.exit(f"deploy failed:\n{deployed.stderr}")
        latencies = data_to_release(env, env["PREFECT_API_URL"], args.trials, work)
    finally:
        subprocess.run([LLMOPS, "stack", "down"], env=env, capture_output=True, text=True, timeout=120)

    print(f"\nPrefect overhead ({args.tasks} tasks in one flow, {args.flows} empty flow calls; 2-core machine)")
    print(f"{'':28}{'running server':>16}{'ephemeral':>12}")
    for key, label in (
        ("per_task_ms", "per task call (ms)"),
        ("per_flow_ms", "per flow call (ms)"),
        ("first_flow_s", "first flow call (s)"),
        ("import_s", "import prefect (s)"),
        ("process_s", "whole probe process (s)"),
    ):
        print(f"{label:28}{server[key]:>16.2f}{ephemeral[key]:>12.2f}")
    print(f"{'plain Python call (us)':28}{server['plain_call_us']:>16.2f}{ephemeral['plain_call_us']:>12.2f}")

    print(f"\nnew data -> release run, {args.trials} trials (seconds after the push started)")
    print(f"{'':28}" + "".join(f"{f'#{i + 1}':>9}" for i in range(len(latencies))) + f"{'median':>9}")
    for key, label in (
        ("push_s", "push done (upload+event)"),
        ("retrain_created_s", "retrain run created"),
        ("release_created_s", "release run created"),
        ("release_running_s", "release run running"),
    ):
        values = [r[key] for r in latencies]
        print(f"{label:28}" + "".join(f"{v:>9.1f}" for v in values) + f"{statistics.median(values):>9.1f}")
    print("(worker poll: PREFECT_WORKER_QUERY_SECONDS=2 in the local stack; the cron path adds up to its interval)")


if __name__ == "__main__":
    main()
