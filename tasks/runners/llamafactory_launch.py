"""Start LlamaFactory's own CLI (`llamafactory-cli train cfg.yaml`) in this interpreter.

Why a launcher instead of the `llamafactory-cli` script: LlamaFactory imports torchaudio at
module import (data/mm_plugin.py) although text-only SFT never calls it, and PyPI only has
CUDA builds of torchaudio, which cannot load beside the CPU torch of this environment. When
no importable torchaudio exists, a placeholder module that fails on first use is registered,
so audio datasets still fail loudly. GPU environments install the real torchaudio and this
changes nothing there. Multi-GPU runs go through LlamaFactory's torchrun launch unchanged.
"""

import importlib.machinery
import sys
import types


def _placeholder_torchaudio() -> types.ModuleType:
    module = types.ModuleType("torchaudio")
    module.__spec__ = importlib.machinery.ModuleSpec("torchaudio", loader=None)

    def __getattr__(name):
        if name.startswith("__"):  # introspection (inspect, hasattr) must see a plain module
            raise AttributeError(name)
        raise ImportError(
            f"torchaudio.{name}: torchaudio is not installed in this CPU environment (audio datasets are unsupported here)"
        )

    setattr(module, "__getattr__", __getattr__)  # noqa: B010  (a module-level __getattr__, PEP 562)
    return module


def main() -> None:
    try:
        import torchaudio  # noqa: F401
    except Exception:  # missing, or a build that cannot load beside this torch
        sys.modules["torchaudio"] = _placeholder_torchaudio()
    from llamafactory.cli import main as llamafactory_main

    sys.argv = ["llamafactory-cli", *sys.argv[1:]]
    llamafactory_main()


if __name__ == "__main__":
    main()
