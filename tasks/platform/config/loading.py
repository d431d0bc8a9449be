"""Loading a profile: a shipped name or a YAML path, `--set` overrides typed like YAML, one-line errors
naming the key path, and the check that this machine has the GPUs the profile needs."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Annotated, Any

import yaml
from pydantic import Field, ValidationError

from tasks.platform.config.machines import HEAVY_STAGES
from tasks.platform.config.profile import Profile
from tasks.platform.errors import BadInput
from tasks.platform.project import PROJECT_ROOT

PROFILES_DIR = PROJECT_ROOT / "profiles"


def available_profiles() -> list[str]:
    return sorted(p.stem for p in PROFILES_DIR.glob("*.yaml"))


# A flow's profile parameter: the shipped profiles are its schema's choices, so the Prefect UI's run
# form offers them and a deployment's server refuses another name (HTTP 409); a direct call
# (`llmops run --profile my.yaml`) still takes a YAML path, as the schema does not bind Python callers.
ProfileName = Annotated[str, Field(json_schema_extra={"enum": available_profiles()})]


def profile_path(name_or_path: str) -> Path:
    candidate = Path(name_or_path)
    if candidate.suffix in (".yaml", ".yml") or candidate.exists():
        if not candidate.is_file():
            raise BadInput(f"profile file {name_or_path}: not found")
        return candidate
    named = PROFILES_DIR / f"{name_or_path}.yaml"
    if not named.is_file():
        raise BadInput(f"profile {name_or_path}: not found (available: {', '.join(available_profiles())})")
    return named


def parse_override(text: str) -> tuple[list[str], Any]:
    key, sep, raw = text.partition("=")
    if not sep or not key.strip():
        raise BadInput(f"--set {text}: expected key=value, e.g. train.learning_rate=1e-4")
    # YAML typing so that 1e-4, true, null and [a, b] mean what they look like.
    return key.strip().split("."), yaml.safe_load(raw) if raw.strip() else ""


def apply_override(data: dict, path: list[str], value: Any, text: str) -> None:
    node = data
    for part in path[:-1]:
        child = node.setdefault(part, {})
        if not isinstance(child, dict):
            raise BadInput(f"--set {text}: {'.'.join(path[:-1])} is not a section")
        node = child
    node[path[-1]] = value


def format_validation_error(source: str, err: ValidationError) -> str:
    parts = []
    for item in err.errors():
        where = ".".join(str(p) for p in item["loc"]) or "(top level)"
        what = "unknown key" if item["type"] == "extra_forbidden" else item["msg"].removeprefix("Value error, ")
        parts.append(f"{where}: {what}")
    return f"{source}: " + "; ".join(parts)


def load_profile(name_or_path: str = "cpu-tiny", overrides: Sequence[str] = (), data: str | None = None) -> Profile:
    path = profile_path(name_or_path)
    label = f"profile {name_or_path}"
    try:
        raw = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        line = f" line {mark.line + 1}" if mark else ""
        raise BadInput(f"profile file {path}{line}: invalid YAML") from exc
    if not isinstance(raw, dict):
        raise BadInput(f"profile file {path}: expected a mapping at the top level")
    # A relative local data path in a profile file is relative to that file (one given on the command line, to the cwd).
    data_section = raw.get("data")
    section: dict = data_section if isinstance(data_section, dict) else {}
    for field in ("source", "eval_source"):
        value = section.get(field)
        if isinstance(value, str) and "://" not in value and not Path(value).is_absolute():
            section[field] = str((path.parent / value).resolve())
    for text in overrides:
        keys, value = parse_override(text)
        apply_override(raw, keys, value, text)
    if data:
        raw.setdefault("data", {})["source"] = data
    try:
        return Profile.model_validate(raw)
    except ValidationError as err:
        raise BadInput(format_validation_error(label, err)) from None


def local_stages(profile: Profile) -> list[str]:
    """The accelerator-bound stages this process runs itself (the others run on their deployments)."""
    return [s for s in HEAVY_STAGES if s not in profile.run.remote_stages] + (["serve"] if profile.serve.deploy else [])


def check_machine(profile: Profile, stages: list[str]) -> None:
    """A GPU profile on a machine without its GPUs fails here, before any stage does work."""
    if profile.hardware.accelerator != "cuda" or not stages:
        return
    import torch

    found = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if found < profile.hardware.gpus:
        raise BadInput(
            f"profile {profile.name}: {', '.join(stages)} need(s) {profile.hardware.gpus} CUDA GPU(s) "
            f"(hardware.gpus), this machine has {found}; run it on a GPU machine, place those stages on "
            f"the GPU pool (run.remote_stages), or pick a CPU profile (llmops profiles list)"
        )
