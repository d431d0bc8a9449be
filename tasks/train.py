"""train: LlamaFactory SFT, DPO or KTO (LoRA or QLoRA) run the way LlamaFactory is run, `llamafactory-cli train cfg.yaml`.

The parent process follows LlamaFactory's `trainer_log.jsonl` while training runs: each
logging step goes to MLflow (`train/loss`, `train/learning_rate`) and to the terminal/Prefect
log, and each finished checkpoint is uploaded to the artifact store from a background thread, so a
retried task or a rerun on a fresh machine resumes from the last stored checkpoint instead of step 0,
and a store that is briefly unreachable does not stop training.
"""

from __future__ import annotations

import json
import shutil
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import yaml

from tasks.platform.config import HardwareSection, TrainSection
from tasks.platform.errors import CheckFailed
from tasks.platform.stage_cache import RunContext, StageMetrics, StageResult, logger, run_cached
from tasks.quality.contract import read_contract, write_contract
from tasks.training.checkpoints import CheckpointUploader, Layout, checkpoint_key, finish, restore_checkpoint
from tasks.training.deepspeed import config_path, read_zero_config
from tasks.training.launch import LocalNodes, launch_command
from tasks.training.memory_plan import check_training_fits

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
    nodes: int
    world_size: int  # training processes across the nodes
    global_batch_size: int  # samples per optimizer update: per device x accumulation x world size

    def headline(self) -> str:
        return f"loss {self.final_loss:.3f}, {self.steps} steps"


def llamafactory_config(
    cfg: TrainSection,
    model_dir: Path,
    data_dir: Path,
    output_dir: Path,
    resume_from: Path | None,
    hardware: HardwareSection | None = None,
    shared_disk: bool = True,
) -> dict:
    """The YAML LlamaFactory reads, under its own key names. The preference settings go to dpo and kto only (an SFT
    run's YAML is as before); mask_history to sft only (LlamaFactory refuses it elsewhere: hparams/parser.py,
    "`train_on_prompt` or `mask_history` cannot be set as True except SFT")."""
    args = {key: value for key, value in settings(cfg).items() if key != "extra_args" and value is not None}
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
    if cfg.deepspeed is not None:
        args["deepspeed"] = str(config_path(cfg))
    if hardware is not None and hardware.world_size > 1:
        args.update(distributed_args(hardware, shared_disk))
    if resume_from is not None:
        args["resume_from_checkpoint"] = str(resume_from)
    args.update(cfg.extra_args)
    return args


PREFERENCE_SETTINGS = {"pref_beta", "pref_loss", "pref_ftx"}


def settings(cfg: TrainSection) -> dict:
    """The train section as this stage uses it: the preference settings with dpo and kto only, mask_history with sft
    only (so an SFT run's cache key and YAML are what they were before train.stage had other values)."""
    return cfg.model_dump(exclude=PREFERENCE_SETTINGS if cfg.stage == "sft" else {"mask_history"})


def global_batch_size(cfg: TrainSection, hardware: HardwareSection) -> int:
    return cfg.per_device_train_batch_size * cfg.gradient_accumulation_steps * hardware.world_size


def distributed_args(hardware: HardwareSection, shared_disk: bool = True) -> dict:
    """What several processes need said: gloo between CPU processes (NCCL is CUDA's), and where every node
    shares one disk (nodes started on this machine), that the dataset is prepared once, by global rank 0, rather
    than once per node into the same cache (LlamaFactory's data/loader.py:302, `main_process_first`)."""
    args: dict = {"ddp_backend": "gloo"} if hardware.accelerator == "cpu" else {}
    if hardware.nodes > 1 and shared_disk:
        args["data_shared_file_system"] = True
    return args


class TrainingFollower:
    """Reads trainer_log.jsonl and checkpoint folders as they appear."""

    def __init__(self, ctx: RunContext, output_dir: Path, uploader: CheckpointUploader | None):
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
            # accuracy: the dpo trainer's share of a step's pairs whose chosen answer out-rewards the rejected one
            # (LlamaFactory's train/callbacks.py, LogCallback.on_log: `rewards/accuracies`)
            metrics = {k: entry[k] for k in ("loss", "lr", "epoch", "throughput", "accuracy") if k in entry}
            if "lr" in metrics:
                metrics["learning_rate"] = metrics.pop("lr")
            self.ctx.tracker.log_metrics("train", metrics, step=step)
            self.last_step = step
            if "loss" in entry:
                accuracy = f" pair accuracy {entry['accuracy']:.2f}" if "accuracy" in entry else ""
                logger().info(
                    f"train: step {step}/{total} ({entry.get('percentage', 0):.0f}%) loss {entry['loss']:.4f}{accuracy} "
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
            if self.uploader is not None:
                self.uploader.submit(folder)


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


def run_llamafactory(
    ctx: RunContext, config: dict, work: Path, follower: TrainingFollower | None, one_of_many: bool = False
) -> None:
    """LlamaFactory's training on every node started here (tasks/training/launch.py; one if this machine is one
    node of several), followed until all finish or one fails; then the others are stopped."""
    config_path = work / "llamafactory_train.yaml"
    config_path.write_text(yaml.safe_dump(config, sort_keys=False))
    hardware = ctx.profile.hardware
    nodes = LocalNodes(config_path, hardware, work, one_of_many)
    try:
        for node in nodes.start():
            where = f"node {node.rank} of {hardware.nodes}, pid {node.process.pid}, " if hardware.nodes > 1 else ""
            logger().info(f"train: {' '.join(launch_command(config_path))}  ({where}log: {node.log_path})")
        while nodes.running():
            time.sleep(POLL_SECONDS)
            if follower is not None:
                follower.poll()
        failure = nodes.failure()
    finally:
        nodes.stop()  # a failed node, or a cancelled task: no trainer is left behind
    if follower is not None:
        follower.poll(finished=True)
    if failure is not None:
        stopped = "; the other nodes were stopped" if hardware.nodes > 1 and not one_of_many else ""
        raise CheckFailed(f"train: LlamaFactory {failure}{stopped}")


def stage_inputs(ctx: RunContext, data: StageResult, base: StageResult) -> dict:
    """What the train stage's result depends on: its cache key's inputs."""
    cfg, hardware = ctx.profile.train, ctx.profile.hardware
    zero = read_zero_config(cfg)
    return {
        "data": data.artifact.digest,
        "base": base.artifact.digest,
        "train": settings(cfg),
        "deepspeed": zero.digest if zero else None,
        "gpus": hardware.gpus,
        "nodes": hardware.nodes,
        "llamafactory": llamafactory_version(),
    }


def prepare(ctx: RunContext, key_inputs: dict, data: StageResult, base: StageResult, work: Path, one_of_many: bool):
    """The LlamaFactory config of this training, with the newest stored checkpoint in place to resume from."""
    cfg, hardware = ctx.profile.train, ctx.profile.hardware
    zero = read_zero_config(cfg)
    checkpoints = checkpoint_key(key_inputs, global_batch_size(cfg, hardware))
    layout = Layout.of(hardware, zero.stage if zero else None)
    output_dir = work / "llamafactory_output"
    output_dir.mkdir(parents=True, exist_ok=True)
    resume_from = restore_checkpoint(ctx, checkpoints, output_dir, layout)
    model_dir, data_dir = ctx.store.fetch(base.artifact.digest), ctx.store.fetch(data.artifact.digest)
    config = llamafactory_config(cfg, model_dir, data_dir, output_dir, resume_from, hardware, not one_of_many)
    return config, checkpoints, layout, output_dir, resume_from


def train_other_node(ctx: RunContext, data: StageResult, base: StageResult) -> None:
    """A node other than node 0 of a training across machines (flows/train_node.py): it trains and stores nothing;
    node 0 holds global rank 0, which writes the trainer log, the checkpoints and the adapter."""
    work = ctx.home / "work" / "train-node"
    config, *_ = prepare(ctx, stage_inputs(ctx, data, base), data, base, work, one_of_many=True)
    run_llamafactory(ctx, config, work, None, one_of_many=True)


def train(ctx: RunContext, data: StageResult, base: StageResult, one_node_of_many: bool = False) -> StageResult:
    """one_node_of_many: this process is node 0 of a training whose other nodes run elsewhere (flows/train_node.py)."""
    cfg, hardware = ctx.profile.train, ctx.profile.hardware
    key_inputs = stage_inputs(ctx, data, base)

    def produce(out_dir: Path) -> dict:
        check_training_fits(ctx.profile)  # also where the flow was started without the command's checks
        work = out_dir.parent
        config, checkpoints, layout, output_dir, resume_from = prepare(
            ctx, key_inputs, data, base, work, one_node_of_many
        )
        # Across pods, ZeRO's optimizer partitions stay on each node's disk: node 0's checkpoint alone cannot resume.
        partial = one_node_of_many and layout.zero_stage is not None
        if partial:
            logger().warning("train: DeepSpeed ZeRO across pods: checkpoints are not stored (a rerun starts over)")
        uploader = None if partial else CheckpointUploader(ctx, checkpoints, layout)
        follower = TrainingFollower(ctx, output_dir, uploader)
        started = time.monotonic()
        try:
            with system_metrics(ctx):
                run_llamafactory(ctx, config, work, follower, one_node_of_many)
        finally:
            if uploader is not None:
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
        finish(ctx, checkpoints, follower.last_step)
        return TrainMetrics(
            final_loss=results.get("train_loss", float("nan")),
            steps=follower.last_step,
            samples_per_second=results.get("train_samples_per_second", 0.0),
            tokens_per_second=results.get("num_input_tokens_seen", 0)
            / max(results.get("train_runtime", seconds), 1e-9),
            runtime_s=results.get("train_runtime", seconds),
            wall_s=seconds,
            resumed_from_step=int(resume_from.name.split("-")[1]) if resume_from else 0,
            nodes=hardware.nodes,
            world_size=hardware.world_size,
            global_batch_size=global_batch_size(cfg, hardware),
        ).as_mlflow()

    return run_cached(ctx, "train", key_inputs, produce, headline=lambda m: TrainMetrics.from_mlflow(m).headline())


def llamafactory_version() -> str:
    from importlib.metadata import version

    return version("llamafactory")
