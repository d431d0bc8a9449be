"""Which settings a run parameter may change: none that runs code.

A setting marked FILE_ONLY (tasks/platform/config/base.py) names an executable, an environment, an image or
arguments passed through to another program. Whoever sets it runs code as the worker, so only a profile file
on disk sets it: a `--set`, a flow's `overrides` and the remote stage's profile parameter, which anyone who
reaches the Prefect API can write, may not (docs/security.md, "The trust boundary").
"""

from __future__ import annotations

import typing
from collections.abc import Iterator
from typing import Any

from pydantic.fields import FieldInfo

from tasks.platform.config.base import Section, decides_trust, is_file_only
from tasks.platform.config.describe import default_of, section_class
from tasks.platform.config.profile import Profile
from tasks.platform.config.release import GateSection
from tasks.platform.errors import BadInput


def _file_only_fields(cls: type[Section], path: tuple[str, ...]) -> Iterator[tuple[tuple[str, ...], Any, bool]]:
    for name, field in cls.model_fields.items():
        nested = section_class(field) or optional_section(field)
        if is_file_only(field):  # a whole section too (serve.auth.jwt)
            yield (*path, name), default_of(field), decides_trust(field)
        elif nested is not None:  # an optional section's own file-only settings (evaluate.judge.api_key_env)
            yield from _file_only_fields(nested, (*path, name))


def optional_section(field: FieldInfo) -> type[Section] | None:
    """The section of a `Section | None` setting."""
    found = [a for a in typing.get_args(field.annotation) if isinstance(a, type) and issubclass(a, Section)]
    return found[0] if len(found) == 1 and type(None) in typing.get_args(field.annotation) else None


FILE_ONLY_DEFAULTS: dict[tuple[str, ...], Any] = {path: default for path, default, _ in _file_only_fields(Profile, ())}
"""Every file-only setting's key path, with its default (which runs nothing beyond the project's own code and
trusts no one beyond what the defaults trust)."""
TRUST_SETTINGS: frozenset[tuple[str, ...]] = frozenset(
    path for path, _, trust in _file_only_fields(Profile, ()) if trust
)
"""The file-only settings that decide whom the pipeline trusts rather than what code runs."""
# gate.approval's levels, weakest first: an override may raise it, never lower it (a person's decision is the
# operator's to waive, in a profile file).
APPROVAL_LEVELS = ("none", "harvested", "required")


def file_only_settings() -> list[str]:
    return [".".join(path) for path in FILE_ONLY_DEFAULTS]


def _sets(keys: tuple[str, ...], value: Any, protected: tuple[str, ...]) -> bool:
    """Whether an override of `keys` to `value` reaches `protected`: the setting itself, a key inside it
    (train.extra_args.x) or a section holding it given as a mapping (`serve={triton_binary: ...}`)."""
    if keys[: len(protected)] == protected:
        return True
    if protected[: len(keys)] != keys:
        return False
    node = value
    for part in protected[len(keys) :]:
        if not isinstance(node, dict) or part not in node:
            return False
        node = node[part]
    return True


def refuse_file_only(keys: list[str], value: Any, text: str) -> None:
    """One `--set key=value` (or flow override): refused when it sets a setting that runs code or decides trust."""
    for protected in FILE_ONLY_DEFAULTS:
        if _sets(tuple(keys), value, protected):
            name = ".".join(protected)
            what = (
                "decides whom the pipeline trusts"
                if protected in TRUST_SETTINGS
                else "names code to run (an executable, environment, image or pass-through arguments)"
            )
            raise BadInput(
                f"--set {'.'.join(keys)}: {name} {what}, so no override or run parameter may set it; put it in a "
                "profile file"
            )


def refuse_lowered_approval(file_value: Any, profile: Profile) -> None:
    """Overrides may make gate.approval stricter than the profile file says, never weaker."""
    written = file_value if file_value in APPROVAL_LEVELS else GateSection.model_fields["approval"].default
    if APPROVAL_LEVELS.index(profile.gate.approval) < APPROVAL_LEVELS.index(written):
        raise BadInput(
            f"--set gate.approval={profile.gate.approval}: the profile file asks for {written}; an override or run "
            "parameter may raise gate.approval, never lower it (a profile file may)"
        )


def file_only_values(profile: Profile) -> dict[str, Any]:
    values: dict[str, Any] = {}
    for path, default in FILE_ONLY_DEFAULTS.items():
        node: Any = profile
        for part in path[:-1]:
            node = getattr(node, part)
            if node is None:  # an optional section not set (evaluate.judge): its settings as they default
                break
        values[".".join(path)] = default if node is None else getattr(node, path[-1])
    return values


def non_default_file_only(profile: Profile) -> dict[str, Any]:
    """The file-only settings this profile sets to something other than their defaults."""
    defaults = {".".join(path): default for path, default in FILE_ONLY_DEFAULTS.items()}
    return {name: value for name, value in file_only_values(profile).items() if value != defaults[name]}
