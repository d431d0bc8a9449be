"""`llmops serve`: keep the registered champion served on a Triton of this machine until stopped.

Triton starts on 127.0.0.1 with the champion behind the router (the service's stable name) and is
published in $LLMOPS_HOME/triton/server.json, so `llmops run` with the same LLMOPS_HOME rolls its
candidates out on it. SIGTERM or Ctrl-C stops Triton and removes server.json.
"""

from __future__ import annotations

import signal
import time
from pathlib import Path

from flows.release import open_serving_context
from tasks.canary import serve_champion
from tasks.config import Profile
from tasks.errors import BadInput
from tasks.triton_server import TritonServer, publish, unpublish


def serve(profile: Profile, home: Path, tracking_uri: str | None, artifacts: str | None) -> None:
    ctx = open_serving_context(profile, tracking_uri, artifacts)
    server = TritonServer.start(home, profile.serve.triton_binary)
    triton = server.client
    try:
        champion = serve_champion(ctx, triton)
        if champion is None:
            raise BadInput(f"registered model {profile.registry.model_name}: no champion yet; run `llmops run` first")
        publish(home, server)
        print(
            f"serving {profile.registry.model_name} (champion v{champion.version}) at {triton.url}/v2/models/"
            f"{profile.registry.model_name}/generate  (gRPC {triton.grpc_url}, metrics {triton.metrics_url}); "
            f"Ctrl-C stops",
            flush=True,
        )
        stopped: list[int] = []
        signal.signal(signal.SIGTERM, lambda *_: stopped.append(1))
        while not stopped and server.running():
            time.sleep(0.5)
    except KeyboardInterrupt:
        pass
    finally:
        unpublish(home)
        server.stop()
        print("llmops serve: stopped", flush=True)
