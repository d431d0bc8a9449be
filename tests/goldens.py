"""Golden files: what the project renders, compared with a reviewed copy in the repository.

`LLMOPS_UPDATE_GOLDEN=1` rewrites the copies that differ, and the test that rewrote one still FAILS: a run that
writes goldens never passes, so an update is always reviewed (git diff) and followed by a clean run.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

UPDATE = os.environ.get("LLMOPS_UPDATE_GOLDEN") == "1"


def matches_golden(path: Path, text: str) -> None:
    current = path.read_text() if path.is_file() else None
    if current == text:
        return
    if UPDATE:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
        pytest.fail(
            f"rewrote golden {path}: review it (git diff), then run the tests again without LLMOPS_UPDATE_GOLDEN"
        )
    assert current is not None, f"no golden file {path}; run with LLMOPS_UPDATE_GOLDEN=1 and review it"
    assert text == current, f"{path} differs from what is rendered now (LLMOPS_UPDATE_GOLDEN=1 rewrites it for review)"
