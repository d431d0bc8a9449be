"""Loading a causal LM and its tokenizer from a Hugging Face folder, the same way in every stage."""

from __future__ import annotations

from pathlib import Path


def load_model(base_dir: Path, adapter_dir: Path | None = None):
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    if adapter_dir is not None:
        from peft import PeftModel

        return PeftModel.from_pretrained(model, adapter_dir).eval()
    return model.eval()


def load_tokenizer(model_dir: Path):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    tokenizer.padding_side = "left"
    return tokenizer
