"""The expiry of suspended approvals (tasks/platform/decisions.py), where the Prefect API cannot be reached: one line
for each overdue run, nothing for one within its time or one that waits in its process. The rejection itself runs
against a real Prefect server and worker in tests/integration/test_approval.py."""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path

from flows.serve import expire_approvals
from tasks.platform.decisions import expire_overdue, pending_folder
from tasks.platform.ports import free_port

RUN = "0f1c2d3e-4f5a-4b6c-8d7e-9f0a1b2c3d4e"


def waiting(home: Path, run: str, since: float, suspended: bool = True) -> None:
    folder = pending_folder(home)
    folder.mkdir(parents=True, exist_ok=True)
    record = {"flow_run_id": run, "api_url": f"http://127.0.0.1:{free_port()}/api", "kind": "release", "model": "m"}
    record |= {"suspended": suspended, "waiting_since": since, "timeout_s": 60}
    (folder / f"{run}.json").write_text(json.dumps(record))


def test_an_overdue_suspension_whose_prefect_api_is_down_is_said_and_tried_again(tmp_path, monkeypatch):
    monkeypatch.delenv("PREFECT_API_AUTH_STRING", raising=False)
    waiting(tmp_path, RUN, time.time() - 61)
    waiting(tmp_path, RUN.replace("0f", "1f"), time.time() - 30)  # within its time
    waiting(tmp_path, RUN.replace("0f", "2f"), time.time() - 61, suspended=False)  # waits in its process
    (said,) = expire_overdue(tmp_path)
    assert said.startswith(f"approval: release {RUN} of m is past its timeout; the Prefect API at http://127.0.0.1:")
    assert (pending_folder(tmp_path) / f"{RUN}.json").is_file()  # kept: the next check tries again


def test_llmops_serve_checks_until_it_stops(tmp_path, capsys, monkeypatch):
    monkeypatch.delenv("PREFECT_API_AUTH_STRING", raising=False)
    waiting(tmp_path, RUN, time.time() - 61)
    stopped = threading.Event()
    checking = threading.Thread(target=expire_approvals, args=(tmp_path, stopped, 0.05))
    checking.start()
    time.sleep(0.5)
    stopped.set()
    checking.join(10)
    lines = capsys.readouterr().out.splitlines()
    assert not checking.is_alive() and lines
    assert all(line.startswith(f"llmops serve: approval: release {RUN} of m is past its timeout") for line in lines)
