"""The train stage's checkpoints across layouts: one key for every spread of the same training, resumed on
another world size without DeepSpeed, refused (with why and what to do) where ZeRO partitioned the optimizer
states; a finished training is never resumed. The shipped DeepSpeed configs read as what they say."""

import json

import pytest

from tasks.platform.config import HardwareSection, load_profile
from tasks.platform.errors import BadInput
from tasks.platform.stage_cache import RunContext
from tasks.platform.store import LocalStore
from tasks.train import global_batch_size
from tasks.training.checkpoints import NAMESPACE, Layout, checkpoint_key, finish, restore_checkpoint
from tasks.training.deepspeed import read_zero_config


def stage_inputs(*overrides: str) -> tuple[dict, int]:
    profile = load_profile("cpu-tiny", list(overrides))
    inputs = {
        "data": "d" * 64,
        "base": "b" * 64,
        "train": profile.train.model_dump(),
        "deepspeed": None,
        "gpus": profile.hardware.gpus,
        "nodes": profile.hardware.nodes,
        "llamafactory": "0.9.5",
    }
    return inputs, global_batch_size(profile.train, profile.hardware)


def test_the_same_global_batch_spread_differently_shares_the_checkpoints():
    one = checkpoint_key(*stage_inputs())  # 1 process x 8
    assert checkpoint_key(*stage_inputs("hardware.nodes=2", "train.per_device_train_batch_size=4")) == one
    assert (
        checkpoint_key(*stage_inputs("train.per_device_train_batch_size=2", "train.gradient_accumulation_steps=4"))
        == one
    )
    # Another global batch, or anything else of the training, is another training.
    assert checkpoint_key(*stage_inputs("hardware.nodes=2")) != one
    assert checkpoint_key(*stage_inputs("train.seed=1")) != one


@pytest.fixture
def ctx(tmp_path):
    return RunContext(load_profile("cpu-tiny"), LocalStore(tmp_path / "store"), None, tmp_path)  # type: ignore[arg-type]


def stored_checkpoint(ctx, tmp_path, step: int, layout: Layout) -> str:
    folder = tmp_path / f"checkpoint-{step}"
    folder.mkdir()
    (folder / "trainer_state.json").write_text(json.dumps({"global_step": step}))
    artifact = ctx.store.put_dir(folder)
    record = {"step": step, "artifact": artifact.as_dict(), "world_size": layout.world_size}
    ctx.store.put_record(NAMESPACE, "key", record | {"zero_stage": layout.zero_stage})
    return "key"


def test_a_checkpoint_of_two_processes_resumes_on_one(ctx, tmp_path, caplog):
    key = stored_checkpoint(ctx, tmp_path, 100, Layout(2, None))
    out = tmp_path / "out"
    out.mkdir()
    assert restore_checkpoint(ctx, key, out, Layout.of(HardwareSection(), None)) == out / "checkpoint-100"
    assert (out / "checkpoint-100" / "trainer_state.json").is_file()


def test_zero_partitions_resume_only_on_the_world_size_that_saved_them(ctx, tmp_path):
    key = stored_checkpoint(ctx, tmp_path, 200, Layout(16, 3))
    out = tmp_path / "out"
    out.mkdir()
    eight = Layout.of(HardwareSection(accelerator="cuda", gpus=8), 3)
    with pytest.raises(BadInput) as refused:
        restore_checkpoint(ctx, key, out, eight)
    message = str(refused.value)
    assert "\n" not in message and not (out / "checkpoint-200").exists()
    assert (
        "step 200 holds DeepSpeed ZeRO-3 optimizer states partitioned over 16 processes and this run has 8" in message
    )
    assert "rerun with 16 processes" in message and "ds_to_universal.py" in message
    sixteen = Layout.of(HardwareSection(accelerator="cuda", gpus=8, nodes=2), 3)
    assert restore_checkpoint(ctx, key, out, sixteen) == out / "checkpoint-200"
    with pytest.raises(
        BadInput, match="saved with 16 processes, DeepSpeed ZeRO-3, this run trains with 16 processes, no"
    ):
        restore_checkpoint(ctx, key, out, Layout(16, None))


def test_a_finished_training_is_not_resumed(ctx, tmp_path):
    key = stored_checkpoint(ctx, tmp_path, 150, Layout(1, None))
    finish(ctx, key, 170)
    out = tmp_path / "out"
    out.mkdir()
    assert restore_checkpoint(ctx, key, out, Layout(2, None)) is None


def test_the_shipped_deepspeed_configs_are_zero_2_and_3():
    profile = load_profile("cpu-tiny")
    assert read_zero_config(profile.train) is None
    for name, stage in (("zero2", 2), ("zero3", 3)):
        profile.train.deepspeed = f"infra/deepspeed/{name}.json"  # a profile file's setting (no --set may set it)
        zero = read_zero_config(profile.train)
        assert (
            zero is not None and zero.stage == stage and zero.path.is_file() and zero.partitions_weights == (stage == 3)
        )
    assert zero.max_live_parameters == 1e9


def test_a_missing_deepspeed_config_names_the_setting(tmp_path):
    profile = load_profile("cpu-tiny")
    profile.train.deepspeed = str(tmp_path / "nowhere.json")
    with pytest.raises(BadInput, match=r"train.deepspeed .*nowhere.json: not a readable DeepSpeed config"):
        read_zero_config(profile.train)


def test_deepspeed_is_for_cuda_profiles(tmp_path):
    own = tmp_path / "own.yaml"
    own.write_text(
        "name: own\ndata: {source: x.jsonl}\nregistry: {model_name: m}\ntrain: {deepspeed: infra/deepspeed/zero3.json}\n"
    )
    with pytest.raises(BadInput, match="train.deepspeed needs hardware.accelerator cuda"):
        load_profile(str(own))
