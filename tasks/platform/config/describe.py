"""`llmops profiles show`: the resolved profile as YAML, every setting under a comment saying what it does.

The output is valid YAML (the comments are YAML comments), so a shown profile can be saved and edited.
"""

from __future__ import annotations

import inspect
import textwrap
from typing import Any

import yaml
from pydantic.fields import FieldInfo
from pydantic_core import PydanticUndefined, to_jsonable_python

from tasks.platform.config.base import Section
from tasks.platform.config.profile import Profile

WIDTH = 110


def section_class(field: FieldInfo) -> type[Section] | None:
    annotation = field.annotation
    return annotation if isinstance(annotation, type) and issubclass(annotation, Section) else None


def section_doc(cls: type[Section]) -> str:
    """A section's docstring as one paragraph."""
    return " ".join((inspect.getdoc(cls) or "").split())


def yaml_value(value: Any) -> str:
    """A JSON-able value as one line of YAML flow style (`[1, 4]`, `{train: run-stage/gpu}`, `null`)."""
    text = yaml.safe_dump(value, default_flow_style=True, width=float("inf"), allow_unicode=True).strip()
    return text.removesuffix("\n...").strip()


def default_of(field: FieldInfo) -> Any:
    """The field's default as JSON-able data, or PydanticUndefined where the setting is required."""
    default = field.get_default(call_default_factory=True)
    return default if default is PydanticUndefined else to_jsonable_python(default)


def _comment(text: str, pad: str) -> list[str]:
    return [f"{pad}# {line}" for line in textwrap.wrap(text, WIDTH - len(pad) - 2)]


def _describe(cls: type[Section], values: dict[str, Any], pad: str) -> list[str]:
    lines: list[str] = []
    for name, field in cls.model_fields.items():
        nested = section_class(field)
        if nested is not None:
            lines += _comment(section_doc(nested), pad)
            lines.append(f"{pad}{name}:")
            lines += _describe(nested, values[name], pad + "  ")
            continue
        default = default_of(field)
        note = "" if default is PydanticUndefined or default == values[name] else f" (default: {yaml_value(default)})"
        lines += _comment(f"{field.description or ''}{note}", pad)
        lines.append(f"{pad}{name}: {yaml_value(values[name])}")
    return lines


def describe_profile(profile: Profile) -> str:
    """The whole resolved profile (defaults included), each setting under its description; where a value
    differs from the schema's default, the comment names the default."""
    header = _comment(f"profile {profile.name} (digest {profile.digest[:12]}). {section_doc(Profile)}", "")
    return "\n".join(header + _describe(Profile, profile.model_dump(mode="json"), "")) + "\n"
