"""Error kinds the CLI maps to exit codes.

Only TransientError (and the network faults recognised in `is_transient`) is retried:
bad input and failed checks are deterministic, retrying them only delays the message.
"""

from __future__ import annotations


class LlmopsError(Exception):
    exit_code = 1


class BadInput(LlmopsError):
    """Data, profile or argument the user must fix."""

    exit_code = 2


class CheckFailed(LlmopsError):
    """A stage ran but its result failed a check (merge exactness, eval margin, ...)."""

    exit_code = 3


class TransientError(LlmopsError):
    """A fault that may pass: network, a server restarting. Retried with backoff."""

    exit_code = 4


class ArtifactMissing(LlmopsError):
    """An artifact is missing or its content does not match its digest."""

    exit_code = 5


def is_transient(exc: BaseException) -> bool:
    import botocore.exceptions as bex
    import requests

    if isinstance(exc, TransientError):
        return True
    transient_types = (
        bex.EndpointConnectionError,
        bex.ConnectionClosedError,
        bex.ReadTimeoutError,
        bex.ConnectTimeoutError,
        requests.ConnectionError,
        requests.Timeout,
        ConnectionError,
        TimeoutError,
    )
    if isinstance(exc, transient_types):
        return True
    if isinstance(exc, bex.ClientError):
        code = exc.response.get("Error", {}).get("Code", "")
        status = exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode", 0)
        return status >= 500 or code in {"SlowDown", "RequestTimeout", "ServiceUnavailable", "Throttling"}
    return False
