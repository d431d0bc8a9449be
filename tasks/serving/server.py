"""The Triton Inference Server process: started on 127.0.0.1 with explicit model control, and stopped. While
`llmops serve` keeps it, it is published for the releases of its LLMOPS_HOME (tasks/serving/publication.py).

Its control plane is locked: Triton's own `--http-restricted-api` / `--grpc-restricted-protocol` restrict
the model-repository, model-config (HTTP) and shared-memory APIs to requests carrying the control key
in the `llmops-control-key` header, so a client that reaches the port can infer but cannot load or
unload models (Triton's secure-deployment guide: dynamic model loading can run arbitrary code).
The key is fresh for every Triton start (a restart by `llmops serve` too) unless LLMOPS_TRITON_CONTROL_KEY
gives one; it never goes into a profile, a log or MLflow. The process that starts Triton holds it in memory;
`llmops serve` hands it to the release runs that roll out on its Triton through
`$LLMOPS_HOME/triton/control.key` (mode 600 from its creation), written when it publishes that Triton and
removed when it stops or restarts it. Triton 2.51 takes the restricted-API key only on its command line
(`tritonserver --help`: `--http-restricted-api=<apis>:<key>=<value>`), so it is in tritonserver's argv, readable by
`ps`, for the life of that one process. gRPC model-config stays open: genai-perf (perf_analyzer) reads the model
config over gRPC, and a key on its command line would land in its artifacts; reading a config controls nothing.

The binary: $LLMOPS_TRITONSERVER or `serve.triton_binary`, else the one in the nvidia-pytriton wheel
(CPU machines), run with the Python backend and this environment's Python:
- the wheel's bundled libraries go on LD_LIBRARY_PATH (without them model loads hang, not fail);
- the Python backend stub embeds Python in isolated mode and finds its interpreter through PATH,
  so this venv's bin goes first on PATH: the stub then runs with exactly this venv's packages
  (the interpreter's global site-packages hold other numpy/torch builds);
- the stub for this Python version is put into a private copy of the Python backend folder.
"""

from __future__ import annotations

import contextlib
import functools
import os
import secrets
import shutil
import signal
import subprocess
import sys
import sysconfig
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from tasks.platform.child_env import program_env
from tasks.platform.errors import BadInput, CheckFailed, TransientError
from tasks.platform.lifetime import dying_with_this_thread
from tasks.platform.ports import free_port
from tasks.platform.project import PROJECT_ROOT
from tasks.serving import adapter_registry
from tasks.serving.client import CONTROL_HEADER, CONTROL_KEY_ENV, Triton
from tasks.serving.model_roots import ROOTS_ENV

if TYPE_CHECKING:
    import psutil


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


def server_env(bundled: bool) -> dict:
    """The environment of tritonserver. Only the nvidia-pytriton binary needs this venv's libraries and
    Python; an NGC or system tritonserver has its own (/opt/tritonserver/lib, the image's Python), which
    these must not shadow, and an image without nvidia-pytriton could not import it at all. It and the model stubs
    it spawns get only the variables child_env.py's allow-list names for them."""
    env = program_env("tritonserver")
    if not bundled:
        return env
    libs = [str(pytriton_root().parent.parent / "nvidia_pytriton.libs"), sysconfig.get_config_var("LIBDIR")]
    env["LD_LIBRARY_PATH"] = os.pathsep.join(filter(None, [*libs, env.get("LD_LIBRARY_PATH")]))
    env["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), env.get("PATH", "")])
    return env


@dataclass
class TritonServer:
    """A tritonserver process this process started, and the client that talks to it."""

    process: subprocess.Popen
    log_path: Path
    client: Triton
    ports: tuple[int, int, int] = (0, 0, 0)  # HTTP, gRPC, metrics: where it is started again
    adapter_maps: Path | None = None  # where its base engines' adapter maps are (tasks/serving/adapter_registry.py)

    @classmethod
    def start(
        cls,
        home: Path,
        binary: str | None = None,
        timeout: float = 120,
        host: str = "127.0.0.1",
        ports: tuple[int, int, int] | None = None,
        die_with_parent: bool = False,
        launcher: list[str] | None = None,
        extra_env: dict[str, str] | None = None,
        replica: int = 0,
        model_roots: list[Path] | None = None,
    ) -> TritonServer:
        """Start tritonserver; `ports` (HTTP, gRPC, metrics) default to free ones. `die_with_parent`: the
        kernel stops Triton when the thread that started it ends (a SIGKILLed `llmops serve` leaves no
        orphan); only for a thread that lives as long as the server, such as a program's main thread.
        `launcher` and `extra_env`: what the profile's models need (tasks/serving/champion.py:triton_launch).
        `replica`: one of several Tritons of one `llmops serve` (tasks/runtime/fleet.py): they share the model
        repository, each logs to its own file. `model_roots`: the only folders (beside each model's own) its models
        may load from (tasks/serving/model_roots.py): the artifact store's."""
        exe = find_binary(binary)
        repository = home / "triton" / "repository"
        repository.mkdir(parents=True, exist_ok=True)
        log_path = home / "triton" / ("tritonserver.log" if replica == 0 else f"tritonserver-{replica}.log")
        key = new_control_key()
        http, grpc, metrics = ports or (free_port(), free_port(), free_port())
        command = [
            *(launcher or []),
            str(exe),
            f"--model-repository={repository}",
            "--model-control-mode=explicit",
            f"--http-port={http}",
            f"--grpc-port={grpc}",
            f"--metrics-port={metrics}",
            f"--http-address={host}",
            f"--grpc-address={host}",
            f"--metrics-address={host}",
            "--allow-metrics=true",
            # p50/p90/p99 per model version (nv_inference_request_summary_us, nv_inference_queue_summary_us),
            # which infra/monitoring's alerts and dashboard read
            "--metrics-config=summary_latencies=true",
            "--exit-timeout-secs=10",
            "--log-verbose=0",
            # one candidate that failed to load must not mark the whole server unready
            "--strict-readiness=false",
            *restricted_api_flags(key),
        ]
        bundled = binary is None and not os.environ.get("LLMOPS_TRITONSERVER")
        if bundled:
            command.append(f"--backend-directory={python_backend_dir(home)}")
        maps = adapter_maps(home)
        roots = {ROOTS_ENV: os.pathsep.join(map(str, model_roots))} if model_roots else {}
        scrub = key_scrubber(home)
        with open(log_path, "ab") as log:
            process = subprocess.Popen(
                dying_with_this_thread(command) if die_with_parent else command,
                stdout=log,
                stderr=subprocess.STDOUT,
                env={
                    **server_env(bundled),
                    **(extra_env or {}),
                    adapter_registry.MAPS_ENV: str(maps),
                    **roots,
                    **scrub,
                },
                start_new_session=True,
            )
        local = "127.0.0.1" if host in ("0.0.0.0", "::", "") else host
        client = Triton(
            f"http://{local}:{http}", repository, f"http://{local}:{metrics}/metrics", f"{local}:{grpc}", key
        )
        server = cls(process, log_path, client, (http, grpc, metrics), maps)
        try:
            server.wait_live(timeout)
        except Exception:
            server.stop()
            raise
        return server

    def wait_live(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise CheckFailed(f"tritonserver exited with {self.process.returncode}: {self.log_tail()}")
            if self.client.is_live():
                return
            time.sleep(0.3)
        raise TransientError(f"Triton at {self.client.url}: not live after {timeout:.0f}s ({self.log_tail()})")

    def running(self) -> bool:
        return self.process.poll() is None

    def stop(self) -> None:
        """SIGTERM (tritonserver started in the background ignores SIGINT), then SIGKILL if it hangs; its adapter map
        goes with it."""
        if self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGTERM)
            try:
                self.process.wait(30)
            except subprocess.TimeoutExpired:
                pass
        self.kill()

    def kill(self) -> None:
        """SIGKILL for it and every process of its session (its model processes, which a hung load left waiting);
        its adapter map goes with it."""
        if self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait(30)
        adapter_registry.forget_map(self.process.pid, str(self.adapter_maps) if self.adapter_maps else None)

    def model_processes(self, models: list[str]) -> list[psutil.Process]:
        """The Python-backend model processes of `models` (nothing else of this Triton). A stub's arguments hold its
        name: its instance's `<model>_<group>_<instance>`, or the model's own for the stub that completes its config
        (python_backend src/stub_launcher.cc, Launch: `stub MODEL_PY SHM ... NAME DEFAULT`)."""
        import re

        import psutil

        instance = re.compile(rf"^({'|'.join(re.escape(m) for m in models)})(_\d+)*$")
        found = []
        for child in psutil.Process(self.process.pid).children(recursive=True):
            try:
                if any(instance.match(argument) for argument in child.cmdline()[1:]):
                    found.append(child)
            except psutil.NoSuchProcess:  # ended meanwhile
                continue
        return found

    def end_model_processes(self, models: list[str]) -> list[int]:
        """SIGKILL for the Python-backend model processes of `models`; the pids."""
        import psutil

        ended = []
        for process in self.model_processes(models):
            with contextlib.suppress(psutil.NoSuchProcess):
                process.kill()
                ended.append(process.pid)
        return ended

    @staticmethod
    def end_left_behind(processes: list[psutil.Process], grace_s: float = 10.0) -> list[int]:
        """Of a model's processes from before it was loaded again, those still there after `grace_s` (the old
        instances end once their requests in flight did), SIGKILLed; the pids. One instance of a Python-backend
        model dead, Triton 2.51's reload (and its unload) ends none of the others: each would hold its memory until
        the Triton stops."""
        import psutil

        _, alive = psutil.wait_procs(processes, timeout=grace_s)
        for process in alive:
            with contextlib.suppress(psutil.NoSuchProcess):
                process.kill()
        return [process.pid for process in alive]

    def log_tail(self, lines: int = 5) -> str:
        if not self.log_path or not self.log_path.is_file():
            return ""
        return " | ".join(self.log_path.read_text(errors="replace").strip().splitlines()[-lines:])


def adapter_maps(home: Path) -> Path:
    """The folder of this home's Tritons' adapter maps (mode 700), the maps of ended Tritons swept out first."""
    folder = home / "triton" / "adapter-maps"
    folder.mkdir(mode=0o700, parents=True, exist_ok=True)
    adapter_registry.forget_ended_maps(str(folder))
    return folder


SCRUBBER_SOURCE = PROJECT_ROOT / "infra" / "scrub-argv" / "scrub_argv.c"


def key_scrubber(home: Path) -> dict[str, str]:
    """The environment that takes the control key off tritonserver's command line once Triton parsed it (LD_PRELOAD
    of infra/scrub-argv: Triton 2.51 takes the key nowhere else), built once per source with the system's C
    compiler into $LLMOPS_HOME/triton; {} where there is none (the key then stays on the command line, said once)."""
    import hashlib

    source = SCRUBBER_SOURCE.read_bytes()
    built = home / "triton" / f"scrub-argv-{hashlib.sha256(source).hexdigest()[:12]}.so"
    if not built.is_file():
        compiler = shutil.which("cc") or shutil.which("gcc")
        if compiler is None:
            warn_once("triton: no C compiler (cc): the Triton control key stays on tritonserver's command line")
            return {}
        staging = built.with_name(f".{built.name}.{os.getpid()}")
        done = subprocess.run(
            [compiler, "-shared", "-fPIC", "-O2", "-o", str(staging), str(SCRUBBER_SOURCE), "-ldl"],
            capture_output=True,
            text=True,
        )
        if done.returncode != 0:
            staging.unlink(missing_ok=True)
            warn_once(
                f"triton: {SCRUBBER_SOURCE.name} did not build ({done.stderr.strip()[:200]}): the key stays on "
                "tritonserver's command line"
            )
            return {}
        os.replace(staging, built)  # whole or not at all: replicas starting at once each build, one wins
    return {"LD_PRELOAD": str(built)}


@functools.cache
def warn_once(message: str) -> None:
    print(f"llmops: warning: {message}", file=sys.stderr)


def new_control_key() -> str:
    """The key of the Triton about to start: LLMOPS_TRITON_CONTROL_KEY when the user gives one, else fresh."""
    return os.environ.get(CONTROL_KEY_ENV) or secrets.token_urlsafe(32)


def restricted_api_flags(key: str) -> list[str]:
    """Triton's syntax: `--http-restricted-api=<API>,<API>:<header>=<value>` (and the gRPC twin). Logging and trace
    too (issue 74): unrestricted, any client that reaches the port turns on verbose logs or traces of every request
    (prompts included) into files on the serve's disk. Statistics stay open: perf_analyzer (genai-perf) reads them."""
    return [
        f"--http-restricted-api=model-repository,model-config,shared-memory,logging,trace:{CONTROL_HEADER}={key}",
        f"--grpc-restricted-protocol=model-repository,shared-memory,logging,trace:{CONTROL_HEADER}={key}",
    ]
