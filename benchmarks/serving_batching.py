"""Triton serving with dynamic batching vs a sequential `transformers` generate loop, and rollout cost.

Same merged model, same prompts, same machine, in one run. Prints two tables:
1. requests/s and output tokens/s at client concurrency 1, 8 and 32 (Triton, max_batch_size 32)
   vs one `model.generate` call after the other (batch size 1), with the ratio;
2. router reload (one canary step's switch), ramp 10 -> 50 -> 100 + promote, and rollback.

    .venv/bin/python benchmarks/serving_batching.py [--home LLMOPS_HOME] [--requests 96] [--tokens 16]

Without --home, it first runs `llmops run` into a temporary LLMOPS_HOME to get a merged model.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import requests

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from tasks.config import load_profile  # noqa: E402
from tasks.triton_repository import render_model  # noqa: E402
from tasks.triton_server import TritonServer  # noqa: E402


def merged_model(home: Path) -> Path:
    records = sorted((home / "store" / "records" / "stages" / "merge").glob("*.json"), key=lambda p: p.stat().st_mtime)
    if not records:
        env = {**os.environ, "LLMOPS_HOME": str(home)}
        env.pop("PREFECT_HOME", None)
        print("bench: no merged model in LLMOPS_HOME; running `llmops run` first ...", flush=True)
        subprocess.run(
            [str(Path(sys.executable).parent / "llmops"), "run"],
            check=True,
            env=env,
            cwd=ROOT,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        return merged_model(home)
    digest = json.loads(records[-1].read_text())["artifact"]["digest"]
    return home / "store" / "objects" / digest / "files"


def prompts(n: int) -> list[str]:
    words = ["hot", "big", "fast", "open", "early", "full", "hard", "high", "long", "new", "rich", "strong"]
    return [f"What is the opposite of {words[i % len(words)]}?" for i in range(n)]


def sequential(model_dir: Path, texts: list[str], tokens: int) -> float:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.set_num_threads(1)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    started = time.perf_counter()
    with torch.no_grad():
        for text in texts:
            ids = tokenizer.apply_chat_template(
                [{"role": "user", "content": text}], add_generation_prompt=True, return_tensors="pt", return_dict=True
            )
            model.generate(
                **ids,
                max_new_tokens=tokens,
                min_new_tokens=tokens,
                do_sample=False,
                pad_token_id=tokenizer.pad_token_id,
            )
    return time.perf_counter() - started


def served(url: str, model: str, texts: list[str], tokens: int, concurrency: int) -> float:
    session = requests.Session()

    def call(text: str) -> None:
        response = session.post(
            f"{url}/v2/models/{model}/generate",
            timeout=120,
            json={"text_input": text, "max_tokens": tokens, "min_length": tokens},
        )
        response.raise_for_status()

    call(texts[0])  # warm up
    started = time.perf_counter()
    with ThreadPoolExecutor(concurrency) as pool:
        list(pool.map(call, texts))
    return time.perf_counter() - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--home", type=Path, help="an LLMOPS_HOME holding a merged model (default: a fresh temporary one)"
    )
    parser.add_argument("--requests", type=int, default=96)
    parser.add_argument("--tokens", type=int, default=16)
    args = parser.parse_args()
    scratch = Path(tempfile.mkdtemp(prefix="llmops-serve-bench-"))
    home = args.home or scratch / "home"
    model_dir = merged_model(home.resolve()).resolve()
    texts = prompts(args.requests)
    profile = load_profile("cpu-tiny", ["serve.max_batch_size=32"])

    print("bench: sequential transformers generate ...", flush=True)
    seq_s = sequential(model_dir, texts, args.tokens)
    server = TritonServer.start(scratch)
    triton = server.client
    try:
        values = {
            "max_batch_size": 32,
            "max_queue_delay_us": 2000,
            "instance_count": 1,
            "model_dir": model_dir,
            "apply_chat_template": "true",
            "default_max_tokens": args.tokens,
            "torch_threads": 1,
            "device": "cpu",
            "artifact_sha256": "benchmark",
        }
        for name in ("bench-a", "bench-b"):
            render_model("llm", triton.repository, name, values)
            triton.load(name)
        rows = []
        for concurrency in (1, 8, 32):
            print(f"bench: Triton at concurrency {concurrency} ...", flush=True)
            rows.append((concurrency, served(triton.url, "bench-a", texts, args.tokens, concurrency)))

        n, tok = len(texts), len(texts) * args.tokens
        print(f"\n{len(texts)} prompts, {args.tokens} output tokens each, same merged model, 2 CPU cores")
        print(
            f"{'concurrency':>11} {'triton req/s':>13} {'triton tok/s':>13} {'sequential req/s':>17} "
            f"{'sequential tok/s':>17} {'ratio':>6}"
        )
        for concurrency, seconds in rows:
            print(
                f"{concurrency:>11} {n / seconds:13.1f} {tok / seconds:13.0f} {n / seq_s:17.1f} {tok / seq_s:17.0f} "
                f"{seq_s / seconds:6.1f}"
            )

        from tasks.canary import set_routes

        class Quiet:
            def info(self, *a):
                pass

        import tasks.canary as canary

        canary.logger = lambda: Quiet()
        timings = []
        started = time.perf_counter()
        set_routes(triton, profile, "bench", {"bench-a": 100})
        timings.append(("router reload (one canary step switch)", time.perf_counter() - started))
        started = time.perf_counter()
        for weight in profile.canary.steps:
            set_routes(triton, profile, "bench", {"bench-b": weight, "bench-a": 100 - weight})
        triton.unload("bench-a")
        ramp = time.perf_counter() - started
        timings.append((f"ramp {' -> '.join(map(str, profile.canary.steps))} + promote, without check windows", ramp))
        timings.append(
            (
                f"  + check windows ({len(profile.canary.steps)} x {profile.canary.window_s:g} s, cpu-tiny)",
                ramp + len(profile.canary.steps) * profile.canary.window_s,
            )
        )
        render_model("llm", triton.repository, "bench-a", values)
        triton.load("bench-a")
        started = time.perf_counter()
        set_routes(triton, profile, "bench", {"bench-a": 100})
        triton.unload("bench-b")
        timings.append(("rollback after a breach (router back + unload)", time.perf_counter() - started))
        print(f"\n{'rollout step':60} {'seconds':>8}")
        for name, seconds in timings:
            print(f"{name:60} {seconds:8.2f}")
    finally:
        server.stop()
        shutil.rmtree(scratch, ignore_errors=True)


if __name__ == "__main__":
    main()
