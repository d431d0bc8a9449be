"""Code that runs inside a heavy stage's image (the NGC TensorRT-LLM image: Python 3.12, its own
TensorRT-LLM and transformers, no Prefect, MLflow or LlamaFactory) imports nothing of the orchestrator,
and the whole project is valid Python 3.12 (requires-python >=3.11,<3.13).

Run under a real Python 3.12 (pyenv's, else `python3.12` on PATH) in isolated mode: no site-packages
at all, so an import of anything outside the standard library fails here as it would in the image."""

from __future__ import annotations

import ast
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
# Modules the images run: the engine evaluation (TensorRT-LLM image), and what it and the Triton models share.
STAGE_SIDE = [
    "tasks.runners.tensorrt_llm_check",
    "tasks.runners.modelopt_quantize",
    "tasks.platform.errors",
    "tasks.quality.chat",
    "tasks.serving.engine_guard",
]
ORCHESTRATOR = ("prefect", "mlflow", "llamafactory", "flows")


def python312() -> str:
    for candidate in (Path.home() / ".pyenv/versions/3.12.1/bin/python3.12", shutil.which("python3.12")):
        if candidate and Path(candidate).is_file():
            return str(candidate)
    pytest.skip("no Python 3.12 on this machine (pyenv install 3.12, or apt-get install python3.12)")


def imported_names(module: str) -> set[str]:
    """Every module a file imports, at the top or inside functions (lazy imports count)."""
    tree = ast.parse((ROOT / (module.replace(".", "/") + ".py")).read_text())
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
    return names


@pytest.mark.parametrize("module", STAGE_SIDE)
def test_stage_side_modules_name_no_orchestrator_package(module):
    leaked = {name for name in imported_names(module) if name.split(".")[0] in ORCHESTRATOR}
    assert not leaked, f"{module} imports {sorted(leaked)}: it runs inside an image that has none of them"


def test_stage_side_modules_import_under_python_312_without_any_package():
    script = "import importlib, sys; [importlib.import_module(m) for m in sys.argv[1:]]; print('ok')"
    result = subprocess.run(
        [python312(), "-I", "-B", "-c", f"import sys; sys.path.insert(0, {str(ROOT)!r}); {script}", *STAGE_SIDE],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 0 and result.stdout.strip() == "ok", result.stderr[-2000:]


def test_the_whole_project_compiles_under_python_312(tmp_path):
    result = subprocess.run(
        # -I ignores PYTHONPYCACHEPREFIX; -X pycache_prefix leaves no 3.12 bytecode in the tree
        [
            python312(),
            "-I",
            "-X",
            f"pycache_prefix={tmp_path}",
            "-m",
            "compileall",
            "-q",
            "flows",
            "tasks",
            "infra/triton",
            "benchmarks",
        ],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
    )
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
