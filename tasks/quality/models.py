"""Loading a causal LM and its tokenizer from a Hugging Face folder, the same way in every stage."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from tasks.platform.config import Profile
from tasks.platform.quiet import quiet_transformers
from tasks.quality.chat import Conversation, answer_ids, prompt_ids


@dataclass(frozen=True)
class Compute:
    """Where and in what dtype a stage runs a model (the profile's hardware section)."""

    device: str = "cpu"
    dtype: str = "float32"

    @classmethod
    def of(cls, profile: Profile) -> Compute:
        hardware = profile.hardware
        return cls("cuda" if hardware.accelerator == "cuda" else "cpu", hardware.compute_dtype)


CPU_FP32 = Compute()


def load_model(base_dir: Path, adapter_dir: Path | None = None, compute: Compute = CPU_FP32):
    import torch
    from transformers import AutoModelForCausalLM

    quiet_transformers()
    if compute.device == "cuda":
        # Spread over the machine's GPUs where one does not hold it (a 72B model in bf16 is 145 GB; accelerate's
        # "auto" fills the GPUs in order, so a model that fits one stays on one).
        model = AutoModelForCausalLM.from_pretrained(base_dir, dtype=getattr(torch, compute.dtype), device_map="auto")
    else:
        model = AutoModelForCausalLM.from_pretrained(base_dir, dtype=getattr(torch, compute.dtype)).to(compute.device)
    if adapter_dir is not None:
        from peft import PeftModel

        # the adapter's weights follow the base's device and dtype
        return PeftModel.from_pretrained(model, adapter_dir, torch_device=compute.device).eval()
    return model.eval()


def load_tokenizer(model_dir: Path):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    tokenizer.padding_side = "left"
    return tokenizer


def probe_batch(tokenizer, conversations: list[Conversation]):
    """Right-padded prompt+answer sequences and their attention mask."""
    import torch

    rows = [prompt_ids(tokenizer, c) + answer_ids(tokenizer, c) for c in conversations]
    width = max(len(r) for r in rows)
    input_ids = torch.full((len(rows), width), tokenizer.pad_token_id)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    for i, row in enumerate(rows):
        input_ids[i, : len(row)] = torch.tensor(row)
        mask[i, : len(row)] = 1
    return input_ids, mask
