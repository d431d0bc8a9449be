"""Error kinds the CLI maps to exit codes.

Only TransientError (and the network faults recognised in `is_transient`) is retried:
bad input and failed checks are deterministic, retrying them only delays the message.
"""

from __future__ import annotations

LOST_SERVICE_EXIT_CODE = 6  # a release fenced off its service: another release owns it now
REJECTED_EXIT_CODE = 10  # `llmops gate` / `llmops run` when the gate rejects the candidate or the canary rolls it back

# The one table of exit codes: the CLI's --help and error mapping use it, and the README's table is
# pinned to it by tests/unit/test_cli.py.
EXIT_CODES: dict[int, str] = {
    0: "success (for run: the candidate was promoted, or already is the champion)",
    1: "anything else (an unexpected error; the last line names it)",
    2: "bad input: data, profile or arguments (nothing is written)",
    3: "a stage's check failed (evaluation margin, merge exactness, quantization accuracy, the train/serve "
    "contract, a model that fails to load)",
    4: "a service (S3, MLflow, Prefect, Triton) stayed unreachable after retries, or the disk is full (a promotion "
    "the registry could not record: the service serves the candidate; run the release again)",
    5: "an artifact is missing or does not match its sha256",
    LOST_SERVICE_EXIT_CODE: "the release lost the service to another release (taken over, or its lease lapsed): it "
    "wrote nothing more; the line names who owns the service now",
    REJECTED_EXIT_CODE: "the gate or a person rejected the candidate, or the canary rolled it back (the champion keeps serving)",
    130: "interrupted (Ctrl-C)",
}


def exit_codes_text() -> str:
    """The table as `--help` prints it."""
    return "exit codes:\n" + "".join(f"  {code:>3}  {meaning}\n" for code, meaning in EXIT_CODES.items())


def exit_codes_markdown() -> str:
    """The table as the README shows it."""
    return "| exit code | meaning |\n|---|---|\n" + "".join(f"| `{c}` | {m} |\n" for c, m in EXIT_CODES.items())


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


class DiskFull(LlmopsError):
    """No room left where a stage writes: not retried (a retry fills the same disk), exit 4 like an outage."""

    exit_code = 4


class RegistryBehind(LlmopsError):
    """The service serves a version the registry does not yet name its champion (an alias write that failed after
    retries): not retried inside the run (the traffic already moved), exit 4 like an outage; the release run again
    moves the alias."""

    exit_code = 4


class RampFailed(LlmopsError):
    """The canary's ramp failed (a service away, an error) after the candidate had live traffic, and was rolled back
    first: the champion serves alone. Not retried inside the run (the candidate is unloaded: a retry would route
    traffic to it); the exit code is its cause's (4 for a service that stayed unreachable)."""

    def __init__(self, message: str, exit_code: int):
        super().__init__(message)
        self.exit_code = exit_code


class LostService(LlmopsError):
    """The release no longer owns its service: another release took it over, or its lease lapsed before a renewal
    landed. Not retried: it writes nothing more (tasks/serving/service.py refuses every write once it is lost)."""

    exit_code = LOST_SERVICE_EXIT_CODE


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
    return is_transient_mlflow(exc)


# sqlite's answer while another process writes (a local tracking store under load): retrying gets through.
DATABASE_LOCKED = "database is locked"


def is_transient_mlflow(exc: BaseException) -> bool:
    """An MLflow client error that may pass: the server unreachable or timing out (mlflow/utils/rest_utils.py
    wraps requests' errors as "API request to URL failed with exception ..." and "... failed with timeout
    exception ..."), a 5xx answer after MLflow's own retries, or sqlite's "database is locked". Not found, a refused
    login and a bad request are not: they say the same thing the next time."""
    import sys

    if DATABASE_LOCKED in str(exc):
        return True
    exceptions = sys.modules.get("mlflow.exceptions")  # an MLflow error means MLflow is imported already
    if exceptions is None or not isinstance(exc, exceptions.MlflowException):
        return False
    message = str(exc)
    if message.startswith("API request to") and ("failed with exception" in message or "timeout exception" in message):
        return True
    return exc.get_http_status_code() >= 500
