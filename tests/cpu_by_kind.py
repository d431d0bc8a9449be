"""Where a command's CPU goes, by kind of process: runs the command, reads every process of the machine once a second
while it runs (psutil), and prints each kind's CPU seconds, process count and share, with how busy the cores were.

    .venv/bin/python tests/cpu_by_kind.py [--every 1] [--kind PATTERN=NAME]... -- make test

Every process of the machine is counted, not only the command's children: the suite's servers start their own
sessions (Triton, vLLM, Prefect), so a process tree would miss them. A process that lives less than one interval is
not seen; one seen is counted with the CPU it had used when last seen (a process ending between two reads loses at
most one interval). A process that was running before the command counts only what it used since. A process's kind
is that of the first pattern of `--kind` or KINDS found in its command line; what matches none is "other" with its
program's name.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from collections import Counter
from dataclasses import dataclass

import psutil

# (substring of the command line, kind), first match wins: the specific before the general (Triton's Python stub runs
# from tritonserver's folder, vLLM's engine core is a vllm process).
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
    cpu_at_start: float | None  # what a process running before the command had used then; None: started since
    cpu_now: float = 0.0

    @property
    def cpu_s(self) -> float:
        return self.cpu_now - (self.cpu_at_start or 0.0)


def read_processes(seen: dict[tuple[int, float], Seen], kinds: tuple[tuple[str, str], ...], before: bool) -> None:
    """Each process's CPU so far, keyed by pid and start time (a pid used again is another process); `before`: this
    read is the one before the command starts. (Not by comparing start times with the clock: psutil's are counted
    from a boot time in whole seconds, up to a second early.)"""
    for process in psutil.process_iter(["cmdline", "create_time", "cpu_times"]):
        info = process.info
        if info["cpu_times"] is None or info["create_time"] is None or process.pid == os.getpid():
            continue  # gone, not ours to read, or this measurement
        cpu = info["cpu_times"].user + info["cpu_times"].system
        key = (process.pid, info["create_time"])
        if key not in seen:
            seen[key] = Seen(kind_of(" ".join(info["cmdline"] or []), kinds), cpu if before else None)
        seen[key].cpu_now = cpu


def measure(
    command: list[str], every: float = 1.0, kinds: tuple[tuple[str, str], ...] = KINDS
) -> tuple[int, float, float, dict[str, tuple[int, float]]]:
    """Run `command`; its exit code, wall seconds, the cores' busy share, and per kind (processes, CPU seconds)."""
    seen: dict[tuple[int, float], Seen] = {}
    read_processes(seen, kinds, before=True)
    before = psutil.cpu_times()
    started = time.monotonic()
    child = subprocess.Popen(command)
    while child.poll() is None:
        read_processes(seen, kinds, before=False)
        time.sleep(every)
    wall = time.monotonic() - started
    after = psutil.cpu_times()
    idle = after.idle + after.iowait - before.idle - before.iowait  # Linux's fields, as the suite's machines
    busy = 1 - idle / max(sum(after) - sum(before), 1e-9)
    processes: Counter[str] = Counter()
    cpu_s: Counter[str] = Counter()
    for process in seen.values():
        if process.cpu_s > 0 or process.cpu_at_start is None:
            processes[process.kind] += 1
            cpu_s[process.kind] += process.cpu_s
    return child.returncode, wall, busy, {kind: (processes[kind], cpu_s[kind]) for kind in processes}


def table(wall: float, busy: float, by_kind: dict[str, tuple[int, float]]) -> str:
    total = sum(cpu for _, cpu in by_kind.values())
    lines = [
        f"{total:.0f} CPU-s in {wall:.0f} s on {psutil.cpu_count()} cores ({busy:.0%} busy)",
        "| kind | processes | CPU-s | share |",
        "|---|---|---|---|",
    ]
    for kind, (count, cpu) in sorted(by_kind.items(), key=lambda item: -item[1][1]):
        lines.append(f"| {kind} | {count} | {cpu:.1f} | {cpu / max(total, 1e-9):.0%} |")
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--every", type=float, default=1.0, help="seconds between two reads (default 1)")
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
    print(table(wall, busy, by_kind))
    return code


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
