"""Real servers for integration tests, on 127.0.0.1 with free ports: the local stack's own S3
(`rclone serve s3`, checks credentials) and MLflow (sqlite, artifacts in that S3) starters; and the
`llmops` command run on an LLMOPS_HOME of a test's, with that home's MLflow registry."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

from tasks.platform import local_stack
from tasks.platform.local_stack import Server
from tasks.platform.ports import free_port

S3_KEY, S3_SECRET = "llmops-test", "llmops-test-secret"
__all__ = [
    "SHARED_PREFECT",
    "TEMPORARY_PREFECT",
    "Stack",
    "free_port",
    "latest_release",
    "llmops",
    "llmops_env",
    "registry",
    "s3_env",
    "start_stack",
]
ROOT = Path(__file__).resolve().parent.parent
LLMOPS = Path(sys.executable).parent / "llmops"


# The session's Prefect server (tests/conftest.py `shared_prefect`), once a module asked for it: releases
# then skip the temporary API server each `llmops run` starts without PREFECT_API_URL (about 4 s a run
# here). The runs that test that default path pass PREFECT_API_URL="" (TEMPORARY_PREFECT).
SHARED_PREFECT: dict[str, str] = {}
TEMPORARY_PREFECT = {"PREFECT_API_URL": ""}


def llmops_env(home: Path) -> dict:
    env = {**os.environ, **SHARED_PREFECT, "LLMOPS_HOME": str(home)}
    env.pop("PREFECT_HOME", None)
    return env


def llmops(home: Path, *args: str, timeout: float = 900) -> subprocess.CompletedProcess:
    """`llmops ARGS` with LLMOPS_HOME=home, from the project root; output captured."""
    return subprocess.run(
        [str(LLMOPS), *args], capture_output=True, text=True, env=llmops_env(home), cwd=ROOT, timeout=timeout
    )


def latest_release(home: Path):
    """The newest release run of a home's tracking store: its tags say what happened (stage.*, gate.decision,
    release.outcome)."""
    from tasks.platform.tracking import EXPERIMENT

    client = registry(home)
    experiment = client.get_experiment_by_name(EXPERIMENT)
    return client.search_runs([experiment.experiment_id], order_by=["attributes.start_time DESC"], max_results=1)[0]


def registry(home: Path):
    """The MLflow client of a home's embedded tracking store (sqlite)."""
    from mlflow import MlflowClient

    return MlflowClient(f"sqlite:///{home / 'mlflow.db'}")


def tritons_under(pid: int) -> list:
    """The tritonserver processes under a process: one that exits while the tree is read (a replica the service
    stopped, a start that died) is not counted, where psutil would raise NoSuchProcess on its name. Nor is a
    tritonserver's own child: the Python backend forks one per model instance and only then execs bash and the stub
    (python_backend src/stub_launcher.cc, Launch: fork, then execvp("bash", ...)), so a model loading shows a child
    named tritonserver for a moment (CI counted 3 where the serve ran 2)."""
    import psutil

    found = {}  # a tritonserver: its parent's pid
    for child in psutil.Process(pid).children(recursive=True):
        with contextlib.suppress(psutil.NoSuchProcess):
            if child.name() == "tritonserver":
                found[child] = child.ppid()
    pids = {triton.pid for triton in found}
    return [triton for triton, parent in found.items() if parent not in pids]


def s3_env(endpoint: str) -> dict:
    return {**local_stack.s3_env(endpoint, S3_KEY, S3_SECRET), "AWS_MAX_ATTEMPTS": "2"}


@dataclass
class Stack:
    s3: Server
    mlflow: Server
    data_dir: Path
    env: dict = field(default_factory=dict)

    def boto3(self):
        import boto3

        return boto3.client(
            "s3",
            endpoint_url=self.s3.url,
            aws_access_key_id=S3_KEY,
            aws_secret_access_key=S3_SECRET,
            region_name="us-east-1",
        )

    def stop(self) -> None:
        self.mlflow.stop()
        self.s3.stop()


def start_stack(root: Path) -> Stack:
    data_dir = root / "s3-data"
    s3 = local_stack.start_s3(data_dir, free_port(), S3_KEY, S3_SECRET, root)
    env = s3_env(s3.url)
    try:
        mlflow = local_stack.start_mlflow(f"sqlite:///{root / 'mlflow.db'}", free_port(), env, root)
    except Exception:
        s3.stop()
        raise
    return Stack(s3, mlflow, data_dir, env)
