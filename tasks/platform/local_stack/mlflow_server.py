"""The stack's MLflow tracking server, its artifacts stored in the stack's S3."""

from __future__ import annotations

from pathlib import Path

import requests

from tasks.platform.local_stack.process import BIN, Server, start


def start_mlflow(backend_store_uri: str, port: int, s3: dict, log_dir: Path, db_env: dict | None = None) -> Server:
    """MLflow server: sqlite or PostgreSQL backend, artifacts proxied into the S3 server's `mlflow` bucket."""
    url = f"http://127.0.0.1:{port}"
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
        ],
        url,
        lambda: requests.get(f"{url}/health", timeout=2).ok,
        log_dir,
        env={**s3, "MLFLOW_S3_ENDPOINT_URL": s3["AWS_ENDPOINT_URL"], **(db_env or {})},
        timeout=180,
    )
