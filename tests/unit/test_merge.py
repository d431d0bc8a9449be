"""merge on a real tiny Qwen2 and a real peft LoRA adapter: an exact merge passes, a wrong one is caught."""

import json

import pytest
import torch

from tasks.base_model import build_tiny_qwen2
from tasks.merge import logits, merge_adapter
from tasks.platform.config import TinyModel
from tasks.quality.models import load_model, load_tokenizer, probe_batch

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


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_a_half_precision_merge_stays_within_the_gpu_profiles_tolerance(base_and_adapter, dtype):
    """What the CUDA profiles do (hardware.compute_dtype), run here on the CPU: the merged weights are
    rounded to 16 bits, so base+adapter and merged differ by more than in float32, and by less than the
    tolerance the GPU profiles set; a wrong merge still stands out above it."""
    from tasks.platform.config import load_profile
    from tasks.quality.models import Compute

    base, adapter, root = base_and_adapter
    gpu_profiles = [load_profile(p) for p in ("qwen-7b-qlora-2xa10", "qwen2-14b-int4-tp2", "llama3-8b-h100-fp8")]
    assert {p.hardware.compute_dtype for p in gpu_profiles} == {"bfloat16"}
    (tolerance,) = {p.merge.tolerance for p in gpu_profiles}
    diff = merge_adapter(base, adapter, root / f"merged-{dtype}", CONVERSATIONS, Compute("cpu", dtype))
    tokenizer = load_tokenizer(base)
    ids, mask = probe_batch(tokenizer, CONVERSATIONS)
    scale = float(logits(load_model(base), ids, mask).abs().max())
    effect = float((logits(load_model(base), ids, mask) - logits(load_model(base, adapter), ids, mask)).abs().max())
    print(
        f"\n{dtype} merge: max |dlogits| {diff:.2e} = {diff / scale:.2%} of max |logit| {scale:.2f}; adapter effect {effect:.2f}"
    )
    assert diff / scale < 0.01  # the GPU tolerance assumes ~0.5% of the logits' scale (~30 for 7-14B models)
    assert effect > tolerance  # a merge that lost the adapter would still fail the GPU check
    assert load_model(root / f"merged-{dtype}").dtype == torch.float32  # loaded back as asked; saved in dtype
    saved_dtype = json.loads((root / f"merged-{dtype}" / "config.json").read_text()).get("dtype")
    assert saved_dtype == dtype
