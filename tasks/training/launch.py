"""The train stage's launch: LlamaFactory's own `llamafactory-cli train`, once per node.

Several processes are LlamaFactory's documented launch, read at the pinned 0.9.5: with FORCE_TORCHRUN,
`llamafactory-cli train` runs torchrun itself (llamafactory/launcher.py:60-62) and reads NNODES, NODE_RANK,
NPROC_PER_NODE, MASTER_ADDR and MASTER_PORT from the environment (launcher.py:64-68). With RDZV_ID set it
starts torchrun with a c10d rendezvous at MASTER_ADDR:MASTER_PORT (launcher.py:85-112), otherwise with a
static one (launcher.py:113-132). Every node runs the same command; only NODE_RANK differs. Across nodes
the rendezvous is c10d: the agent whose address is MASTER_ADDR hosts its store, and torchrun hands out
ranks itself, in the sorted order of the agents' host names and process ids
(torch/distributed/elastic/rendezvous/dynamic_rendezvous.py:833 at torch 2.13), so global rank 0, the
process that writes the trainer log, checkpoints and the adapter, runs on whichever node sorts first.

Where the stage runs as one process, all its nodes start here, each in a session of its own with its
own log: a rehearsal of the multi-node launch on one machine (two nodes on 127.0.0.1 on CPU, gloo), or
one GPU box split into nodes (`CUDA_VISIBLE_DEVICES` per node). They share this machine's disk, so one
output folder serves them all.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

from tasks.platform.child_env import program_env
from tasks.platform.config import HardwareSection
from tasks.platform.ports import free_port
from tasks.platform.project import PROJECT_ROOT

STOP_GRACE_S = 30.0


@dataclass(frozen=True)
class Rendezvous:
    """Where the nodes of one training meet: node 0's address, a port there, and the run's id."""

    address: str
    port: int
    run_id: str


def node_env(hardware: HardwareSection, node_rank: int, rendezvous: Rendezvous | None) -> dict[str, str]:
    """The variables LlamaFactory's launcher reads on one node (none for a single process)."""
    if hardware.world_size == 1:
        return {}
    env = {"FORCE_TORCHRUN": "1", "NPROC_PER_NODE": str(hardware.processes_per_node)}
    if hardware.nodes > 1:
        assert rendezvous is not None, "several nodes need a rendezvous"
        env.update(
            NNODES=str(hardware.nodes),
            NODE_RANK=str(node_rank),
            MASTER_ADDR=rendezvous.address,
            MASTER_PORT=str(rendezvous.port),
            RDZV_ID=rendezvous.run_id,
        )
    return env


def launch_command(config_path: Path) -> list[str]:
    return [sys.executable, "-m", "tasks.runners.llamafactory_launch", "train", str(config_path)]


def base_env() -> dict:
    """LlamaFactory's environment: the allow-list of tasks/platform/child_env.py (no Prefect, MLflow or S3 login:
    it reads and writes local folders only; the stage tracks and stores), the project importable, torchrun on PATH."""
    env = program_env("llamafactory")
    env.setdefault("TOKENIZERS_PARALLELISM", "false")
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(PROJECT_ROOT), env.get("PYTHONPATH")]))
    # LlamaFactory runs `torchrun` by name: the one installed beside this interpreter.
    env["PATH"] = os.pathsep.join(filter(None, [str(Path(sys.executable).parent), env.get("PATH")]))
    return env


def launch_env(hardware: HardwareSection, node_rank: int = 0, rendezvous: Rendezvous | None = None) -> dict:
    return base_env() | node_env(hardware, node_rank, rendezvous)


def local_node_env(hardware: HardwareSection, node_rank: int) -> dict[str, str]:
    """What sets apart the nodes that share this machine: their GPUs, or their share of the CPU cores."""
    if hardware.nodes == 1:
        return {}
    if hardware.accelerator == "cuda":
        first = node_rank * hardware.gpus
        return {"CUDA_VISIBLE_DEVICES": ",".join(str(i) for i in range(first, first + hardware.gpus))}
    if "OMP_NUM_THREADS" in os.environ:
        return {}
    return {"OMP_NUM_THREADS": str(max(1, (os.cpu_count() or 1) // hardware.nodes))}


@dataclass
class Node:
    rank: int
    process: subprocess.Popen
    log_path: Path

    def describe(self, nodes: int) -> str:
        code = self.process.returncode
        how = f"was killed by {signal.Signals(-code).name}" if code is not None and code < 0 else f"exited with {code}"
        tail = [line for line in self.log_path.read_text(errors="replace").splitlines() if line.strip()][-1:]
        last = f": {tail[0][:300]}" if tail and code is not None and code > 0 else ""
        return f"node {self.rank} of {nodes} (pid {self.process.pid}) {how}{last} (log: {self.log_path})"


class LocalNodes:
    """The nodes of one training, started on this machine. Each runs in a session of its own (LlamaFactory's
    launcher, torchrun and its workers), so that stopping a node stops all of it."""

    def __init__(self, config_path: Path, hardware: HardwareSection, work: Path, one_of_many: bool = False):
        """one_of_many: this machine is one node of several (a pod of tasks/training/kubernetes.py), whose launch
        variables are already in this process's environment: one launch here, with them."""
        self.config_path, self.hardware, self.work, self.one_of_many = config_path, hardware, work, one_of_many
        self.nodes: list[Node] = []

    def log_path(self, rank: int) -> Path:
        return self.work / ("llamafactory.log" if rank == 0 else f"llamafactory-node{rank}.log")

    def start(self) -> list[Node]:
        rendezvous = None
        if self.hardware.nodes > 1 and not self.one_of_many:
            rendezvous = Rendezvous("127.0.0.1", free_port(), f"llmops-{uuid.uuid4().hex[:12]}")
        for rank in range(1 if self.one_of_many else self.hardware.nodes):
            if self.one_of_many:
                env = base_env()
            else:
                env = launch_env(self.hardware, rank, rendezvous) | local_node_env(self.hardware, rank)
            with open(self.log_path(rank), "ab") as log:
                process = subprocess.Popen(
                    launch_command(self.config_path),
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    cwd=self.work,
                    env=env,
                    start_new_session=True,
                )
            self.nodes.append(Node(rank, process, self.log_path(rank)))
        return self.nodes

    def failed(self) -> list[Node]:
        return [n for n in self.nodes if n.process.poll() not in (None, 0)]

    def running(self) -> bool:
        """True while a node runs and none has failed."""
        return not self.failed() and any(n.process.poll() is None for n in self.nodes)

    def failure(self) -> str | None:
        """Which nodes failed and how, in one line; None when every node finished."""
        failed = self.failed()
        return "; ".join(n.describe(self.hardware.nodes) for n in failed) if failed else None

    def stop(self) -> None:
        """Stops what still runs (a node failed, or the task was cancelled): no trainer is left behind."""
        alive = [n for n in self.nodes if n.process.poll() is None]
        for node in alive + self.failed():  # a failed node's torchrun workers may outlive its launcher
            _signal_group(node.process.pid, signal.SIGTERM)
        deadline = time.monotonic() + STOP_GRACE_S
        for node in alive:
            try:
                node.process.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                _signal_group(node.process.pid, signal.SIGKILL)
                node.process.wait()
        for node in self.failed():
            _signal_group(node.process.pid, signal.SIGKILL)
        for node in self.failed():
            _wait_group_gone(node.process.pid, deadline + STOP_GRACE_S)


def _wait_group_gone(pgid: int, deadline: float) -> None:
    """Until the group's last process (torchrun's workers, orphaned when their launcher died) is gone."""
    while time.monotonic() < deadline:
        try:
            os.killpg(pgid, 0)
        except (ProcessLookupError, PermissionError):
            return
        time.sleep(0.1)


def _signal_group(pgid: int, signum: int) -> None:
    try:
        os.killpg(pgid, signum)
    except (ProcessLookupError, PermissionError):
        pass
