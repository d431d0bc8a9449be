"""Loading a profile: a shipped name or a YAML path, `--set` overrides typed like YAML, one-line errors
naming the key path, and the check that this machine has the GPUs the profile needs.

Runs started through the Prefect API are held to the profile files on the worker's disk: `check_api_profile`
for the profile they name, `check_received_profile` for a whole profile a remote stage receives.
"""

from __future__ import annotations

import os
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Annotated, Any

import yaml
from pydantic import Field, ValidationError

from tasks.platform.config.machines import HEAVY_STAGES
from tasks.platform.config.policy import (
    file_only_values,
    non_default_file_only,
    refuse_file_only,
    refuse_lowered_approval,
)
from tasks.platform.config.profile import Profile
from tasks.platform.errors import BadInput
from tasks.platform.project import PROJECT_ROOT

PROFILES_DIR = PROJECT_ROOT / "profiles"
# The operator's own profiles, which runs started through the Prefect API may name besides the shipped ones.
OPERATOR_PROFILES_ENV = "LLMOPS_PROFILES_DIR"
PROFILE_NAME = re.compile(r"\A[A-Za-z0-9][A-Za-z0-9_.-]*\Z")  # a name, never a path (no '/', no leading '.')


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
    named = on_disk_profile(name_or_path)
    if named is None:
        raise BadInput(f"profile {name_or_path}: not found (available: {', '.join(available_profiles())})")
    return named


def parse_override(text: str) -> tuple[list[str], Any]:
    key, sep, raw = text.partition("=")
    if not sep or not key.strip():
        raise BadInput(f"--set {text}: expected key=value, e.g. train.learning_rate=1e-4")
    # YAML typing so that 1e-4, true, null and [a, b] mean what they look like; text that is no YAML value (a quote,
    # braces and commas) is the text itself, which the schema then checks like any other value.
    try:
        value = yaml.safe_load(raw) if raw.strip() else ""
    except yaml.YAMLError:
        value = raw
    return key.strip().split("."), value


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


# `--eval-data profile` (a run's eval_data "profile"): the profile's own data.eval_source whatever the data, as the
# retrain and flywheel deployments score: a hash split where the profile names none.
PROFILE_EXAM = "profile"


def load_profile(
    name_or_path: str = "cpu-tiny",
    overrides: Sequence[str] = (),
    data: str | None = None,
    eval_data: str | None = None,
) -> Profile:
    """A profile with `--set` overrides, `data` (`--data`) and `eval_data` (`--eval-data`) applied. Data other than
    the profile's own is judged on its own hash split (choose_exam), unless `eval_data` names its exam."""
    raw = read_profile_file(profile_path(name_or_path))
    profile_data = dict(raw["data"]) if isinstance(raw.get("data"), dict) else {}
    exam_settings = take_exam_settings(raw, name_or_path)
    gate = raw.get("gate")
    file_approval = gate.get("approval") if isinstance(gate, dict) else None
    exam_named = bool(eval_data)
    overridden: set[tuple[str, ...]] = set()
    for text in overrides:
        keys, value = parse_override(text)
        refuse_file_only(keys, value, text)
        apply_override(raw, keys, value, text)
        exam_named |= keys == ["data", "eval_source"]
        overridden.add(tuple(keys))
    if data:
        raw.setdefault("data", {})["source"] = data
    if eval_data and eval_data != PROFILE_EXAM:
        raw.setdefault("data", {})["eval_source"] = eval_data
    elif not exam_named and isinstance(raw.get("data"), dict):
        choose_exam(raw["data"], profile_data)
    if exam_settings and isinstance(raw.get("data"), dict):
        apply_exam_settings(raw, exam_settings, profile_data, overridden)
    try:
        profile = Profile.model_validate(raw)
    except ValidationError as err:
        raise BadInput(format_validation_error(f"profile {name_or_path}", err)) from None
    if overrides:
        refuse_lowered_approval(file_approval, profile)
    return profile


def read_profile_file(path: Path) -> dict:
    """A profile file's mapping, its relative paths (data, allowed signers) made relative to the file: one given on
    the command line stays relative to the working directory."""
    try:
        raw = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        line = f" line {mark.line + 1}" if mark else ""
        raise BadInput(f"profile file {path}{line}: invalid YAML") from exc
    if not isinstance(raw, dict):
        raise BadInput(f"profile file {path}: expected a mapping at the top level")
    data_section = raw.get("data")
    section: dict = data_section if isinstance(data_section, dict) else {}
    for field in ("source", "eval_source", "harvest_eval_source"):
        value = section.get(field)
        if isinstance(value, str) and "://" not in value and not Path(value).is_absolute():
            section[field] = str((path.parent / value).resolve())
    gate = raw.get("gate")
    signers = gate.get("allowed_signers") if isinstance(gate, dict) else None
    if isinstance(signers, str) and not Path(signers).is_absolute():
        gate["allowed_signers"] = str((path.parent / signers).resolve())  # type: ignore[index]
    return raw


def choose_exam(section: dict, profile_data: dict) -> None:
    """The profile's eval_source is the exam of its own source. Other data (`--data`, `--set data.source`) gets its
    own hash split: a curated exam of another task (cpu-tiny's antonyms) cannot judge it. The set stays the exam of
    harvested records, which must never be hash split (tasks/data/records.py)."""
    source, exam = section.get("source"), profile_data.get("eval_source")
    if exam is None or same_location(source, profile_data.get("source")):
        return
    section.setdefault("harvest_eval_source", exam)
    section["eval_source"] = None


EXAM_SETTINGS = "for_exam"


def take_exam_settings(raw: dict, source: str) -> dict:
    """A profile file's `evaluate.for_exam`: evaluate settings sized for its own curated exam (data.eval_source), as
    cpu-tiny's margin for exact match on one-word antonyms. Taken out of the section: they apply only where that exam
    is the eval split (apply_exam_settings), and never to a user's own data, which is judged as its references need."""
    from tasks.platform.config.training import EvaluateSection

    section = raw.get("evaluate")
    found = section.pop(EXAM_SETTINGS, None) if isinstance(section, dict) else None
    if found is None:
        return {}
    if not isinstance(found, dict):
        raise BadInput(f"profile {source}: evaluate.{EXAM_SETTINGS}: expected a mapping of evaluate settings")
    unknown = sorted(set(found) - set(EvaluateSection.model_fields))
    if unknown:
        raise BadInput(f"profile {source}: evaluate.{EXAM_SETTINGS}.{unknown[0]}: unknown key")
    return found


def apply_exam_settings(raw: dict, settings: dict, profile_data: dict, overridden: set[tuple[str, ...]]) -> None:
    """The file's exam settings over its evaluate section where its own data.eval_source is the eval split; an
    override (`--set evaluate.KEY=...`) still wins."""
    exam = profile_data.get("eval_source")
    if exam is None or not same_location(raw["data"].get("eval_source"), exam):
        return
    evaluate = raw.setdefault("evaluate", {})
    for key, value in settings.items():
        if ("evaluate", key) not in overridden:
            evaluate[key] = value


def same_location(one: object, other: object) -> bool:
    """Two data locations name the same thing: equal URIs, or local paths that resolve alike."""
    if not isinstance(one, str) or not isinstance(other, str):
        return one == other
    if "://" in one or "://" in other:
        return one.rstrip("/") == other.rstrip("/")
    return Path(one).resolve() == Path(other).resolve()


def operator_profiles_dir() -> Path | None:
    folder = os.environ.get(OPERATOR_PROFILES_ENV)
    return Path(folder).resolve() if folder else None


def on_disk_profile(name: str) -> Path | None:
    """The profile file NAME.yaml of profiles/, else of LLMOPS_PROFILES_DIR; None when neither has it."""
    if not PROFILE_NAME.match(name):
        return None
    folders = [PROFILES_DIR, operator_profiles_dir()]
    return next((f / f"{name}.yaml" for f in folders if f is not None and (f / f"{name}.yaml").is_file()), None)


def check_api_profile(name_or_path: str) -> None:
    """A run started through the Prefect API names a shipped profile, or a profile of LLMOPS_PROFILES_DIR by
    name or path; never another path, which could be a file the caller wrote with settings that run code."""
    if on_disk_profile(name_or_path) is not None:
        return
    folder = operator_profiles_dir()
    candidate = Path(name_or_path)
    if folder is not None and candidate.suffix in (".yaml", ".yml") and candidate.resolve().is_relative_to(folder):
        return
    raise BadInput(
        f"profile {name_or_path}: a run started through the Prefect API takes a profile of profiles/ "
        f"({', '.join(available_profiles())}) or of {OPERATOR_PROFILES_ENV} "
        f"({folder or 'not set on this worker'}); run other files with `llmops run --profile PATH` on their machine"
    )


def check_received_profile(received: Profile) -> None:
    """A profile passed whole as a run parameter (the remote stage's) sets code-running settings only where
    the profile file of its name on this worker's disk sets the same; defaults run nothing and pass."""
    claimed = non_default_file_only(received)
    if not claimed:
        return
    path = on_disk_profile(received.name)
    if path is None:
        raise BadInput(
            f"profile {received.name}: sets {', '.join(claimed)}, which only a profile file may set, and this "
            f"worker has no profile file {received.name}.yaml (profiles/ or {OPERATOR_PROFILES_ENV}) that does"
        )
    on_disk = file_only_values(load_profile(str(path)))
    differ = [name for name, value in file_only_values(received).items() if value != on_disk[name]]
    if differ:
        raise BadInput(
            f"profile {received.name}: {', '.join(differ)} differ(s) from {path} on this worker; settings that "
            f"run code come only from profile files on disk"
        )


def local_stages(profile: Profile) -> list[str]:
    """The accelerator-bound stages this process runs itself (the others run on their deployments)."""
    return [s for s in HEAVY_STAGES if s not in profile.run.remote_stages] + (["serve"] if profile.serve.deploy else [])


def check_machine(profile: Profile, stages: list[str]) -> None:
    """A GPU profile on a machine without its GPUs fails here, before any stage does work."""
    if profile.hardware.accelerator != "cuda" or not stages:
        return
    import torch

    found = torch.cuda.device_count() if torch.cuda.is_available() else 0
    hardware = profile.hardware
    # The train stage run here starts all its nodes here (tasks/training/launch.py), each with its own GPUs.
    needed = hardware.gpus * hardware.nodes if "train" in stages else hardware.gpus
    if found < needed:
        per_node = f" x hardware.nodes {hardware.nodes} for train" if needed != hardware.gpus else ""
        raise BadInput(
            f"profile {profile.name}: {', '.join(stages)} need(s) {needed} CUDA GPU(s) "
            f"(hardware.gpus{per_node}), this machine has {found}; run it on a GPU machine, place those stages on "
            f"the GPU pool (run.remote_stages), or pick a CPU profile (llmops profiles list)"
        )
