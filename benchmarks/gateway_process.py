"""The gateway of `llmops serve` (tasks/runtime/gateway/) in a process of its own, for the benchmarks that send
load through it: not sharing the load generator's interpreter (and its GIL) with the requests it measures.

It runs as under `llmops serve`: the same app, uvicorn with the same options, the access log on (to a file).
`start_bare_proxy` starts benchmarks/bare_proxy.py instead: a proxy with none of the gateway's work, its floor.
Its settings come as JSON in the environment (`BENCH_GATEWAY`), API keys and the route table included, never on a
command line. `routes(service, {MODEL: WEIGHT})` makes the table: each model a merged version of that name.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
from serving_batching import Bench, merged_model, python_serve  # this script's folder is first on sys.path

from tasks.platform.config import Profile, load_profile

GATEWAY = """
import json, os
from pathlib import Path
from starlette.routing import Route
from tasks.runtime.gateway import Gateway, GatewayConfig
settings = json.loads(os.environ.pop("BENCH_GATEWAY"))
port, access_log = settings.pop("port"), settings.pop("access_log")
if settings.get("table"):
    from tasks.control.contract import RouteTable
    settings["table"] = RouteTable.of(settings["table"])
if settings.get("health"):
    from tasks.platform.config.serving import HealthSection
    settings["health"] = HealthSection(**settings["health"])
if settings.get("shadow_records"):
    settings["shadow_records"] = Path(settings["shadow_records"])
if settings.get("capture"):  # {"location": ..., other CaptureSettings fields}: serve.capture as flows/serve.py builds it
    from tasks.data.exchanges import open_exchange_log
    from tasks.runtime.gateway.capture import CaptureSettings
    capture = settings["capture"]
    settings["capture"] = CaptureSettings(log=open_exchange_log(capture.pop("location")), service=settings["service"], **capture)
from tasks.runtime.gateway.logs import LogWriter  # as `llmops serve` writes its log (flows/serve.py), to a file
LogWriter(open(access_log, "a")).start(["llmops.gateway", "llmops.gateway.access"])
control_port = settings.pop("control_port", None)
gateway = Gateway(GatewayConfig(**settings))
app = gateway.app()
# the benchmarks read the counters on the gateway's port; `llmops serve` serves them on a listener of its own
app.router.routes.append(Route("/metrics", gateway.prometheus))
# as `llmops serve` runs it: its listeners on one event loop in a thread (tasks/runtime/gateway/running.py), the
# control API on a listener of its own where asked
import threading
from tasks.runtime.gateway.running import Listener, RunningGateway
listeners = [Listener(app, "127.0.0.1", port)]
if control_port is not None:
    from tasks.runtime.gateway.control import ControlApi
    listeners.append(Listener(ControlApi(gateway, settings["control_key"]).app(), "127.0.0.1", control_port))
RunningGateway(listeners, gateway).start()
threading.Event().wait()
"""


def routes(service: str, weights: dict[str, float], shadow: tuple[str, float] | None = None) -> dict[str, Any]:
    """The route table's JSON: each model a merged version of that name, the first one the champion; `shadow`:
    (model, fraction) copied."""
    names = list(weights)
    version = lambda name: {"name": name, "model": name}  # noqa: E731
    return {
        "service": service,
        "champion": version(names[0]),
        "candidate": version(names[1]) if len(names) > 1 else (version(shadow[0]) if shadow else None),
        "weights": weights,
        "shadow": shadow[0] if shadow else None,
        "shadow_fraction": shadow[1] if shadow else 0,
    }


def start_gateway(port: int, access_log: Path, **settings: Any) -> subprocess.Popen:
    """The gateway on 127.0.0.1:`port` with GatewayConfig(**settings) (`table`: routes(...)); returns once it
    answers."""
    env = {
        **os.environ,
        "BENCH_GATEWAY": json.dumps({**settings, "port": port, "access_log": str(access_log)}, default=str),
    }
    return answering(subprocess.Popen([sys.executable, "-c", GATEWAY], env=env), port)


def start_bare_proxy(port: int, triton_url: str) -> subprocess.Popen:
    """benchmarks/bare_proxy.py on 127.0.0.1:`port` in front of `triton_url`; returns once it answers."""
    script = Path(__file__).with_name("bare_proxy.py")
    return answering(subprocess.Popen([sys.executable, str(script), str(port), triton_url]), port)


def answering(process: subprocess.Popen, port: int) -> subprocess.Popen:
    """`process` once its /health/live on `port` answers; killed, and an error, where it does not in 60 s."""
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and process.poll() is None:
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health/live", timeout=1).status_code == 200:
                return process
        except httpx.HTTPError:
            time.sleep(0.2)
    process.kill()
    raise RuntimeError(f"{process.args[1]} did not start on port {port}")


def cpu_tiny_bench(home: Path | None, tokens: int, concurrency: list[int], requests: int, prefix: str):
    """The scratch folder (the caller removes it), the Bench of the cpu-tiny merged model of `home` (made by
    `llmops run` where it has none) with one torch thread, and cpu-tiny's profile for the python backend."""
    scratch = Path(tempfile.mkdtemp(prefix=prefix))
    home = (home or scratch / "home").resolve()
    model_dir = merged_model(home).resolve()
    bench = Bench(model_dir, home, scratch, None, "", [tokens], concurrency, requests, 1)
    profile: Profile = load_profile("cpu-tiny", python_serve(bench))
    return scratch, bench, profile
