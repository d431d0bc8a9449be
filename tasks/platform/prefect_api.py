"""A temporary Prefect API server for one `llmops run`, started before the heavy imports.

Without PREFECT_API_URL, Prefect starts a temporary server itself (SubprocessASGIServer) when the
first flow begins: it first imports the whole server application into the client process (about 4 s
here) and then waits for the child to start (about 7 s), one after the other. Starting the same
uvicorn command (Prefect 3.7's `SubprocessASGIServer._run_uvicorn_command`: the same app factory,
flags and environment) at the top of `llmops run` lets the child start while this process imports
the pipeline, and the client never imports the server. A cached rerun is mostly this start-up.
"""

from __future__ import annotations

import subprocess
import sys
import time
from importlib.util import find_spec
from pathlib import Path

import requests

from tasks.platform.child_env import child_env
from tasks.platform.errors import TransientError
from tasks.platform.lifetime import dying_with_this_thread
from tasks.platform.ports import free_port


class TemporaryPrefectAPI:
    def __init__(self, log_path: Path):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}/api"
        spec = find_spec("prefect")  # where it is, without importing it
        if spec is None or spec.origin is None:
            raise TransientError("prefect is not installed in this environment")
        prefect_dir = Path(spec.origin).parent.parent
        log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(log_path, "ab") as log:
            # a SIGKILLed `llmops run` leaves no API server behind (started from its main thread)
            command = dying_with_this_thread(
                [
                    sys.executable,
                    "-m",
                    "uvicorn",
                    "--app-dir",
                    str(prefect_dir),
                    "--factory",
                    "prefect.server.api.server:create_app",
                    "--host",
                    "127.0.0.1",
                    "--port",
                    str(self.port),
                    "--log-level",
                    "error",
                    "--lifespan",
                    "on",
                ]
            )
            self.process = subprocess.Popen(
                command,
                env=child_env(
                    {"PREFECT_UI_ENABLED": "0", "PREFECT__SERVER_EPHEMERAL": "1", "PREFECT__SERVER_FINAL": "1"}
                ),
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        self.log_path = log_path

    def wait_healthy(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise TransientError(
                    f"temporary Prefect API server exited with {self.process.returncode} (log {self.log_path})"
                )
            try:
                if requests.get(f"{self.url}/health", timeout=2).status_code == 200:
                    return
            except requests.RequestException:
                pass
            time.sleep(0.1)
        raise TransientError(f"temporary Prefect API server not up after {timeout:.0f}s (log {self.log_path})")

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(5)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
