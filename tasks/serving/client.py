"""A Triton Inference Server reached over HTTP: the model-control and inference calls the pipeline makes.

Whoever started the server (tasks/serving/server.py, or someone else for an attached one), this is
how the canary, the gate and the benchmark talk to it.

- The model-control APIs (model repository, model config) carry the control key in the
  `llmops-control-key` header when one is set: a Triton started here restricts them to it
  (tasks/serving/server.py); inference and health need no key.
- Loads go over Triton's gRPC endpoint where it is on this machine (tasks/serving/grpc_loads.py says why).
- Without a shared filesystem (`repository` None), a model goes with its load request: its config
  (as JSON) and every file of its folder, base64, in the request's parameters (Triton's model
  repository extension, "load with override files"); the server's own repository is never written.
"""

from __future__ import annotations

import base64
import json
import os
import re
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import requests

from tasks.platform.errors import BadInput, CheckFailed, TransientError
from tasks.serving.grpc_loads import load_over_grpc

CONTROL_HEADER = "llmops-control-key"
CONTROL_KEY_ENV = "LLMOPS_TRITON_CONTROL_KEY"
CONTROL_KEY_FILE = "control.key"  # under $LLMOPS_HOME/triton/, mode 600, while `llmops serve` keeps its Triton
ATTACH_KEY_FILE_ENV = "LLMOPS_TRITON_CONTROL_KEY_FILE"  # the key of a Triton this home did not start
SERVE_URL_ENV = "LLMOPS_SERVE_CONTROL_URL"  # the control API of the `llmops serve` that fronts that Triton
SERVE_KEY_FILE_ENV = "LLMOPS_SERVE_CONTROL_KEY_FILE"  # and the file of that serve's control key
ALLOW_PLAIN_HTTP_ENV = "LLMOPS_TRITON_ALLOW_PLAIN_HTTP"
LOOPBACK = ("127.0.0.1", "localhost", "::1")
# The files a load request may carry (model_folder): 45 MiB is 60 MiB in base64, under Triton's 64 MiB HTTP body with
# the config and the JSON around it
SENT_FILES_LIMIT = 45 * 2**20


def control_key(home: Path) -> str | None:
    """The key of the Triton `llmops serve` keeps for this LLMOPS_HOME: LLMOPS_TRITON_CONTROL_KEY, else its
    key file (present while that Triton lives)."""
    if os.environ.get(CONTROL_KEY_ENV):
        return os.environ[CONTROL_KEY_ENV]
    path = home / "triton" / CONTROL_KEY_FILE
    return path.read_text().strip() if path.is_file() else None


@dataclass(frozen=True)
class TritonTarget:
    """A Triton to roll out on that this run does not start: its endpoints, given by flags or the environment
    (LLMOPS_TRITON_URL, LLMOPS_TRITON_GRPC_URL, LLMOPS_TRITON_METRICS_URL, LLMOPS_TRITON_REPOSITORY), and
    the control key given for it explicitly: the file LLMOPS_TRITON_CONTROL_KEY_FILE (`llmops run
    --triton-control-key-file`), else LLMOPS_TRITON_CONTROL_KEY; never this home's own key, which would go
    to whatever URL a run parameter names. Both come from the environment of the process, never from a
    run parameter. Plain http:// is refused off loopback (the key would cross the network in clear) unless
    LLMOPS_TRITON_ALLOW_PLAIN_HTTP=1 (`--allow-plain-http`)."""

    url: str
    grpc_url: str
    metrics_url: str
    repository: str | None = None  # its model repository on a filesystem this machine shares; None: send models
    control_key: str | None = field(default=None, repr=False)
    # The control API of the `llmops serve` in front of that Triton (LLMOPS_SERVE_CONTROL_URL, `llmops run
    # --serve-control-url`) and its key (LLMOPS_SERVE_CONTROL_KEY_FILE): the release routes there. None: the
    # release routes through a temporary gateway of its own (no client of the service sees the candidate)
    serve_url: str | None = None
    serve_key: str | None = field(default=None, repr=False)

    @classmethod
    def from_options(
        cls,
        url: str | None,
        grpc_url: str | None,
        metrics_url: str | None,
        repository: str | None,
        from_api: bool = False,
    ) -> TritonTarget | None:
        """`from_api`: the URLs come from a run's parameters, which whoever reaches the Prefect API writes: a URL
        other than this worker's own LLMOPS_TRITON_URL must be on the operator's allow-list (LLMOPS_TRITON_URLS),
        or the control key and the candidate's weights would go wherever the caller says."""
        env = os.environ
        if from_api and url and url != env.get("LLMOPS_TRITON_URL"):
            refuse_unlisted_url(url)
        url = url or env.get("LLMOPS_TRITON_URL")
        if not url:
            return None
        grpc_url = grpc_url or env.get("LLMOPS_TRITON_GRPC_URL")
        metrics_url = metrics_url or env.get("LLMOPS_TRITON_METRICS_URL")
        missing = [
            flag
            for flag, value in (
                ("--triton-grpc-url (genai-perf's endpoint)", grpc_url),
                ("--triton-metrics-url (the canary's live checks)", metrics_url),
            )
            if not value
        ]
        if missing:
            raise BadInput(
                f"Triton at {url}: attaching needs {' and '.join(missing)}, or LLMOPS_TRITON_GRPC_URL / "
                "LLMOPS_TRITON_METRICS_URL"
            )
        assert grpc_url is not None and metrics_url is not None
        refuse_plain_http(url)
        repository = repository or env.get("LLMOPS_TRITON_REPOSITORY") or None
        serve_url, serve_key = serve_control()
        return cls(url, grpc_url, metrics_url, repository, attach_control_key(), serve_url, serve_key)


ALLOWED_URLS_ENV = "LLMOPS_TRITON_URLS"  # the operator's allow-list of Tritons a run parameter may name


def refuse_unlisted_url(url: str) -> None:
    allowed = [u.strip().rstrip("/") for u in os.environ.get(ALLOWED_URLS_ENV, "").split(",") if u.strip()]
    if url.rstrip("/") not in allowed:
        raise BadInput(
            f"triton_url {url}: a run parameter may name this worker's Triton (LLMOPS_TRITON_URL) or one of "
            f"{ALLOWED_URLS_ENV}, the operator's allow-list in the worker's environment ({', '.join(allowed) or 'empty'});"
            " the control key and the candidate's weights go nowhere else"
        )


def refuse_plain_http(url: str) -> None:
    parts = urlsplit(url)
    if parts.scheme == "http" and parts.hostname not in LOOPBACK and os.environ.get(ALLOW_PLAIN_HTTP_ENV) != "1":
        raise BadInput(
            f"Triton at {url}: plain http:// to another machine sends the control key in clear; "
            f"use https://, or pass --allow-plain-http ({ALLOW_PLAIN_HTTP_ENV}=1) on a network you trust"
        )


def serve_control() -> tuple[str | None, str | None]:
    """The control API of the `llmops serve` in front of an attached Triton and its key, from this process's
    environment only (never a run parameter, which could send the key anywhere)."""
    url = os.environ.get(SERVE_URL_ENV)
    if not url:
        return None, None
    refuse_plain_http(url)
    path = os.environ.get(SERVE_KEY_FILE_ENV)
    if not path:
        raise BadInput(f"{SERVE_URL_ENV} {url}: give that serve's control key in a file ({SERVE_KEY_FILE_ENV})")
    try:
        key = Path(path).read_text().strip()
    except OSError as exc:
        raise BadInput(f"{SERVE_KEY_FILE_ENV} {path}: cannot read the control key ({exc.strerror})") from None
    if not key:
        raise BadInput(f"{SERVE_KEY_FILE_ENV} {path}: the file is empty")
    return url.rstrip("/"), key


def attach_control_key() -> str | None:
    """The key given for an attached Triton (see TritonTarget), or None: its control API then refuses us."""
    path = os.environ.get(ATTACH_KEY_FILE_ENV)
    if not path:
        return os.environ.get(CONTROL_KEY_ENV) or None
    try:
        key = Path(path).read_text().strip()
    except OSError as exc:
        raise BadInput(f"{ATTACH_KEY_FILE_ENV} {path}: cannot read the control key ({exc.strerror})") from None
    if not key:
        raise BadInput(f"{ATTACH_KEY_FILE_ENV} {path}: the file is empty")
    return key


@dataclass
class Triton:
    """A Triton reachable over HTTP: its URLs, its model repository folder when this machine shares it
    (None: models go with their load requests), and the model-control key (never printed)."""

    url: str
    repository: Path | None
    metrics_url: str | None = None
    grpc_url: str | None = None
    control_key: str | None = field(default=None, repr=False)
    # Where the key is read again when Triton refuses it: a Triton restarted by `llmops serve` has a new one (its
    # control.key), an operator may rotate a key file. None: the key given is the only one.
    reread_key: Callable[[], str | None] | None = field(default=None, repr=False, compare=False)

    @classmethod
    def attach(
        cls,
        url: str,
        repository: Path | None,
        metrics_url: str | None = None,
        grpc_url: str | None = None,
        control_key: str | None = None,
        timeout: float = 30,
    ) -> Triton:
        server = cls(url.rstrip("/"), repository, metrics_url, grpc_url, control_key)
        deadline = time.monotonic() + timeout
        while not server.is_live():
            if time.monotonic() > deadline:
                raise TransientError(f"Triton at {server.url}: not live after {timeout:.0f}s")
            time.sleep(0.3)
        return server

    def is_local(self) -> bool:
        """On this machine (its memory is this machine's): a loopback address."""
        return urlsplit(self.url).hostname in LOOPBACK

    def is_live(self) -> bool:
        """/v2/health/live: an attached server with strict readiness reports "not ready" while any model
        is unavailable (a failed candidate), yet it serves the others; models are checked one by one."""
        try:
            return requests.get(f"{self.url}/v2/health/live", timeout=2).status_code == 200
        except requests.RequestException:
            return False

    # --- model control -------------------------------------------------------------------------
    def control_headers(self) -> dict[str, str]:
        return {CONTROL_HEADER: self.control_key} if self.control_key else {}

    def fresh_control_headers(self, again: bool) -> dict[str, str]:
        """The control-key header; where `again`, with the key read again (a restarted Triton, a rotated key)."""
        if again and self.reread_key is not None:
            self.control_key = self.reread_key() or self.control_key
        return self.control_headers()

    def control_call(self, method: str, path: str, **kwargs) -> requests.Response:
        """A call of Triton's restricted API with the control key; refused (401/403) and with a key that was read
        again and changed since (the Triton restarted, the key rotated), once more with the new key."""
        response = requests.request(method, f"{self.url}{path}", headers=self.control_headers(), **kwargs)
        if response.status_code in (401, 403) and self.reread_key is not None:
            fresh = self.reread_key()
            if fresh and fresh != self.control_key:
                self.control_key = fresh
                response = requests.request(method, f"{self.url}{path}", headers=self.control_headers(), **kwargs)
        return response

    def load(self, name: str, timeout: float = 300, model_folder: Path | None = None) -> None:
        """Load (or reload) model `name`: from the server's repository, or, with `model_folder`, from the
        config and files sent with the request. Over gRPC where this machine's Triton has it (grpc_loads.py: a
        load over HTTP holds the keep-alive connections clients' requests take)."""
        parameters = load_parameters(model_folder) if model_folder is not None else None
        if self.grpc_url and urlsplit(f"//{self.grpc_url}").hostname in LOOPBACK:
            load_over_grpc(self.grpc_url, self.url, name, timeout, parameters, self.fresh_control_headers)
            return
        body = {"parameters": parameters} if parameters is not None else None
        try:
            response = self.control_call("POST", f"/v2/repository/models/{name}/load", json=body, timeout=timeout)
        except requests.Timeout:
            raise TransientError(
                f"Triton at {self.url}: {name} did not load within {timeout:.0f}s (serve.load_timeout_s)"
            ) from None
        except requests.RequestException as exc:
            raise TransientError(f"Triton at {self.url}: load {name}: {exc}") from None
        if response.status_code != 200:
            message = response.json().get("error", response.text) if response.content else response.reason
            raise CheckFailed(f"Triton: model {name} failed to load: {message.strip()[:400]}")

    def reload(self, name: str, timeout: float = 300) -> None:
        """Load `name` again from this server's repository, its files unchanged. Triton 2.51 skips a load of a model
        whose files it loaded already, a dead instance and all (measured: no "loading:" line, the killed process not
        started again), and a newer config.pbtxt alone only updates its instances; a version folder newer than the
        loaded one makes it a new load of every instance."""
        assert self.repository is not None
        now = time.time()
        for version in (self.repository / name).iterdir():
            if version.is_dir() and version.name.isdigit():
                os.utime(version, (now, now))
        self.load(name, timeout=timeout)

    def unload(self, name: str) -> None:
        # unload_dependents: an ensemble's composing models go with it (a no-op for other models)
        self.control_call(
            "POST", f"/v2/repository/models/{name}/unload", json={"parameters": {"unload_dependents": True}}, timeout=60
        ).raise_for_status()

    def is_ready(self, name: str) -> bool:
        try:
            return requests.get(f"{self.url}/v2/models/{name}/ready", timeout=5).status_code == 200
        except requests.RequestException:
            return False

    def loaded_models(self) -> list[str]:
        index = self.control_call("POST", "/v2/repository/index", json={"ready": True}, timeout=10).json()
        return sorted(m["name"] for m in index)

    def generate(
        self,
        name: str,
        text: str,
        max_tokens: int = 16,
        timeout: float = 60,
        history: Sequence[Mapping[str, object]] | None = None,
    ) -> str:
        """Greedy answer of model `name` to `text`, after `history` (earlier messages, e.g. a system prompt)."""
        body = generate_body(text, max_tokens, history)
        response = requests.post(f"{self.url}/v2/models/{name}/generate", timeout=timeout, json=body)
        if response.status_code != 200:
            raise CheckFailed(f"Triton: {name} generate failed: {response.text[:300]}")
        return response.json()["text_output"]

    def model_config(self, name: str) -> dict:
        """The configuration Triton loaded for model `name` (what it serves, not what a file says)."""
        response = self.control_call("GET", f"/v2/models/{name}/config", timeout=10)
        response.raise_for_status()
        return response.json()

    def model_parameter(self, name: str, key: str) -> str:
        """One string parameter of the configuration Triton loaded for model `name`; "" where it has none."""
        parameters = self.model_config(name).get("parameters", {})
        return str(parameters.get(key, {}).get("string_value", ""))

    def metrics(self) -> str:
        if not self.metrics_url:
            raise CheckFailed(
                f"Triton at {self.url}: no metrics URL (give --triton-metrics-url or LLMOPS_TRITON_METRICS_URL)"
            )
        return requests.get(self.metrics_url, timeout=10).text


def load_parameters(model_folder: Path) -> dict[str, str]:
    """A rendered model folder as load-request parameters: its config.pbtxt as JSON, every other file base64.
    CheckFailed, before anything is read or sent, where the files are more than a request carries: Triton's HTTP
    server takes a body of at most 64 MiB (tritonserver --http-max-input-size), and base64 makes 3 bytes 4."""
    from google.protobuf import json_format, text_format
    from tritonclient.grpc import model_config_pb2

    files = [
        path
        for path in sorted(model_folder.rglob("*"))
        if path.is_file() and path.name != "config.pbtxt" and "__pycache__" not in path.parts
    ]
    size = sum(path.stat().st_size for path in files)
    if size > SENT_FILES_LIMIT:
        raise CheckFailed(
            f"model {model_folder.name}: its files are {size / 2**20:,.1f} MiB, more than the "
            f"{SENT_FILES_LIMIT / 2**20:.0f} MiB a load request carries to a Triton that shares no disk; serve from "
            "an S3 artifact store (--artifacts s3://BUCKET/PREFIX, and `llmops triton --artifacts` the same), from "
            "which the Triton fetches the files itself"
        )
    config = text_format.Parse((model_folder / "config.pbtxt").read_text(), model_config_pb2.ModelConfig())
    parameters = {"config": json_format.MessageToJson(config, preserving_proto_field_name=True)}
    for path in files:
        parameters[f"file:{path.relative_to(model_folder)}"] = base64.b64encode(path.read_bytes()).decode()
    return parameters


def parse_metric(text: str, metric: str, model: str) -> float:
    """Sum of a Prometheus counter over the versions of one model (Triton's nv_inference_* family)."""
    return metric_by_model(text, metric).get(model, 0.0)


def metric_by_model(text: str, metric: str) -> dict[str, float]:
    """A Prometheus counter of Triton's nv_inference_* family, summed over each model's versions, by model."""
    found: dict[str, float] = {}
    for model, value in re.findall(rf'^{metric}{{[^}}]*model="([^"]+)"[^}}]*}} ([0-9.eE+-]+)$', text, re.M):
        found[model] = found.get(model, 0.0) + float(value)
    return found


def generate_body(text: str, max_tokens: int, history: Sequence[Mapping[str, object]] | None) -> dict[str, Any]:
    """Triton's generate request for a greedy answer to `text` after `history` (earlier messages), the answer alone."""
    body: dict[str, Any] = {"text_input": text, "max_tokens": max_tokens, "exclude_input_in_output": True}
    if history:
        body["chat_history"] = json.dumps(list(history), ensure_ascii=False)
    return body
