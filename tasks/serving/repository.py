"""Triton model repositories: one folder per model, rendered from infra/triton/<kind>/ templates.

Rendering builds data, not text: a template's config.pbtxt is parsed into Triton's ModelConfig (the protobuf types
tritonclient ships), each value is set on its typed field (the name, max_batch_size, the batcher's delay and queue,
the instance count) or on a parameter the template declares, and the message is serialized by protobuf. A value
cannot reach any other field whatever characters it holds (a quote and braces in a `--set` once added parameters
to a substituted template: issue 61). It is strict (a value for no field or declared parameter, a declared parameter
left without one, a field value of the wrong type fail at render time) and atomic (a temporary folder renamed into
place), so a half-written model folder never exists. Each Python-backend model (a template with 1/model.py) gets a
copy of the helpers its model.py imports next to it (MODEL_HELPERS: tasks/text/model_text.py, the text helpers;
tasks/serving/adapter_registry.py, the base engine's adapter map; tasks/serving/engine_guard.py, the engine
processes' watcher; tasks/serving/model_roots.py, the folders a model may load from): each is written once, and a load request sends the copies with the folder's other files.
"""

from __future__ import annotations

import os
import re
import shutil
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from tasks.platform.errors import BadInput
from tasks.platform.project import PROJECT_ROOT
from tasks.serving import adapter_registry, engine_guard, model_roots
from tasks.serving.client import Triton
from tasks.text import model_text

TEMPLATES = PROJECT_ROOT / "infra" / "triton"
NAME_RE = re.compile(r"\A[A-Za-z0-9][A-Za-z0-9_.-]*\Z")  # \Z, not $: no trailing newline
MODEL_HELPERS = (
    model_text,
    adapter_registry,
    engine_guard,
    model_roots,
)  # standard-library modules copied next to every model.py
HEADER = "# Rendered by tasks/serving/repository.py from {source}: a copy, not the place to change it.\n"


def _batch(config: Any, value: int) -> None:
    config.max_batch_size = value


def _queue_delay(config: Any, value: int) -> None:
    config.dynamic_batching.max_queue_delay_microseconds = value


def _queue_size(config: Any, value: int) -> None:
    config.dynamic_batching.default_queue_policy.max_queue_size = value


def _instances(config: Any, value: int) -> None:
    config.instance_group[0].count = value


# The values that set a ModelConfig field, by name; every other value is one of the template's declared parameters.
FIELDS: dict[str, Callable[[Any, int], None]] = {
    "max_batch_size": _batch,
    "max_queue_delay_us": _queue_delay,
    "max_queue_size": _queue_size,
    "instance_count": _instances,
}


def render_config(text: str, name: str, values: dict[str, object], source: str) -> str:
    """The template `text` (config.pbtxt) as Triton's ModelConfig with `name` and `values` set, serialized."""
    from google.protobuf import text_format
    from tritonclient.grpc import model_config_pb2

    try:
        config = text_format.Parse(text, model_config_pb2.ModelConfig())
    except text_format.ParseError as exc:
        raise BadInput(f"template {source}: not a Triton model config ({exc})") from None
    config.name = name
    declared = set(config.parameters)
    unknown = sorted(set(values) - declared - set(FIELDS))
    missing = sorted(declared - set(values))
    if unknown:
        raise BadInput(
            f"template {source}: unknown value(s) {', '.join(unknown)} (no such field or declared parameter)"
        )
    if missing:
        raise BadInput(f"template {source}: no value for parameter(s) {', '.join(missing)}")
    for key, value in values.items():
        if key in FIELDS:
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise BadInput(f"template {source}: {key} must be a whole number, 0 or more, not {value!r}")
            FIELDS[key](config, value)
        else:
            config.parameters[key].string_value = str(value)
    return HEADER.format(source=source) + text_format.MessageToString(config, as_utf8=True)


def stage_model_files(kind: str, folder: Path) -> None:
    """infra/triton/<kind>/ copied into `folder` (its config.pbtxt still the template), each helper its model.py
    imports beside it."""
    shutil.copytree(TEMPLATES / kind, folder, dirs_exist_ok=True, ignore=shutil.ignore_patterns("__pycache__"))
    if (folder / "1" / "model.py").is_file():
        for helper in MODEL_HELPERS:
            shutil.copyfile(str(helper.__file__), folder / "1" / helper.FILE_NAME)


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
        stage_model_files(kind, staging)
        template = source / "config.pbtxt"
        config = render_config(template.read_text(), name, values, str(template.relative_to(PROJECT_ROOT)))
        (staging / "config.pbtxt").write_text(config, encoding="utf-8")
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


def config_parameters(text: str) -> dict[str, str]:
    """The parameters of a config.pbtxt's text, as Triton parses it."""
    from google.protobuf import text_format
    from tritonclient.grpc import model_config_pb2

    config = text_format.Parse(text, model_config_pb2.ModelConfig())
    return {key: value.string_value for key, value in config.parameters.items()}


def rendered_parameter(model_folder: Path, key: str) -> str | None:
    """A parameter of a rendered model folder's config.pbtxt; None where it declares none."""
    return config_parameters((model_folder / "config.pbtxt").read_text(encoding="utf-8")).get(key)


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
