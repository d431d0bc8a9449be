"""Placeholder torchaudio of the train image, copied in only when the base image has no importable one.

LlamaFactory imports torchaudio at module import (llamafactory/data/mm_plugin.py) although text SFT never
calls it, in every process, torchrun's workers included; NVIDIA's PyTorch image may ship no torchaudio,
and PyPI's would replace the image's CUDA torch (infra/images/README.md). It has no distribution metadata,
so pip and `importlib.metadata` still see no torchaudio; any use fails here, naming why.
"""


def __getattr__(name: str):
    if name.startswith("__"):  # introspection (inspect, hasattr) must see a plain module
        raise AttributeError(name)
    raise ImportError(
        f"torchaudio.{name}: this image has no torchaudio built for its torch (a placeholder, "
        "infra/images/train.Dockerfile); audio datasets are unsupported here"
    )
