"""What vLLM refuses or drops of a LoRA adapter is refused before the canary loads it (tasks/serving/lora_support.py,
issue 76): real PEFT adapters of a tiny Qwen2, saved as PEFT saves them, one per feature."""

from __future__ import annotations

from pathlib import Path

import pytest

from tasks.platform.errors import CheckFailed
from tasks.serving.lora_support import refuse_what_vllm_refuses


def saved_adapter(
    folder: Path, vocab: int = 64, resize_to: int | None = None, save_embedding_layers: bool = False, **lora
) -> Path:
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    config = Qwen2Config(
        vocab_size=vocab, hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
        num_key_value_heads=1, max_position_embeddings=64,
    )  # fmt: skip
    model = Qwen2ForCausalLM(config)
    if resize_to:
        model.resize_token_embeddings(resize_to)
    settings = {"r": 4, "lora_alpha": 8, "target_modules": ["q_proj", "v_proj"], **lora}
    get_peft_model(model, LoraConfig(**settings)).save_pretrained(folder, save_embedding_layers=save_embedding_layers)
    return folder


def test_a_plain_adapter_passes(tmp_path):
    refuse_what_vllm_refuses("svc-v2", saved_adapter(tmp_path / "plain"), tmp_path)


@pytest.mark.parametrize(
    "lora, said",
    [
        ({"modules_to_save": ["embed_tokens", "lm_head"]}, "trains whole modules (modules_to_save ['embed_tokens', 'lm_head']"),
        ({"use_dora": True}, "use_dora (DoRA) is not served by vLLM"),
        ({"init_lora_weights": "pissa"}, "init_lora_weights 'pissa' changes the base's weights"),
    ],
)  # fmt: skip
def test_an_adapter_with_what_vllm_refuses_at_load_is_refused_before_it_naming_it(tmp_path, lora, said):
    adapter = saved_adapter(tmp_path / "adapter", **lora)
    with pytest.raises(CheckFailed, match=r"^serve\.lora adapter: svc-v2's adapter \(") as refused:
        refuse_what_vllm_refuses("svc-v2", adapter, tmp_path)
    assert said in str(refused.value) and "\n" not in str(refused.value)


def test_an_adapter_of_a_resized_vocabulary_is_refused_where_vllm_would_drop_its_embeddings(tmp_path):
    """PEFT saves the whole resized embedding and output matrices beside the LoRA factors; vLLM skips them
    (is_base_embedding_weights), and the added tokens would be served untrained."""
    adapter = saved_adapter(tmp_path / "resized", resize_to=80, save_embedding_layers=True)
    with pytest.raises(CheckFailed, match="carries a resized vocabulary") as refused:
        refuse_what_vllm_refuses("svc-v2", adapter, tmp_path)
    assert "embed_tokens" in str(refused.value) and "serve.lora: merged" in str(refused.value)
