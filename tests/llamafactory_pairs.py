"""Run by tests/unit/test_preferences.py: what LlamaFactory's own data pipeline (its sharegpt converter and the
pairwise or KTO processor, through get_dataset with the stage its DPO or KTO workflow passes: train/dpo/workflow.py
stage="rm", train/kto/workflow.py stage="kto") makes of the preference dataset tasks/data/preferences.py writes.
Prints one JSON line per training example of each file: the decoded chosen and rejected texts (pairs) or the answer
and its tag (KTO), with the file's index.

    .venv/bin/python tests/llamafactory_pairs.py WORK_DIR DATA.jsonl [DATA.jsonl ...]
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from tasks.runners.llamafactory_launch import _use_placeholder_torchaudio


def main(work: Path, files: list[Path]) -> None:
    try:
        import torchaudio  # noqa: F401
    except Exception:  # as the train stage's launcher does (tasks/runners/llamafactory_launch.py)
        _use_placeholder_torchaudio()
    from tasks.platform.config import load_profile

    profile = load_profile("cpu-tiny", [])
    for index, data in enumerate(files):
        for example in examples(work / str(index), data, profile):
            print("EXAMPLE " + json.dumps({"file": index, **example}))


def examples(work: Path, data: Path, profile):
    from llamafactory.data import get_dataset, get_template_and_fix_tokenizer
    from llamafactory.hparams import get_train_args

    from tasks.base_model import train_tokenizer
    from tasks.data.preferences import read_preferences, write_preference_dataset
    from tasks.data.records import read_source
    from tasks.train import llamafactory_config

    prepared = read_preferences(read_source(str(data)), profile.data)
    texts = [m["content"] for r in prepared.train for m in r.prompt] + [r.chosen for r in prepared.train]
    tokenizer = train_tokenizer(texts * 3 + [r.rejected or "" for r in prepared.train], 400)
    tokenizer.save_pretrained(work / "base")
    folder = work / "data"
    folder.mkdir(parents=True, exist_ok=True)
    write_preference_dataset(prepared, folder)
    stage = "kto" if prepared.kind == "kto" else "dpo"
    args = llamafactory_config(profile.train, work / "base", folder, work / "out", None) | {"stage": stage}
    # LlamaFactory refuses both outside SFT (hparams/parser.py: "`train_on_prompt` or `mask_history` cannot be set as
    # True except SFT."): a preference stage labels only the answers anyway. cpu-tiny sets mask_history.
    args.pop("mask_history", None)
    args.pop("train_on_prompt", None)
    model_args, data_args, training_args, _, _ = get_train_args(args)
    template = get_template_and_fix_tokenizer(tokenizer, data_args)
    loading = "kto" if stage == "kto" else "rm"
    module = get_dataset(template, model_args, data_args, training_args, stage=loading, tokenizer=tokenizer)
    for row in module["train_dataset"]:
        if stage == "kto":
            learned = [t for t in row["labels"] if t >= 0]
            yield {"answer": tokenizer.decode(learned), "kto_tag": row["kto_tags"]}
        else:
            yield {key: tokenizer.decode([t for t in row[f"{key}_labels"] if t >= 0]) for key in ("chosen", "rejected")}


if __name__ == "__main__":
    main(Path(sys.argv[1]), [Path(arg) for arg in sys.argv[2:]])
