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

PLACEHOLDER = Path(__file__).resolve().parents[2] / "infra" / "images" / "torchaudio-placeholder"


def _use_placeholder_torchaudio() -> None:
    for name in [m for m in sys.modules if m == "torchaudio" or m.startswith("torchaudio.")]:
        del sys.modules[name]  # what a build that cannot load beside this torch left half-imported
    sys.path.insert(0, str(PLACEHOLDER))
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(PLACEHOLDER), os.environ.get("PYTHONPATH")]))


def main() -> None:
    try:
        import torchaudio  # noqa: F401
    except Exception:  # missing, or a build that cannot load beside this torch
        _use_placeholder_torchaudio()
    from llamafactory.cli import main as llamafactory_main

    sys.argv = ["llamafactory-cli", *sys.argv[1:]]
    llamafactory_main()


if __name__ == "__main__":
    main()
