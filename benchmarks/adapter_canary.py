"""A canary's cost on vLLM: the candidate as a second merged engine (serve.lora merged, what a release does by
default) against the candidate as a LoRA adapter on the one engine of the base model (serve.lora adapter), on the
same two trained versions, side by side in one run.

For each mode one Triton (vLLM's environment, cpu-tiny's vLLM settings) serves the champion alone, then loads the
candidate next to it, as deploy_canary does (tasks/serving/models.py: install_model):
- load s: the candidate's load, from the load request to ready. In adapter mode the base engine's own load is the
  champion's (once per service), shown as the champion's load;
- memory added: the proportional set size (PSS: shared pages split between the processes sharing them) of
  tritonserver and every process under it, after the candidate loaded minus before, and that as a share of the
  champion's serving memory (the tree's PSS before, less Triton's own with nothing loaded);
- then genai-perf at each concurrency on the candidate (its own model, or the base engine asked for its adapter
  with `lora_name`, as the gateway asks): requests/s and TTFT p99 (median of --rounds runs).

    .venv/bin/python benchmarks/adapter_canary.py [--home LLMOPS_HOME] [--concurrency 1,8,32] [--requests 64]
        [--rounds 1]

The versions are the last two registered in --home's MLflow registry that share a base model. Without --home, or
with fewer there, it first runs `llmops run --set serve.deploy=false` with train.seed 40 and 41 (about 2 minutes
each): two LoRA fine-tunes of the same base, merged and registered, not served.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil

from tasks.load.genai_perf import GenaiPerf
from tasks.platform.config import load_profile
from tasks.serving.adapters import AdapterVersion, base_model_name, served_artifact
from tasks.serving.champion import triton_launch
from tasks.serving.models import MergedVersion, Served, install_model, model_name
from tasks.serving.server import TritonServer

ROOT = Path(__file__).resolve().parent.parent
SERVICE = "tiny-qwen2-antonyms"
GIB = 1 << 30


def registered_versions(home: Path) -> list[dict[str, str]]:
    """The last two registered versions of SERVICE in `home` that share a base model: their artifact digests."""
    from mlflow import MlflowClient

    database = home / "mlflow.db"
    if not database.is_file():
        return []
    client = MlflowClient(f"sqlite:///{database}")
    versions = sorted(client.search_model_versions(f"name = '{SERVICE}'"), key=lambda v: int(v.version))
    tags = [{"version": str(v.version), **v.tags} for v in versions if "artifact.train.sha256" in v.tags]
    for newer in reversed(tags):
        same_base = [t for t in tags if t["artifact.base_model.sha256"] == newer["artifact.base_model.sha256"]]
        if len(same_base) >= 2:
            return same_base[-2:]
    return []


def train_versions(home: Path) -> list[dict[str, str]]:
    env = {**os.environ, "LLMOPS_HOME": str(home)}
    env.pop("PREFECT_HOME", None)
    for seed in (40, 41):
        print(f"bench: training a version (train.seed {seed}) into {home} ...", flush=True)
        subprocess.run(
            [str(Path(sys.executable).parent / "llmops"), "run", "--set", "serve.deploy=false"]
            + ["--set", f"train.seed={seed}"],
            check=True,
            env=env,
            cwd=ROOT,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
    return registered_versions(home)


def served(home: Path, tags: dict[str, str], mode: str) -> Served:
    def fetch(stage: str) -> Path:
        return home / "store" / "objects" / tags[f"artifact.{stage}.sha256"] / "files"

    name, merged = model_name(SERVICE, tags["version"]), fetch("merge")
    if mode == "merged":
        return MergedVersion(
            version=tags["version"], name=name, model_dir=merged, artifact_sha256=tags["artifact.merge.sha256"]
        )
    adapter, base = tags["artifact.train.sha256"], tags["artifact.base_model.sha256"]
    return AdapterVersion(
        version=tags["version"],
        name=name,
        model_dir=merged,
        artifact_sha256=served_artifact(adapter, base),
        adapter_dir=fetch("train"),
        base_dir=fetch("base_model"),
        base_sha256=base,
        base_model=base_model_name(SERVICE),
    )


def tree_pss(pid: int) -> float:
    """PSS in bytes of process `pid` and every process under it."""
    total = 0.0
    root = psutil.Process(pid)
    for process in [root, *root.children(recursive=True)]:
        try:
            total += process.memory_full_info().pss
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            pass
    return total


def settled_pss(pid: int) -> float:
    """PSS once the tree stops growing (an engine's worker allocates for a few seconds after ready)."""
    previous, current = -1.0, tree_pss(pid)
    while abs(current - previous) > 0.01 * current:
        time.sleep(2)
        previous, current = current, tree_pss(pid)
    return current


def measure_mode(mode: str, versions: list[dict[str, str]], home: Path, scratch: Path, args) -> dict:
    profile = load_profile(
        "cpu-tiny", ["serve.backend=vllm", f"serve.lora={mode}", f"bench.request_count={args.requests}"]
    )
    champion, candidate = (served(home, tags, mode) for tags in versions)
    launcher, env = triton_launch(profile, scratch / "home")
    server = TritonServer.start(scratch / mode, None, launcher=launcher, extra_env=env)
    try:
        triton = server.client
        empty = settled_pss(server.process.pid)
        started = time.monotonic()
        install_model(triton, profile, champion)
        champion_load_s = time.monotonic() - started
        before = settled_pss(server.process.pid)
        candidate_load_s = install_model(triton, profile, candidate)
        after = settled_pss(server.process.pid)
        genai_perf = GenaiPerf(triton.grpc_url or "", profile.bench, scratch / mode / "genai-perf")
        load = {}
        for concurrency in args.concurrency:
            runs = [genai_perf.measure(candidate, concurrency, f"-{mode}-{index}") for index in range(args.rounds)]
            load[concurrency] = (
                statistics.median(r.requests_per_s for r in runs),
                statistics.median(r.ttft_p99_ms for r in runs),
            )
        return {
            "champion_load_s": champion_load_s,
            "candidate_load_s": candidate_load_s,
            "added_gib": (after - before) / GIB,
            "added_share": (after - before) / (before - empty),
            "champion_gib": (before - empty) / GIB,
            "load": load,
        }
    finally:
        server.stop()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--home", type=Path, help="LLMOPS_HOME with two registered cpu-tiny versions (else made)")
    parser.add_argument("--concurrency", type=lambda s: [int(c) for c in s.split(",")], default=[1, 8, 32])
    parser.add_argument("--requests", type=int, default=64, help="requests per genai-perf run")
    parser.add_argument("--rounds", type=int, default=1, help="genai-perf runs per concurrency (median)")
    args = parser.parse_args()
    scratch = Path(tempfile.mkdtemp(prefix="llmops-adapter-bench-"))
    home = (args.home or scratch / "versions").resolve()
    try:
        versions = registered_versions(home) or train_versions(home)
        print(f"bench: champion v{versions[0]['version']}, candidate v{versions[1]['version']} (one base)", flush=True)
        rows = {mode: measure_mode(mode, versions, home, scratch, args) for mode in ("merged", "adapter")}
        print_table(rows, args)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


def print_table(rows: dict[str, dict], args) -> None:
    print(
        f"\nvLLM on Triton (cpu-tiny), candidate loaded next to the champion; genai-perf, {args.requests} streaming "
        f"requests per run to the candidate (its own model, or the base engine asked for its adapter), median of "
        f"{args.rounds}\n"
    )
    print(f"{'':34} {'merged (today)':>16} {'adapter':>16}")
    merged, adapter = rows["merged"], rows["adapter"]
    print(f"{'champion load s':34} {merged['champion_load_s']:>16.1f} {adapter['champion_load_s']:>16.1f}")
    print(f"{'candidate load s':34} {merged['candidate_load_s']:>16.2f} {adapter['candidate_load_s']:>16.2f}")
    print(f"{'champion serving memory GiB':34} {merged['champion_gib']:>16.2f} {adapter['champion_gib']:>16.2f}")
    print(f"{'memory added by candidate GiB':34} {merged['added_gib']:>16.3f} {adapter['added_gib']:>16.3f}")
    print(f"{'  as share of the champion':34} {merged['added_share']:>16.1%} {adapter['added_share']:>16.1%}")
    for concurrency in args.concurrency:
        for index, label in ((0, "requests/s"), (1, "TTFT p99 ms")):
            key = f"c={concurrency} {label}"
            print(f"{key:34} {merged['load'][concurrency][index]:>16.1f} {adapter['load'][concurrency][index]:>16.1f}")


if __name__ == "__main__":
    main()
