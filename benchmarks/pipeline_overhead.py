"""Pipeline overhead on cpu-tiny, side by side with its baselines, in one run. Prints a table.

1. A full `llmops run` (the main job: data .. register, canary on Triton, benchmark, gate, promote)
   on a fresh LLMOPS_HOME vs an immediate rerun (all cache hits, the candidate already the champion:
   no Triton is started). Goal: the rerun takes at most 10% of the full run.
2. The train stage through the pipeline vs bare LlamaFactory on the same generated config
   (`llamafactory-cli train cfg.yaml`, started through tasks/runners/llamafactory_launch.py, the only way
   LlamaFactory imports on this CPU stack; see docs/development.md) with a fresh output folder.

    .venv/bin/python benchmarks/pipeline_overhead.py [--keep]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parent.parent
BIN = Path(sys.executable).parent


def llmops_run(home: Path) -> tuple[float, dict[str, float]]:
    env = {**os.environ, "LLMOPS_HOME": str(home)}
    env.pop("PREFECT_HOME", None)
    started = time.perf_counter()
    result = subprocess.run([str(BIN / "llmops"), "run"], capture_output=True, text=True, env=env, cwd=ROOT)
    wall = time.perf_counter() - started
    if result.returncode != 0:
        sys.exit(f"llmops run failed:\n{result.stderr[-3000:]}")
    stages = {m[1]: float(m[2]) for m in re.finditer(r"^(\w+)\s+(?:ran|cached)\s+([\d.]+)", result.stdout, re.M)}
    return wall, stages


def bare_llamafactory(home: Path, scratch: Path) -> tuple[float, float]:
    config_path = next((home / "work" / "train").glob("*/llamafactory_train.yaml"))
    config = yaml.safe_load(config_path.read_text())
    config["output_dir"] = str(scratch / "bare-output")
    config.pop("resume_from_checkpoint", None)
    bare = scratch / "bare.yaml"
    bare.write_text(yaml.safe_dump(config))
    env = {**os.environ, "PYTHONPATH": str(ROOT), "TOKENIZERS_PARALLELISM": "false"}
    started = time.perf_counter()
    subprocess.run(
        [sys.executable, "-m", "tasks.runners.llamafactory_launch", "train", str(bare)],
        check=True,
        env=env,
        cwd=scratch,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    wall = time.perf_counter() - started
    samples = json.loads((scratch / "bare-output" / "train_results.json").read_text())["train_samples_per_second"]
    return wall, samples


def pipeline_samples_per_second(home: Path) -> float:
    record = next((home / "store" / "records" / "stages" / "train").glob("*.json"))
    return json.loads(record.read_text())["metrics"]["samples_per_second"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--keep", action="store_true", help="keep the temporary LLMOPS_HOME and print its path")
    args = parser.parse_args()
    scratch = Path(tempfile.mkdtemp(prefix="llmops-bench-"))
    home = scratch / "home"
    print("benchmark: full run on a fresh LLMOPS_HOME ...", flush=True)
    full_wall, full_stages = llmops_run(home)
    print("benchmark: immediate rerun ...", flush=True)
    cached_wall, _ = llmops_run(home)
    print("benchmark: bare LlamaFactory on the same config ...", flush=True)
    bare_wall, bare_samples = bare_llamafactory(home, scratch)
    pipe_samples = pipeline_samples_per_second(home)

    rows = [
        ("full run, fresh LLMOPS_HOME (s)", full_wall, cached_wall, "cached rerun (s)"),
        ("train stage wall time (s)", full_stages["train"], bare_wall, "bare LlamaFactory (s)"),
        ("train samples/s (HF Trainer)", pipe_samples, bare_samples, "bare samples/s"),
    ]
    print(f"\n{'measure':34} {'pipeline':>9} {'baseline':>9}  {'baseline is':24} {'ratio':>6}")
    for name, value, base, label in rows:
        print(f"{name:34} {value:9.2f} {base:9.2f}  {label:24} {value / base:6.2f}")
    overhead = (full_stages["train"] - bare_wall) / bare_wall * 100
    print(f"\ncached rerun / full run: {cached_wall / full_wall:.3f} (goal: at most 0.10)")
    print(
        f"train stage overhead over bare LlamaFactory: {overhead:+.1f}% "
        f"(stage = fetch inputs + launch + follow log/checkpoints + store adapter)"
    )
    if args.keep:
        print(f"kept: {scratch}")
    else:
        shutil.rmtree(scratch, ignore_errors=True)


if __name__ == "__main__":
    main()
