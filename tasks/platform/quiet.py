"""Library output that tells an llmops user nothing, silenced where it comes from: by message and category for
warnings, by logger for log records, never all warnings at once (a warning not listed here still shows).

Each entry says what it is and why it is noise here. `quiet_libraries()` is idempotent; the CLI calls it before a
command runs and the release flow at its start (a worker's flow run does not go through the CLI).
`quiet_transformers()` is called where the stages import transformers.
"""

from __future__ import annotations

import logging
import os
import re
import warnings

# (message regex, category): warnings Python's `warnings` module would print once per place.
WARNINGS: tuple[tuple[str, type[Warning]], ...] = (
    # mlflow/data/dataset_source_registry.py: a local dataset folder matches MLflow's two local-artifact source
    # classes, which are the same class registered twice; it picks one, rightly.
    ("The specified dataset source can be interpreted in multiple ways", UserWarning),
    # torch.onnx's dynamo exporter (torch 2.13) about its own use of pytree's LeafSpec: not ours to change.
    (r"`isinstance\(treespec, LeafSpec\)` is deprecated", FutureWarning),
    # torch.onnx: our dynamic axes share their constraints (input_ids and attention_mask have the same batch and
    # sequence), so their names are merged; the exported graph is the same.
    (r"# The axis name: \w+ will not be used, since it shares the same shape constraints", UserWarning),
)

# logger name -> the lowest level still shown.
LOGGERS: dict[str, int] = {
    # torch.onnx registers torchvision's operators when torchvision exists: a text model has none.
    "torch.onnx._internal.exporter._registration": logging.ERROR,
    # bitsandbytes' CPU backend looks for the optional `kernels` package for a faster 4-bit GEMM, then falls back.
    "bitsandbytes.backends.cpu.ops": logging.ERROR,
    # MLflow's stores: the sqlite schema set-up on a fresh home, "Waiting up to 300 seconds for model version to
    # finish creation" at each registration; and its system-metrics monitor starting and stopping.
    "mlflow.store": logging.WARNING,
    "mlflow.system_metrics": logging.WARNING,
}

# logger name ("" for the root logger) -> regular expressions of the messages of it that are dropped (re.match).
MESSAGES: dict[str, tuple[str, ...]] = {
    # onnxruntime/quantization/quantize.py logs on the root logger (`logging.warning`): shape inference before
    # dynamic int8 quantization, an image-model tip; the quantize stage measures the quantized model's accuracy itself.
    "": (r"Please consider to run pre-processing before quantization",),
    # urllib3 (under MLflow's client and our requests sessions) retrying a request whose kept-alive connection the
    # server closed as it was sent: a server's keep-alive timeout racing the request (seen in a CI run: MLflow's
    # runs/get, RemoteDisconnected). The retry is answered. Retries after a refused or timed-out connection still
    # show, in our words (_Reworded): they are an outage in progress, which ends in our one-line error if it outlasts
    # the retries.
    "urllib3.connectionpool": (r"Retrying \(.*\) after connection broken by 'RemoteDisconnected\(",),
}

# urllib3 2.x's own line for a retried connection (connectionpool.py, HTTPConnectionPool.urlopen): "Retrying (%r)
# after connection broken by '%r': %s" with the Retry object's repr and the error's, an object address among them.
URLLIB3_RETRY = "Retrying (%r) after connection broken by '%r': %s"


def retry_in_our_words(record: logging.LogRecord) -> None:
    """`127.0.0.1:5000 refused the connection; retrying /api/2.0/mlflow/runs/get (2 retries left)`: where, what and
    how many tries are left, for urllib3's retry line."""
    if record.msg != URLLIB3_RETRY or not isinstance(record.args, tuple) or len(record.args) != 3:
        return
    retries, error, path = record.args
    # a refused connection names its connection (NewConnectionError.conn), a read timeout its pool (RequestError.pool)
    server = getattr(error, "conn", None) or (None if hasattr(error, "conn") else getattr(error, "pool", None))
    where = f"{server.host}:{server.port}" if server is not None and hasattr(server, "host") else "the server"
    text = str(error)
    if "Connection refused" in text:
        what = "refused the connection"
    elif "timed out" in text.lower():
        what = "did not answer in time"
    else:
        what = f"broke the connection ({type(error).__name__})"
    left = getattr(retries, "total", None)
    tries = "retries left" if left is None else f"{left} {'retry' if left == 1 else 'retries'} left"
    record.msg, record.args = "%s %s; retrying %s (%s)", (where, what, path, tries)


class _DropMessages(logging.Filter):
    def __init__(self, patterns: tuple[str, ...]):
        super().__init__()
        self.patterns = [re.compile(pattern) for pattern in patterns]

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        if any(pattern.match(message) for pattern in self.patterns):
            return False
        retry_in_our_words(record)
        return True


# A logger's filters apply to the records created on it (not to those that reach it from a child logger), so each
# logger of MESSAGES gets its own.
_FILTERS = {name: _DropMessages(patterns) for name, patterns in MESSAGES.items()}


# Environment switches of libraries that print without a logger.
ENVIRONMENT = {
    # MLflow's client writes "🏃 View run ... at: URL" and "🧪 View experiment at: URL" to stdout when a run on a
    # tracking server ends (mlflow/tracking/_tracking_service/client.py _log_url); our summary names the run's URL.
    "MLFLOW_SUPPRESS_PRINTING_URL_TO_STDOUT": "true",
}


def quiet_libraries() -> None:
    for name, value in ENVIRONMENT.items():
        os.environ.setdefault(name, value)
    for message, category in WARNINGS:
        warnings.filterwarnings("ignore", message=message, category=category)
    for name, level in LOGGERS.items():
        logging.getLogger(name).setLevel(level)
    for name, dropping in _FILTERS.items():
        logger = logging.getLogger(name)
        if dropping not in logger.filters:
            logger.addFilter(dropping)


def quiet_transformers() -> None:
    """transformers' own progress bars, "Loading weights" and "Writing model shards": a second or two on these
    models, a bar per load in the terminal. Called where a stage imports transformers (importing it for every
    command would cost each one a second); Hugging Face Hub's download bars stay, downloads are long."""
    from transformers.utils import logging as transformers_logging

    transformers_logging.disable_progress_bar()
