import os
import sys
import tempfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
# Prefect and Hugging Face state of the test process stays out of the user's home.
os.environ.setdefault("PREFECT_HOME", tempfile.mkdtemp(prefix="llmops-test-prefect-"))
os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
os.environ.setdefault("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", "120")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")


@pytest.fixture(scope="session")
def cpu_tiny_store(tmp_path_factory):
    """One artifact store for the cpu-tiny releases of several test modules: each training runs once in the
    session and later modules' releases of the same model are cache hits (the stages' own tests are elsewhere)."""
    return tmp_path_factory.mktemp("cpu-tiny-store")


@pytest.fixture(scope="session")
def shared_prefect(tmp_path_factory):
    """One real Prefect server (sqlite) for the session's releases; see tests/servers.py SHARED_PREFECT."""
    from tasks.platform.local_stack import start_prefect
    from tasks.platform.ports import free_port
    from tests.servers import SHARED_PREFECT

    folder = tmp_path_factory.mktemp("prefect-server")
    server = start_prefect(folder / "home", free_port(), folder)
    SHARED_PREFECT["PREFECT_API_URL"] = server.url
    yield server.url
    SHARED_PREFECT.clear()
    server.stop()


@pytest.fixture(scope="session", autouse=True)
def _stop_prefect_at_the_end():
    yield
    from flows.cli import stop_prefect_services

    stop_prefect_services()
