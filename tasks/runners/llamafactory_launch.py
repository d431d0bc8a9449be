"""Start LlamaFactory's own CLI (`llamafactory-cli train cfg.yaml`) in this interpreter.

Why a launcher instead of the `llamafactory-cli` script: LlamaFactory imports torchaudio at
module import (data/mm_plugin.py) although text-only SFT never calls it, and PyPI only has
CUDA builds of torchaudio, which cannot load beside the CPU torch of this environment. When
no importable torchaudio exists, the train image's placeholder module
(infra/images/torchaudio-placeholder/, which fails on first use) goes first on the import path, so
audio datasets still fail loudly. It goes on PYTHONPATH too: with FORCE_TORCHRUN, LlamaFactory starts
torchrun, whose workers are new interpreters that import LlamaFactory again
(llamafactory/launcher.py:115-132 at 0.9.5). GPU images install the real torchaudio or the same
placeholder in site-packages, and this changes nothing there. Multi-GPU and multi-node runs go through
LlamaFactory's torchrun launch unchanged.
"""

import os
import sys
from pathlib import Path

from tasks.platform.unused_imports import BOTO3, SCIKIT_LEARN, leave_out

PLACEHOLDER = Path(__file__).resolve().parents[2] / "infra" / "images" / "torchaudio-placeholder"
TORCH_ADAMW = ("adamw_torch", "adamw_torch_fused")  # transformers' default optimizers (training_args.py)


def _use_placeholder_torchaudio() -> None:
    for name in [m for m in sys.modules if m == "torchaudio" or m.startswith("torchaudio.")]:
        del sys.modules[name]  # what a build that cannot load beside this torch left half-imported
    sys.path.insert(0, str(PLACEHOLDER))
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(PLACEHOLDER), os.environ.get("PYTHONPATH")]))


def unused_libraries(args: list[str]) -> list[str]:
    """Libraries that transformers, peft and accelerate import whenever they are installed, which the training of
    `args` (LlamaFactory's argv) never calls (tasks/platform/unused_imports.py): about 4 of the ~17 s from this
    launcher's start to the first step of cpu-tiny.

    - scikit-learn and boto3 always: LlamaFactory imports neither, and the training reports to nothing
      (`report_to: none`), so nothing in its process writes to S3 (the train stage stores what it wrote).
    - bitsandbytes, unless the training quantizes (quantization_bit), names an optimizer other than torch's AdamW
      (bitsandbytes has 8-bit and paged ones: transformers' trainer_optimizer.py:561-575), or its base model is
      stored quantized (a quantization_config in its config.json, or a base this launcher cannot read): peft imports
      it to offer its 8- and 4-bit LoRA layers whenever it is installed (tuners/lora/model.py:311-319 at 0.18),
      about 2 s.
    """
    unused = [SCIKIT_LEARN, BOTO3]
    config_file = Path(args[1]) if len(args) == 2 and args[0] == "train" else None
    if config_file is None or config_file.suffix not in (".yaml", ".yml", ".json"):
        return unused
    import yaml  # JSON is YAML

    config = yaml.safe_load(config_file.read_text()) or {}
    model_config = Path(str(config.get("model_name_or_path", ""))) / "config.json"
    may_use_bitsandbytes = (
        config.get("quantization_bit") is not None
        or config.get("optim", "adamw_torch") not in TORCH_ADAMW
        or not model_config.is_file()
        or "quantization_config" in yaml.safe_load(model_config.read_text())
    )
    if not may_use_bitsandbytes:
        unused.append("bitsandbytes")
    return unused


def main() -> None:
    leave_out(unused_libraries(sys.argv[1:]))
    try:
        import torchaudio  # noqa: F401
    except Exception:  # missing, or a build that cannot load beside this torch
        _use_placeholder_torchaudio()
    from llamafactory.cli import main as llamafactory_main

    sys.argv = ["llamafactory-cli", *sys.argv[1:]]
    llamafactory_main()


if __name__ == "__main__":
    main()
