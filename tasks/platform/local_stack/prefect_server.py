"""The stack's Prefect server, the CPU work pool and the process worker that runs its flow runs."""

from __future__ import annotations

import os
from pathlib import Path

import requests

from tasks.platform.errors import CheckFailed
from tasks.platform.local_stack.process import BIN, Server, start

CPU_POOL = "llmops-cpu"


def prefect_api() -> requests.Session:
    """HTTP to the Prefect API that retries what Prefect's own client retries: 502/503/504, which a
    Prefect server on sqlite answers while its database is busy (seen here under load on 2 cores)."""
    from requests.adapters import HTTPAdapter
    from urllib3.util.retry import Retry

    session = requests.Session()
    session.mount(
        "http://",
        HTTPAdapter(
            max_retries=Retry(
                total=6,
                backoff_factor=0.5,
                status_forcelist=(502, 503, 504),
                allowed_methods=None,
                raise_on_status=False,
            )
        ),
    )
    return session


API = prefect_api()


def prefect_server_env(prefect_home: Path) -> dict:
    return {"PREFECT_HOME": str(prefect_home), "PREFECT_SERVER_ANALYTICS_ENABLED": "false", "PREFECT_API_URL": ""}


def start_prefect(prefect_home: Path, port: int, log_dir: Path, db_env: dict | None = None) -> Server:
    url = f"http://127.0.0.1:{port}/api"
    return start(
        "prefect",
        [str(BIN / "prefect"), "server", "start", "--host", "127.0.0.1", "--port", str(port)],
        url,
        lambda: requests.get(f"{url}/health", timeout=2).ok,
        log_dir,
        # The UI asks /ui-settings where the API is; left alone that is port 4200 whatever --port says.
        env={**prefect_server_env(prefect_home), "PREFECT_UI_API_URL": url, **(db_env or {})},
        timeout=180,
    )


def ensure_process_pool(api_url: str, pool: str = CPU_POOL) -> None:
    """The work pool for CPU work; created once, left as is when it exists (a user may have tuned it)."""
    found = API.get(f"{api_url}/work_pools/{pool}", timeout=10)
    if found.status_code == 404:
        response = API.post(
            f"{api_url}/work_pools/",
            timeout=10,
            json={"name": pool, "type": "process", "description": "llmops: CPU stages and the release flow itself"},
        )
        if response.status_code not in (201, 409):
            raise CheckFailed(f"creating work pool {pool}: HTTP {response.status_code} {response.text[:200]}")
    elif not found.ok:
        raise CheckFailed(f"reading work pool {pool}: HTTP {found.status_code} {found.text[:200]}")


def worker_online(api_url: str, pool: str, name: str) -> bool:
    response = API.post(f"{api_url}/work_pools/{pool}/workers/filter", json={}, timeout=5)
    return any(w["name"] == name and w.get("status") == "ONLINE" for w in response.json())


def start_worker(
    api_url: str, env: dict, log_dir: Path, pool: str = CPU_POOL, name: str = "llmops-local", query_seconds: float = 2
) -> Server:
    """A `process` worker for `pool`; its flow runs inherit `env` (S3, MLflow, LLMOPS_HOME)."""
    ensure_process_pool(api_url, pool)
    worker_env = {
        **env,
        "PREFECT_API_URL": api_url,
        "PREFECT_WORKER_QUERY_SECONDS": str(query_seconds),
        # flow runs from this worker find the project's modules and the venv's executables
        "PATH": f"{BIN}{os.pathsep}{os.environ.get('PATH', '')}",
        "PYTHONUNBUFFERED": "1",
        # a key the user gave for attaching runs to a Triton (tasks/serving/client.py:TritonTarget)
        **{name: os.environ[name] for name in ("LLMOPS_TRITON_CONTROL_KEY",) if os.environ.get(name)},
    }
    return start(
        "worker",
        [str(BIN / "prefect"), "worker", "start", "--pool", pool, "--type", "process", "--name", name],
        api_url,
        lambda: worker_online(api_url, pool, name),
        log_dir,
        env=worker_env,
        timeout=120,
    )
