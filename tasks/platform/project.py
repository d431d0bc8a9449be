"""Where the project's own files are: the checkout (or the image's copy of it) that holds tasks/, profiles/ and infra/."""

from pathlib import Path

PROJECT_ROOT = Path(__file__).resolve().parents[2]
