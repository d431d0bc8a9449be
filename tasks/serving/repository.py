"""Triton model repositories: one folder per model, rendered from infra/triton/<kind>/ templates.

Rendering is strict (a missing, unknown or malformed `${variable}` fails at render time) and atomic
(a temporary folder renamed into place), so a half-written model folder never exists. Each Python-backend
model (a template with 1/model.py) gets a copy of the helpers its model.py imports next to it (MODEL_HELPERS:
tasks/text/model_text.py, the text helpers; tasks/serving/adapter_registry.py, the base engine's adapter map;
tasks/serving/engine_guard.py, the engine processes' watcher): each is written once, and a load request sends the
copies with the folder's other files.
"""

from __future__ import annotations

import os
import re
import shutil
import string
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from tasks.platform.errors import BadInput
from tasks.platform.project import PROJECT_ROOT
from tasks.serving import adapter_registry, engine_guard
from tasks.serving.client import Triton
from tasks.text import model_text

TEMPLATES = PROJECT_ROOT / "infra" / "triton"
NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*$")
MODEL_HELPERS = (model_text, adapter_registry, engine_guard)  # standard-library modules copied next to every model.py


def render_template(text: str, values: dict[str, object], source: str) -> str:
    """`${var}` substitution that refuses a missing variable, an unused (unknown) value and a bad placeholder.

    TensorRT-LLM's fill_template leaves unknown `${...}` in place silently; a config with a literal
    `${triton_max_batch_size}` then fails far from its cause. Here it fails at render time.
    """
    template = string.Template(text)
    if not template.is_valid():
        raise BadInput(f"template {source}: malformed placeholder (use ${{name}})")
    wanted = set(template.get_identifiers())
    missing, unknown = sorted(wanted - set(values)), sorted(set(values) - wanted)
    if missing:
        raise BadInput(f"template {source}: no value for {', '.join('${' + m + '}' for m in missing)}")
    if unknown:
        raise BadInput(f"template {source}: unknown variable(s) {', '.join(unknown)} (not in the template)")
    return template.substitute({k: str(v) for k, v in values.items()})


def render_model(kind: str, repository: Path, name: str, values: dict[str, object]) -> Path:
    """Render infra/triton/<kind>/ into repository/<name>/, atomically (a temporary folder renamed in)."""
    if not NAME_RE.match(name):
        raise BadInput(f"model name {name!r}: use letters, digits, '-', '_' or '.'")
    source = TEMPLATES / kind
    if not (source / "config.pbtxt").is_file():
        raise BadInput(f"template {source}: no config.pbtxt")
    repository.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{name}-", dir=repository))
    try:
        shutil.copytree(source, staging, dirs_exist_ok=True, ignore=shutil.ignore_patterns("__pycache__"))
        if (staging / "1" / "model.py").is_file():
            for helper in MODEL_HELPERS:
                shutil.copyfile(str(helper.__file__), staging / "1" / helper.FILE_NAME)
        config = render_template(
            (source / "config.pbtxt").read_text(), {"model_name": name, **values}, str(source / "config.pbtxt")
        )
        (staging / "config.pbtxt").write_text(config)
        target = repository / name
        if target.exists():
            old = repository / f".old-{name}-{os.getpid()}-{time.monotonic_ns()}"
            os.rename(target, old)
            os.rename(staging, target)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.rename(staging, target)
        return target
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise


@contextmanager
def model_folders(triton: Triton) -> Iterator[Path]:
    """Where model folders are rendered: the server's repository when this machine shares it, else a
    temporary folder whose models go with their load requests (nothing is written on the server's side)."""
    if triton.repository is not None:
        yield triton.repository
        return
    with tempfile.TemporaryDirectory(prefix="llmops-models-") as folder:
        yield Path(folder)


def load_rendered(triton: Triton, name: str, folder: Path, timeout: float) -> None:
    triton.load(name, timeout=timeout, model_folder=None if triton.repository is not None else folder / name)
