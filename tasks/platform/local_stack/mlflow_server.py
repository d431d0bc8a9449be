"""The stack's MLflow tracking server, its artifacts stored in the stack's S3, behind MLflow's own basic auth, with
two accounts for its clients: one that releases (may move registered-model aliases) and one that only reads."""

from __future__ import annotations

import os
from pathlib import Path

import requests

from tasks.platform.child_env import write_secret
from tasks.platform.local_stack.process import BIN, Server, start

# MLflow's admin: it may do everything, users and permissions included. Only `llmops stack up` logs in as it, to make
# the two accounts below; no client of the stack gets its password.
ADMIN = "llmops"
RELEASE = "llmops-release"  # release runs (register, promote, rollback), the worker's flow runs, `llmops stack env`
READER = "llmops-reader"  # dashboards and other clients that only look: `llmops stack env --mlflow-reader`
# What each account may do on every experiment and registered model ("*": MLflow 3.17's wildcard grain,
# mlflow/server/auth/permissions.py:157-176; a wildcard grant matches any id, :266-273). Moving an alias needs
# can_update on the registered model and deleting one can_delete (mlflow/server/auth/__init__.py:2192-2223,
# validate_can_set/delete_model_or_prompt_version_alias), so the release account gets MANAGE there; EDIT on
# experiments logs runs, metrics and artifacts into experiments another account made (an account that makes an
# experiment or model is granted MANAGE on it: __init__.py:5416-5437). READ has can_read only (permissions.py:23-30).
GRANTS = {
    RELEASE: {"experiment": "EDIT", "registered_model": "MANAGE"},
    READER: {"experiment": "READ", "registered_model": "READ"},
}
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


def login_env(account: str, password: str) -> dict:
    """What an MLflow client needs to log in as `account` (mlflow/utils/credentials.py reads these two)."""
    return {"MLFLOW_TRACKING_USERNAME": account, "MLFLOW_TRACKING_PASSWORD": password}


def provision_accounts(url: str, admin_password: str, passwords: dict[str, str]) -> None:
    """Make (or re-key) each account of GRANTS with its password in `passwords` and give it its grants, as the
    admin, through MLflow's auth REST API (mlflow/server/auth/routes.py:7,23,25,29, methods at __init__.py:4713-4762;
    handlers create_user,
    update_user_password and grant_user_permission in mlflow/server/auth/__init__.py:7264,7407,7482). Idempotent:
    an account that exists gets the password of stack.json, a grant that exists is made again at its level."""
    api = f"{url}/api"
    session = requests.Session()
    session.auth = (ADMIN, admin_password)

    def call(method: str, path: str, body: dict) -> requests.Response:
        response = session.request(method, f"{api}{path}", json=body, timeout=30)
        if response.status_code >= 500:
            response.raise_for_status()
        return response

    def exists(response: requests.Response) -> bool:
        return response.status_code == 400 and "RESOURCE_ALREADY_EXISTS" in response.text

    for account, grants in GRANTS.items():
        made = call("POST", "/2.0/mlflow/users/create", {"username": account, "password": passwords[account]})
        if exists(made):
            made = call(
                "PATCH", "/2.0/mlflow/users/update-password", {"username": account, "password": passwords[account]}
            )
        made.raise_for_status()
        for resource_type, permission in grants.items():
            grant = {"username": account, "resource_type": resource_type, "resource_id": "*"}
            granted = call("POST", "/3.0/mlflow/users/permissions/grant", {**grant, "permission": permission})
            if exists(granted):  # MLflow's grant inserts only (sqlalchemy_store.py:448-496): revoke, then grant
                call("POST", "/3.0/mlflow/users/permissions/revoke", grant).raise_for_status()
                granted = call("POST", "/3.0/mlflow/users/permissions/grant", {**grant, "permission": permission})
            granted.raise_for_status()


def start_mlflow(
    backend_store_uri: str,
    port: int,
    s3: dict,
    log_dir: Path,
    db_env: dict | None = None,
    login: dict | None = None,
) -> Server:
    """MLflow server: sqlite or PostgreSQL backend, artifacts proxied into the S3 server's `mlflow` bucket.

    `login` ({"password", "secret_key", "folder", "accounts"}): `--app-name basic-auth`, so that every call but
    /health needs a login (401 without it); the admin account is made on the first start with `password` (the only
    time MLflow reads it), `secret_key` signs its CSRF tokens, and once it is up the release and reader accounts are
    made with the passwords of `accounts` ({account: password})."""
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
    server = start(
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
    if login is not None:
        try:
            provision_accounts(url, login["password"], login["accounts"])
        except BaseException:
            server.stop()
            raise
    return server
