"""Library lines silenced at their source (tasks/platform/quiet.py), each proven with the fault that printed it."""

from __future__ import annotations

import re
import socket
import subprocess
import sys
import threading
from pathlib import Path

from tasks.platform.ports import free_port

ROOT = Path(__file__).resolve().parents[2]
OK = b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 2\r\nConnection: keep-alive\r\n\r\n{}"

# Two requests through MLflow's own retrying session (its tracking client's http_request calls it:
# mlflow/utils/rest_utils.py:298 at 3.17.2), then one to a port where nothing listens; what the libraries log goes
# to stderr as a CLI's console handler would print it.
CLIENT = """
import logging, sys
logging.basicConfig(level=logging.WARNING, stream=sys.stderr, format="%(name)s - %(message)s")
if sys.argv[3] == "quiet":
    from tasks.platform.quiet import quiet_libraries
    quiet_libraries()
from mlflow.utils.request_utils import _get_http_response_with_retries as get
retrying = dict(max_retries=2, backoff_factor=0, backoff_jitter=0, retry_codes=(), timeout=10)
print([get("GET", sys.argv[1], **retrying).status_code for _ in range(2)])
try:
    get("GET", sys.argv[2], **retrying)
except Exception as error:
    print(type(error).__name__)
"""


def read_request(connection: socket.socket) -> bool:
    """One request's head (these are GETs: no body); False when the client closed the connection."""
    received = b""
    while b"\r\n\r\n" not in received:
        chunk = connection.recv(4096)
        if not chunk:
            return False
        received += chunk
    return True


def closes_its_first_kept_alive_connection(listener: socket.socket) -> None:
    """An HTTP server whose first connection answers one request, then is closed as the second arrives, with no
    answer: what a server's keep-alive timeout does to a request sent just as it expires. Later connections answer."""
    for index in range(3):
        connection, _ = listener.accept()
        with connection:
            if index == 0:
                read_request(connection)
                connection.sendall(OK)
                read_request(connection)
                continue  # closed with the second request unanswered
            while read_request(connection):
                connection.sendall(OK)


def client_output(mode: str) -> subprocess.CompletedProcess:
    listener = socket.create_server(("127.0.0.1", 0))
    server = threading.Thread(target=closes_its_first_kept_alive_connection, args=(listener,), daemon=True)
    server.start()
    try:
        url = f"http://127.0.0.1:{listener.getsockname()[1]}/api/2.0/mlflow/runs/get"
        nowhere = f"http://127.0.0.1:{free_port()}/api/2.0/mlflow/runs/get"
        return subprocess.run(
            [sys.executable, "-c", CLIENT, url, nowhere, mode],
            capture_output=True,
            text=True,
            cwd=ROOT,
            timeout=120,
        )
    finally:
        listener.close()


def test_a_retried_kept_alive_connection_prints_nothing_but_a_refused_one_still_does():
    plain, quiet = client_output("plain"), client_output("quiet")
    for done in (plain, quiet):
        assert done.returncode == 0, done.stderr[-2000:]
        assert done.stdout.split("\n")[:2] == ["[200, 200]", "ConnectionError"], done.stdout + done.stderr[-2000:]
    # the fault is real: urllib3 logs the retry of the request the server dropped, unless quieted
    assert "after connection broken by 'RemoteDisconnected(" in plain.stderr, plain.stderr[-2000:]
    assert "RemoteDisconnected" not in quiet.stderr, quiet.stderr[-2000:]
    # an outage in progress still shows: the refused connection's retries are logged either way, quieted in our words
    assert "urllib3.connectionpool - Retrying (" in plain.stderr and "NewConnectionError" in plain.stderr
    said = [line for line in quiet.stderr.splitlines() if line.startswith("urllib3.connectionpool - ")]
    assert said and all(
        re.fullmatch(
            r"urllib3\.connectionpool - 127\.0\.0\.1:\d+ refused the connection; retrying "
            r"/api/2\.0/mlflow/runs/get \((1 retry|\d retries) left\)",
            line,
        )
        for line in said
    ), said
    assert "object at 0x" not in quiet.stderr


def test_a_read_timeout_retry_names_the_server_that_did_not_answer(caplog):
    """A server that takes the connection and never answers (a frozen MLflow): urllib3's retry line, in our words,
    names it (ReadTimeoutError carries its pool, not a connection)."""
    import logging

    import urllib3

    from tasks.platform.quiet import quiet_libraries

    quiet_libraries()
    silent = socket.create_server(("127.0.0.1", 0))
    port = silent.getsockname()[1]
    http = urllib3.PoolManager(retries=urllib3.Retry(total=1, read=1), timeout=urllib3.Timeout(read=0.3))
    try:
        with caplog.at_level(logging.WARNING, logger="urllib3.connectionpool"):
            try:
                http.request("GET", f"http://127.0.0.1:{port}/api/2.0/mlflow/runs/get")
            except urllib3.exceptions.MaxRetryError:
                pass
    finally:
        silent.close()
    said = [r.getMessage() for r in caplog.records if r.name == "urllib3.connectionpool"]
    assert said == [f"127.0.0.1:{port} did not answer in time; retrying /api/2.0/mlflow/runs/get (0 retries left)"]
