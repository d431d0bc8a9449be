"""Real servers for integration tests, on 127.0.0.1 with free ports: the local stack's own S3
(`rclone serve s3`, checks credentials) and MLflow (sqlite, artifacts in that S3) starters."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from flows import stack as local_stack
from flows.stack import Server, free_port

S3_KEY, S3_SECRET = "llmops-test", "llmops-test-secret"
__all__ = ["Stack", "free_port", "s3_env", "start_stack"]


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

        return boto3.client("s3", endpoint_url=self.s3.url, aws_access_key_id=S3_KEY,
                            aws_secret_access_key=S3_SECRET, region_name="us-east-1")

    def stop(self) -> None:
        self.mlflow.stop()
        self.s3.stop()


def start_stack(root: Path) -> Stack:
    data_dir = root / "s3-data"
    s3 = local_stack.start_s3(data_dir, free_port(), S3_KEY, S3_SECRET, root)
    env = s3_env(s3.url)
    try:
        mlflow = local_stack.start_mlflow(root / "mlflow.db", free_port(), env, root)
    except Exception:
        s3.stop()
        raise
    return Stack(s3, mlflow, data_dir, env)
