"""The stack's MLflow tracking server, its artifacts stored in the stack's S3, behind MLflow's own basic auth."""

from __future__ import annotations

import os
from pathlib import Path

import requests

from tasks.platform.child_env import write_secret
from tasks.platform.local_stack.process import BIN, Server, start

ADMIN = "llmops"  # the stack's one MLflow account: every client of the stack logs in as it
# MLflow 3.17's server runs job execution by default (mlflow/environment_variables.py, on when unset;
# mlflow/server/__init__.py starts its huey consumers): eight processes of about 290 MB and 4.6% of a core each
# while idle, for jobs nothing in this project submits. Off unless the operator's environment turns it on.
JOB_EXECUTION_ENV = "MLFLOW_SERVER_ENABLE_JOB_EXECUTION"


def auth_config(folder: Path) -> Path:
    """MLflow's basic-auth settings (mlflow/server/auth/basic_auth.ini at 3.17.2): its users in a sqlite file of the
    stack, no permission for an account that is not the admin, and a password check cached for 60 s: uncached,
    each request of a release (hundreds) pays a PBKDF2 hash (the ini's own note: about 3x the throughput cached); a
    changed or revoked password stops working within that minute (MLflow's default, 10 minutes, kept it valid).
    The admin's password is not in it: MLflow takes it from its environment the first time it starts."""
    path = folder / "mlflow-auth.ini"
    write_secret(
        path,
        "\n".join(
            [
                "[mlflow]",
                "default_permission = NO_PERMISSIONS",
                f"database_uri = sqlite:///{folder / 'mlflow-auth.db'}",
                f"admin_username = {ADMIN}",
                "authorization_function = mlflow.server.auth:authenticate_request_basic_auth",
                "grant_default_workspace_access = false",
                "auth_cache_ttl_seconds = 60",
                "",
            ]
        ),
    )
    return path


def login_env(password: str) -> dict:
    """What an MLflow client needs to log in (mlflow/utils/credentials.py reads these two)."""
    return {"MLFLOW_TRACKING_USERNAME": ADMIN, "MLFLOW_TRACKING_PASSWORD": password}


def start_mlflow(
    backend_store_uri: str,
    port: int,
    s3: dict,
    log_dir: Path,
    db_env: dict | None = None,
    login: dict | None = None,
) -> Server:
    """MLflow server: sqlite or PostgreSQL backend, artifacts proxied into the S3 server's `mlflow` bucket.

    `login` ({"password", "secret_key", "folder"}): `--app-name basic-auth`, so that every call but /health needs
    the stack's login (401 without it); the admin account is made on the first start with `password` (the only time
    MLflow reads it) and `secret_key` signs its CSRF tokens."""
    url = f"http://127.0.0.1:{port}"
    auth_args: list[str] = []
    auth_env: dict = {}
    if login is not None:
        auth_args = ["--app-name", "basic-auth"]
        auth_env = {
            "MLFLOW_AUTH_CONFIG_PATH": str(auth_config(Path(login["folder"]))),
            "MLFLOW_AUTH_ADMIN_USERNAME": ADMIN,
            "MLFLOW_AUTH_ADMIN_PASSWORD": login["password"],
            "MLFLOW_FLASK_SERVER_SECRET_KEY": login["secret_key"],
        }
    return start(
        "mlflow",
        [
            str(BIN / "mlflow"),
            "server",
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--workers",
            "1",
            "--backend-store-uri",
            backend_store_uri,
            "--artifacts-destination",
            "s3://mlflow/artifacts",
            *auth_args,
        ],
        url,
        lambda: requests.get(f"{url}/health", timeout=2).ok,
        log_dir,
        env={
            **s3,
            "MLFLOW_S3_ENDPOINT_URL": s3["AWS_ENDPOINT_URL"],
            JOB_EXECUTION_ENV: os.environ.get(JOB_EXECUTION_ENV, "false"),
            **(db_env or {}),
            **auth_env,
        },
        timeout=180,
    )
