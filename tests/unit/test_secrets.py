"""Secrets on a shared machine (docs/security.md): a fresh Triton control key per start, handed over in a file
that lives as long as that Triton; keys of attached Tritons given only explicitly; no secret on a command line
(rclone) or inherited by a child that does not need it; secret files private from their creation."""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from tasks.platform.errors import BadInput
from tasks.serving.client import Triton, TritonTarget
from tasks.serving.publication import publish, published, unpublish
from tasks.serving.server import new_control_key, restricted_api_flags
from tests.leaks import in_processes

SECRET = "s3cr3t-for-the-leak-scanner-7d1e"


def mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def test_every_triton_start_gets_a_fresh_key_unless_the_user_gives_one(monkeypatch):
    monkeypatch.delenv("LLMOPS_TRITON_CONTROL_KEY", raising=False)
    keys = {new_control_key() for _ in range(3)}
    assert len(keys) == 3 and all(len(key) >= 40 for key in keys)
    monkeypatch.setenv("LLMOPS_TRITON_CONTROL_KEY", "from-the-environment")
    assert new_control_key() == "from-the-environment"
    assert restricted_api_flags("k") == [
        "--http-restricted-api=model-repository,model-config,shared-memory,logging,trace:llmops-control-key=k",
        "--grpc-restricted-protocol=model-repository,shared-memory,logging,trace:llmops-control-key=k",
    ]


@pytest.fixture
def no_chmod(monkeypatch):
    """umask 0 and chmod forbidden: a file is private only if it was created so."""
    old = os.umask(0)

    def refuse(*_args, **_kwargs):
        raise AssertionError("chmod after the write: the file was readable by others for a moment")

    monkeypatch.setattr(os, "chmod", refuse)
    monkeypatch.setattr(Path, "chmod", refuse)
    yield
    os.umask(old)


def test_publish_hands_the_keys_over_privately_and_unpublish_takes_them_away(tmp_path, no_chmod):
    client = Triton("http://127.0.0.1:1", tmp_path / "repository", "http://127.0.0.1:2/metrics", "127.0.0.1:3", "k1")
    replica = Triton("http://127.0.0.1:5", tmp_path / "repository", None, None, "k3")
    state = publish(tmp_path, [client, replica], "http://127.0.0.1:4", "http://127.0.0.1:6", "serve-key", "svc")
    key_file, serve_key = tmp_path / "triton" / "control.key", tmp_path / "serving" / "control.key"
    assert key_file.read_text() == "k1" and mode(key_file) == 0o600 and mode(state) == 0o600
    assert serve_key.read_text() == "serve-key" and mode(serve_key) == 0o600
    assert not (tmp_path / "triton" / "control.keys").exists()  # the replicas' keys stay the serve's own
    published = json.loads(state.read_text())
    assert published["gateway_url"] == "http://127.0.0.1:4" and published["service"] == "svc"
    assert [r["url"] for r in published["replicas"]] == [client.url, replica.url]
    restarted = Triton(client.url, client.repository, client.metrics_url, client.grpc_url, "k2")  # a restart
    publish(tmp_path, [restarted], None)
    assert key_file.read_text() == "k2"
    assert sorted(os.listdir(key_file.parent)) == ["control.key", "server.json"]
    unpublish(tmp_path, serve_stops=False)  # a Triton restarts: the serve's own key stays
    assert os.listdir(key_file.parent) == [] and serve_key.is_file()
    unpublish(tmp_path)
    assert not serve_key.exists()


def test_the_stacks_secret_files_are_private_from_their_creation(tmp_path, no_chmod):
    from tasks.platform.local_stack.stack import Stack

    stack = Stack(tmp_path)
    stack.save({"s3_credentials": {"key": "llmops", "secret": SECRET}})
    assert mode(stack.state_file) == 0o600 and stack.load()["s3_credentials"]["secret"] == SECRET
    assert os.listdir(stack.root) == ["stack.json"]  # no staged file left behind


class LiveTriton(BaseHTTPRequestHandler):
    def do_GET(self):  # noqa: N802 (http.server's name)
        self.send_response(200)
        self.end_headers()

    def log_message(self, *_args):
        pass


def test_server_json_is_trusted_only_while_its_pid_is_an_llmops_process(tmp_path, monkeypatch):
    monkeypatch.delenv("LLMOPS_TRITON_CONTROL_KEY", raising=False)
    http = ThreadingHTTPServer(("127.0.0.1", 0), LiveTriton)
    threading.Thread(target=http.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{http.server_address[1]}"
    gone = subprocess.Popen(["true"])
    gone.wait()
    other = subprocess.Popen(["sleep", "30"])
    serve = subprocess.Popen(["llmops-serve", "30"], executable="sleep")  # argv[0] names it as `llmops serve` would
    try:
        (tmp_path / "triton").mkdir()
        for pid, trusted in ((gone.pid, False), (other.pid, False), (serve.pid, True)):
            info = {"url": url, "grpc_url": "127.0.0.1:1", "metrics_url": f"{url}/metrics", "pid": pid}
            (tmp_path / "triton" / "server.json").write_text(json.dumps({**info, "repository": str(tmp_path)}))
            assert (published(tmp_path) is not None) == trusted, pid
    finally:
        for child in (other, serve):
            child.kill()
            child.wait()
        http.shutdown()


def test_an_attached_triton_gets_only_a_key_given_for_it_and_no_plain_http_off_loopback(tmp_path, monkeypatch):
    for name in ("LLMOPS_TRITON_CONTROL_KEY", "LLMOPS_TRITON_CONTROL_KEY_FILE", "LLMOPS_TRITON_ALLOW_PLAIN_HTTP"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("LLMOPS_HOME", str(tmp_path))
    (tmp_path / "triton").mkdir()
    (tmp_path / "triton" / "control.key").write_text("this-homes-own-key")

    def target(url: str) -> TritonTarget:
        found = TritonTarget.from_options(url, "h:1", "http://h:2/metrics", None)
        assert found is not None
        return found

    assert target("http://127.0.0.1:8000").control_key is None  # never this home's key
    assert target("https://triton.example:8000").control_key is None
    with pytest.raises(BadInput) as refused:
        target("http://10.0.0.7:8000")
    assert str(refused.value) == (
        "Triton at http://10.0.0.7:8000: plain http:// to another machine sends the control key in clear; "
        "use https://, or pass --allow-plain-http (LLMOPS_TRITON_ALLOW_PLAIN_HTTP=1) on a network you trust"
    )
    monkeypatch.setenv("LLMOPS_TRITON_ALLOW_PLAIN_HTTP", "1")
    assert target("http://10.0.0.7:8000").url == "http://10.0.0.7:8000"
    key_file = tmp_path / "operator.key"
    key_file.write_text("the-operators-key\n")
    monkeypatch.setenv("LLMOPS_TRITON_CONTROL_KEY_FILE", str(key_file))
    assert target("http://10.0.0.7:8000").control_key == "the-operators-key"
    assert "the-operators-key" not in repr(target("http://10.0.0.7:8000"))
    monkeypatch.setenv("LLMOPS_TRITON_CONTROL_KEY_FILE", str(tmp_path / "missing.key"))
    with pytest.raises(BadInput, match=r"^LLMOPS_TRITON_CONTROL_KEY_FILE .*missing.key: cannot read the control key"):
        target("https://triton.example:8000")


def test_run_refuses_plain_http_off_loopback_in_one_line_naming_the_option(tmp_path):
    llmops = Path(sys.executable).parent / "llmops"
    env = {k: v for k, v in os.environ.items() if not k.startswith("LLMOPS_TRITON")}
    url = ["--triton-url", "http://10.0.0.7:8000", "--triton-grpc-url", "10.0.0.7:8001"]
    args = [*url, "--triton-metrics-url", "http://10.0.0.7:8002/metrics"]
    done = subprocess.run(
        [llmops, "run", *args], capture_output=True, text=True, env={**env, "LLMOPS_HOME": str(tmp_path)}
    )
    assert done.returncode == 2
    assert done.stderr.strip().splitlines()[-1] == (
        "llmops: error: Triton at http://10.0.0.7:8000: plain http:// to another machine sends the control key in "
        "clear; use https://, or pass --allow-plain-http (LLMOPS_TRITON_ALLOW_PLAIN_HTTP=1) on a network you trust"
    )


def test_rclone_takes_the_s3_secret_from_its_environment_not_its_command_line(tmp_path):
    import boto3
    from botocore.exceptions import ClientError

    from tasks.platform.local_stack.s3 import start_s3
    from tasks.platform.ports import free_port

    port = free_port()
    server = start_s3(tmp_path / "s3", port, "llmops", SECRET, tmp_path / "logs")  # returns once the secret works
    try:
        assert SECRET not in " ".join(server.record()["command"])  # what stack.json records
        leaks = in_processes({"S3 secret": SECRET})
        assert leaks == [(f"pid {server.pid} environ: {server.command[0]}", "S3 secret")]
        wrong = boto3.client(
            "s3", endpoint_url=f"http://127.0.0.1:{port}", aws_access_key_id="llmops", aws_secret_access_key="wrong"
        )
        with pytest.raises(ClientError):
            wrong.list_buckets()
    finally:
        server.stop()


def test_children_do_not_inherit_secrets_they_do_not_need(tmp_path, monkeypatch):
    from tasks.serving.server import server_env

    for name in ("LLMOPS_API_KEYS", "LLMOPS_TRITON_CONTROL_KEY", "AWS_SECRET_ACCESS_KEY", "AWS_ACCESS_KEY_ID"):
        monkeypatch.setenv(name, f"{SECRET}-{name}")
    assert not [value for value in server_env(False).values() if SECRET in value]
    from tasks.platform.local_stack.process import start

    child = start("sleeper", ["sleep", "30"], "", lambda: True, tmp_path, {"MINE": "1"})
    try:
        environ = child_environ(child.pid)
        assert SECRET.encode() not in environ and b"MINE=1" in environ
    finally:
        child.stop()


# Every login an `llmops` process (a flow run on the stack's worker) may hold: none of them is LlamaFactory's,
# TensorRT-LLM's or git's business.
LOGINS = (
    *(
        "LLMOPS_API_KEYS",
        "LLMOPS_TRITON_CONTROL_KEY",
        "AWS_ACCESS_KEY_ID",
        "AWS_SECRET_ACCESS_KEY",
        "AWS_SESSION_TOKEN",
    ),
    *(
        "PREFECT_API_AUTH_STRING",
        "PREFECT_SERVER_API_AUTH_STRING",
        "MLFLOW_TRACKING_USERNAME",
        "MLFLOW_TRACKING_PASSWORD",
    ),
    *(
        "MLFLOW_FLASK_SERVER_SECRET_KEY",
        "RCLONE_AUTH_KEY",
        "PGPASSFILE",
        "HF_TOKEN",
        "GITHUB_TOKEN",
        "SOME_NEW_CLOUD_TOKEN",
        "OPENAI_API_KEY",
        "LLMOPS_JUDGE_KEY_OF_A_PROFILE",
    ),
)


@pytest.mark.parametrize("program", ["llamafactory", "tensorrt_llm", "git", "tritonserver"])
def test_each_third_party_program_starts_with_its_allow_list_only(program, monkeypatch):
    """The environment LlamaFactory, the TensorRT-LLM commands, git and tritonserver (with the model processes it
    starts; issue 74: the OpenAI key, HF_TOKEN and a judge's key reached them) start with, read from the started process:
    only names its allow-list holds (tasks/platform/child_env.py), no login of the flow run that starts it, not even
    one no deny-list knows."""
    import fnmatch

    from tasks.platform.child_env import PROGRAMS, program_env
    from tasks.platform.config import HardwareSection
    from tasks.serving.server import server_env
    from tasks.serving.tensorrt_llm import command_env
    from tasks.training.launch import launch_env

    for name in LOGINS:
        monkeypatch.setenv(name, f"{SECRET}-{name}")
    monkeypatch.setenv("PREFECT_API_URL", "http://127.0.0.1:4200/api")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    env = {
        "llamafactory": lambda: launch_env(HardwareSection()),
        "tensorrt_llm": command_env,
        "git": lambda: program_env("git"),
        "tritonserver": lambda: server_env(True),
    }[program]()
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"], env=env)
    try:
        names = [line.split(b"=", 1)[0].decode() for line in child_environ(child.pid).split(b"\0") if b"=" in line]
    finally:
        child.kill()
    assert [n for n in names if not any(fnmatch.fnmatchcase(n, p) for p in PROGRAMS[program])] == []
    assert not [n for n in names if n in LOGINS or n.startswith(("PREFECT_", "MLFLOW_", "AWS_"))]
    assert "PATH" in names and (program == "git" or "HF_HUB_OFFLINE" in names)


def child_environ(pid: int) -> bytes:
    """The environment of a child just started. Popen returns once the exec has closed its error pipe, but the
    kernel sets the new image's argument and environment bounds a little later (create_elf_tables, after
    begin_new_exec), and until then /proc/PID/cmdline and environ read empty: CI read b"" once."""
    deadline = time.monotonic() + 5
    while not Path(f"/proc/{pid}/cmdline").read_bytes() and time.monotonic() < deadline:
        time.sleep(0.01)
    return Path(f"/proc/{pid}/environ").read_bytes()


def test_the_process_scanner_finds_a_secret_in_a_childs_argv_or_environment():
    sleeper = [sys.executable, "-c", "import time; time.sleep(30)"]
    with_argv = subprocess.Popen([*sleeper, SECRET], env={})
    with_env = subprocess.Popen(sleeper, env={"TOKEN": SECRET})
    without = subprocess.Popen(sleeper, env={"TOKEN": "nothing"})
    try:
        for child in (with_argv, with_env, without):
            child_environ(child.pid)
        found = in_processes({"the secret": SECRET})
        assert sorted(found) == [
            (f"pid {with_argv.pid} argv: {sys.executable}", "the secret"),
            (f"pid {with_env.pid} environ: {sys.executable}", "the secret"),
        ]
        assert not [where for where, _ in found if str(without.pid) in where]
    finally:
        for child in (with_argv, with_env, without):
            child.kill()
            child.wait()


def test_a_run_parameter_aims_the_control_key_only_at_the_workers_triton_or_the_operators_allow_list(monkeypatch):
    monkeypatch.setenv("LLMOPS_TRITON_CONTROL_KEY", SECRET)
    monkeypatch.setenv("LLMOPS_TRITON_URL", "https://triton.internal:8000")
    monkeypatch.delenv("LLMOPS_TRITON_URLS", raising=False)
    urls = ("127.0.0.1:8001", "http://127.0.0.1:8002/metrics", None)
    with pytest.raises(BadInput, match=r"^triton_url https://elsewhere.example: a run parameter may name this worker"):
        TritonTarget.from_options("https://elsewhere.example", *urls, from_api=True)
    own = TritonTarget.from_options("https://triton.internal:8000", *urls, from_api=True)
    assert own is not None and own.control_key == SECRET
    monkeypatch.setenv("LLMOPS_TRITON_URLS", "https://canary.internal:8000, https://other.internal")
    listed = TritonTarget.from_options("https://canary.internal:8000/", *urls, from_api=True)
    assert listed is not None and listed.url.startswith("https://canary.internal")
    mine = TritonTarget.from_options("https://elsewhere.example", *urls)  # `llmops run --triton-url` by its owner
    assert mine is not None
