"""Model loads over Triton's gRPC endpoint, away from the HTTP one that clients' requests take.

Triton 2.51's HTTP frontend runs a model load on the event thread of the connection that asked for it (libevhtp), for
as long as the model takes to start, and for good where the load hangs. Every keep-alive connection that thread
holds waits with it: the gateway's pooled connections to the same Triton, opened one after another while it was idle,
sit on one thread. Measured with a Python-backend model whose process was stopped as it started (the load hangs): of
24 keep-alive connections opened before the load, 24 got no answer to a health request within 3 s when the load went
over HTTP, 0 when it went over gRPC, whose model-control calls run apart from inference and from HTTP; fresh
connections were answered either way. In `llmops serve`, a candidate's hung load left one client request unanswered
(tests/integration/test_serving.py, the abandoned load).

Only for a Triton on this machine (loopback): the control key would otherwise cross the network over plain gRPC,
where the HTTP URL of an attached Triton is https.
"""

from __future__ import annotations

import base64
from collections.abc import Callable

from tasks.platform.errors import CheckFailed, TransientError

GRPC_HEADER_PREFIX = "triton-grpc-protocol-"  # Triton's --grpc-restricted-protocol reads `<prefix><header>`


def load_over_grpc(
    grpc_url: str,
    http_url: str,
    name: str,
    timeout: float,
    parameters: dict[str, str] | None,
    control_headers: Callable[[bool], dict[str, str]],
) -> None:
    """Load (or reload) `name` through Triton's gRPC RepositoryModelLoad; `parameters`: the HTTP form of a model sent
    with its load (config JSON, files base64), None for the server's own repository. `control_headers(again)`: the
    control-key header, read again where `again` (a restarted Triton has a new key)."""
    from tritonclient.grpc import InferenceServerClient
    from tritonclient.utils import InferenceServerException

    config, files = None, None
    if parameters is not None:
        config = parameters["config"]
        files = {key: base64.b64decode(value) for key, value in parameters.items() if key.startswith("file:")}
    client = InferenceServerClient(grpc_url)
    try:
        for again in (False, True):
            headers = {GRPC_HEADER_PREFIX + key: value for key, value in control_headers(again).items()}
            try:
                client.load_model(name, headers=headers, config=config, files=files, client_timeout=timeout)
                return
            except InferenceServerException as exc:
                if not again and "restricted" in (exc.message() or ""):
                    continue  # the key changed: once more with the one read again
                raise load_error(exc, http_url, name, timeout) from None
    finally:
        client.close()


def load_error(exc, http_url: str, name: str, timeout: float) -> Exception:
    """The error the HTTP load raises for the same outcome: a deadline or an absent server is transient, a model that
    failed to load is not."""
    status, message = str(exc.status() or ""), (exc.message() or str(exc)).strip()
    if status.endswith("DEADLINE_EXCEEDED"):
        return TransientError(f"Triton at {http_url}: {name} did not load within {timeout:.0f}s (serve.load_timeout_s)")
    if status.endswith("UNAVAILABLE"):
        return TransientError(f"Triton at {http_url}: load {name}: {message[:300]}")
    return CheckFailed(f"Triton: model {name} failed to load: {message[:400]}")
