"""The train stage's checkpoints in the artifact store: uploaded while training runs, restored by a rerun.

Each finished checkpoint folder is uploaded from a background thread, so that training goes on while the
store is slow or briefly unreachable, and a record under `checkpoints/train/<key>` names the newest stored
one: a retried task, or a rerun on a fresh machine, resumes from it instead of step 0. A training that
finished marks its record so, and nothing resumes from it.

The key is the training's identity without how it was spread: the number of nodes and GPUs is left out,
and the per-device batch and accumulation steps count only through the global batch they make. So a rerun
on fewer or more processes resumes a checkpoint of the same global batch at the same point of the data: the
Trainer's `global_step` counts optimizer updates, and equal global batches make equal updates (with one
process per node on 2 nodes, accelerate hands process i batches i, i+2, ... of the same sampler order;
accelerate/data_loader.py:220-235). Without DeepSpeed, global rank 0 saves the whole optimizer state
(`optimizer.pt`), which any number of processes loads. DeepSpeed's ZeRO saves each process's partition of it
(`global_step*/*_optim_states.pt`) and loads them only into the same number of processes, so a rerun with
another world size is refused with what to do instead (convert with DeepSpeed's `ds_to_universal.py`, or run
with the checkpoint's world size).
"""

from __future__ import annotations

import shutil
import threading
from dataclasses import dataclass
from pathlib import Path

from tasks.platform.config import HardwareSection, sha256_json
from tasks.platform.errors import BadInput, is_transient
from tasks.platform.stage_cache import RunContext, logger
from tasks.platform.store import Artifact, outlast_outage

NAMESPACE = "checkpoints/train"
LAYOUT_INPUTS = ("gpus", "nodes")  # of the train stage's cache inputs: how the training is spread
PER_DEVICE = ("per_device_train_batch_size", "gradient_accumulation_steps")


@dataclass(frozen=True)
class Layout:
    """How a training is spread over processes: what a checkpoint must match to be resumed."""

    world_size: int
    zero_stage: int | None  # DeepSpeed's ZeRO stage; None without DeepSpeed

    @classmethod
    def of(cls, hardware: HardwareSection, zero_stage: int | None) -> Layout:
        return cls(hardware.world_size, zero_stage)

    def describe(self) -> str:
        zero = f"DeepSpeed ZeRO-{self.zero_stage}" if self.zero_stage is not None else "no DeepSpeed"
        return f"{self.world_size} process{'es' if self.world_size != 1 else ''}, {zero}"


def checkpoint_key(stage_inputs: dict, global_batch_size: int) -> str:
    """The checkpoints' key: the train stage's cache inputs without the layout, the batch as its global size."""
    train = {k: v for k, v in stage_inputs["train"].items() if k not in PER_DEVICE}
    inputs = {k: v for k, v in stage_inputs.items() if k not in LAYOUT_INPUTS}
    return sha256_json(inputs | {"train": train, "global_batch_size": global_batch_size})


class CheckpointUploader:
    """Stores finished checkpoints from a thread of its own, so that training goes on while the store
    is slow or briefly unreachable (a restart of the S3 server, a network blip): an upload that meets
    a transient fault is retried with backoff for up to `run.storage_outage_s`. Only the newest
    checkpoint matters for a resume, so one still waiting when a newer one is finished is dropped."""

    def __init__(self, ctx: RunContext, checkpoint_key: str, layout: Layout):
        self.ctx, self.checkpoint_key, self.layout = ctx, checkpoint_key, layout
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
            record = {"step": step, "artifact": artifact.as_dict(), "world_size": self.layout.world_size}
            self.ctx.store.put_record(NAMESPACE, self.checkpoint_key, record | {"zero_stage": self.layout.zero_stage})
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


def restore_checkpoint(ctx: RunContext, key: str, output_dir: Path, layout: Layout) -> Path | None:
    """The newest stored checkpoint of an unfinished training of this key, put in `output_dir`; None if none."""
    record = ctx.store.get_record(NAMESPACE, key)
    if record is None or record.get("finished") or not ctx.store.exists(record["artifact"]["digest"]):
        return None
    step = record["step"]
    saved = Layout(record.get("world_size", 1), record.get("zero_stage"))
    refuse_incompatible(saved, layout, step)
    target = output_dir / f"checkpoint-{step}"
    if not target.is_dir():
        shutil.copytree(ctx.store.fetch(record["artifact"]["digest"]), target)
    moved = f", saved by {saved.describe()} and resumed by {layout.world_size}" if saved != layout else ""
    logger().info(f"train: resuming from stored checkpoint at step {step} ({record['artifact']['uri']}{moved})")
    return target


def refuse_incompatible(saved: Layout, now: Layout, step: int) -> None:
    if saved.zero_stage != now.zero_stage:
        raise BadInput(
            f"train: the stored checkpoint at step {step} was saved with {saved.describe()}, this run trains with "
            f"{now.describe()}: the Trainer resumes optimizer states only in the form they were saved in; train "
            "with the checkpoint's train.deepspeed"
        )
    if saved.zero_stage is not None and saved.world_size != now.world_size:
        raise BadInput(
            f"train: the stored checkpoint at step {step} holds DeepSpeed ZeRO-{saved.zero_stage} optimizer states "
            f"partitioned over {saved.world_size} processes and this run has {now.world_size} (hardware.nodes x "
            f"hardware.gpus): DeepSpeed loads them only into as many processes as saved them; rerun with "
            f"{saved.world_size} processes, or convert the checkpoint with DeepSpeed's ds_to_universal.py and train "
            "from it with DeepSpeed's load_universal"
        )


def finish(ctx: RunContext, key: str, step: int) -> None:
    """The training of this key is done: no later run resumes from its checkpoints (a run that spreads the same
    training differently trains from the start instead of taking over this one's last checkpoint)."""
    ctx.store.put_record(NAMESPACE, key, {"finished": True, "step": step})
