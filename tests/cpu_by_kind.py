"""Where a command's CPU goes, by kind of process: runs the command, reads every process of the machine once a second
while it runs (psutil), and prints each kind's CPU seconds, process count and share, with how busy the cores were.

    .venv/bin/python tests/cpu_by_kind.py [--every 1] -- make test

Every process of the machine is counted, not only the command's children: the suite's servers start their own
sessions (Triton, vLLM, Prefect), so a process tree would miss them. A process that lives less than one interval is
not seen; one seen is counted with the CPU it had used when last seen (a process ending between two reads loses at
most one interval). A process that was running before the command counts only what it used since. The kinds are the first pattern of KINDS found in the command line; what matches none is
"other" with its program's name.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from collections import defaultdict
from dataclasses import dataclass

import psutil

# (substring of the command line, kind), first match wins: the specific before the general (a Prefect flow run's
# command line names prefect too, Triton's Python stub names tritonserver's paths).
KINDS = (
    ("triton_python_backend_stub", "Triton Python model"),
    ("tritonserver", "tritonserver"),
    ("EngineCore", "vLLM engine"),
    ("vllm", "vLLM"),
    ("llamafactory", "LlamaFactory"),
    ("flows.train_node", "LlamaFactory"),
    ("torchrun", "LlamaFactory"),
    ("prefect.engine", "Prefect flow run"),
    ("prefect server", "Prefect server"),
    ("prefect worker", "Prefect worker"),
    ("uvicorn", "Prefect server (temporary)"),
    ("genai-perf", "genai-perf"),
    ("genai_perf", "genai-perf"),
    ("perf_analyzer", "genai-perf"),
    ("aiperf", "AIPerf"),
    ("mlflow", "MLflow"),
    ("huey", "MLflow"),
    ("llmops serve", "llmops serve"),
    ("llmops run", "llmops run"),
    ("bin/llmops", "llmops (other commands)"),
    ("exec(eval(sys.stdin", "pytest"),  # xdist's workers, started by execnet
    ("pytest", "pytest"),
    ("rclone", "S3 (rclone)"),
    ("postgres", "PostgreSQL"),
    ("prometheus", "Prometheus"),
    ("chrom", "Chromium"),
    ("pip", "pip"),
)


def kind_of(command_line: str, kinds: tuple[tuple[str, str], ...] = KINDS) -> str:
    for pattern, kind in kinds:
        if pattern in command_line:
            return kind
    program = command_line.split(" ", 1)[0].rsplit("/", 1)[-1]
    return f"other ({program or 'kernel'})"


@dataclass
class Seen:
    kind: str
    started_before: bool  # running before the command: counted only where it used CPU since
    cpu_at_start: float  # what such a process had used when the command started
    cpu_now: float = 0.0

    @property
    def cpu_s(self) -> float:
        return self.cpu_now - self.cpu_at_start


def read_processes(seen: dict[tuple[int, float], Seen], started_at: float, kinds: tuple[tuple[str, str], ...]) -> None:
    """Each process's CPU so far, keyed by pid and start time (a pid used again is another process)."""
    for process in psutil.process_iter(["cmdline", "create_time", "cpu_times"]):
        info = process.info
        if info["cpu_times"] is None or info["create_time"] is None or process.pid == os.getpid():
            continue  # gone, not ours to read, or this measurement
        cpu = info["cpu_times"].user + info["cpu_times"].system
        key = (process.pid, info["create_time"])
        if key not in seen:
            before = info["create_time"] < started_at
            seen[key] = Seen(kind_of(" ".join(info["cmdline"] or []), kinds), before, cpu if before else 0.0)
        seen[key].cpu_now = cpu


def measure(
    command: list[str], every: float = 1.0, kinds: tuple[tuple[str, str], ...] = KINDS
) -> tuple[int, float, float, dict[str, tuple[int, float]]]:
    """Run `command`; its exit code, wall seconds, the cores' busy share, and per kind (processes, CPU seconds)."""
    seen: dict[tuple[int, float], Seen] = {}
    started_at = time.time()
    read_processes(seen, started_at, kinds)
    before = psutil.cpu_times()
    started = time.monotonic()
    child = subprocess.Popen(command)
    while child.poll() is None:
        read_processes(seen, started_at, kinds)
        time.sleep(every)
    wall = time.monotonic() - started
    after = psutil.cpu_times()
    idle = (
        (after.idle + after.iowait - before.idle - before.iowait)
        if hasattr(after, "iowait")
        else after.idle - before.idle
    )
    busy = 1 - idle / max(sum(after) - sum(before), 1e-9)
    by_kind: dict[str, list[float]] = defaultdict(lambda: [0, 0.0])
    for process in seen.values():
        if process.cpu_s > 0 or not process.started_before:
            by_kind[process.kind][0] += 1
            by_kind[process.kind][1] += process.cpu_s
    return child.returncode, wall, busy, {kind: (int(n), cpu) for kind, (n, cpu) in by_kind.items()}


def table(wall: float, busy: float, by_kind: dict[str, tuple[int, float]], top: int = 20) -> str:
    total = sum(cpu for _, cpu in by_kind.values())
    lines = [
        f"{total:.0f} CPU-s in {wall:.0f} s on {psutil.cpu_count()} cores ({busy:.0%} busy)",
        "| kind | processes | CPU-s | share |",
        "|---|---|---|---|",
    ]
    for kind, (count, cpu) in sorted(by_kind.items(), key=lambda item: -item[1][1])[:top]:
        lines.append(f"| {kind} | {count} | {cpu:.1f} | {cpu / max(total, 1e-9):.0%} |")
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--every", type=float, default=1.0, help="seconds between two reads (default 1)")
    parser.add_argument("--top", type=int, default=20, help="kinds printed, most CPU first (default 20)")
    parser.add_argument(
        "--kind", action="append", default=[], metavar="PATTERN=NAME", help="a kind of your own, matched before KINDS"
    )
    parser.add_argument("command", nargs="+", help="the command to run, after --")
    args = parser.parse_args(argv)
    own = []
    for given in args.kind:
        pattern, equals, name = given.partition("=")
        if not (pattern and equals and name):
            parser.error(f"--kind {given!r}: expected PATTERN=NAME")
        own.append((pattern, name))
    code, wall, busy, by_kind = measure(args.command, args.every, (*own, *KINDS))
    print(table(wall, busy, by_kind, args.top))
    return code


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
