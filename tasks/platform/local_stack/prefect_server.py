"""The stack's Prefect server, the CPU work pool and the process worker that runs its flow runs."""

from __future__ import annotations

import base64
import os
from collections.abc import Mapping
from pathlib import Path

import requests

from tasks.platform.errors import CheckFailed
from tasks.platform.local_stack.process import BIN, Server, start

CPU_POOL = "llmops-cpu"


def prefect_api(auth_string: str | None = None) -> requests.Session:
    """HTTP to the Prefect API that retries what Prefect's own client retries: 502/503/504, which a
    Prefect server on sqlite answers while its database is busy (seen here under load on 2 cores).
    `auth_string` ("user:password"): sent as Prefect's own client sends PREFECT_API_AUTH_STRING
    (prefect/client/orchestration/__init__.py:352-361 at 3.7.2: Basic, the whole string base64-encoded)."""
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
    if auth_string:
        session.headers["Authorization"] = f"Basic {base64.b64encode(auth_string.encode()).decode()}"
    return session


API = prefect_api()  # a Prefect API without authentication (Prefect's temporary one)


def prefect_session(env: Mapping[str, str]) -> requests.Session:
    """The Prefect API of the client environment `env`, with its PREFECT_API_AUTH_STRING where it has one."""
    return prefect_api(env.get(AUTH_ENV))


AUTH_ENV = "PREFECT_API_AUTH_STRING"  # the client's; the server's is PREFECT_SERVER_API_AUTH_STRING


def prefect_server_env(prefect_home: Path) -> dict:
    """A server's own UI folder: by default every server of one install serves the UI from one folder inside the
    package (prefect/server/ui_build), which a starting server empties and fills again when its marker file does not
    match (prefect/server/api/server.py:711-729 at 3.7.2). Two servers started at once in a fresh venv (the test
    workers' Prefect servers) interleaved that: the marker was written over a folder missing 70 of 116 assets, so
    every later server of that venv answered the UI's script with its HTML page (a login page that never came)."""
    return {
        "PREFECT_HOME": str(prefect_home),
        "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
        "PREFECT_API_URL": "",
        "PREFECT_SERVER_UI_STATIC_DIRECTORY": str(prefect_home / "ui-build"),
    }


def start_prefect(
    prefect_home: Path, port: int, log_dir: Path, db_env: dict | None = None, auth_string: str | None = None
) -> Server:
    """`auth_string` ("user:password"): every API call but GET /api/health and /api/ready needs it, websockets
    included, and the UI asks for it once per browser (prefect/server/api/server.py:531-568 at 3.7.2)."""
    url = f"http://127.0.0.1:{port}/api"
    auth = {"PREFECT_SERVER_API_AUTH_STRING": auth_string} if auth_string else {}
    return start(
        "prefect",
        [str(BIN / "prefect"), "server", "start", "--host", "127.0.0.1", "--port", str(port)],
        url,
        lambda: requests.get(f"{url}/health", timeout=2).ok,
        log_dir,
        # The UI asks /ui-settings where the API is; left alone that is port 4200 whatever --port says.
        env={**prefect_server_env(prefect_home), "PREFECT_UI_API_URL": url, **(db_env or {}), **auth},
        timeout=180,
    )


def ensure_process_pool(api_url: str, pool: str = CPU_POOL, api: requests.Session = API) -> None:
    """The work pool for CPU work; created once, left as is when it exists (a user may have tuned it)."""
    found = api.get(f"{api_url}/work_pools/{pool}", timeout=10)
    if found.status_code == 404:
        response = api.post(
            f"{api_url}/work_pools/",
            timeout=10,
            json={"name": pool, "type": "process", "description": "llmops: CPU stages and the release flow itself"},
        )
        if response.status_code not in (201, 409):
            raise CheckFailed(f"creating work pool {pool}: HTTP {response.status_code} {response.text[:200]}")
    elif not found.ok:
        raise CheckFailed(f"reading work pool {pool}: HTTP {found.status_code} {found.text[:200]}")


def worker_online(api_url: str, pool: str, name: str, api: requests.Session = API) -> bool:
    response = api.post(f"{api_url}/work_pools/{pool}/workers/filter", json={}, timeout=5)
    return any(w["name"] == name and w.get("status") == "ONLINE" for w in response.json())


def start_worker(
    api_url: str, env: dict, log_dir: Path, pool: str = CPU_POOL, name: str = "llmops-local", query_seconds: float = 2
) -> Server:
    """A `process` worker for `pool`; its flow runs inherit `env` (S3, MLflow, Prefect's auth, LLMOPS_HOME)."""
    api = prefect_session(env)
    ensure_process_pool(api_url, pool, api)
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
        lambda: worker_online(api_url, pool, name, api),
        log_dir,
        env=worker_env,
        timeout=120,
    )
