"""MLflow tracking for a release run: one run, keys prefixed by stage (`train/loss`).

Stages log through an explicit run id rather than MLflow's fluent "active run", which is
thread-local and would not follow a Prefect task into its worker thread.
"""

from __future__ import annotations

import json
import math
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

EXPERIMENT = "llm-release"


def default_tracking_uri(home: Path) -> str:
    return f"sqlite:///{(home / 'mlflow.db').resolve()}"


@dataclass
class Registered:
    """A version of an MLflow registered model, as the register stage made (or reused) it; what serving and the
    release's later stages address."""

    name: str
    version: str
    source: str
    reused: bool


@dataclass
class Tracker:
    tracking_uri: str
    run_id: str
    experiment_id: str

    @property
    def client(self):
        from mlflow import MlflowClient

        return MlflowClient(self.tracking_uri)

    def log_params(self, prefix: str, params: dict) -> None:
        from mlflow.entities import Param

        flat = {f"{prefix}/{k}": str(v)[:6000] for k, v in flatten(params).items()}
        existing = self.client.get_run(self.run_id).data.params
        # MLflow refuses to change a logged param; a stage that runs twice logs once.
        new = [Param(k, v) for k, v in flat.items() if k not in existing]
        for i in range(0, len(new), 100):
            self.client.log_batch(self.run_id, params=new[i : i + 100])

    def log_metrics(self, prefix: str, metrics: dict, step: int = 0) -> None:
        import time

        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        batch = [
            Metric(f"{prefix}/{k}", float(v), now, step)
            for k, v in metrics.items()
            if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)
        ]
        if batch:
            self.client.log_batch(self.run_id, metrics=batch)

    def set_tags(self, tags: dict) -> None:
        for key, value in tags.items():
            self.client.set_tag(self.run_id, key, str(value))

    def log_file(self, path: Path, artifact_path: str | None = None) -> None:
        self.client.log_artifact(self.run_id, str(path), artifact_path)

    def log_json(self, name: str, value: dict) -> None:
        with tempfile.TemporaryDirectory() as tmp:
            path = Path(tmp) / name
            path.write_text(json.dumps(value, indent=2, sort_keys=True))
            self.log_file(path)

    def url(self) -> str:
        if self.tracking_uri.startswith("http"):
            return f"{self.tracking_uri.rstrip('/')}/#/experiments/{self.experiment_id}/runs/{self.run_id}"
        return f"mlflow ui --backend-store-uri {self.tracking_uri}  (run {self.run_id})"


def flatten(value: dict, prefix: str = "") -> dict:
    out = {}
    for key, item in value.items():
        name = f"{prefix}{key}"
        if isinstance(item, dict) and item:
            out.update(flatten(item, f"{name}."))
        else:
            out[name] = item
    return out


def ensure_experiment(tracking_uri: str, name: str, artifact_root: Path | None) -> str:
    """The experiment's id, made if missing. `artifact_root`: where a local tracking store keeps its artifacts
    (under LLMOPS_HOME); left to MLflow, a sqlite store puts them in ./mlruns of whatever folder the process runs in."""
    from mlflow import MlflowClient

    client = MlflowClient(tracking_uri)
    experiment = client.get_experiment_by_name(name)
    if experiment is not None:
        return experiment.experiment_id
    location = artifact_root.resolve().as_uri() if artifact_root else None
    return client.create_experiment(name, artifact_location=location)


def start_run(tracking_uri: str, artifact_root: Path | None, run_name: str, tags: dict) -> Tracker:
    from mlflow import MlflowClient

    experiment_id = ensure_experiment(tracking_uri, EXPERIMENT, artifact_root)
    run = MlflowClient(tracking_uri).create_run(experiment_id, run_name=run_name, tags=tags)
    return Tracker(tracking_uri, run.info.run_id, experiment_id)


def resume_run(tracking_uri: str, run_id: str) -> Tracker:
    """An MLflow run started by an earlier process of the same release (one suspended for approval), continued."""
    from mlflow import MlflowClient

    return Tracker(tracking_uri, run_id, MlflowClient(tracking_uri).get_run(run_id).info.experiment_id)


def end_run(tracker: Tracker, status: str) -> None:
    tracker.client.set_terminated(tracker.run_id, status=status)


def end_failed(tracker: Tracker, exc: BaseException, warn: Callable[[str], None]) -> None:
    """The failure's error tag and status FAILED, where MLflow answers: the failure being raised (an MLflow outage,
    often) is what the caller sees, never an error of recording it."""
    try:
        tracker.set_tags({"error": f"{type(exc).__name__}: {exc}"[:5000]})
        end_run(tracker, "FAILED")
    except Exception as unrecorded:
        warn(
            f"MLflow: the failure was not recorded in run {tracker.run_id}, which stays RUNNING there "
            f"({type(unrecorded).__name__}: {str(unrecorded)[:200]})"
        )


def not_found(exc) -> bool:
    """MLflow's answer for a registered model or alias that does not exist: RESOURCE_DOES_NOT_EXIST for the model,
    INVALID_PARAMETER_VALUE "Registered model alias NAME not found." for the alias (mlflow/store/model_registry/
    sqlalchemy_store.py and file_store.py, get_model_version_by_alias)."""
    code = getattr(exc, "error_code", "")
    return code == "RESOURCE_DOES_NOT_EXIST" or (code == "INVALID_PARAMETER_VALUE" and "not found" in str(exc))
