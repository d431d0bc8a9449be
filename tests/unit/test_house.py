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


# --- the import contract: the layers of tasks/ ------------------------------------------------------------------

# tasks/'s packages, what stages share; runtime: `llmops serve`'s, which shares what it serves through control;
# reporting: the release report, drawn from the files the stages wrote
SHARED = {"platform", "text", "data", "quality", "serving", "runners", "runtime", "load", "control", "reporting"}


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def project_imports() -> dict[str, set[str]]:
    """Every module of tasks/ and the modules of tasks/ it imports: at the top, in functions, for type checking."""
    paths = {module_name(p): p for p in (ROOT / "tasks").rglob("*.py")}
    graph: dict[str, set[str]] = {}
    for name, path in paths.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        named: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                named |= {alias.name for alias in node.names}
            elif isinstance(node, ast.ImportFrom):
                base = package.split(".")[: len(package.split(".")) - node.level + 1] if node.level else []
                module = ".".join([*base, *([node.module] if node.module else [])])
                named |= {module, *(f"{module}.{alias.name}" for alias in node.names)}
        found = set()
        for module in named:
            while module and module not in paths:
                module = module.rpartition(".")[0]
            if module and module != name:
                found.add(module)
        graph[name] = found
    return graph


def layer(module: str) -> str:
    """`stage` for tasks/<stage>.py, else the shared package's name."""
    part = module.split(".")[1] if "." in module else ""
    return part if part in SHARED else "stage"


def test_the_layers_hold_stages_use_shared_packages_and_never_the_reverse():
    broken = []
    for module, imported in sorted(project_imports().items()):
        for other in sorted(imported):
            here, there = layer(module), layer(other)
            if (
                (here != "stage" and there == "stage")  # a shared package never imports a stage
                # training's side knows nothing of serving
                or (here in ("quality", "data") and there in ("serving", "runtime", "load"))
                or (here in ("platform", "text") and there != here)  # the bottom: nothing else of the project
                # the release side reaches the runtime through the control API's contract alone (tasks/control/)
                or (here != "runtime" and there == "runtime")
                or (here == "control" and there not in ("control", "platform"))  # plain data, below both sides
                # the release report reads what stages wrote, never the stages' objects
                or (here == "reporting" and there not in ("reporting", "platform"))
            ):
                broken.append(f"{module} -> {other}")
    assert broken == []


def test_no_module_of_tasks_imports_itself_back():
    graph, cycles = project_imports(), []

    def reaches(start: str, goal: str, seen: set[str]) -> bool:
        for nxt in graph[start]:
            if nxt == goal or (nxt not in seen and (seen.add(nxt) or reaches(nxt, goal, seen))):
                return True
        return False

    for module in sorted(graph):
        if reaches(module, module, set()):
            cycles.append(module)
    assert cycles == []


def test_no_module_of_flows_shadows_a_package_the_stages_import():
    """A Prefect worker loads a deployment's entrypoint (flows/retrain.py:retrain) with flows/ put on sys.path, so a
    flows/triton.py was what torch's `import triton` found there (the retrain run died importing transformers)."""
    import importlib.metadata
    import sys

    # the top-level names of what is installed and of the standard library (read from metadata, not sys.path, which
    # other tests extend with benchmarks/), and what the ML stack imports where it is installed (torch: triton)
    taken = set(importlib.metadata.packages_distributions()) | set(sys.stdlib_module_names)
    taken |= {"triton", "flash_attn", "xformers", "apex", "deepspeed", "vllm", "tensorrt_llm", "bitsandbytes"}
    modules = [path for path in sorted((ROOT / "flows").glob("*.py")) if path.stem != "__init__"]
    assert [path.name for path in modules if path.stem in taken] == []
