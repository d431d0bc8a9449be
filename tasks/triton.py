"""Triton Inference Server: lifecycle, model repository rendering, and the HTTP calls the canary uses.

Start a real `tritonserver` (explicit model control) on 127.0.0.1, or attach to a running one by URL.
The binary: $LLMOPS_TRITONSERVER or `serve.triton_binary`, else the one in the nvidia-pytriton wheel
(CPU machines), run with the Python backend and this environment's Python:
- the wheel's bundled libraries go on LD_LIBRARY_PATH (without them model loads hang, not fail);
- the Python backend stub embeds Python in isolated mode and finds its interpreter through PATH,
  so this venv's bin goes first on PATH: the stub then runs with exactly this venv's packages
  (the interpreter's global site-packages hold other numpy/torch builds);
- the stub for this Python version is put into a private copy of the Python backend folder.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import string
import subprocess
import sys
import sysconfig
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import requests

from tasks.errors import BadInput, CheckFailed, TransientError
from tasks.ports import free_port

TEMPLATES = Path(__file__).resolve().parent.parent / "infra" / "triton"
NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*$")


def render_template(text: str, values: dict[str, object], source: str) -> str:
    """`${var}` substitution that refuses a missing variable, an unused (unknown) value and a bad placeholder.

    TensorRT-LLM's fill_template leaves unknown `${...}` in place silently; a config with a literal
    `${triton_max_batch_size}` then fails far from its cause. Here it fails at render time.
    """
    template = string.Template(text)
    if not template.is_valid():
        raise BadInput(f"template {source}: malformed placeholder (use ${{name}})")
    wanted = set(template.get_identifiers())
    missing, unknown = sorted(wanted - set(values)), sorted(set(values) - wanted)
    if missing:
        raise BadInput(f"template {source}: no value for {', '.join('${' + m + '}' for m in missing)}")
    if unknown:
        raise BadInput(f"template {source}: unknown variable(s) {', '.join(unknown)} (not in the template)")
    return template.substitute({k: str(v) for k, v in values.items()})


def render_model(kind: str, repository: Path, name: str, values: dict[str, object]) -> Path:
    """Render infra/triton/<kind>/ into repository/<name>/, atomically (a temporary folder renamed in)."""
    if not NAME_RE.match(name):
        raise BadInput(f"model name {name!r}: use letters, digits, '-', '_' or '.'")
    source = TEMPLATES / kind
    if not (source / "config.pbtxt").is_file():
        raise BadInput(f"template {source}: no config.pbtxt")
    repository.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{name}-", dir=repository))
    try:
        shutil.copytree(source, staging, dirs_exist_ok=True, ignore=shutil.ignore_patterns("__pycache__"))
        config = render_template(
            (source / "config.pbtxt").read_text(), {"model_name": name, **values}, str(source / "config.pbtxt")
        )
        (staging / "config.pbtxt").write_text(config)
        target = repository / name
        if target.exists():
            old = repository / f".old-{name}-{os.getpid()}-{time.monotonic_ns()}"
            os.rename(target, old)
            os.rename(staging, target)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.rename(staging, target)
        return target
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise


def pytriton_root() -> Path:
    import pytriton

    return Path(pytriton.__file__).resolve().parent / "tritonserver"


def find_binary(configured: str | None) -> Path:
    named = os.environ.get("LLMOPS_TRITONSERVER") or configured
    if named:
        path = Path(shutil.which(named) or named)
        if not path.is_file() or not os.access(path, os.X_OK):
            raise BadInput(
                f"tritonserver binary {named}: not found or not executable "
                "(set serve.triton_binary or LLMOPS_TRITONSERVER)"
            )
        return path
    try:
        return pytriton_root() / "bin" / "tritonserver"
    except ImportError:
        raise BadInput("tritonserver: no binary configured and nvidia-pytriton is not installed") from None


def python_backend_dir(home: Path) -> Path:
    """A backend folder whose Python backend carries the stub for the running Python version."""
    root = pytriton_root()
    target = home / "triton" / "backends"
    python = target / "python"
    if not (python / "triton_python_backend_stub").is_file():
        shutil.rmtree(target, ignore_errors=True)
        shutil.copytree(root / "backends" / "python", python)
        version = f"{sys.version_info.major}.{sys.version_info.minor}"
        shutil.copy2(root / "python_backend_stubs" / version / "triton_python_backend_stub", python)
    return target


def server_env() -> dict:
    env = dict(os.environ)
    libs = [str(pytriton_root().parent.parent / "nvidia_pytriton.libs"), sysconfig.get_config_var("LIBDIR")]
    env["LD_LIBRARY_PATH"] = os.pathsep.join(filter(None, [*libs, env.get("LD_LIBRARY_PATH")]))
    env["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), env.get("PATH", "")])
    return env


@dataclass
class Triton:
    """A Triton reachable over HTTP; `process` is set when this process started it."""

    url: str
    repository: Path
    process: subprocess.Popen | None = None
    log_path: Path | None = None
    metrics_url: str | None = None
    grpc_url: str | None = None

    # --- lifecycle ---------------------------------------------------------------------------
    @classmethod
    def start(cls, home: Path, binary: str | None = None, timeout: float = 120) -> Triton:
        exe = find_binary(binary)
        repository = home / "triton" / "repository"
        repository.mkdir(parents=True, exist_ok=True)
        log_path = home / "triton" / "tritonserver.log"
        http, grpc, metrics = free_port(), free_port(), free_port()
        command = [
            str(exe),
            f"--model-repository={repository}",
            "--model-control-mode=explicit",
            f"--http-port={http}",
            f"--grpc-port={grpc}",
            f"--metrics-port={metrics}",
            "--http-address=127.0.0.1",
            "--grpc-address=127.0.0.1",
            "--allow-metrics=true",
            "--exit-timeout-secs=10",
            "--log-verbose=0",
            # one candidate that failed to load must not mark the whole server unready
            "--strict-readiness=false",
        ]
        if binary is None and not os.environ.get("LLMOPS_TRITONSERVER"):
            command.append(f"--backend-directory={python_backend_dir(home)}")
        with open(log_path, "ab") as log:
            process = subprocess.Popen(
                command, stdout=log, stderr=subprocess.STDOUT, env=server_env(), start_new_session=True
            )
        server = cls(f"http://127.0.0.1:{http}", repository, process, log_path, f"http://127.0.0.1:{metrics}/metrics")
        server.grpc_url = f"127.0.0.1:{grpc}"
        server.wait_ready(timeout)
        return server

    @classmethod
    def attach(cls, url: str, repository: Path) -> Triton:
        server = cls(url.rstrip("/"), repository)
        server.wait_ready(30)
        return server

    def wait_ready(self, timeout: float) -> None:
        """Server liveness and readiness; models are checked one by one (`is_ready`)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process is not None and self.process.poll() is not None:
                raise CheckFailed(f"tritonserver exited with {self.process.returncode}: {self.log_tail()}")
            try:
                # /v2/health/live: an attached server with strict readiness reports "not ready"
                # while any model is unavailable (a failed candidate), yet it serves the others.
                if requests.get(f"{self.url}/v2/health/live", timeout=2).status_code == 200:
                    return
            except requests.RequestException:
                pass
            time.sleep(0.3)
        raise TransientError(f"Triton at {self.url}: not ready after {timeout:.0f}s")

    def stop(self) -> None:
        """SIGTERM (tritonserver started in the background ignores SIGINT), then SIGKILL if it hangs."""
        if self.process is None or self.process.poll() is not None:
            return
        os.killpg(self.process.pid, signal.SIGTERM)
        try:
            self.process.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait(10)

    def log_tail(self, lines: int = 5) -> str:
        if not self.log_path or not self.log_path.is_file():
            return ""
        return " | ".join(self.log_path.read_text(errors="replace").strip().splitlines()[-lines:])

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
        self, name: str, text: str, max_tokens: int = 16, timeout: float = 60, history: list[dict] | None = None
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
