"""Where `llmops serve` publishes what it runs for its LLMOPS_HOME, and how a release of that home finds it:
`$LLMOPS_HOME/triton/server.json` (its Triton replicas, its gateway and control API's URLs, its process), the first
Triton's control key in `$LLMOPS_HOME/triton/control.key` (for a release of another service, which loads on that
Triton itself; one of the serve's own service holds no Triton key: the serve loads), and the serve's own key in
`$LLMOPS_HOME/serving/control.key` (all mode 600, written while the serve runs, removed when it stops). This module is
those files' one owner.
"""

from __future__ import annotations

import json
import os
import secrets
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from tasks.platform.child_env import write_secret
from tasks.platform.errors import TransientError
from tasks.serving.client import CONTROL_KEY_FILE, Triton, control_key

if TYPE_CHECKING:
    from tasks.serving.service import Service


SERVER_FILE = "server.json"  # written while `llmops serve` runs: lets a run attach to the serving Triton
SERVE_KEY_FILE = Path("serving") / "control.key"  # under $LLMOPS_HOME, mode 600, while `llmops serve` runs
SERVE_KEY_ENV = "LLMOPS_SERVE_CONTROL_KEY"  # the serve's control key where its user gives one (else a fresh one)


def new_serve_key() -> str:
    """The control key of an `llmops serve` about to start: LLMOPS_SERVE_CONTROL_KEY where given, else fresh."""
    return os.environ.get(SERVE_KEY_ENV) or secrets.token_urlsafe(32)


def publish(
    home: Path,
    tritons: list[Triton],
    gateway_url: str | None = None,
    control_url: str | None = None,
    serve_key: str | None = None,
    service: str | None = None,
    gateway_metrics_url: str | None = None,
) -> Path:
    """Write server.json: runs with this LLMOPS_HOME roll out on these Triton replicas (the first one first), through
    the serve's control API, while it lives; clients of this machine find the gateway there, and Prometheus (or a
    person) the gateway's /metrics."""
    state = home / "triton" / SERVER_FILE
    first = tritons[0]
    state.parent.mkdir(parents=True, exist_ok=True)
    if first.control_key:
        write_secret(home / "triton" / CONTROL_KEY_FILE, first.control_key)
    if serve_key:
        (home / SERVE_KEY_FILE).parent.mkdir(parents=True, exist_ok=True)
        write_secret(home / SERVE_KEY_FILE, serve_key)

    def endpoints(triton: Triton) -> dict:
        repository = str(triton.repository) if triton.repository is not None else None
        return {
            "url": triton.url,
            "grpc_url": triton.grpc_url,
            "metrics_url": triton.metrics_url,
            "repository": repository,
        }

    write_secret(
        state,
        json.dumps(
            {
                **endpoints(first),
                "replicas": [endpoints(t) for t in tritons],
                "gateway_url": gateway_url,
                "control_url": control_url,
                "service": service,
                "gateway_metrics_url": gateway_metrics_url,
                "pid": os.getpid(),
            }
        ),
    )
    return state


def unpublish(home: Path, serve_stops: bool = True) -> None:
    """Before its Tritons stop: the server file, and the keys that die with them; and where the serve stops too, its
    own control key."""
    for name in (SERVER_FILE, CONTROL_KEY_FILE, "control.keys"):  # control.keys: an older serve's replica keys
        (home / "triton" / name).unlink(missing_ok=True)
    if serve_stops:
        (home / SERVE_KEY_FILE).unlink(missing_ok=True)


def serving_process(pid: int) -> bool:
    """Whether `pid` is alive and is an llmops or tritonserver process (a stale server.json names a dead pid,
    which the system may since have given to anything)."""
    try:
        command = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return False
    return b"llmops" in command or b"tritonserver" in command


def published_state(home: Path) -> dict | None:
    """server.json of the `llmops serve` running for this LLMOPS_HOME; None without one, or when its process is gone."""
    info = server_file(home)
    return info if info is not None and serving_process(int(info.get("pid", 0))) else None


def server_file(home: Path) -> dict | None:
    """server.json as it lies, whether or not its serve lives; None without one (or one half written)."""
    try:
        return json.loads((home / "triton" / SERVER_FILE).read_text())
    except (OSError, ValueError):
        return None


def serving_gateway(home: Path) -> str | None:
    """The URL of the gateway of the `llmops serve` running for this LLMOPS_HOME, if one runs."""
    info = published_state(home)
    return info.get("gateway_url") if info else None


def published(home: Path) -> Triton | None:
    """The client of the Triton `llmops serve` publishes for this LLMOPS_HOME, if it answers."""
    info = published_state(home)
    if info is None:
        return None
    repository = Path(info["repository"]) if info.get("repository") else None
    triton = Triton(
        info["url"], repository, info["metrics_url"], info["grpc_url"], control_key(home), lambda: control_key(home)
    )
    return triton if triton.is_live() else None


def died_without_stopping(home: Path, name: str) -> int | None:
    """The pid of the `llmops serve` of service `name` on this home that died without stopping (SIGKILLed, out of
    memory: its server.json stays, naming a dead pid), which its supervisor starts again; None where none did (a
    serve that stops unpublishes)."""
    info = server_file(home) or {}
    pid = int(info.get("pid", 0))
    return pid if info.get("service") == name and pid and not serving_process(pid) else None


def awaited_service(home: Path, name: str, wait_s: float, say: Callable[[str], None]) -> Service | None:
    """Where the serve of `name` on this home died without stopping: that serve once it is back (it publishes again),
    waited for up to `wait_s`; TransientError past it. None where no serve died so. A release never starts a service
    of its own on the record of a serve that comes back (issue 73: a release started while the serve restarted
    promoted on its own gateway, and the serve, back, kept routing the old champion)."""
    pid = died_without_stopping(home, name)
    if pid is None:
        return None
    say(f"serving: the llmops serve of {name} (pid {pid}) died without stopping; waiting up to {wait_s:.0f}s for it")
    deadline = time.monotonic() + wait_s
    while time.monotonic() < deadline:
        found = published_service(home, name)
        if found is not None:
            return found
        time.sleep(1)
    raise TransientError(
        f"the llmops serve of {name} (pid {pid}) died without stopping and is not back after {wait_s:.0f}s: start it "
        f"again (a release without it: remove {home / 'triton' / SERVER_FILE})"
    )


def published_service(home: Path, name: str) -> Service | None:
    """The service `name` as `llmops serve` runs it for this LLMOPS_HOME (its replicas and its control API), while
    that serve's process lives, whether or not a replica answers now: one restarting, or none at all at zero
    replicas, is the serve's to bring back, and a release waits for it (PUT /owner) rather than start a service of its
    own on the same record (issue 73). Another service's serve is not this one's (its Triton may host it: `published`).
    """
    from tasks.serving.service import Service, ServiceControl

    info = published_state(home)
    key_file = home / SERVE_KEY_FILE
    if info is None or info.get("service") != name or not key_file.is_file():
        return None
    control = ServiceControl(info["control_url"], key_file.read_text().strip(), reread=lambda: published_control(home))
    return Service(name, published_replicas(info), control)


def published_control(home: Path) -> tuple[str, str] | None:
    """The control API's URL and key the `llmops serve` of this LLMOPS_HOME publishes now; None without one."""
    info, key_file = published_state(home), home / SERVE_KEY_FILE
    return (info["control_url"], key_file.read_text().strip()) if info and key_file.is_file() else None


def published_replicas(info: dict) -> list[Triton]:
    """Every Triton replica server.json lists, without a control key: a release benchmarks on them and reads their
    metrics; what they load is the serve's (POST /control/v1/versions)."""
    replicas = info.get("replicas") or [{k: info.get(k) for k in ("url", "grpc_url", "metrics_url", "repository")}]
    return [
        Triton(
            r["url"], Path(r["repository"]) if r.get("repository") else None, r.get("metrics_url"), r.get("grpc_url")
        )
        for r in replicas
    ]
