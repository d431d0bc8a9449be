"""Serving engines compared on one model with one client, and rollout cost.

Same model, same prompts, same streaming client, in one run. Prints two tables:

1. engine x concurrency x output length: requests/s, output tokens/s, time to first token (TTFT) p50/p99,
   inter-token latency (ITL) p50, and output tokens/s as a multiple of `sequential` (same output length)
   and of `llamafactory` (same concurrency and output length). Engines (--engines, default all):
   - sequential: transformers `model.generate`, one prompt after the other (batch 1), in this process;
   - ceiling: the same model's batched `generate`, batch 32, in this process: what batching alone reaches
     here with no serving around it (concurrency column = batch size; TTFT '-': the prompts of a batch
     do not arrive one by one);
   - llamafactory: `llamafactory-cli api` (OpenAI-compatible, HF engine) on 127.0.0.1, started through
     tasks/runners/llamafactory_launch.py (placeholder torchaudio), streaming /v1/chat/completions. It runs with its
     defaults: MAX_CONCURRENT=1, i.e. one `generate` at a time, in arrival order;
   - triton-python: Triton with infra/triton/llm (dynamic batching, max_batch_size 32), streaming
     /v2/models/NAME/generate_stream (SSE);
   - triton-vllm: Triton with the vLLM Python-backend model (serve.backend=vllm, max_batch_size 64), same
     inputs and endpoint (continuous batching; from .venv-vllm, `make setup-vllm`).
2. rollout on Triton behind the gateway: one canary step (a control-API call), ramp 10 -> 50 -> 100 + promote,
   rollback.

Measurement. Each served engine answers one warm-up request before timing; then a thread pool of
`concurrency` workers sends max(--requests, concurrency) streaming requests. TTFT: send -> first chunk with
text; ITL: gaps between successive chunks of one request, pooled over requests. In-process rows note each
decode step with a streamer hook on `generate`. LlamaFactory streams words (TextIteratorStreamer), not
tokens, so its ITL is per word. Greedy decoding everywhere.

Output tokens = N per request, forced in every engine: min_new_tokens in-process, `min_length` for Triton's
models, and for LlamaFactory, whose requests take only `max_tokens`, a `min_new_tokens` in the served folder's
generation_config.json (a copy of the model folder whose other files are symlinks), which transformers
merges into the generation config LlamaFactory passes; so LlamaFactory gets one server per output length.
The returned text is re-tokenized as a check: a row whose answers are much shorter than N is counted from
the re-tokenized text instead and marked '*'. Special tokens are dropped from every engine's text, so a
model that emits them (an undertrained one emits <|endoftext|>) reads as short answers, and TTFT/ITL only
see the tokens that carry text.

Threads (--torch-threads, default 2, the cores of the machine this was written on): torch.set_num_threads in
this process, OMP_NUM_THREADS for LlamaFactory, serve.torch_threads for Triton's Python model; vLLM keeps its
own. The client runs in this process, on the same cores as the server: with a model as small as cpu-tiny,
torch threads for every core leave the client and the server's HTTP threads little CPU (Triton python at
concurrency 8 on cpu-tiny: 130-390 output tok/s with 2 threads vs 1,014-1,244 with 1), so compare with 1.

Models (--model):
- cpu-tiny: the merged model of an `llmops run` in --home (without --home, or with no merged model there,
  `llmops run` runs first into that LLMOPS_HOME);
- compute: a Qwen2 of ~23M parameters (hidden 512, 8 layers, 8 heads / 2 KV heads, intermediate 1408), made
  with tasks/base_model.py's functions (BPE on the task's text) but random weights (no pretrain: see
  COMPUTE_SHAPE; only its cost matters here), cached under
  LLMOPS_HOME/benchmarks/ (a temporary one without --home).

    .venv/bin/python benchmarks/serving_batching.py [--home LLMOPS_HOME] [--model cpu-tiny|compute]
        [--engines sequential,ceiling,llamafactory,triton-python,triton-vllm] [--concurrency 1,8,32,64]
        [--tokens 16,128] [--requests 64] [--torch-threads 2]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from tasks.platform.config import Profile, load_profile  # noqa: E402
from tasks.platform.ports import free_port  # noqa: E402
from tasks.serving.champion import triton_launch  # noqa: E402
from tasks.serving.client import Triton  # noqa: E402
from tasks.serving.model_config import serving_model  # noqa: E402
from tasks.serving.repository import render_model  # noqa: E402
from tasks.serving.server import TritonServer  # noqa: E402

ENGINES = ("sequential", "ceiling", "llamafactory", "triton-python", "triton-vllm")
IN_PROCESS = {"sequential": 1, "ceiling": 32}  # engine: batch size
VLLM_SERVE = ["serve.backend=vllm", "serve.max_batch_size=64"]
COMPUTE_SHAPE = {
    "hidden_size": 512,
    "num_hidden_layers": 8,
    "num_attention_heads": 8,
    "num_key_value_heads": 2,
    "intermediate_size": 1408,
    # Random weights: after a short pretrain (20 steps) the model mostly emits <|endoftext|>, the token
    # that ends every pretraining text; engines drop it from the text, so streams would carry no text.
    "pretrain_steps": 0,
}
SHORT_ANSWER = 0.5  # re-tokenized answers below this share of N: the engine did not force the length


@dataclass
class Timed:
    """One request: when it was sent, when each chunk with text arrived, and the text."""

    sent: float
    chunks: list[float] = field(default_factory=list)
    text: str = ""

    def gaps(self) -> list[float]:
        return [later - earlier for earlier, later in zip(self.chunks, self.chunks[1:], strict=False)]


@dataclass
class Row:
    engine: str
    concurrency: int
    tokens: int
    req_s: float
    tok_s: float
    ttft_p50: float | None
    ttft_p99: float | None
    itl_p50: float | None
    recounted: bool = False  # output tokens re-tokenized from the text (the length was not forced)

    @classmethod
    def of(
        cls,
        engine: str,
        concurrency: int,
        tokens: int,
        seconds: float,
        timed: list[Timed],
        output_tokens: int,
        ttft: bool = True,
        recounted: bool = False,
    ) -> Row:
        firsts = [(t.chunks[0] - t.sent) * 1000 for t in timed if t.chunks] if ttft else []
        gaps = [gap * 1000 for t in timed for gap in t.gaps()]
        return cls(
            engine,
            concurrency,
            tokens,
            len(timed) / seconds,
            output_tokens / seconds,
            percentile(firsts, 50),
            percentile(firsts, 99),
            percentile(gaps, 50),
            recounted,
        )


def percentile(values: list[float], q: float) -> float | None:
    import numpy as np

    return float(np.percentile(values, q)) if values else None


@dataclass
class Bench:
    model_dir: Path
    home: Path  # LLMOPS_HOME: vLLM's caches
    scratch: Path  # Triton's and LlamaFactory's folders and logs, removed at the end
    tokenizer: Any
    template: str  # LlamaFactory's name for the model's chat template
    tokens: list[int]
    concurrency: list[int]
    requests: int
    threads: int  # torch threads of every engine but vLLM
    load_s: dict[str, float] = field(default_factory=dict)  # Triton model load time by template (llm, vllm)


def prompts(n: int) -> list[str]:
    words = ["hot", "big", "fast", "open", "early", "full", "hard", "high", "long", "new", "rich", "strong"]
    return [f"What is the opposite of {words[i % len(words)]}?" for i in range(n)]


# --- models ---------------------------------------------------------------------------------------------


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


def compute_model(home: Path) -> Path:
    """The compute-bound model, built once per shape with tasks/base_model.py's own functions."""
    from tasks.base_model import build_tiny_qwen2, corpus
    from tasks.data.records import read_data
    from tasks.platform.config import TinyModel

    profile = load_profile("cpu-tiny")
    shape = TinyModel(**{**profile.base_model.tiny.model_dump(), **COMPUTE_SHAPE})
    key = hashlib.sha256(json.dumps(shape.model_dump(), sort_keys=True).encode()).hexdigest()[:12]
    folder = home / "benchmarks" / f"compute-qwen2-{key}"
    if not (folder / "config.json").is_file():
        print(f"bench: building the compute model into {folder} ...", flush=True)
        folder.parent.mkdir(parents=True, exist_ok=True)
        staging = Path(tempfile.mkdtemp(prefix=".compute-", dir=folder.parent))
        build_tiny_qwen2(corpus(read_data(profile.data).train), shape, staging)
        os.rename(staging, folder)
    return folder


def parameter_count(model_dir: Path) -> int:
    from safetensors import safe_open

    total = 0
    for path in model_dir.glob("*.safetensors"):
        with safe_open(str(path), "pt") as weights:
            total += sum(math.prod(weights.get_slice(name).get_shape()) for name in weights.keys())  # noqa: SIM118
    return total


def head_dim(model_dir: Path) -> int:
    config = json.loads((model_dir / "config.json").read_text())
    return config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]


# --- in-process rows ------------------------------------------------------------------------------------


class TokenClock:
    """A logits processor that changes nothing and notes when each decode step's logits are ready: the
    moment that step's token is chosen. (A `streamer` would do for batch 1 only.)"""

    def __init__(self) -> None:
        self.times: list[float] = []

    def __call__(self, input_ids, scores):
        self.times.append(time.perf_counter())
        return scores


def generate_timed(model, tokenizer, texts: list[str], tokens: int) -> list[Timed]:
    """One batched greedy `generate` of exactly `tokens` new tokens per prompt (left padding)."""
    import torch
    from transformers import LogitsProcessorList

    chats = [
        tokenizer.apply_chat_template([{"role": "user", "content": t}], add_generation_prompt=True, tokenize=False)
        for t in texts
    ]
    batch = tokenizer(chats, padding=True, add_special_tokens=False, return_tensors="pt")
    clock = TokenClock()
    sent = time.perf_counter()
    with torch.no_grad():
        out = model.generate(
            **batch,
            max_new_tokens=tokens,
            min_new_tokens=tokens,
            do_sample=False,
            pad_token_id=tokenizer.pad_token_id,
            logits_processor=LogitsProcessorList([clock]),
        )
    generated = out.shape[1] - batch["input_ids"].shape[1]
    if generated != tokens:
        raise RuntimeError(f"in-process generate made {generated} tokens, not {tokens}")
    return [Timed(sent, clock.times) for _ in texts]


def in_process_rows(bench: Bench, engines: list[str]) -> list[Row]:
    import torch
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(bench.threads)
    model = AutoModelForCausalLM.from_pretrained(bench.model_dir, dtype=torch.float32).eval()
    generate_timed(model, bench.tokenizer, prompts(1), 2)  # warm-up
    rows = []
    for engine, batch in IN_PROCESS.items():
        if engine not in engines:
            continue
        for tokens in bench.tokens:
            print(f"bench: {engine} (batch {batch}), {tokens} tokens ...", flush=True)
            texts = prompts(max(bench.requests, batch))
            started = time.perf_counter()
            timed = [
                t
                for i in range(0, len(texts), batch)
                for t in generate_timed(model, bench.tokenizer, texts[i : i + batch], tokens)
            ]
            seconds = time.perf_counter() - started
            rows.append(Row.of(engine, batch, tokens, seconds, timed, tokens * len(texts), ttft=batch == 1))
    return rows


# --- served rows ----------------------------------------------------------------------------------------


@dataclass
class Endpoint:
    """A streaming endpoint: its URL, the request body for (prompt, N) and the text of one SSE event."""

    url: str
    body: Callable[[str, int], dict]
    text_of: Callable[[dict], str]


def stream(client: httpx.Client, endpoint: Endpoint, text: str, tokens: int) -> Timed:
    timed = Timed(time.perf_counter())
    with client.stream("POST", endpoint.url, json=endpoint.body(text, tokens)) as response:
        if response.is_error:
            response.read()
            raise RuntimeError(f"{endpoint.url}: HTTP {response.status_code}: {response.text[:300]}")
        for line in response.iter_lines():
            if not line.startswith("data:"):
                continue
            data = line[len("data:") :].strip()
            if data == "[DONE]":
                break
            piece = endpoint.text_of(json.loads(data))
            if piece:
                timed.chunks.append(time.perf_counter())
                timed.text += piece
    return timed


def retokenized(tokenizer, timed: list[Timed]) -> int:
    return sum(len(tokenizer(t.text, add_special_tokens=False)["input_ids"]) for t in timed)


def measure(engine: str, endpoint: Endpoint, bench: Bench, tokens: int, concurrency: int) -> Row:
    print(f"bench: {engine} at concurrency {concurrency}, {tokens} tokens ...", flush=True)
    texts = prompts(max(bench.requests, concurrency))
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    with httpx.Client(timeout=600, limits=limits) as client:
        started = time.perf_counter()
        with ThreadPoolExecutor(concurrency) as pool:
            timed = list(pool.map(lambda text: stream(client, endpoint, text, tokens), texts))
        seconds = time.perf_counter() - started
    counted = retokenized(bench.tokenizer, timed)
    recounted = counted < SHORT_ANSWER * tokens * len(timed)
    output_tokens = counted if recounted else tokens * len(timed)
    return Row.of(engine, concurrency, tokens, seconds, timed, output_tokens, recounted=recounted)


def served_rows(engine: str, endpoints: Iterator[tuple[int, Endpoint]], bench: Bench) -> Iterator[Row]:
    for tokens, endpoint in endpoints:
        with httpx.Client(timeout=600) as client:
            stream(client, endpoint, prompts(1)[0], tokens)  # warm-up
        for concurrency in bench.concurrency:
            yield measure(engine, endpoint, bench, tokens, concurrency)


def stop_process(process: subprocess.Popen) -> None:
    if process.poll() is None:
        os.killpg(process.pid, signal.SIGTERM)
        try:
            process.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait(10)


def wait_ready(process: subprocess.Popen, url: str, log_path: Path, timeout: float = 300) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process.poll() is not None:
            tail = log_path.read_text(errors="replace").strip().splitlines()[-5:]
            raise RuntimeError(f"{process.args!r} exited with {process.returncode}: {' | '.join(tail)}")
        try:
            if httpx.get(url, timeout=2).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.5)
    raise RuntimeError(f"{url}: not ready after {timeout:.0f}s (log: {log_path})")


def forced_length_copy(model_dir: Path, tokens: int, folder: Path) -> Path:
    """`model_dir` with `min_new_tokens: tokens` in its generation config; the other files are symlinks."""
    folder.mkdir(parents=True)
    for item in model_dir.iterdir():
        if item.name != "generation_config.json":
            (folder / item.name).symlink_to(item.resolve())
    config_path = model_dir / "generation_config.json"
    config = json.loads(config_path.read_text()) if config_path.is_file() else {}
    (folder / "generation_config.json").write_text(json.dumps({**config, "min_new_tokens": tokens}, indent=2))
    return folder


@contextmanager
def llamafactory_server(model_dir: Path, template: str, threads: int, log_path: Path) -> Iterator[str]:
    """`llamafactory-cli api` with its HF engine on a free port of 127.0.0.1; yields its base URL."""
    port = free_port()
    env = {
        **os.environ,
        "API_HOST": "127.0.0.1",
        "API_PORT": str(port),
        "OMP_NUM_THREADS": str(threads),  # torch's intra-op threads
    }
    command = [
        *(sys.executable, "-m", "tasks.runners.llamafactory_launch", "api"),
        *("--model_name_or_path", str(model_dir)),
        *("--template", template),
        *("--infer_backend", "huggingface"),
        *("--infer_dtype", "float32"),
        *("--do_sample", "false"),  # its default samples (GeneratingArguments: do_sample true, temperature 0.95)
    ]
    with open(log_path, "ab") as log:
        process = subprocess.Popen(
            command, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
        )
    url = f"http://127.0.0.1:{port}"
    try:
        wait_ready(process, f"{url}/v1/models", log_path)
        yield url
    finally:
        stop_process(process)


def llamafactory_text(event: dict) -> str:
    return event["choices"][0]["delta"].get("content") or ""


def llamafactory_endpoints(bench: Bench) -> Iterator[tuple[int, Endpoint]]:
    for tokens in bench.tokens:
        folder = forced_length_copy(bench.model_dir, tokens, bench.scratch / f"llamafactory-model-{tokens}")
        log_path = bench.scratch / f"llamafactory-{tokens}.log"
        with llamafactory_server(folder, bench.template, bench.threads, log_path) as url:
            yield (
                tokens,
                Endpoint(
                    f"{url}/v1/chat/completions",
                    lambda text, n: {
                        "model": "bench",
                        "messages": [{"role": "user", "content": text}],
                        "max_tokens": n,
                        "stream": True,
                    },
                    llamafactory_text,
                ),
            )


def serving_values(profile: Profile, model_dir: Path) -> tuple[str, dict]:
    """The Triton template and values of the profile's serving model, as the canary renders them."""
    return serving_model(profile, model_dir, "benchmark")


def triton_text(event: dict) -> str:
    if "error" in event:
        raise RuntimeError(f"Triton: {event['error']}")
    return event.get("text_output", "")


def install(triton: Triton, template: str, name: str, values: dict) -> float:
    """Render the model into the server's repository and load it; the seconds the load took."""
    if triton.repository is None:
        raise RuntimeError(f"Triton at {triton.url}: no local model repository")
    render_model(template, triton.repository, name, values)
    started = time.perf_counter()
    triton.load(name, timeout=600)
    return time.perf_counter() - started


@contextmanager
def triton_model(bench: Bench, overrides: list[str], name: str = "bench") -> Iterator[TritonServer]:
    """A Triton started for the profile's serving backend, with the model loaded as `name`."""
    profile = load_profile("cpu-tiny", overrides)
    template, values = serving_values(profile, bench.model_dir)
    launcher, env = triton_launch(profile, bench.home)
    server = TritonServer.start(bench.scratch, None, launcher=launcher, extra_env=env)
    try:
        bench.load_s[template] = install(server.client, template, name, values)
        yield server
    finally:
        server.stop()


def python_serve(bench: Bench) -> list[str]:
    return ["serve.max_batch_size=32", f"serve.torch_threads={bench.threads}"]


def triton_endpoints(bench: Bench, overrides: list[str]) -> Iterator[tuple[int, Endpoint]]:
    with triton_model(bench, overrides) as server:
        endpoint = Endpoint(
            f"{server.client.url}/v2/models/bench/generate_stream",
            lambda text, n: {"text_input": text, "max_tokens": n, "min_length": n, "stream": True},
            triton_text,
        )
        for tokens in bench.tokens:
            yield tokens, endpoint


SERVED: dict[str, Callable[[Bench], Iterator[tuple[int, Endpoint]]]] = {
    "llamafactory": llamafactory_endpoints,
    "triton-python": lambda bench: triton_endpoints(bench, python_serve(bench)),
    "triton-vllm": lambda bench: triton_endpoints(bench, VLLM_SERVE),
}


# --- tables ---------------------------------------------------------------------------------------------


def cell(value: float | None, digits: int = 1) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def ratio(row: Row, base: Row | None) -> str:
    return "-" if base is None else f"{row.tok_s / base.tok_s:.2f}"


def print_engines(rows: list[Row]) -> None:
    order = {engine: i for i, engine in enumerate(ENGINES)}
    rows = sorted(rows, key=lambda r: (r.tokens, order[r.engine], r.concurrency))
    sequential = {r.tokens: r for r in rows if r.engine == "sequential"}
    llamafactory = {(r.concurrency, r.tokens): r for r in rows if r.engine == "llamafactory"}
    header = [
        ("engine", 14),
        ("concurrency", 11),
        ("out tokens", 10),
        ("req/s", 8),
        ("out tok/s", 10),
        ("TTFT p50 ms", 11),
        ("TTFT p99 ms", 11),
        ("ITL p50 ms", 10),
        ("x sequential", 12),
        ("x llamafactory", 14),
    ]
    print("  ".join(f"{name:>{width}}" if i else f"{name:{width}}" for i, (name, width) in enumerate(header)))
    for r in rows:
        values = [
            r.engine,
            str(r.concurrency),
            str(r.tokens),
            cell(r.req_s),
            cell(r.tok_s, 0) + ("*" if r.recounted else ""),
            cell(r.ttft_p50),
            cell(r.ttft_p99),
            cell(r.itl_p50),
            ratio(r, sequential.get(r.tokens)),
            ratio(r, llamafactory.get((r.concurrency, r.tokens))),
        ]
        print(
            "  ".join(
                f"{v:>{w}}" if i else f"{v:{w}}" for i, (v, (_, w)) in enumerate(zip(values, header, strict=True))
            )
        )
    if any(r.recounted for r in rows):
        print("* answers shorter than asked: output tokens counted by re-tokenizing the returned text")


def print_header(bench: Bench, model: str, engines: list[str]) -> None:
    print(
        f"\nmodel {model}: {bench.model_dir}\n"
        f"  {parameter_count(bench.model_dir):,} parameters, head_dim {head_dim(bench.model_dir)}; "
        f"machine: {os.cpu_count()} CPUs (nproc); {bench.threads} torch threads (in-process, LlamaFactory, Triton python)\n"
        f"  engines: {', '.join(engines)}; max({bench.requests}, concurrency or batch) prompts per row; greedy; "
        f"output tokens = N per request (forced in every engine, checked by re-tokenizing the answers)\n"
    )


def print_rollout(bench: Bench) -> None:
    """Rollout cost on a Triton serving the model as two versions, behind a gateway with its control API."""
    from tasks.control.contract import RouteTable, Version
    from tasks.platform.ports import free_port
    from tasks.runtime.gateway import Gateway, GatewayConfig
    from tasks.runtime.gateway.control import ControlApi
    from tasks.runtime.gateway.running import Listener, RunningGateway
    from tasks.serving.service import ServiceControl

    profile = load_profile("cpu-tiny", python_serve(bench))
    template, values = serving_values(profile, bench.model_dir)
    print("bench: rollout on Triton ...", flush=True)
    with triton_model(bench, python_serve(bench), "bench-a") as server:
        triton = server.client
        install(triton, template, "bench-b", values)
        a, b = Version("bench-a", "bench-a"), Version("bench-b", "bench-b")
        table = RouteTable("bench", a, b, {"bench-a": 100.0})
        key, port = "bench-control-key", free_port()
        gateway = Gateway(GatewayConfig(triton.url, "bench", 512, table=table, control_key=key))
        running = RunningGateway([Listener(ControlApi(gateway, key).app(lifespan=True), "127.0.0.1", port)], gateway)
        running.start()
        control = ServiceControl(f"http://127.0.0.1:{port}", key)
        try:
            timings = []
            started = time.perf_counter()
            control.set_weights({"bench-a": 90, "bench-b": 10}, "bench", 600)
            timings.append(("one canary step (a control-API call, no model load)", time.perf_counter() - started))
            started = time.perf_counter()
            for weight in profile.canary.steps:
                control.set_weights({"bench-b": weight, "bench-a": 100 - weight}, "bench", 600)
            control.put_table(RouteTable("bench", b, weights={"bench-b": 100.0}))
            triton.unload("bench-a")
            ramp = time.perf_counter() - started
            steps = profile.canary.steps
            timings.append((f"ramp {' -> '.join(map(str, steps))} + promote, without check windows", ramp))
            timings.append(
                (
                    f"  + check windows ({len(steps)} x {profile.canary.window_s:g} s, cpu-tiny)",
                    ramp + len(steps) * profile.canary.window_s,
                )
            )
            install(triton, template, "bench-a", values)
            control.put_table(RouteTable("bench", b, a, {"bench-b": 50.0, "bench-a": 50.0}))
            started = time.perf_counter()
            control.put_table(RouteTable("bench", b, weights={"bench-b": 100.0}))
            triton.unload("bench-a")
            timings.append(("rollback after a breach (champion alone + unload)", time.perf_counter() - started))
        finally:
            running.stop()
    for template, seconds in sorted(bench.load_s.items()):
        engine = {"llm": "Python-backend model", "vllm": "vLLM engine"}[template]
        timings.append((f"load of one version ({engine}): once per candidate, before the steps", seconds))
    print(f"\n{'rollout step':60} {'seconds':>8}")
    for name, seconds in timings:
        print(f"{name:60} {seconds:8.2f}")


# --- main -----------------------------------------------------------------------------------------------


def int_list(text: str) -> list[int]:
    return [int(part) for part in text.split(",") if part]


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--home", type=Path, help="an LLMOPS_HOME holding a merged model (default: a fresh temporary one)"
    )
    parser.add_argument("--model", choices=["cpu-tiny", "compute"], default="cpu-tiny")
    parser.add_argument("--engines", default=",".join(ENGINES), help="comma-separated, from: " + ", ".join(ENGINES))
    parser.add_argument("--concurrency", type=int_list, default=[1, 8, 32, 64])
    parser.add_argument("--tokens", type=int_list, default=[16, 128], help="output lengths N")
    parser.add_argument("--requests", type=int, default=64, help="prompts per row (at least the concurrency)")
    parser.add_argument(
        "--torch-threads",
        type=int,
        default=2,
        help="torch threads in-process, in LlamaFactory and in Triton's Python model",
    )
    args = parser.parse_args()
    args.engines = [e for e in args.engines.split(",") if e]
    unknown = sorted(set(args.engines) - set(ENGINES))
    if unknown:
        parser.error(f"unknown engine(s) {', '.join(unknown)}; choose from {', '.join(ENGINES)}")
    return args


def main() -> None:
    args = parse_args()
    scratch = Path(tempfile.mkdtemp(prefix="llmops-serve-bench-"))
    home = (args.home or scratch / "home").resolve()
    failures: list[str] = []
    try:
        model_dir = (merged_model(home) if args.model == "cpu-tiny" else compute_model(home)).resolve()
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(model_dir, padding_side="left")
        template = load_profile("cpu-tiny").train.template
        bench = Bench(
            model_dir,
            home,
            scratch,
            tokenizer,
            template,
            args.tokens,
            args.concurrency,
            args.requests,
            args.torch_threads,
        )
        rows = in_process_rows(bench, args.engines) if set(IN_PROCESS) & set(args.engines) else []
        for engine in (e for e in ENGINES if e in SERVED and e in args.engines):
            try:  # one engine that fails (to start, to load, mid-run) keeps the rows of the others
                for row in served_rows(engine, SERVED[engine](bench), bench):
                    rows.append(row)
            except Exception as exc:
                failures.append(f"{engine}: {type(exc).__name__}: {exc}")
                print(f"bench: {failures[-1]}", flush=True)
        print_header(bench, args.model, args.engines)
        print_engines(rows)
        for failure in failures:
            print(f"FAILED {failure}")
        print_rollout(bench)
    finally:
        if failures:  # the servers' logs (triton/tritonserver.log, llamafactory-N.log) say why
            print(f"bench: logs kept in {scratch}")
        else:
            shutil.rmtree(scratch, ignore_errors=True)


if __name__ == "__main__":
    main()
