"""train: LlamaFactory SFT (LoRA or QLoRA) run the way LlamaFactory is run, `llamafactory-cli train cfg.yaml`.

The parent process follows LlamaFactory's `trainer_log.jsonl` while training runs: each
logging step goes to MLflow (`train/loss`, `train/learning_rate`) and to the terminal/Prefect
log, and each finished checkpoint is uploaded to the artifact store from a background thread, so a
retried task or a rerun on a fresh machine resumes from the last stored checkpoint instead of step 0,
and a store that is briefly unreachable does not stop training.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import yaml

from tasks.platform.child_env import program_env
from tasks.platform.config import HardwareSection, TrainSection
from tasks.platform.errors import CheckFailed, is_transient
from tasks.platform.stage_cache import RunContext, StageMetrics, StageResult, logger, run_cached
from tasks.platform.store import Artifact, outlast_outage
from tasks.quality.contract import read_contract, write_contract

POLL_SECONDS = 1.0
# What of LlamaFactory's output_dir makes up the adapter artifact (checkpoints are stored apart).
ADAPTER_FILES = (
    "adapter_model.safetensors",
    "adapter_config.json",
    "trainer_log.jsonl",
    "training_loss.png",
    "train_results.json",
    "all_results.json",
    "trainer_state.json",
)


@dataclass
class TrainMetrics(StageMetrics):
    """The finished training run, from LlamaFactory's train_results.json and the follower."""

    STAGES = ("train",)

    final_loss: float
    steps: int
    samples_per_second: float
    tokens_per_second: float  # real (unpadded) training tokens per second of the trainer's own runtime
    runtime_s: float
    wall_s: float
    resumed_from_step: int  # 0: trained from the start

    def headline(self) -> str:
        return f"loss {self.final_loss:.3f}, {self.steps} steps"


def llamafactory_config(
    cfg: TrainSection, model_dir: Path, data_dir: Path, output_dir: Path, resume_from: Path | None
) -> dict:
    """The YAML LlamaFactory reads, under its own key names."""
    args = cfg.model_dump(exclude={"extra_args"}, exclude_none=True)
    if cfg.finetuning_type != "lora":
        for key in ("lora_rank", "lora_alpha", "lora_dropout", "lora_target"):
            args.pop(key, None)
    if cfg.quantization_bit is None:
        args.pop("quantization_method", None)
        args.pop("double_quantization", None)
    args.update(
        model_name_or_path=str(model_dir),
        do_train=True,
        dataset="train",
        dataset_dir=str(data_dir),
        output_dir=str(output_dir),
        overwrite_cache=True,
        plot_loss=True,
        save_strategy="steps",
        save_total_limit=2,
        report_to="none",
        dataloader_num_workers=0,
        include_num_input_tokens_seen="non_padding",  # tokens/s of real (unpadded) tokens in the trainer log
    )
    if resume_from is not None:
        args["resume_from_checkpoint"] = str(resume_from)
    args.update(cfg.extra_args)
    return args


def launch_command(config_path: Path) -> list[str]:
    return [sys.executable, "-m", "tasks.runners.llamafactory_launch", "train", str(config_path)]


def launch_env(hardware: HardwareSection) -> dict:
    """LlamaFactory's environment: the allow-list of tasks/platform/child_env.py (no Prefect, MLflow or S3 login:
    it reads and writes local folders only; this process tracks and stores), plus what the launch sets."""
    env = program_env("llamafactory")
    env.setdefault("TOKENIZERS_PARALLELISM", "false")
    env["PYTHONPATH"] = os.pathsep.join(
        filter(None, [str(Path(__file__).resolve().parent.parent), env.get("PYTHONPATH")])
    )
    if hardware.gpus > 1:
        # LlamaFactory's own torchrun launch (one process per GPU).
        env.update(FORCE_TORCHRUN="1", NPROC_PER_NODE=str(hardware.gpus))
    return env


class CheckpointUploader:
    """Stores finished checkpoints from a thread of its own, so that training goes on while the store
    is slow or briefly unreachable (a restart of the S3 server, a network blip): an upload that meets
    a transient fault is retried with backoff for up to `run.storage_outage_s`. Only the newest
    checkpoint matters for a resume, so one still waiting when a newer one is finished is dropped."""

    def __init__(self, ctx: RunContext, checkpoint_key: str):
        self.ctx, self.checkpoint_key = ctx, checkpoint_key
        self.log = logger()  # the task's logger, taken here: the upload thread has no Prefect run context
        self._changed = threading.Condition()
        self._next: Path | None = None
        self._closing = False
        self.stored_step = 0
        self._thread = threading.Thread(target=self._work, name="checkpoint-uploader", daemon=True)
        self._thread.start()

    def submit(self, folder: Path) -> None:
        with self._changed:
            self._next = folder
            self._changed.notify_all()

    def close(self) -> None:
        """Stores what was submitted last (one attempt once training is over: the final artifact,
        not a checkpoint, is what the stage now waits for) and stops the thread."""
        with self._changed:
            self._closing = True
            self._changed.notify_all()
        self._thread.join()

    def _work(self) -> None:
        while True:
            with self._changed:
                self._changed.wait_for(lambda: self._next is not None or self._closing)
                folder, self._next = self._next, None
            if folder is None:
                return
            self._store(folder)

    def _superseded(self) -> bool:
        with self._changed:
            return self._next is not None or self._closing

    def _newer_waiting(self) -> bool:
        with self._changed:
            return self._next is not None

    def _pause(self, seconds: float) -> None:
        """A backoff sleep that ends early when a newer checkpoint arrives or training ends."""
        with self._changed:
            self._changed.wait_for(lambda: self._next is not None or self._closing, timeout=seconds)

    def _store(self, folder: Path) -> None:
        step = int(folder.name.split("-")[1])

        def store() -> Artifact:
            artifact = self.ctx.store.put_dir(folder)
            self.ctx.store.put_record(
                "checkpoints/train", self.checkpoint_key, {"step": step, "artifact": artifact.as_dict()}
            )
            return artifact

        try:
            artifact = outlast_outage(
                f"train: checkpoint {step}",
                store,
                self.ctx.profile.run.storage_outage_s,
                self.log.warning,
                keep_trying=lambda: not self._superseded(),
                sleep=self._pause,
            )
        except Exception as exc:  # a checkpoint is a convenience: the stage fails on the final artifact only
            if not folder.is_dir() or isinstance(exc, FileNotFoundError | shutil.Error):
                # The trainer's rotation (save_total_limit) deleted it mid-upload (shutil.Error: the local
                # store's copytree lost a file); only older ones are rotated away, so a newer one follows.
                self.log.info(f"train: checkpoint {step} was rotated away before it was stored; a newer one follows")
                return
            if self._newer_waiting():
                next_step = "a newer one follows"
            elif self._superseded():
                next_step = "training is over, the adapter is stored next"
            elif is_transient(exc):
                next_step = "the store stayed unreachable for run.storage_outage_s; training goes on"
            else:
                next_step = "training goes on"
            self.log.warning(f"train: checkpoint {step} not stored ({type(exc).__name__}: {exc}); {next_step}")
        else:
            self.stored_step = step
            self.log.info(f"train: checkpoint {step} stored -> {artifact.uri}")


class TrainingFollower:
    """Reads trainer_log.jsonl and checkpoint folders as they appear."""

    def __init__(self, ctx: RunContext, output_dir: Path, uploader: CheckpointUploader):
        self.ctx, self.output_dir, self.uploader = ctx, output_dir, uploader
        self.offset = 0
        self.submitted: set[str] = set()
        self.pending: dict[str, tuple] = {}
        self.last_step = 0

    def poll(self, finished: bool = False) -> None:
        self._read_log()
        self._submit_checkpoints(finished)

    def _read_log(self) -> None:
        """Only the bytes appended since the last poll; a line is used once it is complete."""
        path = self.output_dir / "trainer_log.jsonl"
        if not path.is_file():
            return
        with open(path, "rb") as fh:
            fh.seek(self.offset)
            chunk = fh.read()
        complete = chunk[: chunk.rfind(b"\n") + 1]
        self.offset += len(complete)
        for line in complete.decode().splitlines():
            entry = json.loads(line)
            step, total = entry.get("current_steps", 0), entry.get("total_steps", 0)
            metrics = {k: entry[k] for k in ("loss", "lr", "epoch", "throughput") if k in entry}
            if "lr" in metrics:
                metrics["learning_rate"] = metrics.pop("lr")
            self.ctx.tracker.log_metrics("train", metrics, step=step)
            self.last_step = step
            if "loss" in entry:
                logger().info(
                    f"train: step {step}/{total} ({entry.get('percentage', 0):.0f}%) loss {entry['loss']:.4f} "
                    f"lr {metrics.get('learning_rate', 0):.2e} elapsed {entry.get('elapsed_time', '?')} "
                    f"eta {entry.get('remaining_time', '?')}"
                )

    def _submit_checkpoints(self, finished: bool) -> None:
        for folder in sorted(self.output_dir.glob("checkpoint-*"), key=lambda p: int(p.name.split("-")[1])):
            if folder.name in self.submitted or not (folder / "trainer_state.json").is_file():
                continue
            # A checkpoint counts as written once its file list and sizes hold still across two polls.
            snapshot = tuple(sorted((p.name, p.stat().st_size) for p in folder.rglob("*") if p.is_file()))
            if not finished and self.pending.get(folder.name) != snapshot:
                self.pending[folder.name] = snapshot
                continue
            self.submitted.add(folder.name)
            self.uploader.submit(folder)


def restore_checkpoint(ctx: RunContext, key: str, output_dir: Path) -> Path | None:
    record = ctx.store.get_record("checkpoints/train", key)
    if record is None or not ctx.store.exists(record["artifact"]["digest"]):
        return None
    target = output_dir / f"checkpoint-{record['step']}"
    if not target.is_dir():
        shutil.copytree(ctx.store.fetch(record["artifact"]["digest"]), target)
    logger().info(f"train: resuming from stored checkpoint at step {record['step']} ({record['artifact']['uri']})")
    return target


@contextmanager
def system_metrics(ctx: RunContext):
    """MLflow system metrics on the release run while the trainer runs: CPU and memory, and per-GPU
    utilisation and memory (`system/gpu_0_memory_usage_megabytes`, ...) where nvidia-ml-py is installed."""
    from mlflow.system_metrics.system_metrics_monitor import SystemMetricsMonitor

    monitor = SystemMetricsMonitor(ctx.tracker.run_id, sampling_interval=5, tracking_uri=ctx.tracker.tracking_uri)
    monitor.start()
    try:
        yield
    finally:
        monitor.finish()


def run_llamafactory(ctx: RunContext, config: dict, work: Path, follower: TrainingFollower) -> None:
    config_path = work / "llamafactory_train.yaml"
    config_path.write_text(yaml.safe_dump(config, sort_keys=False))
    log_path = work / "llamafactory.log"
    command = launch_command(config_path)
    logger().info(f"train: {' '.join(command)}  (log: {log_path})")
    with open(log_path, "ab") as log_file:
        process = subprocess.Popen(
            command,
            stdout=log_file,
            stderr=subprocess.STDOUT,
            cwd=work,
            env=launch_env(ctx.profile.hardware),
            start_new_session=True,
        )
        try:
            while process.poll() is None:
                time.sleep(POLL_SECONDS)
                follower.poll()
        finally:
            if process.poll() is None:  # the task was cancelled or interrupted: do not leave a trainer behind
                process.terminate()
                process.wait(30)
    follower.poll(finished=True)
    if process.returncode != 0:
        tail = [line for line in log_path.read_text(errors="replace").splitlines() if line.strip()][-1:] or [
            "(no output)"
        ]
        raise CheckFailed(f"train: LlamaFactory exited with {process.returncode}: {tail[0][:300]} (log: {log_path})")


def train(ctx: RunContext, data: StageResult, base: StageResult) -> StageResult:
    cfg = ctx.profile.train
    key_inputs = {
        "data": data.artifact.digest,
        "base": base.artifact.digest,
        "train": cfg.model_dump(),
        "gpus": ctx.profile.hardware.gpus,
        "llamafactory": llamafactory_version(),
    }

    def produce(out_dir: Path) -> dict:
        from tasks.platform.config import sha256_json

        checkpoint_key = sha256_json(key_inputs)
        work = out_dir.parent
        output_dir = work / "llamafactory_output"
        output_dir.mkdir(exist_ok=True)
        resume_from = restore_checkpoint(ctx, checkpoint_key, output_dir)
        config = llamafactory_config(
            cfg, ctx.store.fetch(base.artifact.digest), ctx.store.fetch(data.artifact.digest), output_dir, resume_from
        )
        uploader = CheckpointUploader(ctx, checkpoint_key)
        follower = TrainingFollower(ctx, output_dir, uploader)
        started = time.monotonic()
        try:
            with system_metrics(ctx):
                run_llamafactory(ctx, config, work, follower)
        finally:
            uploader.close()
        seconds = time.monotonic() - started
        for name in ADAPTER_FILES:
            if (output_dir / name).is_file():
                shutil.copy2(output_dir / name, out_dir / name)
        shutil.copy2(work / "llamafactory_train.yaml", out_dir / "llamafactory_train.yaml")
        # The contract of the tokenizer LlamaFactory trained with (its template, saved next to the adapter).
        trained_with = (
            output_dir if (output_dir / "tokenizer_config.json").is_file() else ctx.store.fetch(base.artifact.digest)
        )
        write_contract(read_contract(trained_with, ctx.store.fetch(base.artifact.digest)), out_dir)
        if (out_dir / "training_loss.png").is_file():
            ctx.tracker.log_file(out_dir / "training_loss.png", "train")
        results = json.loads((output_dir / "train_results.json").read_text())
        return TrainMetrics(
            final_loss=results.get("train_loss", float("nan")),
            steps=follower.last_step,
            samples_per_second=results.get("train_samples_per_second", 0.0),
            tokens_per_second=results.get("num_input_tokens_seen", 0)
            / max(results.get("train_runtime", seconds), 1e-9),
            runtime_s=results.get("train_runtime", seconds),
            wall_s=seconds,
            resumed_from_step=int(resume_from.name.split("-")[1]) if resume_from else 0,
        ).as_mlflow()

    return run_cached(ctx, "train", key_inputs, produce, headline=lambda m: TrainMetrics.from_mlflow(m).headline())


def llamafactory_version() -> str:
    from importlib.metadata import version

    return version("llamafactory")
