"""The local stack at idle: CPU and memory of each service's processes, with MLflow's job execution on (MLflow's own
default) and off (the stack's default), and then with the Prefect server's ten loop services off too (the stack keeps
them: what an idle Prefect server costs without them), side by side in one run. Prints a table.

Each round starts `llmops stack up` on free ports in a fresh LLMOPS_HOME, waits for the stack to settle, samples
every process of each service (the process the stack started and its children, from stack.json) for the window,
then stops it. CPU is the share of one core over the window (user + system); memory is the resident set summed
over the service's processes at the end (shared pages counted once per process, as `ps` does).

    .venv/bin/python benchmarks/stack_idle.py [--settle 20] [--window 30]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil

ROOT = Path(__file__).resolve().parent.parent
LLMOPS = str(Path(sys.executable).parent / "llmops")
PORTS = ["--prefect-port", "0", "--mlflow-port", "0", "--s3-port", "0"]
JOBS = "MLFLOW_SERVER_ENABLE_JOB_EXECUTION"
# Prefect 3.7.2's server services (prefect/settings/models/server/services.py), each with its own ENABLED setting
PREFECT_SERVICES = (
    *("CANCELLATION_CLEANUP", "DB_VACUUM", "EVENT_PERSISTER", "FOREMAN", "LATE_RUNS", "PAUSE_EXPIRATIONS"),
    *("REPOSSESSOR", "SCHEDULER", "TASK_RUN_RECORDER", "TRIGGERS"),
)
SERVICES_OFF = {f"PREFECT_SERVER_SERVICES_{name}_ENABLED": "false" for name in PREFECT_SERVICES}


def service_processes(home: Path) -> dict[str, list[psutil.Process]]:
    state = json.loads((home / "stack" / "stack.json").read_text())
    found = {}
    for name, record in state["services"].items():
        try:
            root = psutil.Process(record["pid"])
            found[name] = [root, *root.children(recursive=True)]
        except psutil.Error:
            found[name] = []
    return found


def cpu_seconds(processes: list[psutil.Process]) -> float:
    total = 0.0
    for process in processes:
        try:
            times = process.cpu_times()
            total += times.user + times.system
        except psutil.Error:
            pass
    return total


def rss_mb(processes: list[psutil.Process]) -> float:
    total = 0
    for process in processes:
        try:
            total += process.memory_info().rss
        except psutil.Error:
            pass
    return total / 2**20


def measure(
    job_execution: bool, settle: float, window: float, extra: dict | None = None
) -> dict[str, dict[str, float]]:
    with tempfile.TemporaryDirectory(prefix="stack-idle-") as folder:
        home = Path(folder)
        env = {**os.environ, "LLMOPS_HOME": str(home), JOBS: str(job_execution).lower(), **(extra or {})}
        subprocess.run([LLMOPS, "stack", "up", *PORTS], env=env, cwd=ROOT, check=True, capture_output=True)
        try:
            time.sleep(settle)
            processes = service_processes(home)
            before = {name: cpu_seconds(procs) for name, procs in processes.items()}
            started = time.monotonic()
            time.sleep(window)
            elapsed = time.monotonic() - started
            return {
                name: {
                    "processes": len(procs),
                    "cpu_percent": 100 * (cpu_seconds(procs) - before[name]) / elapsed,
                    "rss_mb": rss_mb(procs),
                }
                for name, procs in processes.items()
            }
        finally:
            subprocess.run([LLMOPS, "stack", "down"], env=env, cwd=ROOT, capture_output=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--settle", type=float, default=20.0, help="seconds after start-up before sampling")
    parser.add_argument("--window", type=float, default=30.0, help="seconds sampled")
    args = parser.parse_args()
    rounds = {
        "jobs on (MLflow's default)": measure(True, args.settle, args.window),
        "jobs off (the stack's default)": measure(False, args.settle, args.window),
        "jobs off, Prefect's services off": measure(False, args.settle, args.window, SERVICES_OFF),
    }
    print(f"\nlocal stack at idle, {args.window:.0f} s sampled after {args.settle:.0f} s (CPU: % of one core)\n")
    print(f"{'service':<10}" + "".join(f"{label:>44}" for label in rounds))
    print(f"{'':<10}" + f"{'processes    CPU %    RSS MB':>44}" * len(rounds))
    names = sorted({name for result in rounds.values() for name in result})
    for name in [*names, "total"]:
        cells = []
        for result in rounds.values():
            rows = list(result.values()) if name == "total" else [result.get(name, {})]
            count = sum(r.get("processes", 0) for r in rows)
            cpu = sum(r.get("cpu_percent", 0.0) for r in rows)
            rss = sum(r.get("rss_mb", 0.0) for r in rows)
            cells.append(f"{count:>22} {cpu:>8.1f} {rss:>9.0f}")
        print(f"{name:<10}" + "".join(f"{c:>44}" for c in cells))


if __name__ == "__main__":
    main()
