"""The prepared dataset's layout: LlamaFactory's sharegpt/messages files for the train and eval splits."""

from __future__ import annotations

import json
from pathlib import Path

from tasks.data.records import CleanData
from tasks.platform.config import EvaluateSection
from tasks.platform.errors import CheckFailed
from tasks.platform.stage_cache import RunContext, StageResult
from tasks.quality.chat import Conversation


def dataset_info() -> dict:
    """LlamaFactory's dataset registry for the two splits, in its sharegpt/messages layout."""
    columns = {"messages": "messages"}
    tags = {
        "role_tag": "role",
        "content_tag": "content",
        "user_tag": "user",
        "assistant_tag": "assistant",
        "system_tag": "system",
    }
    return {
        split: {"file_name": f"{split}.json", "formatting": "sharegpt", "columns": columns, "tags": tags}
        for split in ("train", "eval")
    }


def write_dataset(data: CleanData, out_dir: Path) -> None:
    for split, rows in (("train", data.train), ("eval", data.eval)):
        (out_dir / f"{split}.json").write_text(json.dumps([{"messages": m} for m in rows], ensure_ascii=False))
    (out_dir / "dataset_info.json").write_text(json.dumps(dataset_info(), indent=2))
    (out_dir / "stats.json").write_text(
        json.dumps({**data.stats, "fingerprint": data.fingerprint, "eval_fingerprint": data.eval_fingerprint}, indent=2)
    )


def load_split(folder: Path, split: str) -> list[Conversation]:
    """A split's conversations, each ending with its reference answer: an SFT record's own; a preference pair's
    chosen answer (tasks/data/preferences.py, llamafactory_rows); a KTO answer only where it was rated desirable."""
    conversations = []
    for row in json.loads((folder / f"{split}.json").read_text()):
        if "chosen" in row:
            conversations.append([*row["messages"], row["chosen"]])
        elif row.get("kto_tag", True):
            conversations.append(row["messages"])
    return conversations


def load_rejected(folder: Path, split: str) -> list[Conversation] | None:
    """A split of preference pairs as load_split reads it, with each rejected answer in place of the chosen one; None
    for a split of other records."""
    rows = json.loads((folder / f"{split}.json").read_text())
    if not rows or "rejected" not in rows[0]:
        return None
    return [[*row["messages"], row["rejected"]] for row in rows]


def eval_conversations(ctx: RunContext, data: StageResult, limit: int | None = None) -> list[Conversation]:
    """The held-out split of a prepared dataset artifact (verified on read)."""
    return load_split(ctx.store.fetch(data.artifact.digest), "eval")[:limit]


ADD_SAMPLES = "add data, raise data.eval_fraction, or name a held-out set with --eval-data (data.eval_source)"


def eval_rejected(ctx: RunContext, data: StageResult, limit: int | None = None) -> list[Conversation] | None:
    """The held-out pairs with their rejected answers, in eval_conversations' order; None where the data has no pairs."""
    rejected = load_rejected(ctx.store.fetch(data.artifact.digest), "eval")
    return None if rejected is None else rejected[:limit]


def require_samples(
    count: int, cfg: EvaluateSection, where: str, split: str = "the eval split", advice: str = ADD_SAMPLES
) -> None:
    """A decision on a handful of samples is noise: refuse it, saying what to do."""
    if count < cfg.min_samples:
        raise CheckFailed(
            f"{where}: {split} has {count} samples, fewer than evaluate.min_samples {cfg.min_samples}: too few "
            f"to decide on; {advice}"
        )
