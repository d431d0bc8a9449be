"""The house rules a newcomer relies on: tasks/ holds one module per DAG stage, named after its stage
function; what stages share lives in subpackages; no module or function grows past what one can read."""

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
STAGES = {
    "prepare_data",
    "base_model",
    "train",
    "evaluate",
    "merge",
    "quantize",
    "build_engine",
    "register",
    "deploy_canary",
    "tune_serving",
    "shadow",
    "benchmark",
    "gate",
    "approve",
    "rollout",
}
MAX_MODULE_LINES = 400
MAX_FUNCTION_LINES = 80
LONG_ON_PURPOSE = {("flows/release.py", "release")}  # the DAG reads in one function


def project_modules() -> list[Path]:
    return sorted(p for folder in ("tasks", "flows") for p in (ROOT / folder).rglob("*.py"))


def test_tasks_top_level_holds_one_module_per_stage_named_after_its_stage_function():
    modules = {p.stem for p in (ROOT / "tasks").glob("*.py")} - {"__init__"}
    assert modules == STAGES
    for stage in STAGES:
        tree = ast.parse((ROOT / "tasks" / f"{stage}.py").read_text())
        assert stage in {n.name for n in tree.body if isinstance(n, ast.FunctionDef)}, f"tasks/{stage}.py"


def test_no_module_or_function_is_too_long_to_read():
    too_long = []
    for path in project_modules():
        source = path.read_text()
        where = str(path.relative_to(ROOT))
        if len(source.splitlines()) > MAX_MODULE_LINES:
            too_long.append(f"{where}: {len(source.splitlines())} lines")
        for node in ast.walk(ast.parse(source)):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) and (where, node.name) not in LONG_ON_PURPOSE:
                length = node.end_lineno - node.lineno + 1
                if length > MAX_FUNCTION_LINES:
                    too_long.append(f"{where}:{node.lineno} {node.name}: {length} lines")
    assert not too_long, too_long
