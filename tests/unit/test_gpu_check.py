"""`make gpu-check` (benchmarks/gpu_check.py): the smoke, then the 7B/8B bench, inside one command's budget. Its CPU
form here, stopped twice on purpose: the budget cuts the smoke, SIGTERM (what the device tool sends at its limit)
cuts the bench; the table of what finished is printed and written all the same, and nothing it started is left."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil

ROOT = Path(__file__).resolve().parents[2]


def test_stopped_by_its_budget_and_then_by_sigterm_it_prints_the_table_of_what_finished_and_leaves_nothing(tmp_path):
    work = tmp_path / "work"
    started = time.monotonic()
    check = subprocess.Popen(
        ["make", "-s", "gpu-check", f"GPU_CHECK_ARGS=--allow-cpu --budget-s 60 --smoke-s 20 --work {work}"],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        cwd=ROOT,
        env={**os.environ, "PYTHON": sys.executable, "OUT": str(tmp_path)},
        start_new_session=True,
    )
    assert check.stdout is not None
    lines = []
    for line in check.stdout:
        lines.append(line)
        if line.startswith("gpu-check: gpu-bench, up to"):  # the budget cut the smoke
            time.sleep(3)
            os.killpg(check.pid, signal.SIGTERM)
            break
    lines += check.stdout.readlines()
    check.wait(30)
    output = "".join(lines)
    assert time.monotonic() - started < 60, output[-3000:]
    assert "gpu-smoke: stopped by the budget after 20 s" in output and "gpu-bench: stopped (SIGTERM)" in output
    assert "memory    skipped" in output and "needs a CUDA GPU" in output  # a step the smoke finished, in the table
    kept = json.loads((tmp_path / "gpu_check.json").read_text())
    assert kept["endings"] == {"gpu-smoke": "stopped by the budget after 20 s", "gpu-bench": "stopped (SIGTERM)"}
    assert kept["parts"]["gpu-smoke"]["steps"][0]["name"] == "memory"
    left = [p for p in psutil.process_iter(["cmdline"]) if str(work) in " ".join(p.info["cmdline"] or [])]
    assert not left, [p.info["cmdline"] for p in left]
