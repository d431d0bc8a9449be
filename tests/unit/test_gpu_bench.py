"""benchmarks/gpu_bench.py (`make gpu-bench`) where no GPU is: it refuses without one, its GPU sizes are the ones the
docs state, and its steps run on the CPU (--allow-cpu) on one layer of Qwen2.5-7B's shapes through the train stage's
own config and launcher and through bare LlamaFactory, then merge and generate."""

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
BENCH = ROOT / "benchmarks" / "gpu_bench.py"
sys.path.insert(0, str(ROOT / "benchmarks"))

import gpu_bench  # noqa: E402


def test_without_a_gpu_it_says_so_and_exits_2(tmp_path):
    done = subprocess.run(
        [sys.executable, str(BENCH), "--out", str(tmp_path / "bench.json")], capture_output=True, text=True, cwd=ROOT
    )
    assert done.returncode == 2
    assert "no CUDA GPU visible to torch" in done.stderr and "--allow-cpu" in done.stderr
    assert not (tmp_path / "bench.json").exists()


def test_on_a_gpu_it_trains_the_stated_sizes():
    args = gpu_bench.with_defaults(gpu_bench.parse_args([]), on_gpu=True)
    assert (args.steps, args.cutoff, args.batch, args.answer_tokens) == (20, 1024, 4, 128)
    assert gpu_bench.with_defaults(gpu_bench.parse_args(["--cutoff", "2048"]), on_gpu=True).cutoff == 2048


def test_every_seven_and_eight_b_profile_names_the_shape_the_bench_builds():
    from tasks.platform.config import load_profile

    shapes = {name: load_profile(name).base_model.architecture for name in ("qwen-7b-vllm-h100", "llama3-8b-h100-fp8")}
    assert shapes["qwen-7b-vllm-h100"].hidden_size == 3584 and shapes["qwen-7b-vllm-h100"].vocab_size == 152064
    assert shapes["llama3-8b-h100-fp8"].num_hidden_layers == 32 and shapes["llama3-8b-h100-fp8"].vocab_size == 128256


def test_on_the_cpu_the_pipeline_and_bare_llamafactory_train_the_same_tokens(tmp_path):
    """As documented: `make gpu-bench` with --allow-cpu, the numbers in $OUT."""
    out = tmp_path / "gpu_bench.json"
    done = subprocess.run(
        ["make", "-s", "gpu-bench", f"GPU_BENCH_ARGS=--allow-cpu --work {tmp_path / 'work'}"],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=240,
        env={**os.environ, "PYTHON": sys.executable, "OUT": str(tmp_path)},
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    steps = {step["name"]: step for step in json.loads(out.read_text())["steps"]}
    assert steps["base"]["numbers"]["architecture"] == "Qwen2" and steps["base"]["numbers"]["layers"] == 1
    lora, bare = steps["lora"]["numbers"], steps["bare"]["numbers"]
    # every sample is cut to exactly the cutoff: what LlamaFactory counted is steps x batch x cutoff
    assert lora["tokens_seen"] == lora["steps"] * lora["tokens_per_step"] == 1 * 2 * 32
    assert bare["steps"] == lora["steps"] and bare["tokens_per_s_per_gpu"] > 0 and bare["pipeline_over_bare"] > 0
    assert steps["qlora"]["status"] == "skipped" and "CUDA" in steps["qlora"]["note"]
    assert steps["merge"]["status"] == "ok" and steps["merge"]["numbers"]["max_abs_dlogits"] < 1e-3
    assert steps["generate"]["numbers"]["tokens_per_s_batch_32"] > 0
    assert "pipeline_over_bare" in done.stdout and "gpu-bench: numbers in" in done.stdout
