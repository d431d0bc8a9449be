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


# `make test` runs two pytest-xdist workers (--dist loadgroup): each test module is a group of its own, run whole by
# one worker, except the modules that share the session's cpu-tiny store (they train once between them), which are one
# group. The longest groups go first (seconds in CI, build/junit.xml), so the two workers finish together.
SHARED_STORE = ("test_serving", "test_attach")  # the modules using the cpu_tiny_store fixture
LONGEST_FIRST = ("test_serving", "test_attach", "test_service", "test_release", "test_quality_gate", "test_approval")

if os.environ.get("PYTEST_XDIST_WORKER"):
    # One thread per worker for torch, OpenMP and the tokenizers, in this process and every server and run it starts:
    # two workers whose trainings each spin two OpenMP threads on 2 cores took 4.5 times as long as one alone.
    for name in ("OMP_NUM_THREADS", "MKL_NUM_THREADS"):
        os.environ.setdefault(name, "1")


@pytest.hookimpl(tryfirst=True)  # before xdist's own hook reads the groups
def pytest_collection_modifyitems(items):
    def module(item) -> str:
        return item.module.__name__.rsplit(".", 1)[-1]

    def rank(item) -> int:
        return LONGEST_FIRST.index(module(item)) if module(item) in LONGEST_FIRST else len(LONGEST_FIRST)

    items.sort(key=rank)  # stable: the order inside a module is kept
    for item in items:
        group = "cpu-tiny-store" if module(item) in SHARED_STORE else item.module.__name__
        item.add_marker(pytest.mark.xdist_group(group))
