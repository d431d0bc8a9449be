"""The environment a child process starts with: this process's, less the secrets it does not need.

`os.environ` of an `llmops` process may hold the gateway's API keys, Triton's control key and S3
credentials, and the Prefect and MLflow logins of the local stack; a child that inherits them (tritonserver and the Python-backend stubs it spawns,
genai-perf, rclone, MLflow, Prefect) keeps them in /proc/<pid>/environ, where its logs, crash dumps
and anything it runs can read them. Each place that starts a child builds its environment here and
adds back by name only what that child needs.
"""

from __future__ import annotations

import os
import secrets
from collections.abc import Mapping

SECRETS = (
    "LLMOPS_API_KEYS",
    "LLMOPS_TRITON_CONTROL_KEY",
    "AWS_ACCESS_KEY_ID",
    "AWS_SECRET_ACCESS_KEY",
    "AWS_SESSION_TOKEN",
    "RCLONE_AUTH_KEY",
    "PREFECT_API_AUTH_STRING",
    "PREFECT_SERVER_API_AUTH_STRING",
    "MLFLOW_TRACKING_PASSWORD",
)


def child_env(extra: Mapping[str, str] | None = None, base: Mapping[str, str] | None = None) -> dict[str, str]:
    """`base` (default: os.environ) without SECRETS, then `extra` (what this child needs, secrets included)."""
    env = {name: value for name, value in (os.environ if base is None else base).items() if name not in SECRETS}
    return {**env, **(extra or {})}


def write_secret(path, text: str) -> None:
    """Write `text` to `path`, mode 600 from its creation (never readable by others, not even for an instant),
    replacing it atomically: a reader sees the old file or the new one, whole."""
    staged = f"{path}.{secrets.token_hex(6)}.partial"
    fd = os.open(staged, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        with os.fdopen(fd, "w") as out:
            out.write(text)
        os.replace(staged, path)
    except BaseException:
        if os.path.exists(staged):
            os.unlink(staged)
        raise
