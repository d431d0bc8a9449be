"""Run by tests/unit/test_train_config.py: which tokens of each training record LlamaFactory learns, read from
LlamaFactory's own data pipeline (its sharegpt converter and SupervisedDatasetProcessor, through get_dataset) fed
with what prepare_data writes and the arguments the train stage hands LlamaFactory. Prints one JSON line per
record: {"input": the text, "learned": the labelled tokens}.

    .venv/bin/python tests/llamafactory_labels.py WORK_DIR DATA.jsonl EVAL.jsonl [KEY=VALUE ...]   (cpu-tiny's overrides)
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from tasks.runners.llamafactory_launch import _use_placeholder_torchaudio


def main(work: Path, data: Path, held_out: Path, overrides: list[str]) -> None:
    try:
        import torchaudio  # noqa: F401
    except Exception:  # as the train stage's launcher does (tasks/runners/llamafactory_launch.py)
        _use_placeholder_torchaudio()
    from llamafactory.data import get_dataset, get_template_and_fix_tokenizer
    from llamafactory.hparams import get_train_args

    from tasks.base_model import train_tokenizer
    from tasks.data.records import clean_and_split, read_source
    from tasks.data.splits import write_dataset
    from tasks.platform.config import load_profile
    from tasks.train import llamafactory_config

    profile = load_profile("cpu-tiny", overrides)
    texts = [m["content"] for line in data.read_text().splitlines() for m in json.loads(line).get("messages", [])]
    tokenizer = train_tokenizer(texts * 3, 400)
    tokenizer.save_pretrained(work / "base")
    prepared = work / "data"
    prepared.mkdir(parents=True, exist_ok=True)
    write_dataset(clean_and_split(read_source(str(data)), profile.data, read_source(str(held_out))), prepared)
    args = llamafactory_config(profile.train, work / "base", prepared, work / "out", None)
    model_args, data_args, training_args, _, _ = get_train_args(args)
    template = get_template_and_fix_tokenizer(tokenizer, data_args)
    module = get_dataset(template, model_args, data_args, training_args, stage="sft", tokenizer=tokenizer)
    for row in module["train_dataset"]:
        learned = [t for t in row["labels"] if t >= 0]  # IGNORE_INDEX (-100) marks what is context only
        print(
            "LABELS " + json.dumps({"input": tokenizer.decode(row["input_ids"]), "learned": tokenizer.decode(learned)})
        )


if __name__ == "__main__":
    main(Path(sys.argv[1]), Path(sys.argv[2]), Path(sys.argv[3]), sys.argv[4:])
