"""`train.deepspeed`: the DeepSpeed config LlamaFactory hands to the Hugging Face Trainer.

The project ships two, `infra/deepspeed/zero2.json` and `zero3.json` (docs/gpu.md#deepspeed): ZeRO-2
partitions the optimizer states and gradients across the processes, ZeRO-3 the weights as well. Their
batch, clipping and precision keys are "auto": the Trainer fills them from LlamaFactory's arguments
(transformers/integrations/deepspeed.py:200-240 at 5.6, which also sets ZeRO-3's prefetch bucket to
0.9 x hidden_size² and its persistence threshold to 10 x hidden_size). A relative path is relative to the
project's root, so that a profile names the shipped files the same way on every machine and in every image.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path

from tasks.platform.config import TrainSection
from tasks.platform.errors import BadInput
from tasks.platform.project import PROJECT_ROOT


@dataclass(frozen=True)
class ZeroConfig:
    """What the memory plan and the checkpoints need of a DeepSpeed config."""

    path: Path
    stage: int  # ZeRO stage: 0 (data parallel), 1 (optimizer states), 2 (+ gradients), 3 (+ weights)
    max_live_parameters: float  # ZeRO-3: parameters gathered at once at most (stage3_max_live_parameters)
    # Communication buckets in elements; None: "auto" (the Trainer sets hidden_size²)
    reduce_bucket_size: float | None
    allgather_bucket_size: float | None  # ZeRO-2 only
    digest: str  # sha256 of the file: a changed config is a different training

    @property
    def partitions_weights(self) -> bool:
        return self.stage >= 3


def config_path(cfg: TrainSection) -> Path | None:
    if cfg.deepspeed is None:
        return None
    path = Path(cfg.deepspeed)
    return path if path.is_absolute() else PROJECT_ROOT / path


def read_zero_config(cfg: TrainSection) -> ZeroConfig | None:
    """The profile's DeepSpeed config, read; a missing or malformed file names train.deepspeed."""
    path = config_path(cfg)
    if path is None:
        return None
    try:
        text = path.read_bytes()
        config = json.loads(text)
        zero = config.get("zero_optimization") or {}
        stage = int(zero.get("stage", 0))
        live = float(zero.get("stage3_max_live_parameters", 1e9))
        buckets = [_elements(zero.get(name)) for name in ("reduce_bucket_size", "allgather_bucket_size")]
    except (OSError, ValueError, TypeError, AttributeError) as exc:
        raise BadInput(f"train.deepspeed {cfg.deepspeed}: not a readable DeepSpeed config ({exc})") from None
    if stage not in (0, 1, 2, 3):
        raise BadInput(f"train.deepspeed {cfg.deepspeed}: zero_optimization.stage {stage} is not 0, 1, 2 or 3")
    return ZeroConfig(
        path, stage, live, buckets[0], buckets[1] if stage == 2 else None, hashlib.sha256(text).hexdigest()
    )


def _elements(value: object) -> float | None:
    """A bucket size: a number of elements, "auto" (None), or absent (DeepSpeed's default, 5e8)."""
    if value == "auto":
        return None
    return 5e8 if value is None else float(value)  # type: ignore[arg-type]
