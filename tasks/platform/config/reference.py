"""The profile reference page (docs/reference/profiles.md), generated from the schema so it cannot drift.

Regenerate it after changing a setting:

    python -m tasks.platform.config.reference > docs/reference/profiles.md

tests/unit/test_config.py fails while the committed page differs from what this renders.
"""

from __future__ import annotations

import json
import types
from collections.abc import Iterator
from typing import Any, Literal, Union, get_args, get_origin

import annotated_types
from pydantic.fields import FieldInfo
from pydantic_core import PydanticUndefined

from tasks.platform.config.base import Section, is_file_only
from tasks.platform.config.describe import default_of, section_class, section_doc, yaml_value
from tasks.platform.config.profile import Profile

BOUNDS: tuple[tuple[type, str, str], ...] = (
    (annotated_types.Ge, "ge", ">="),
    (annotated_types.Gt, "gt", ">"),
    (annotated_types.Le, "le", "<="),
    (annotated_types.Lt, "lt", "<"),
    (annotated_types.MinLen, "min_length", "length >="),
)


def type_label(annotation: Any) -> str:
    """A field's type the way a profile author writes it: `int`, `"a" | "b"`, `float | null`, `dict[str, str]`."""
    origin, args = get_origin(annotation), get_args(annotation)
    if annotation is type(None):
        return "null"
    if annotation is Any:
        return "any"
    if origin is Literal:
        return " | ".join(json.dumps(arg) for arg in args)
    if origin in (Union, types.UnionType):
        return " | ".join(type_label(arg) for arg in args)
    if origin in (list, dict):
        return f"{origin.__name__}[{', '.join(type_label(arg) for arg in args)}]"
    return getattr(annotation, "__name__", str(annotation))


def constraints(field: FieldInfo) -> str:
    found = []
    for item in field.metadata:
        for kind, attribute, symbol in BOUNDS:
            if isinstance(item, kind):
                found.append(f"{symbol} {getattr(item, attribute)}")
    return ", ".join(found)


def optional_section(field: FieldInfo) -> type[Section] | None:
    """The section of a `Section | None` setting (one whose absence means something: base_model.architecture)."""
    found = [a for a in get_args(field.annotation) if isinstance(a, type) and issubclass(a, Section)]
    return found[0] if len(found) == 1 and type(None) in get_args(field.annotation) else None


def sections(cls: type[Section], path: str) -> Iterator[tuple[str, type[Section]]]:
    """(dotted path, section class) of cls and every section inside it, depth first in field order."""
    yield path, cls
    for name, field in cls.model_fields.items():
        nested = section_class(field) or optional_section(field)
        if nested is not None:
            yield from sections(nested, f"{path}.{name}" if path else name)


def cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


FILE_ONLY_NOTE = "**Profile file only.**"


def setting_row(name: str, field: FieldInfo) -> str:
    kind = f"`{type_label(field.annotation)}`"
    if bounds := constraints(field):
        kind += f" ({bounds})"
    default = default_of(field)
    shown = "required" if default is PydanticUndefined else f"`{yaml_value(default)}`"
    described = (field.description or "") + (f" {FILE_ONLY_NOTE}" if is_file_only(field) else "")
    return f"| `{name}` | {cell(kind)} | {cell(shown)} | {cell(described)} |"


def render_reference() -> str:
    lines = [
        "# Profile reference",
        "",
        "<!-- Generated from tasks/platform/config/ by "
        "`python -m tasks.platform.config.reference > docs/reference/profiles.md`; do not edit. -->",
        "",
        f"{section_doc(Profile)} A profile lists only what differs from these defaults; "
        "`llmops profiles show NAME` prints a profile with every setting resolved and described.",
        "",
        f"A setting marked {FILE_ONLY_NOTE} runs code (an executable, environment, image or arguments passed "
        "through to another program) or decides whom the pipeline trusts (whose corrections train, whose "
        "signature approves, whether harvests go unreviewed): only a profile file on disk sets it; `--set`, a "
        "flow's `overrides` and the remote stage's profile parameter are refused "
        "([Security](../security.md#the-trust-boundary)).",
    ]
    for path, cls in sections(Profile, ""):
        rows = [setting_row(name, field) for name, field in cls.model_fields.items() if section_class(field) is None]
        lines += ["", f"## {path or 'Top level'}", ""]
        if path:
            lines += [section_doc(cls), ""]
        lines += ["| Setting | Type | Default | Description |", "| --- | --- | --- | --- |", *rows]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    print(render_reference(), end="")
