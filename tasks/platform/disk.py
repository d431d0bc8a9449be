"""Room on disk for a stage: checked before it runs, and a full disk met while it runs turned into one line.

What a stage writes is estimated from the largest artifact it reads (the base model, or the merged one) and the
stage's known multiple of it; a stage with no model input (prepare_data, base_model) is not checked ahead. Checked
where the stage writes: its work folder, and a local store's folder (an S3 store's bytes are the bucket's).
"""

from __future__ import annotations

import errno
import shutil
from pathlib import Path

from tasks.platform.errors import DiskFull

# Bytes a stage writes per byte of its largest input artifact. Estimates that err high, from what each writes:
# LoRA: the adapter and two checkpoints with their optimizer state (a few % of the base); full fine-tuning: two
# checkpoints of weights plus Adam's two fp32 moments; merge: the merged weights; quantize: an fp32 ONNX export
# and its int8 copy (CPU) or a quantized checkpoint (ModelOpt); evaluate and build_engine: reports.
STAGE_MULTIPLE = {
    "train": 0.1,
    "train/full": 6.0,
    "evaluate": 0.01,
    "merge": 1.1,
    "quantize": 2.5,
    "build_engine": 0.01,
}


def human(size: float) -> str:
    for unit in ("bytes", "KiB", "MiB", "GiB"):
        if size < 1024 or unit == "GiB":
            return f"{size:.0f} {unit}" if unit == "bytes" else f"{size:.2f} {unit}"
        size /= 1024
    raise AssertionError("unreachable")


def needed_bytes(stage: str, input_bytes: int, full_fine_tuning: bool = False) -> int:
    key = "train/full" if stage == "train" and full_fine_tuning else stage
    return int(STAGE_MULTIPLE.get(key, 0.0) * input_bytes)


def require_room(stage: str, folders: list[Path], needed: int) -> None:
    """Refuse to start a stage where a folder it writes has less room than it needs."""
    for folder in folders:
        free = free_bytes(folder)
        if free < needed:
            raise DiskFull(
                f"{stage}: disk full at {folder} ({human(free)} free, {human(needed)} needed); "
                "free space there (llmops store gc) or point LLMOPS_HOME / --artifacts elsewhere"
            )


def free_bytes(folder: Path) -> int:
    """Free bytes on the filesystem of `folder` (of its nearest existing parent)."""
    path = folder
    while not path.exists() and path != path.parent:
        path = path.parent
    return shutil.disk_usage(path).free


def is_disk_full(exc: BaseException) -> bool:
    """ENOSPC anywhere in the exception's chain, or its words in a message a subprocess or library passed on."""
    seen: BaseException | None = exc
    while seen is not None:
        if isinstance(seen, OSError) and seen.errno in (errno.ENOSPC, errno.EDQUOT):
            return True
        if "No space left on device" in str(seen):
            return True
        seen = seen.__cause__ or seen.__context__
    return False


def disk_full(stage: str, exc: BaseException, folders: list[Path], needed: int) -> DiskFull:
    """The one-line error for a full disk met while `stage` ran, naming where: the file the error names, else the
    fullest of the folders the stage writes to."""
    named = getattr(exc, "filename", None)
    where = Path(named) if named else min(folders, key=free_bytes)
    return DiskFull(
        f"{stage}: disk full at {where} ({human(free_bytes(where))} free, {human(needed)} needed); "
        "nothing of the stage was kept; free space there (llmops store gc) or point LLMOPS_HOME / --artifacts elsewhere"
    )
