"""merge: fold the LoRA adapter into the full-precision base, then prove the merge is exact.

The merge always loads the base in full precision, also after QLoRA training: merging into a
4-bit base is the known way to ship wrong weights ("Cannot merge adapters to a quantized
model"), and re-quantization is the quantize stage's job. Exactness is checked on the merged
model as saved (reloaded from disk), against base + adapter unmerged, on a probe batch. The folder
is saved in the spelling the serving images' transformers 4.x also reads (tasks/serving/hf_compat.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from tasks.data.splits import eval_conversations
from tasks.platform.errors import CheckFailed
from tasks.platform.stage_cache import RunContext, StageMetrics, StageResult, logger, run_cached
from tasks.quality.chat import Conversation
from tasks.quality.contract import load_contract, read_contract, require_same, write_contract
from tasks.quality.models import CPU_FP32, Compute, load_model, load_tokenizer, probe_batch
from tasks.serving.hf_compat import make_loadable_by_transformers4


@dataclass
class MergeMetrics(StageMetrics):
    """How far the merged model's logits are from base + adapter's, on the probe batch."""

    STAGES = ("merge",)

    max_abs_logit_diff: float
    probe_samples: int

    def headline(self) -> str:
        return f"max |dlogits| {self.max_abs_logit_diff:.1e}"


def logits(model, input_ids, mask):
    """float32 logits on the CPU, whatever the model's device and dtype."""
    import torch

    with torch.no_grad():
        out = model(input_ids=input_ids.to(model.device), attention_mask=mask.to(model.device)).logits
    return out.float().cpu() * mask.unsqueeze(-1)  # padding positions carry no meaning: compare real tokens only


def merge_adapter(
    base_dir: Path, adapter_dir: Path, out_dir: Path, probe: list[Conversation], compute: Compute = CPU_FP32
) -> float:
    """Write the merged model to out_dir (in compute.dtype); return max |logits(base+adapter) - logits(merged)|."""
    tokenizer = load_tokenizer(base_dir)
    input_ids, mask = probe_batch(tokenizer, probe)
    with_adapter = load_model(base_dir, adapter_dir, compute)
    expected = logits(with_adapter, input_ids, mask)
    merged = with_adapter.merge_and_unload()
    merged.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    make_loadable_by_transformers4(out_dir)  # the serving images read it with transformers 4.x
    del merged, with_adapter  # one copy of a 14B model on the GPU at a time
    reloaded = load_model(out_dir, compute=compute)
    return float((logits(reloaded, input_ids, mask) - expected).abs().max())


def merge(ctx: RunContext, data: StageResult, base: StageResult, adapter: StageResult) -> StageResult:
    cfg = ctx.profile.merge
    key = {
        "base": base.artifact.digest,
        "adapter": adapter.artifact.digest,
        "data": data.artifact.digest,
        "merge": cfg.model_dump(),
    }

    def produce(out_dir: Path) -> dict:
        probe = eval_conversations(ctx, data, cfg.probe_samples)
        max_diff = merge_adapter(
            ctx.store.fetch(base.artifact.digest),
            ctx.store.fetch(adapter.artifact.digest),
            out_dir,
            probe,
            Compute.of(ctx.profile),
        )
        trained = load_contract(ctx.store.fetch(adapter.artifact.digest))
        require_same(trained, read_contract(out_dir), "the merged model's tokenizer")
        write_contract(trained, out_dir)
        logger().info(
            f"merge: max |logits(base+adapter) - logits(merged)| = {max_diff:.3e} (tolerance {cfg.tolerance:g})"
        )
        if max_diff > cfg.tolerance:
            raise CheckFailed(
                f"merge: max |logits(base+adapter) - logits(merged)| = {max_diff:.3e} exceeds "
                f"merge.tolerance {cfg.tolerance:g} on {len(probe)} probe samples"
            )
        return MergeMetrics(max_diff, len(probe)).as_mlflow()

    return run_cached(ctx, "merge", key, produce, headline=lambda m: MergeMetrics.from_mlflow(m).headline())
