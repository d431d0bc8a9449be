"""Preference data (issue 78): LlamaFactory's pair and KTO layouts read, refused with one line naming the line and
field, split by prompt, and written so that LlamaFactory's own DPO and KTO data pipeline reads every example."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tasks.data.preferences import normalize_preference, read_preferences
from tasks.data.records import SourceFile, normalize, record_hash
from tasks.platform.config import DataSection
from tasks.platform.errors import BadInput
from tests.unit.test_gateway import SERVICE

ROOT = Path(__file__).resolve().parents[2]
CFG = DataSection(source="pairs.jsonl")


def jsonl(name: str, rows: list) -> SourceFile:
    return SourceFile(name, "".join(json.dumps(r) + "\n" for r in rows).encode())


def pair(i: int, chosen: str = "cold", rejected: str = "hot") -> dict:
    return {"instruction": f"What is the opposite of word {i}?", "chosen": chosen, "rejected": rejected}


def test_the_three_layouts_read_as_the_same_pair():
    alpaca = {"instruction": "Opposite of hot?", "chosen": "cold", "rejected": "warm", "system": "Be brief."}
    sharegpt = {
        "conversations": [{"from": "system", "value": "Be brief."}, {"from": "human", "value": "Opposite of hot?"}],
        "chosen": {"from": "gpt", "value": "cold"},
        "rejected": {"from": "gpt", "value": "warm"},
    }
    openai = {
        "messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Opposite of hot?"}],
        "chosen": "cold",
        "rejected": {"role": "assistant", "content": "warm"},
    }
    read = [normalize_preference(r, "auto", "here") for r in (alpaca, sharegpt, openai)]
    assert read[0] == read[1] == read[2]
    assert read[0].prompt[-1] == {"role": "user", "content": "Opposite of hot?"} and read[0].kind == "pairs"


@pytest.mark.parametrize(
    ("record", "error"),
    [
        ({"instruction": "q", "chosen": "a", "rejected": ""}, "line 1: field 'rejected' is empty"),
        (
            {"instruction": "q", "chosen": " a", "rejected": "a "},
            "line 1: fields 'chosen' and 'rejected' hold the same",
        ),
        ({"instruction": "q", "chosen": "a"}, "line 1: field 'rejected' is missing"),
        (
            {"instruction": "q", "chosen": "a", "rejected": 3},
            "line 1: field 'rejected' must be a string or an assistant",
        ),
        (
            {
                "messages": [{"role": "user", "content": "q"}],
                "chosen": {"role": "user", "content": "a"},
                "rejected": "b",
            },
            "line 1: field 'chosen' is a user turn; it must be the assistant's",
        ),
        (
            {
                "messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}],
                "chosen": "a",
                "rejected": "b",
            },
            "line 1: field 'messages' must alternate user/assistant turns and end with the user",
        ),
        (
            {"instruction": "q", "output": "a", "kto_tag": "yes"},
            "line 1: field 'kto_tag' must be true or false, got str",
        ),
        ({"instruction": "q", "kto_tag": True}, "line 1: field 'output' is missing"),
    ],
)
def test_a_bad_record_is_refused_naming_its_line_and_field(record, error):
    with pytest.raises(BadInput) as refused:
        read_preferences([jsonl("pairs.jsonl", [record, pair(1)])], CFG)
    assert str(refused.value).startswith(f"data file pairs.jsonl {error}")


def test_a_second_kind_in_one_dataset_is_refused_naming_the_first():
    kto = {"instruction": "q", "output": "a", "kto_tag": False}
    with pytest.raises(
        BadInput, match=r"line 2: a KTO \(kto_tag\) record among preference pair .*line 1 was the first"
    ):
        read_preferences([jsonl("pairs.jsonl", [pair(1), kto])], CFG)


def test_sft_refuses_a_preference_record_naming_its_field():
    with pytest.raises(BadInput, match="here: field 'chosen' makes it a preference record; train.stage sft"):
        normalize(pair(1), "auto", "here")


def test_a_prompts_pairs_stay_in_one_split_and_duplicates_are_dropped():
    rows = [pair(i, chosen=answer) for i in range(60) for answer in ("cold", "chilly", "icy")]
    data = read_preferences([jsonl("pairs.jsonl", [*rows, rows[0]])], CFG)
    assert (data.read, data.duplicates, data.prompts) == (181, 1, 60)
    train_prompts = {record_hash(r.prompt) for r in data.train}
    eval_prompts = {record_hash(r.prompt) for r in data.eval}
    assert not train_prompts & eval_prompts and len(eval_prompts) == data.eval_prompts > 0
    assert len(data.train) == 3 * len(train_prompts) and len(data.eval) == 3 * len(eval_prompts)
    shuffled = read_preferences([jsonl("pairs.jsonl", rows[::-1])], CFG)
    assert shuffled.fingerprint == data.fingerprint and len(shuffled.eval) == len(data.eval)


def read_by_llamafactory(tmp_path, *datasets: list[dict]) -> list[list[dict]]:
    """What LlamaFactory's own DPO or KTO data pipeline makes of each dataset as we write it
    (tests/llamafactory_pairs.py, one process for all)."""
    files = []
    for index, rows in enumerate(datasets):
        files.append(tmp_path / f"data-{index}.jsonl")
        files[-1].write_text("".join(json.dumps(r) + "\n" for r in rows))
    env = {**os.environ, "PYTHONPATH": str(ROOT), "HF_HOME": str(tmp_path / "hf")}
    script = ROOT / "tests" / "llamafactory_pairs.py"
    done = subprocess.run(
        [sys.executable, str(script), str(tmp_path), *map(str, files)],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert "Skipping this abnormal example" not in done.stderr + done.stdout
    printed = [
        json.loads(line.removeprefix("EXAMPLE ")) for line in done.stdout.splitlines() if line.startswith("EXAMPLE ")
    ]
    return [[e for e in printed if e["file"] == index] for index in range(len(datasets))]


def test_llamafactory_reads_every_pair_and_every_rated_answer_we_write(tmp_path):
    pairs = [json.loads(line) for line in (ROOT / "profiles" / "data" / "antonym-pairs.jsonl").read_text().splitlines()]
    rated = [{"instruction": f"Opposite of word {i}?", "output": "cold", "kto_tag": i % 2 == 0} for i in range(40)]
    read_pairs, read_rated = read_by_llamafactory(tmp_path, pairs, rated)
    expected = read_preferences([jsonl("pairs.jsonl", pairs)], CFG)
    assert len(read_pairs) == len(expected.train)
    for example, record in zip(read_pairs, expected.train, strict=True):
        assert record.chosen in example["chosen"] and record.rejected in example["rejected"], example
    tags = {record.desirable for record in read_preferences([jsonl("kto.jsonl", rated)], CFG).train}
    assert read_rated and {e["kto_tag"] for e in read_rated} == tags == {True, False}
    assert all("cold" in e["answer"] for e in read_rated)


def test_one_answer_rated_both_ways_is_two_records_not_a_duplicate():
    rated = [{"instruction": f"q{i}", "output": "a", "kto_tag": tag} for i in range(30) for tag in (True, False, True)]
    data = read_preferences([jsonl("kto.jsonl", rated)], CFG)
    assert data.duplicates == 30 and len(data.train) + len(data.eval) == 60


def prepared(tmp_path: Path, rows: list) -> Path:
    from tasks.data.preferences import write_preference_dataset

    write_preference_dataset(read_preferences([jsonl("pairs.jsonl", rows)], CFG), tmp_path)
    return tmp_path


def test_the_stages_read_a_pairs_chosen_answer_as_its_reference_and_the_scorer_its_rejected_one(tmp_path):
    from tasks.data.splits import load_rejected, load_split

    folder = prepared(tmp_path, [pair(i, chosen=f"c{i}", rejected=f"r{i}") for i in range(60)])
    chosen, rejected = load_split(folder, "eval"), load_rejected(folder, "eval")
    assert chosen and rejected and len(chosen) == len(rejected)
    for good, bad in zip(chosen, rejected, strict=True):
        assert good[:-1] == bad[:-1] and good[-1]["role"] == bad[-1]["role"] == "assistant"
        assert good[-1]["content"].replace("c", "r") == bad[-1]["content"]


def test_a_kto_split_gives_the_stages_its_desirable_answers_only(tmp_path):
    from tasks.data.preferences import write_preference_dataset
    from tasks.data.splits import load_rejected, load_split

    rated = [{"instruction": f"q{i}", "output": "good" if i % 2 else "bad", "kto_tag": bool(i % 2)} for i in range(60)]
    write_preference_dataset(read_preferences([jsonl("kto.jsonl", rated)], CFG), tmp_path)
    train = load_split(tmp_path, "train")
    assert train and {c[-1]["content"] for c in train} == {"good"} and load_rejected(tmp_path, "train") is None


@pytest.mark.parametrize(
    ("stage", "rows", "said"),
    [
        ("dpo", [{"instruction": f"q{i}", "output": "a", "kto_tag": True} for i in range(30)], "these are KTO"),
        ("kto", [pair(i) for i in range(30)], "learns from KTO (kto_tag) records; these are preference pair"),
    ],
)
def test_a_preference_stage_refuses_the_other_methods_data_in_one_line(stage, rows, said):
    from tasks.prepare_data import preference_data

    with pytest.raises(BadInput, match=f"train.stage {stage} learns from .*") as refused:
        preference_data([jsonl("pairs.jsonl", rows)], CFG, stage)
    assert said in str(refused.value) and "\n" not in str(refused.value)


@pytest.mark.parametrize(
    ("overrides", "said"),
    [
        (["train.stage=dpo"], "data.eval_source with train.stage dpo"),
        (["evaluate.metric=preference_accuracy"], "evaluate.metric preference_accuracy with train.stage sft"),
        (
            ["train.stage=dpo", "data.eval_source=null", "evaluate.metric=preference_accuracy", "evaluate.engine=vllm"],
            "metric preference_accuracy with engine vllm",
        ),
        (
            ["train.stage=kto", "data.eval_source=null", "evaluate.metric=reward_margin"],
            "reward_margin with train.stage kto",
        ),
        (
            ["train.stage=dpo", "data.eval_source=null", "evaluate.metric=reward_margin", "evaluate.engine=vllm"],
            "metric reward_margin with engine vllm",
        ),
    ],
)
def test_a_profile_that_would_judge_a_preference_run_on_what_it_cannot_score_is_refused(overrides, said):
    from tasks.platform.config import load_profile

    with pytest.raises(BadInput, match=said):
        load_profile("cpu-tiny", overrides)


# --- pairs harvested from the service (`llmops data harvest --pairs`) --------------------------------------------


def served_traffic(folder: Path) -> float:
    """A capture folder as the gateway writes it: corrections, one client's answers rated both ways, and what the
    flywheel's rules drop."""
    import time

    from tasks.data.exchanges import LocalExchangeLog
    from tests.unit.test_capture import exchange, feedback

    log, now = LocalExchangeLog(folder), time.time()
    exchange(log, now - 60, "c1", "What is the opposite of polite?", "polite", client="team-a")
    feedback(log, now - 50, "c1", "bad", "rude", client="team-a")  # a correction: rude over polite
    exchange(log, now - 59, "g1", "What is the opposite of ancient?", "modern", client="team-b")
    feedback(log, now - 50, "g1", "good", client="team-b")
    exchange(log, now - 58, "b1", "what is the opposite of ANCIENT", "ancient", client="team-b")
    feedback(log, now - 50, "b1", "bad", client="team-b")  # the same prompt rated bad: modern over ancient
    exchange(log, now - 57, "x1", "What is the opposite of wise?", "foolish", client="team-a")
    feedback(log, now - 50, "x1", "good", client="team-b")  # feedback from another client: no pair
    exchange(log, now - 56, "h1", "Antonym of hot:", "hot", client="team-a")
    feedback(log, now - 50, "h1", "bad", "cold", client="team-a")  # a prompt of the curated exam: never a pair
    exchange(log, now - 55, "u1", "What is the opposite of huge?", "tiny", client="team-a")  # unrated
    return now


def test_corrections_and_answers_rated_both_ways_become_pairs_a_dpo_run_reads(tmp_path):
    from datetime import UTC, datetime

    from tasks.data.exchanges import LocalExchangeLog
    from tasks.data.harvest_pairs import harvest_pairs, pairs_text
    from tests.unit.test_capture import conversation

    now = served_traffic(tmp_path / "capture")
    exam = [conversation("Antonym of hot:", "cold")]
    found = harvest_pairs(
        LocalExchangeLog(tmp_path / "capture"), SERVICE, datetime.fromtimestamp(now - 3600, UTC), exam
    )
    assert [(p.chosen, p.rejected, p.client) for p in found.pairs] == [
        ("rude", "polite", "team-a"),
        ("modern", "ancient", "team-b"),
    ]
    counts = found.counts
    assert (counts["corrected"], counts["rated"], counts["pairs"], counts["exchanges"]) == (1, 1, 2, 6)
    assert counts["eval_overlap_dropped"] == counts["feedback_from_another_client"] == 1
    assert counts["unrated_dropped"] == 2  # u1, and x1 whose only feedback came from another client
    curated = [pair(i, chosen=f"c{i}", rejected=f"r{i}") for i in range(40)]
    text = "".join(json.dumps(r) + "\n" for r in curated) + pairs_text(found) * 3  # harvested pairs, some held out
    data = read_preferences([SourceFile("pairs.jsonl", text.encode())], CFG)
    trained = [r for r in data.train if r.harvested]
    # a harvested pair is trained on, or left out where its prompt hashes into the eval split; never an exam
    assert {r.chosen for r in trained} <= {"rude", "modern"} and not any(r.harvested for r in data.eval)
    assert len(trained) + data.harvested_held_out == 2 and data.duplicates == 4
    # counted as the flywheel's records: a DPO release trained on them waits for a person (gate.approval harvested,
    # flows/release.py), as an SFT release on harvested records does; before, a pair counted none and went out alone
    from tasks.prepare_data import DatasetMetrics

    metrics = DatasetMetrics.of_preferences(data, "pairs.jsonl")
    assert (metrics.harvested_records or 0) == len(trained) and (
        metrics.harvested_held_out or 0
    ) == data.harvested_held_out
    assert len(trained) >= 1, "the split must train on one harvested pair for this test to say anything"


def test_the_harvest_command_writes_pairs_that_forget_removes(tmp_path):
    from tests.unit.test_cli import llmops

    served_traffic(tmp_path / "capture")
    out = tmp_path / "pairs"
    done = llmops(
        *("data", "harvest", "--pairs", "--service", SERVICE, "--capture", str(tmp_path / "capture")),
        *("--since", "1h", "--out", str(out)),
    )
    assert done.returncode == 0, done.stderr
    # against cpu-tiny's curated exam, which "Antonym of hot:" is not in: that correction is a pair here
    assert "pairs kept             3 (2 corrected, 1 rated)" in done.stdout, done.stdout
    (written,) = out.glob(f"harvest-pairs-{SERVICE}-*.jsonl")
    rows = [json.loads(line) for line in written.read_text().splitlines()]
    assert [(r["chosen"], r["rejected"], r["harvested"]["client"]) for r in rows] == [
        ("cold", "hot", "team-a"),  # corrections first, the newest first
        ("rude", "polite", "team-a"),
        ("modern", "ancient", "team-b"),
    ]
    gone = llmops(
        *("data", "forget", "--client", "team-b", "--service", SERVICE),
        *("--capture", str(tmp_path / "capture"), "--dataset", str(written)),
        env_home=str(tmp_path / "home"),
    )
    assert gone.returncode == 0, gone.stderr
    assert [json.loads(line)["harvested"]["client"] for line in written.read_text().splitlines()] == ["team-a"] * 2


def test_a_dpo_profile_harvests_pairs_held_out_from_its_own_pairs_exam_and_refuses_single_answers(tmp_path):
    """`llmops data harvest --pairs --profile cpu-tiny-dpo` read the profile's pairs as SFT data and exited 2; its
    exam is the held-out pairs' prompts, which no harvested pair takes. Without --pairs, or for a KTO profile, the
    harvest is refused in one line naming what the profile learns from."""
    from flows.harvest import held_out_conversations
    from tasks.data.harvest import prompt_key
    from tasks.platform.config import load_profile
    from tests.unit.test_cli import llmops

    served_traffic(tmp_path / "capture")
    harvest = (
        "data",
        "harvest",
        "--profile",
        "cpu-tiny-dpo",
        "--service",
        SERVICE,
        "--capture",
        str(tmp_path / "capture"),
    )
    done = llmops(*harvest, "--pairs", "--since", "1h", "--out", str(tmp_path / "pairs"))
    assert done.returncode == 0, done.stderr
    (written,) = (tmp_path / "pairs").glob("harvest-pairs-*.jsonl")
    prompts = {
        prompt_key([*json.loads(line)["messages"], {"role": "assistant", "content": ""}])
        for line in written.read_text().splitlines()
    }
    exam = {prompt_key(c) for c in held_out_conversations(load_profile("cpu-tiny-dpo"))}
    assert len(exam) == 41 and prompts and not prompts & exam
    import shutil

    from tests.unit.test_cli import ROOT as PROJECT

    shutil.copy(PROJECT / "profiles" / "data" / "antonym-pairs.jsonl", tmp_path / "pairs")
    validated = llmops("data", "validate", "--profile", "cpu-tiny-dpo", str(tmp_path / "pairs"))
    assert validated.returncode == 0, validated.stderr
    assert "  harvested              1 trained on, 0 left out" in validated.stdout, validated.stdout
    refused = llmops(*harvest, "--since", "1h", "--out", str(tmp_path / "sft"))
    assert refused.returncode == 2 and "train.stage dpo learns from preference data" in refused.stderr
    assert "--pairs" in refused.stderr and len(refused.stderr.strip().splitlines()) == 1, refused.stderr


# --- SFT then DPO: the base a registered version names (base_model.source models:/...) ----------------------------


def test_a_registered_base_is_the_merged_model_its_alias_or_number_names_and_a_missing_one_is_one_line(tmp_path):
    """base_model.source models:/NAME@ALIAS and models:/NAME/N, against a real MLflow registry (sqlite): the store
    digest of the version's merged model; an alias no version holds, or a URI of neither form, is refused naming it."""
    from types import SimpleNamespace

    from mlflow import MlflowClient

    from tasks.base_model import registered_merge

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    client = MlflowClient(uri)
    client.create_registered_model("svc")
    for digest in ("a" * 64, "b" * 64):
        client.create_model_version("svc", str(tmp_path), tags={"artifact.merge.sha256": digest})
    client.set_registered_model_alias("svc", "champion", "1")
    ctx = SimpleNamespace(tracker=SimpleNamespace(client=client, tracking_uri=uri))
    assert registered_merge(ctx, "models:/svc@champion") == "a" * 64
    assert registered_merge(ctx, "models:/svc/2") == "b" * 64
    with pytest.raises(BadInput, match=r"^base_model.source models:/svc@canary: no such registered version in sqlite"):
        registered_merge(ctx, "models:/svc@canary")
    with pytest.raises(BadInput, match="a registered model is models:/NAME@ALIAS or models:/NAME/N"):
        registered_merge(ctx, "models:/svc")


def test_a_copied_base_counts_its_parameters_from_the_safetensors_headers(tmp_path):
    """A registered or copied base (a DPO run's SFT model) said `? params` in the run table: its count is now read
    from its safetensors headers, the same as the model's own (tied embeddings saved once), and a folder of .bin
    weights says it was not counted."""
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from tasks.base_model import BaseModelMetrics, copy_model

    torch.manual_seed(0)
    config = Qwen2Config(
        vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=1, tie_word_embeddings=True,
    )  # fmt: skip
    model = Qwen2ForCausalLM(config)
    model.save_pretrained(tmp_path / "base")
    copied = copy_model(str(tmp_path / "base"), tmp_path / "copy")
    assert copied.parameters == sum(p.numel() for p in model.parameters())
    assert copied.headline() == f"{copied.parameters} params"
    assert BaseModelMetrics().headline() == "parameters not counted (weights not in safetensors)"
