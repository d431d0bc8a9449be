"""The benchmarks import what the project still has: every `from tasks|flows|tests.X import name` in benchmarks/*.py
(at the top or inside a function) names a module and an attribute that exist. A benchmark runs for minutes on a
service; a name moved elsewhere would otherwise be found only then (benchmarks/predict.py once imported open_store
from its old module)."""

from __future__ import annotations

import ast
import importlib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PROJECT_PACKAGES = ("tasks", "flows", "tests")


def project_imports(script: Path) -> list[tuple[int, str, str]]:
    """(line, module, name) of each name the script imports from this project."""
    found = []
    for node in ast.walk(ast.parse(script.read_text(), str(script))):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] in PROJECT_PACKAGES:
            found += [(node.lineno, node.module, alias.name) for alias in node.names]
        elif isinstance(node, ast.Import):
            found += [(node.lineno, a.name, "") for a in node.names if a.name.split(".")[0] in PROJECT_PACKAGES]
    return found


@pytest.mark.parametrize("script", sorted((ROOT / "benchmarks").glob("*.py")), ids=lambda path: path.name)
def test_a_benchmark_imports_only_what_the_project_has(script: Path):
    missing = []
    for line, module_name, name in project_imports(script):
        module = importlib.import_module(module_name)
        if name and not hasattr(module, name):
            try:  # a submodule imported by name (from tasks.serving import vllm)
                importlib.import_module(f"{module_name}.{name}")
            except ModuleNotFoundError:
                missing.append(f"{script.name}:{line}: {module_name} has no {name}")
    assert missing == []


def test_the_gateway_benchmark_pins_a_process_tree_apart_and_back(monkeypatch):
    """`gateway_overhead.py --apart`: every thread of a process and its children on the cores given, then on every
    core again."""
    import os
    import subprocess
    import sys
    import time

    import psutil

    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    gateway_overhead = importlib.import_module("gateway_overhead")
    # a parent with a second thread that started before the pinning, and a child
    script = "import subprocess, threading; threading.Thread(target=subprocess.run, args=(['sleep', '30'],)).start()"
    parent = subprocess.Popen([sys.executable, "-c", script])
    try:
        deadline = time.monotonic() + 10
        while not psutil.Process(parent.pid).children() and time.monotonic() < deadline:
            time.sleep(0.05)
        tree = [psutil.Process(parent.pid), *psutil.Process(parent.pid).children(recursive=True)]
        threads = [thread.id for process in tree for thread in process.threads()]
        gateway_overhead.pin(parent.pid, [0])
        assert len(tree) == 2 and len(threads) >= 3
        assert [os.sched_getaffinity(tid) for tid in threads] == [{0}] * len(threads)
        gateway_overhead.pin(parent.pid, None)
        assert [os.sched_getaffinity(tid) for tid in threads] == [set(range(psutil.cpu_count()))] * len(threads)
    finally:
        for process in psutil.Process(parent.pid).children(recursive=True):
            process.kill()
        parent.kill()


def test_the_gateway_benchmark_names_a_wrong_serving_setting_before_it_starts_anything():
    """`gateway_overhead.py --set`: each setting validated as `llmops run --set` is, a wrong one refused in one line."""
    import subprocess
    import sys

    done = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "gateway_overhead.py"), "--set", "serve.max_queue_delay_us=-1"],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
    )
    assert done.returncode == 2, done.stdout + done.stderr
    assert "serve.max_queue_delay_us" in done.stderr.splitlines()[-1], done.stderr


def test_the_unused_imports_benchmark_starts_a_process_without_what_it_leaves_out(tmp_path, monkeypatch):
    """benchmarks/unused_imports.py's start: a process whose left-out library is absent to importlib's checks (as
    transformers makes them), with its CPU, its own peak memory and its modules; a start that fails stops it."""
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    unused_imports = importlib.import_module("unused_imports")
    code = "import importlib.util\nassert importlib.util.find_spec('sklearn') is None"
    cpu, peak_mib, modules = unused_imports.start(code, ["sklearn"], tmp_path, tmp_path)
    assert cpu > 0 and 1 < peak_mib < 200 and modules > 10
    with pytest.raises(SystemExit, match="exited with 1"):  # installed here: with it, the check fails
        unused_imports.start(code, [], tmp_path, tmp_path)


def test_the_bytecode_benchmark_reads_kept_bytecode_from_its_own_prefix_only(tmp_path, monkeypatch):
    """benchmarks/bytecode_cache.py's measure: the bytecode its "kept" runs read is kept under the benchmark's prefix,
    and the module's own folder gets no __pycache__ (the environments stay as they were)."""
    import os
    import sys

    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    bytecode_cache = importlib.import_module("bytecode_cache")
    package = tmp_path / "src"
    package.mkdir()
    (package / "tiny_module.py").write_text("".join(f"def f{i}(x):\n    return x + {i}\n" for i in range(200)))
    base = {k: v for k, v in os.environ.items() if k not in ("PYTHONDONTWRITEBYTECODE", "PYTHONPYCACHEPREFIX")}
    base["PYTHONPATH"] = str(package)
    prefix = tmp_path / "prefix"
    source, kept = bytecode_cache.measure(Path(sys.executable), "import tiny_module", base, prefix, rounds=1)
    assert source > 0 and kept > 0
    assert [p.name for p in prefix.rglob("tiny_module*.pyc")] == [f"tiny_module.{sys.implementation.cache_tag}.pyc"]
    assert not (package / "__pycache__").exists()


def test_the_step_loads_ttft_p99_is_prometheus_histogram_quantile_over_the_steps_counts():
    from benchmarks.autoscale_step import histogram_quantile

    before = {0.1: 5.0, 0.5: 5.0, 1.0: 5.0, float("inf"): 5.0}
    after = {0.1: 55.0, 0.5: 95.0, 1.0: 105.0, float("inf"): 105.0}  # 50 under 0.1 s, 40 to 0.5 s, 10 to 1 s
    assert histogram_quantile(0.5, before, after) == 100.0  # the 50th of 100: the top of the first bucket
    assert abs(histogram_quantile(0.99, before, after) - 950.0) < 1e-6  # 9 of the last bucket's 10, linearly
    assert histogram_quantile(0.99, after, after) != histogram_quantile(0.99, after, after)  # no request: NaN
