"""Which settings a run parameter may change: none that runs code.

A setting marked FILE_ONLY (tasks/platform/config/base.py) names an executable, an environment, an image or
arguments passed through to another program. Whoever sets it runs code as the worker, so only a profile file
on disk sets it: a `--set`, a flow's `overrides` and the remote stage's profile parameter, which anyone who
reaches the Prefect API can write, may not (docs/security.md, "The trust boundary").
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from tasks.platform.config.base import Section, is_file_only
from tasks.platform.config.describe import default_of, section_class
from tasks.platform.config.profile import Profile
from tasks.platform.errors import BadInput


def _file_only_fields(cls: type[Section], path: tuple[str, ...]) -> Iterator[tuple[tuple[str, ...], Any]]:
    for name, field in cls.model_fields.items():
        nested = section_class(field)
        if nested is not None:
            yield from _file_only_fields(nested, (*path, name))
        elif is_file_only(field):
            yield (*path, name), default_of(field)


FILE_ONLY_DEFAULTS: dict[tuple[str, ...], Any] = dict(_file_only_fields(Profile, ()))
"""Every file-only setting's key path, with its default (which runs nothing beyond the project's own code)."""


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
    """One `--set key=value` (or flow override): refused when it sets a setting that runs code."""
    for protected in FILE_ONLY_DEFAULTS:
        if _sets(tuple(keys), value, protected):
            name = ".".join(protected)
            raise BadInput(
                f"--set {'.'.join(keys)}: {name} names code to run (an executable, environment, image or "
                f"pass-through arguments), so no override or run parameter may set it; put it in a profile file"
            )


def file_only_values(profile: Profile) -> dict[str, Any]:
    values: dict[str, Any] = {}
    for path in FILE_ONLY_DEFAULTS:
        node: Any = profile
        for part in path:
            node = getattr(node, part)
        values[".".join(path)] = node
    return values


def non_default_file_only(profile: Profile) -> dict[str, Any]:
    """The file-only settings this profile sets to something other than their defaults."""
    defaults = {".".join(path): default for path, default in FILE_ONLY_DEFAULTS.items()}
    return {name: value for name, value in file_only_values(profile).items() if value != defaults[name]}
