"""`make gpu-check`: what a lent GPU should run first, in one command that fits its budget.

A lent device gives 15 minutes in all (starts included) and at most 10 minutes a command. This runs, in order:

1. the smoke (benchmarks/gpu_smoke.py): the pipeline's numerics on a small model, every stage (`--smoke-s`, 300 s
   at most);
2. the 7B/8B bench (benchmarks/gpu_bench.py) with what is left, at a size that fits: `--bench-steps` (10) optimizer
   steps, the pipeline's LoRA first and bare LlamaFactory's second, checkpoints deleted as soon as measured.

Each part is a child process that rewrites its JSON after every step it finishes; each gets a deadline inside the
budget (`--budget-s`, 540: a 600 s command with a minute to spare) and is stopped with SIGTERM at it (SIGKILL 10 s
later). Stopped by the budget, by the device tool or by a person (SIGTERM, Ctrl-C), it still prints one table of
every step finished so far and writes it to gpu_check.json beside the parts' JSON: a partial table is the point.

    python3 benchmarks/gpu_check.py [--budget-s 540] [--smoke-s 300] [--bench-steps 10] [--allow-cpu] [--out F]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
MARGIN_S = 15.0  # kept back at the end: the table, the JSON and a SIGKILLed child's cleanup
GRACE_S = 10.0  # SIGTERM, then this long before SIGKILL


class Stopped(Exception):
    """SIGTERM or SIGINT reached this process: the table of what finished, and out."""


def stop(signum: int, frame: object) -> None:
    raise Stopped(f"stopped ({signal.Signals(signum).name})")


def run_part(command: list[str], seconds: float) -> str:
    """The part run until it ends or `seconds` pass; how it ended."""
    if seconds <= 1:
        return "not started: no budget left"
    child = subprocess.Popen(command, start_new_session=True)  # its group: the trainings it starts stop with it
    try:
        code = child.wait(timeout=seconds)
        return f"exit {code}"
    except subprocess.TimeoutExpired:
        ended = f"stopped by the budget after {seconds:.0f} s"
    except Stopped as stopped:
        ended = str(stopped)
    signal_group(child.pid, signal.SIGTERM)
    try:
        child.wait(timeout=GRACE_S)
    except subprocess.TimeoutExpired:
        signal_group(child.pid, signal.SIGKILL)
        child.wait()
    if ended.startswith("stopped ("):  # this process was told to stop: so is the rest
        raise Stopped(ended)
    return ended


def signal_group(pid: int, signum: signal.Signals) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(pid, signum)


def read_part(path: Path) -> dict[str, Any]:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return {"environment": {}, "steps": []}


def table(parts: dict[str, dict[str, Any]], endings: dict[str, str], spent_s: float) -> str:
    lines = [f"gpu-check: {spent_s:.0f} s spent"]
    for name, part in parts.items():
        env = ", ".join(f"{k} {v}" for k, v in part["environment"].items() if v is not None)
        lines += ["", f"{name}: {endings.get(name, 'not started')}" + (f"; {env}" if env else "")]
        lines.append(f"{'step':<9} {'status':<8} {'s':>7}  numbers")
        for step in part["steps"]:
            numbers = ", ".join(f"{k} {v}" for k, v in step["numbers"].items())
            detail = "; ".join(filter(None, [numbers, step["note"]]))
            lines.append(f"{step['name']:<9} {step['status']:<8} {step['seconds']:>7.1f}  {detail}")
    return "\n".join(lines)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--budget-s", type=float, default=540, help="wall-clock seconds for everything (540)")
    parser.add_argument("--smoke-s", type=float, default=300, help="the most of it the smoke may take (300)")
    parser.add_argument("--bench-steps", type=int, default=10, help="optimizer steps of each bench training (10)")
    parser.add_argument("--profile", default="qwen-7b-vllm-h100", help="the bench's GPU profile")
    parser.add_argument("--out", type=Path, default=Path("gpu_check.json"), help="the JSON of both parts")
    parser.add_argument("--work", type=Path, help="where the parts' models go (default: temporary folders)")
    parser.add_argument("--allow-cpu", action="store_true", help="without a GPU, both parts' CPU forms")
    args = parser.parse_args(argv)
    if args.budget_s <= MARGIN_S or args.smoke_s <= 0 or args.bench_steps < 1:
        parser.error(f"--budget-s above {MARGIN_S:.0f}, --smoke-s above 0 and --bench-steps 1 or more")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    started = time.monotonic()
    deadline = started + args.budget_s - MARGIN_S
    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    outs = {"gpu-smoke": args.out.with_name("gpu_smoke.json"), "gpu-bench": args.out.with_name("gpu_bench.json")}
    for path in outs.values():
        path.unlink(missing_ok=True)  # an earlier run's numbers are not this one's
    common = ["--allow-cpu"] if args.allow_cpu else []
    work = (lambda name: ["--work", str(args.work / name)]) if args.work else (lambda name: [])
    commands = {
        "gpu-smoke": [sys.executable, str(HERE / "gpu_smoke.py"), "--out", str(outs["gpu-smoke"]), *common],
        "gpu-bench": [
            *(sys.executable, str(HERE / "gpu_bench.py"), "--out", str(outs["gpu-bench"]), *common),
            *("--profile", args.profile, "--steps", str(args.bench_steps)),
        ],
    }
    endings: dict[str, str] = {}
    current, received = "", ""
    try:
        for current, command in commands.items():
            left = deadline - time.monotonic()
            seconds = min(left, args.smoke_s) if current == "gpu-smoke" else left
            print(f"gpu-check: {current}, up to {max(seconds, 0):.0f} s", flush=True)
            endings[current] = run_part([*command, *work(current)], seconds)
    except Stopped as stopped:
        endings[current] = str(stopped)
        received = str(stopped).removeprefix("stopped (").removesuffix(")")
    parts = {name: read_part(path) for name, path in outs.items()}
    spent = time.monotonic() - started
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"spent_s": round(spent, 1), "endings": endings, "parts": parts}, indent=1))
    print("\n" + table(parts, endings, spent))
    print(f"\ngpu-check: numbers in {args.out}")
    if received:  # SIGTERM or SIGINT: as the shell reports a process that signal ended
        return 128 + int(signal.Signals[received])
    # a part the budget cut is what the budget is for (its table says so); a step that failed is not
    return 1 if any(s["status"] == "failed" for p in parts.values() for s in p["steps"]) else 0


if __name__ == "__main__":
    sys.exit(main())
