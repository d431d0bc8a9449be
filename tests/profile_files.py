"""A profile file of the user's own for a test: cpu-tiny's with some settings changed. Settings that decide trust or
run code come only from a profile file (tasks/platform/config/policy.py), so a test of them writes one."""

from __future__ import annotations

from pathlib import Path

import yaml

from tasks.platform.project import PROJECT_ROOT


def cpu_tiny_file(path: Path, changes: dict[str, dict]) -> Path:
    """cpu-tiny.yaml with `changes` merged into its sections, written to `path` (its data named by absolute path, as
    a file outside profiles/ needs)."""
    values = yaml.safe_load((PROJECT_ROOT / "profiles" / "cpu-tiny.yaml").read_text())
    for section, settings in changes.items():
        values[section] = {**(values.get(section) or {}), **settings}
    values["data"] = {"source": str(PROJECT_ROOT / "profiles" / "data" / "antonyms.jsonl")}
    path.write_text(yaml.safe_dump(values))
    return path
