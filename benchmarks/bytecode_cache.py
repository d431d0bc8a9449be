"""What kept bytecode saves each process a release starts: the CPU seconds of each kind's imports compiled from
source (what every process paid where PYTHONDONTWRITEBYTECODE=1 is set, as on the machines this project is built
on, before the Makefile unset it) against read from kept bytecode, side by side in one run. Prints a table.

Neither side touches the environments' own __pycache__: each kind reads bytecode under a temporary
PYTHONPYCACHEPREFIX of its own that first holds the standard library's bytecode only (compiled there by compileall,
as Python's own install compiled it). "From source" runs with PYTHONDONTWRITEBYTECODE=1; one run without it then
keeps the rest, which "kept" reads.

    .venv/bin/python benchmarks/bytecode_cache.py [--rounds 3]
"""

from __future__ import annotations

import argparse
import os
import resource
import shutil
import statistics
import subprocess
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# (what starts it, environment, the imports of its start)
KINDS = [
    ("llmops run", ".venv", "import flows.release"),
    (
        "Prefect server",
        ".venv",
        "import prefect.server.api.server, prefect.plugins; prefect.plugins.load_prefect_collections()",
    ),
    ("MLflow server", ".venv", "import mlflow.server"),
    ("Triton model (python)", ".venv", "import torch; from transformers import AutoModelForCausalLM, AutoTokenizer"),
    ("genai-perf", ".venv", "import genai_perf.main"),
    ("AIPerf service", ".venv-aiperf", "import aiperf.cli"),
    ("vLLM engine", ".venv-vllm", "import vllm.entrypoints.openai.api_server"),
]


def cpu_seconds(python: Path, code: str, env: dict[str, str]) -> float:
    """User + system CPU seconds of `python -c code` (the child's own, from the kernel's accounting)."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    subprocess.run([str(python), "-c", code], env=env, cwd=ROOT, check=True, capture_output=True)
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    return (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)


def measure(python: Path, code: str, base: dict[str, str], prefix: Path, rounds: int) -> tuple[float, float]:
    """Median CPU seconds of `code` compiled from source and read from bytecode kept under `prefix`: the source runs
    write nothing there, one run then keeps what the "kept" runs read."""
    source_env = {**base, "PYTHONDONTWRITEBYTECODE": "1", "PYTHONPYCACHEPREFIX": str(prefix)}
    kept_env = {**base, "PYTHONPYCACHEPREFIX": str(prefix)}
    source = statistics.median(cpu_seconds(python, code, source_env) for _ in range(rounds))
    cpu_seconds(python, code, kept_env)  # keeps the bytecode the "kept" side reads
    return source, statistics.median(cpu_seconds(python, code, kept_env) for _ in range(rounds))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3, help="runs of each side per kind; the median is shown")
    args = parser.parse_args()
    base = {k: v for k, v in os.environ.items() if k not in ("PYTHONDONTWRITEBYTECODE", "PYTHONPYCACHEPREFIX")}
    print(
        f"{'process':24s} {'from source':>12s} {'kept':>8s} {'saved':>7s}  (CPU-s of its imports, median of {args.rounds})"
    )
    with tempfile.TemporaryDirectory() as scratch:
        stdlib_only = Path(scratch) / "stdlib"
        compiled: set[str] = set()
        for number, (name, venv, code) in enumerate(KINDS):
            python = ROOT / venv / "bin" / "python"
            if not python.exists():
                print(f"{name:24s} {'-':>12s} {'-':>8s} {'-':>7s}  ({venv} not set up)")
                continue
            stdlib = subprocess.run(
                [str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['stdlib'])"],
                capture_output=True,
                text=True,
                check=True,
            ).stdout.strip()
            if stdlib not in compiled:  # what every install of Python has: only the packages' bytecode differs
                compile_env = {**base, "PYTHONPYCACHEPREFIX": str(stdlib_only)}
                # its test suites hold files that do not compile on purpose: compileall names them, nothing more
                subprocess.run(
                    [str(python), "-m", "compileall", "-q", "-j", "0", stdlib], env=compile_env, capture_output=True
                )
                compiled.add(stdlib)
            # a prefix per kind: modules one kind kept would otherwise be read by the next kind's "from source"
            prefix = Path(scratch) / f"kind-{number}"
            shutil.copytree(stdlib_only, prefix)
            source, cached = measure(python, code, base, prefix, args.rounds)
            print(f"{name:24s} {source:12.2f} {cached:8.2f} {source - cached:7.2f}", flush=True)


if __name__ == "__main__":
    main()
