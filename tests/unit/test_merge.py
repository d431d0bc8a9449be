"""merge on a real tiny Qwen2 and a real peft LoRA adapter: an exact merge passes, a wrong one is caught."""

import pytest
import torch

from tasks.base_model import build_tiny_qwen2
from tasks.config import TinyModel
from tasks.merge import logits, merge_adapter, probe_batch
from tasks.models import load_model, load_tokenizer

CONVERSATIONS = [
    [{"role": "user", "content": f"opposite of {a}?"}, {"role": "assistant", "content": b}]
    for a, b in [("hot", "cold"), ("up", "down"), ("big", "small"), ("fast", "slow")]
]


@pytest.fixture(scope="module")
def base_and_adapter(tmp_path_factory):
    from peft import LoraConfig, get_peft_model

    root = tmp_path_factory.mktemp("merge")
    texts = [" ".join(m["content"] for m in c) for c in CONVERSATIONS] * 8
    build_tiny_qwen2(texts, TinyModel(vocab_size=300, pretrain_steps=5), root / "base")
    torch.manual_seed(0)
    peft_model = get_peft_model(load_model(root / "base"), LoraConfig(r=4, lora_alpha=8, target_modules="all-linear"))
    for name, param in peft_model.named_parameters():
        if "lora_B" in name:  # B starts at zero; give the adapter a real effect
            torch.nn.init.normal_(param, std=0.05)
    peft_model.save_pretrained(root / "adapter")
    return root / "base", root / "adapter", root


def test_merged_model_matches_base_plus_adapter(base_and_adapter):
    base, adapter, root = base_and_adapter
    diff = merge_adapter(base, adapter, root / "merged", CONVERSATIONS)
    assert diff < 1e-4
    tokenizer = load_tokenizer(base)
    ids, mask = probe_batch(tokenizer, CONVERSATIONS)
    # the adapter really changes the model: a merge that dropped it would not pass
    assert (logits(load_model(base), ids, mask) - logits(load_model(root / "merged"), ids, mask)).abs().max() > 1e-3


def test_a_wrong_merge_is_detected(base_and_adapter):
    base, adapter, root = base_and_adapter
    tokenizer = load_tokenizer(base)
    ids, mask = probe_batch(tokenizer, CONVERSATIONS)
    expected = logits(load_model(base, adapter), ids, mask)
    wrong = load_model(base, adapter)
    for module in wrong.modules():  # the classic mistake: merging with the wrong scale (alpha/r)
        if hasattr(module, "scaling") and isinstance(module.scaling, dict):
            module.scaling = {k: v * 2 for k, v in module.scaling.items()}
    wrongly_merged = wrong.merge_and_unload()
    assert (logits(wrongly_merged, ids, mask) - expected).abs().max() > 1e-3
