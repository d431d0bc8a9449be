"""Batch inference three ways on cpu-tiny's champion, side by side (issue 42): the same N prompts (alpaca records
cycled from the cpu-tiny data), answered

1. serial: one request at a time to the gateway of `llmops serve` (`/v1/chat/completions`, as `llmops predict`
   sends them): LlamaFactory's users' pattern of looping over a file;
2. LlamaFactory's own batch prediction: `llamafactory-cli train` with `do_predict: true` and
   `predict_with_generate: true` on the champion's merged model (this environment's LlamaFactory, through the
   project's launcher), the same template, the same greedy answer length, `per_device_eval_batch_size` the engine's
   batch (serve.max_batch_size);
3. `llmops predict` against the same `llmops serve` (default concurrency: the engine's batch times its instances).

Each is timed as a user waits for it (process start included) and, where the tool reports it, without start-up.
The service runs with its per-key limits off (a benchmark, not a client); it is stopped before LlamaFactory runs,
so the two never share the cores. Answers of LlamaFactory and `llmops predict` are compared (same greedy model).

    .venv/bin/python benchmarks/predict.py [--home LLMOPS_HOME] [--artifacts STORE] [--prompts 500] [--batch 8]

Without a champion in --home (default ./.llmops, what `make run` leaves), `llmops run` makes one first (with
--artifacts, from that store: cache hits where it holds the stages already).
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import yaml

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
LLMOPS = str(Path(sys.executable).parent / "llmops")
NO_LIMITS = ["--set", "serve.limits.requests_per_second=0", "--set", "serve.limits.tokens_per_minute=0"]


def champion(home: Path, profile) -> object | None:
    from mlflow import MlflowClient
    from mlflow.exceptions import MlflowException

    client = MlflowClient(f"sqlite:///{home / 'mlflow.db'}")
    try:
        return client.get_model_version_by_alias(profile.registry.model_name, "champion")
    except MlflowException:
        return None


def prompts(n: int) -> list[dict]:
    data = ROOT / "profiles" / "data"
    records = [json.loads(line) for f in ("antonyms.jsonl", "antonyms-eval.jsonl") for line in (data / f).open()]
    return [{**r, "id": i + 1} for i, r in enumerate(itertools.islice(itertools.cycle(records), n))]


def start_serve(home: Path, env: dict, log: Path, store: list[str]) -> tuple[subprocess.Popen, str]:
    ports = ["--port", "0", "--triton-http-port", "0", "--triton-grpc-port", "0", "--metrics-port", "0"]
    with open(log, "w") as out:
        process = subprocess.Popen(
            [LLMOPS, "serve", *ports, *NO_LIMITS, *store], stdout=out, stderr=subprocess.STDOUT, env=env, cwd=ROOT,
            start_new_session=True,
        )  # fmt: skip
    state = home / "triton" / "server.json"
    deadline = time.monotonic() + 300
    while not state.is_file():
        if process.poll() is not None or time.monotonic() > deadline:
            raise SystemExit(f"llmops serve did not start: {log.read_text()[-2000:]}")
        time.sleep(0.5)
    url = json.loads(state.read_text())["gateway_url"]
    while httpx.get(f"{url}/health/ready").status_code != 200:
        time.sleep(0.5)
    return process, url


def serial(url: str, model: str, records: list[dict]) -> tuple[float, list[str]]:
    from tasks.data.prompt_rows import prompt_of

    answers = []
    with httpx.Client(timeout=300) as client:
        started = time.perf_counter()
        for record in records:
            messages, _ = prompt_of(record, "benchmark")
            body = client.post(f"{url}/v1/chat/completions", json={"model": model, "messages": messages}).json()
            answers.append(body["choices"][0]["message"]["content"])
        return time.perf_counter() - started, answers


def llmops_predict(data: Path, out: Path, env: dict) -> tuple[float, float, list[str]]:
    """(wall seconds, the seconds its summary says it spent answering, its answers)."""
    started = time.perf_counter()
    done = subprocess.run(
        [LLMOPS, "predict", "--data", str(data), "--out", str(out)], capture_output=True, text=True, env=env, cwd=ROOT
    )
    seconds = time.perf_counter() - started
    if done.returncode != 0:
        raise SystemExit(f"llmops predict failed: {done.stderr[-2000:]}")
    answering = re.search(r"predict: \d+ answered in ([\d.]+) s", done.stdout + done.stderr)
    if answering is None:
        raise SystemExit(f"llmops predict printed no summary: {done.stdout[-1000:]} {done.stderr[-1000:]}")
    return seconds, float(answering.group(1)), [json.loads(line)["answer"] for line in out.open()]


def llamafactory_predict(profile, model_dir: Path, data: Path, work: Path, batch: int) -> tuple[float, dict, list]:
    (work / "dataset_info.json").write_text(json.dumps({"bench": {"file_name": str(data)}}))
    config = {
        "model_name_or_path": str(model_dir),
        "stage": "sft",
        "do_train": False,
        "do_predict": True,
        "predict_with_generate": True,
        "finetuning_type": "full",
        "template": profile.train.template,
        "cutoff_len": profile.train.cutoff_len,
        "dataset_dir": str(work),
        "eval_dataset": "bench",
        "max_new_tokens": profile.serve.default_max_tokens,
        "do_sample": False,
        "per_device_eval_batch_size": batch,
        "output_dir": str(work / "out"),
        "overwrite_output_dir": True,
        "overwrite_cache": True,
        "report_to": "none",
        "dataloader_num_workers": 0,
    }
    (work / "predict.yaml").write_text(yaml.safe_dump(config))
    started = time.perf_counter()
    done = subprocess.run(
        [sys.executable, "-m", "tasks.runners.llamafactory_launch", "train", str(work / "predict.yaml")],
        capture_output=True, text=True, cwd=ROOT, env={**os.environ, "HF_HUB_OFFLINE": "1"},
    )  # fmt: skip
    seconds = time.perf_counter() - started
    if done.returncode != 0:
        raise SystemExit(f"llamafactory-cli train (do_predict) failed: {done.stderr[-3000:]}")
    results = json.loads((work / "out" / "predict_results.json").read_text())
    answers = [json.loads(line)["predict"] for line in (work / "out" / "generated_predictions.jsonl").open()]
    return seconds, results, answers


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--home", type=Path, default=ROOT / ".llmops")
    parser.add_argument("--artifacts", help="the artifact store (default: the home's)")
    parser.add_argument("--prompts", type=int, default=500)
    parser.add_argument("--batch", type=int, help="LlamaFactory's per_device_eval_batch_size (default: the engine's)")
    args = parser.parse_args()

    from tasks.platform.config import load_profile
    from tasks.platform.stores import open_store

    profile = load_profile("cpu-tiny")
    home = args.home.resolve()
    env = {**os.environ, "LLMOPS_HOME": str(home)}
    store = ["--artifacts", args.artifacts] if args.artifacts else []
    if champion(home, profile) is None:
        print(f"no champion in {home}: llmops run", file=sys.stderr)
        subprocess.run([LLMOPS, "run", *store], env=env, cwd=ROOT, check=True)
    version = champion(home, profile)
    assert version is not None
    model_dir = open_store(args.artifacts, home).fetch(version.tags["artifact.merge.sha256"])
    batch = args.batch or profile.serve.max_batch_size

    with tempfile.TemporaryDirectory(prefix="bench-predict-") as tmp:
        work = Path(tmp)
        records = prompts(args.prompts)
        data = work / "prompts.jsonl"
        data.write_text("".join(json.dumps(r) + "\n" for r in records))
        process, url = start_serve(home, env, work / "serve.log", store)
        try:
            serial(url, profile.registry.model_name, records[:16])  # warm-up, not timed
            serial_s, serial_answers = serial(url, profile.registry.model_name, records)
            predict_s, answering_s, predict_answers = llmops_predict(data, work / "answers.jsonl", env)
        finally:
            os.killpg(process.pid, signal.SIGTERM)
            process.wait(120)
        factory_s, factory, factory_answers = llamafactory_predict(profile, model_dir, data, work, batch)

    n = args.prompts
    print(f"\n{n} prompts, cpu-tiny champion v{version.version}, {os.cpu_count()} cores, answers of at most "
          f"{profile.serve.default_max_tokens} tokens (greedy)\n")  # fmt: skip
    print(f"{'method':<52} {'seconds':>8} {'rows/s':>8} {'vs serial':>10}")
    rows = [
        ("serial: one request at a time through the gateway", serial_s),
        (f"llamafactory-cli train do_predict (batch {batch}), wall", factory_s),
        ("  its own predict_runtime (no start-up)", factory["predict_runtime"]),
        ("llmops predict, wall (process start included)", predict_s),
        ("  its own answering time (its summary line)", answering_s),
    ]
    for name, seconds in rows:
        print(f"{name:<52} {seconds:>8.1f} {n / seconds:>8.1f} {serial_s / seconds:>9.2f}x")
    print(f"\nllmops predict vs LlamaFactory: {factory_s / predict_s:.2f}x wall, "
          f"{factory['predict_runtime'] / answering_s:.2f}x without start-up")  # fmt: skip
    same = sum(a.strip() == b.strip() for a, b in zip(predict_answers, factory_answers, strict=True))
    agree = sum(a == b for a, b in zip(predict_answers, serial_answers, strict=True))
    print(f"answers equal: llmops predict = serial {agree}/{n}; llmops predict = LlamaFactory {same}/{n}")


if __name__ == "__main__":
    main()
