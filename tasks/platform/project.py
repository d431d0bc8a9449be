"""Where the project's own files are: the checkout (or the image's copy of it) that holds tasks/, profiles/ and infra/."""

import os
from pathlib import Path

PROJECT_ROOT = Path(__file__).resolve().parents[2]


def llmops_home() -> Path:
    """$LLMOPS_HOME (`.llmops` under the working directory where unset), absolute: every command's and flow's home."""
    return Path(os.environ.get("LLMOPS_HOME", ".llmops")).resolve()
