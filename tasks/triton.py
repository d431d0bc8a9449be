"""A Triton Inference Server reached over HTTP: the model-control and inference calls the pipeline makes.

Whoever started the server (tasks/triton_server.py, or someone else for an attached one), this is
how the canary, the gate and the benchmark talk to it.
"""

from __future__ import annotations

import json
import re
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import requests

from tasks.errors import CheckFailed, TransientError


@dataclass
class Triton:
    """A Triton reachable over HTTP, with its model repository folder and metrics endpoint."""

    url: str
    repository: Path
    metrics_url: str | None = None
    grpc_url: str | None = None

    @classmethod
    def attach(cls, url: str, repository: Path, timeout: float = 30) -> Triton:
        server = cls(url.rstrip("/"), repository)
        deadline = time.monotonic() + timeout
        while not server.is_live():
            if time.monotonic() > deadline:
                raise TransientError(f"Triton at {server.url}: not live after {timeout:.0f}s")
            time.sleep(0.3)
        return server

    def is_live(self) -> bool:
        """/v2/health/live: an attached server with strict readiness reports "not ready" while any model
        is unavailable (a failed candidate), yet it serves the others; models are checked one by one."""
        try:
            return requests.get(f"{self.url}/v2/health/live", timeout=2).status_code == 200
        except requests.RequestException:
            return False

    # --- model control -------------------------------------------------------------------------
    def load(self, name: str, timeout: float = 300) -> None:
        try:
            response = requests.post(f"{self.url}/v2/repository/models/{name}/load", timeout=timeout)
        except requests.RequestException as exc:
            raise TransientError(f"Triton at {self.url}: load {name}: {exc}") from None
        if response.status_code != 200:
            message = response.json().get("error", response.text) if response.content else response.reason
            raise CheckFailed(f"Triton: model {name} failed to load: {message.strip()[:400]}")

    def unload(self, name: str) -> None:
        # unload_dependents: an ensemble's composing models go with it (a no-op for other models)
        requests.post(
            f"{self.url}/v2/repository/models/{name}/unload",
            json={"parameters": {"unload_dependents": True}},
            timeout=60,
        ).raise_for_status()

    def is_ready(self, name: str) -> bool:
        try:
            return requests.get(f"{self.url}/v2/models/{name}/ready", timeout=5).status_code == 200
        except requests.RequestException:
            return False

    def loaded_models(self) -> list[str]:
        index = requests.post(f"{self.url}/v2/repository/index", json={"ready": True}, timeout=10).json()
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
        body = {"text_input": text, "max_tokens": max_tokens, "exclude_input_in_output": True}
        if history:
            body["chat_history"] = json.dumps(history, ensure_ascii=False)
        response = requests.post(f"{self.url}/v2/models/{name}/generate", timeout=timeout, json=body)
        if response.status_code != 200:
            raise CheckFailed(f"Triton: {name} generate failed: {response.text[:300]}")
        return response.json()["text_output"]

    def model_config(self, name: str) -> dict:
        """The configuration Triton loaded for model `name` (what it serves, not what a file says)."""
        response = requests.get(f"{self.url}/v2/models/{name}/config", timeout=10)
        response.raise_for_status()
        return response.json()

    def metrics(self) -> str:
        url = self.metrics_url or re.sub(r":\d+$", ":8002", self.url) + "/metrics"
        return requests.get(url, timeout=10).text


def parse_metric(text: str, metric: str, model: str) -> float:
    """Sum of a Prometheus counter over the versions of one model (Triton's nv_inference_* family)."""
    pattern = re.compile(rf'^{metric}{{[^}}]*model="{re.escape(model)}"[^}}]*}} ([0-9.eE+-]+)$', re.M)
    return sum(float(v) for v in pattern.findall(text))
