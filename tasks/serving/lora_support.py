"""What vLLM refuses (or silently drops) of a LoRA adapter, found before the adapter is loaded for its canary.

Read in vLLM 0.32.0 (the pinned CPU build, .venv-vllm; vllm/lora/peft_helper.py `PEFTHelper._validate_features`,
l.53-80, and vllm/lora/lora_model.py `LoRAModel.from_lora_tensors`, l.130-194):

- `modules_to_save` other than a classifier head ("classifier", "score") is refused at load ("vLLM only supports
  modules_to_save being either None or ..."): LlamaFactory's `additional_target` (embed_tokens, lm_head) and
  `resize_vocab` train whole modules this way (hiyouga/LlamaFactory#7997; vllm-project/vllm#9280);
- DoRA (`use_dora`), LoRA bias (`lora_bias`) and PiSSA/OLoRA-style `init_lora_weights` are refused at load;
- full embedding or output weights inside the adapter (PEFT saves them when the vocabulary was resized) are skipped
  without a word (`is_base_embedding_weights`, vllm/lora/utils.py l.223-229), so tokens added in training would be
  served with the base's untrained rows: refused here, as is an adapter whose tokenizer outgrew the base's.

Each refusal is one line naming the adapter's setting and what vLLM would do, raised before any model loads.
"""

from __future__ import annotations

import json
from pathlib import Path

from tasks.platform.errors import CheckFailed

CLASSIFIER_HEADS = {"classifier", "score"}  # the only modules_to_save vLLM takes
VOCAB_MODULES = ("embed_tokens", "lm_head", "wte")  # a whole one in an adapter: its vocabulary was resized
SUPPORTED_INITS = ("gaussian", "eva", "orthogonal", "mica", "lora_ga")  # peft_helper.py l.89-100, and any bool


def vocabulary_size(folder: Path) -> int | None:
    """The tokenizer's vocabulary in `folder` (its model's tokens and the added ones); None without tokenizer.json."""
    try:
        tokenizer = json.loads((folder / "tokenizer.json").read_text())
    except (OSError, ValueError):
        return None
    ids = set(tokenizer.get("model", {}).get("vocab", {}).values()) | {
        t["id"] for t in tokenizer.get("added_tokens", [])
    }
    return len(ids)


def whole_vocab_tensors(adapter_dir: Path) -> list[str]:
    """The adapter's tensors that are whole embedding or output matrices (not LoRA factors of them)."""
    from safetensors import safe_open

    found = []
    for path in sorted(adapter_dir.glob("*.safetensors")):
        with safe_open(str(path), "np") as weights:  # the header alone: no tensor is read
            found += [n for n in weights.keys() if any(m in n for m in VOCAB_MODULES) and "lora_" not in n]  # noqa: SIM118 (a handle, not a dict)
    return found


def refuse_what_vllm_refuses(name: str, adapter_dir: Path, base_dir: Path) -> None:
    """CheckFailed naming the first feature of `name`'s adapter that vLLM would refuse or drop at load."""
    config_path = adapter_dir / "adapter_config.json"
    try:
        config = json.loads(config_path.read_text())
    except (OSError, ValueError) as exc:
        raise CheckFailed(f"serve.lora adapter: {config_path}: not a PEFT LoRA adapter config ({exc})") from None
    where = f"serve.lora adapter: {name}'s adapter ({config_path})"
    whole = sorted(set(config.get("modules_to_save") or []) - CLASSIFIER_HEADS)
    if whole:
        raise CheckFailed(
            f"{where} trains whole modules (modules_to_save {whole}: LlamaFactory's additional_target or resize_vocab), "
            "which vLLM refuses to load; train without them, or serve the version merged (serve.lora: merged)"
        )
    for key, refused in (("use_dora", "DoRA"), ("lora_bias", "LoRA bias")):
        if config.get(key):
            raise CheckFailed(f"{where}: {key} ({refused}) is not served by vLLM; serve the version merged")
    init = config.get("init_lora_weights", True)
    if isinstance(init, str) and init.lower() not in SUPPORTED_INITS:
        raise CheckFailed(
            f"{where}: init_lora_weights {init!r} changes the base's weights when PEFT loads it, which vLLM does not; "
            "serve the version merged"
        )
    tensors = whole_vocab_tensors(adapter_dir)
    trained, base = vocabulary_size(adapter_dir), vocabulary_size(base_dir)
    if tensors or (trained is not None and base is not None and trained > base):
        sizes = f"its tokenizer has {trained} tokens, the base's {base}" if trained and base else "whole vocab weights"
        raise CheckFailed(
            f"{where} carries a resized vocabulary ({sizes}; {', '.join(tensors) or 'no embedding weights'}): vLLM "
            "serves an adapter on the base's embeddings and drops these, so the added tokens would be untrained; "
            "serve the version merged (serve.lora: merged)"
        )
