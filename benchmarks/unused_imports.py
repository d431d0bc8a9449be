"""What leaving out the libraries a process never calls saves the processes that leave them out: each kind started as
it would start with them (what a new Python process, `llamafactory-cli` or `genai-perf` does) and as it starts now,
in turn, round after round; the CPU seconds, the peak resident memory and the modules of each, side by side.

- Triton Python model: what infra/triton/llm/1/model.py's `initialize` does on cpu-tiny's model shape (torch and
  transformers imported, the model and its tokenizer loaded, one forward pass), without scikit-learn, scipy and
  accelerate.
- LlamaFactory launcher: the imports before LlamaFactory's first line (its trainer), without scikit-learn, boto3 and
  bitsandbytes (tasks/runners/llamafactory_launch.py, for cpu-tiny's training).
- genai-perf runner: genai-perf and transformers' tokenizers (tasks/runners/genai_perf_fork.py), without scikit-learn
  and accelerate.

    .venv/bin/python benchmarks/unused_imports.py [--rounds 5]
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PLACEHOLDER = ROOT / "infra" / "images" / "torchaudio-placeholder"

TRITON_MODEL = """
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer
torch.set_num_threads(1)
model = AutoModelForCausalLM.from_pretrained(sys.argv[1], dtype=torch.float32).eval()
tokenizer = AutoTokenizer.from_pretrained(sys.argv[1])
with torch.no_grad():
    model(input_ids=tokenizer("What is the opposite of up?", return_tensors="pt").input_ids)
"""
# (name, what its start runs, what it leaves out now)
KINDS = [
    ("Triton Python model", TRITON_MODEL, ["sklearn", "scipy", "accelerate"]),
    (
        "LlamaFactory launcher",
        f"sys.path.insert(0, {str(PLACEHOLDER)!r})\nfrom llamafactory.train.tuner import run_exp",
        ["sklearn", "boto3", "bitsandbytes"],
    ),
    ("genai-perf runner", "import genai_perf.main\nfrom transformers import AutoTokenizer", ["sklearn", "accelerate"]),
]


def start(code: str, left_out: list[str], model: Path, scratch: Path) -> tuple[float, float, int]:
    """CPU seconds, peak resident MiB and modules of one `python -c code` (the kernel's accounting of that child)."""
    absent = "".join(f"sys.modules.setdefault({name!r}, None)\n" for name in left_out)
    # the peak of this program alone (VmHWM): the kernel's ru_maxrss of a child starts from what its parent held
    peak = "print(len(sys.modules), open('/proc/self/status').read().split('VmHWM:')[1].split()[0])"
    program = f"import sys\n{absent}{code}\n{peak}"
    out = scratch / "modules.txt"
    with open(out, "w") as stdout:
        process = subprocess.Popen(
            [sys.executable, "-c", program, str(model)], cwd=ROOT, stdout=stdout, stderr=subprocess.DEVNULL
        )
        _, status, usage = os.wait4(process.pid, 0)
    process.returncode = os.waitstatus_to_exitcode(status)
    if process.returncode != 0:
        raise SystemExit(f"{code.strip().splitlines()[0]} ...: exited with {process.returncode}")
    modules, peak_kib = out.read_text().split()[-2:]
    return usage.ru_utime + usage.ru_stime, int(peak_kib) / 1024, int(modules)


def cpu_tiny_model(folder: Path) -> Path:
    """cpu-tiny's base model shape, unpretrained (benchmarks/vllm_engine_idle.py), made in a process of its own."""
    make = f"from vllm_engine_idle import tiny_model; from pathlib import Path; tiny_model(Path({str(folder)!r}))"
    subprocess.run([sys.executable, "-c", make], cwd=Path(__file__).parent, check=True, capture_output=True)
    return folder / "tiny-qwen2"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=5, help="starts of each side per kind, in turn; medians shown")
    args = parser.parse_args()
    print(f"{'process':22s} {'':12s} {'CPU-s':>7s} {'peak MiB':>9s} {'modules':>8s}  (median of {args.rounds})")
    with tempfile.TemporaryDirectory() as folder:
        scratch = Path(folder)
        model = cpu_tiny_model(scratch)
        for name, code, left_out in KINDS:
            sides: dict[str, list[tuple[float, float, int]]] = {"with them": [], "left out": []}
            start(code, [], model, scratch)  # a warm-up: both sides then read the same files from the page cache
            for _ in range(args.rounds):
                sides["with them"].append(start(code, [], model, scratch))
                sides["left out"].append(start(code, left_out, model, scratch))
            medians = {
                side: [statistics.median(column) for column in zip(*runs, strict=True)] for side, runs in sides.items()
            }
            for side, (cpu, peak, modules) in medians.items():
                print(f"{name if side == 'with them' else '':22s} {side:12s} {cpu:7.2f} {peak:9.0f} {modules:8.0f}")
            (cpu_with, peak_with, _), (cpu_out, peak_out, _) = medians.values()
            ratios = [a / b for (a, *_), (b, *_) in zip(sides["left out"], sides["with them"], strict=True)]
            print(
                f"{'':22s} {'saved':12s} {cpu_with - cpu_out:7.2f} {peak_with - peak_out:9.0f}"
                f"   CPU left out / with, pair by pair: median {statistics.median(ratios):.2f}"
                f" ({min(ratios):.2f} to {max(ratios):.2f}); left out: {', '.join(left_out)}",
                flush=True,
            )


if __name__ == "__main__":
    main()
