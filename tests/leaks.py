"""Where a secret must never appear: the files a run leaves, MLflow's params, tags and registry tags,
Prefect's flow-run parameters, logs and artifacts, and the command line and environment of every process
this user runs. Each finder returns `(where, secret name)` pairs."""

from __future__ import annotations

import os
from pathlib import Path

import requests


def in_files(secrets: dict[str, str], root: Path, allowed: set[Path]) -> list[tuple[str, str]]:
    """Every file under root but the `allowed` ones (where a secret is kept on purpose, mode 600)."""
    found = []
    needles = {name: value.encode() for name, value in secrets.items()}
    for path in root.rglob("*"):
        if not path.is_file() or path.is_symlink() or path in allowed:
            continue
        try:
            content = path.read_bytes()
        except OSError:
            continue
        found += [(str(path), name) for name, needle in needles.items() if needle in content]
    return found


def in_mlflow(secrets: dict[str, str], tracking_uri: str) -> list[tuple[str, str]]:
    from mlflow import MlflowClient

    client = MlflowClient(tracking_uri)
    texts: list[tuple[str, str]] = []
    for experiment in client.search_experiments():
        for run in client.search_runs([experiment.experiment_id], max_results=1000):
            texts += [(f"run {run.info.run_id} param {k}", str(v)) for k, v in run.data.params.items()]
            texts += [(f"run {run.info.run_id} tag {k}", str(v)) for k, v in run.data.tags.items()]
    for model in client.search_registered_models():
        for version in client.search_model_versions(f"name = '{model.name}'"):
            full = client.get_model_version(model.name, version.version)
            texts += [(f"{model.name} v{version.version} tag {k}", str(v)) for k, v in full.tags.items()]
            texts.append((f"{model.name} v{version.version} description", full.description or ""))
            texts.append((f"{model.name} v{version.version} source", full.source or ""))
    return [(where, name) for where, text in texts for name, value in secrets.items() if value in text]


def in_prefect(secrets: dict[str, str], api: str, http=requests) -> list[tuple[str, str]]:
    """`http`: requests, or a session carrying the API's auth (tasks/platform/local_stack: prefect_session)."""
    texts: list[tuple[str, str]] = []
    for offset in range(0, 10_000, 200):
        runs = http.post(f"{api}/flow_runs/filter", json={"limit": 200, "offset": offset}, timeout=30).json()
        texts += [(f"flow run {r['name']} parameters", str(r["parameters"])) for r in runs]
        if len(runs) < 200:
            break
    for offset in range(0, 100_000, 200):
        logs = http.post(f"{api}/logs/filter", json={"limit": 200, "offset": offset}, timeout=30).json()
        texts += [(f"log of flow run {line['flow_run_id']}", line["message"]) for line in logs]
        if len(logs) < 200:
            break
    artifacts = http.post(f"{api}/artifacts/filter", json={"limit": 200}, timeout=30).json()
    texts += [(f"artifact {a['key']}", f"{a.get('data')} {a.get('description')}") for a in artifacts]
    variables = http.post(f"{api}/variables/filter", json={"limit": 200}, timeout=30).json()
    texts += [(f"variable {v['name']}", str(v.get("value"))) for v in variables]
    return [(where, name) for where, text in texts for name, value in secrets.items() if value in text]


def in_processes(secrets: dict[str, str], skip: frozenset[int] = frozenset()) -> list[tuple[str, str]]:
    """/proc/<pid>/cmdline and /proc/<pid>/environ of every process of this user but the pids in `skip`;
    where is `pid N argv|environ: program`."""
    found = []
    needles = {name: value.encode() for name, value in secrets.items()}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) in skip:
            continue
        try:
            if entry.stat().st_uid != os.getuid():
                continue
            texts = {part: (entry / part).read_bytes() for part in ("cmdline", "environ")}
        except OSError:  # gone meanwhile, or not readable
            continue
        program = texts["cmdline"].split(b"\0", 1)[0].decode(errors="replace")
        for part, text in texts.items():
            where = f"pid {entry.name} {'argv' if part == 'cmdline' else part}: {program}"
            found += [(where, name) for name, needle in needles.items() if needle in text]
    return found
