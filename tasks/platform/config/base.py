"""What every profile section shares: unknown keys are errors, and names other systems must accept.

Every section forbids unknown keys so a typo (`lora_rnk`) is an error naming its path, not a silently
ignored setting; every setting carries a `Field(description=...)` that `llmops profiles show` and the
reference page (docs/reference/profiles.md) print. A setting that names code to run carries FILE_ONLY, one that
decides whom the pipeline trusts TRUST_ONLY: only a profile file on disk sets either, never an override or a run
parameter (tasks/platform/config/policy.py).
"""

from __future__ import annotations

import re
from typing import Annotated

from pydantic import AfterValidator, BaseModel, ConfigDict, JsonValue
from pydantic.fields import FieldInfo

# Triton's model repository folder names as tasks/serving/repository.py renders them; also fits MLflow's
# registered model names (no '/' or ':') and Prefect's concurrency limit names.
TRITON_NAME = re.compile(r"\A[A-Za-z0-9][A-Za-z0-9_.-]*\Z")  # \Z: "$" also matches before a trailing newline


# `Field(json_schema_extra=FILE_ONLY)`: the setting names an executable, an environment, a script, an image or
# arguments passed through to another program, so it runs code; `--set`, a flow's overrides and the remote
# stage's profile parameter may not set it (tasks/platform/config/policy.py).
FILE_ONLY: dict[str, JsonValue] = {"profile_file_only": True}
# `Field(json_schema_extra=TRUST_ONLY)`: the setting decides whom the pipeline trusts (whose corrections it trains
# on, whose signature approves, whether data goes unreviewed), so only the operator's profile files set it, as
# FILE_ONLY settings.
TRUST_ONLY: dict[str, JsonValue] = {"profile_file_only": True, "decides_trust": True}


def is_file_only(field: FieldInfo) -> bool:
    extra = field.json_schema_extra
    return isinstance(extra, dict) and extra.get("profile_file_only") is True


def decides_trust(field: FieldInfo) -> bool:
    extra = field.json_schema_extra
    return isinstance(extra, dict) and extra.get("decides_trust") is True


class Section(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


def _fits_triton(name: str) -> str:
    if not TRITON_NAME.match(name):
        raise ValueError(
            f"{name!r} is not a Triton model name: start with a letter or digit, then letters, digits, '-', '_' or '.'"
        )
    return name


TritonName = Annotated[str, AfterValidator(_fits_triton)]
