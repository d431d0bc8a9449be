"""base_model: the model LoRA adapts.

GPU profiles name a hub id, a local folder or an s3:// prefix, copied into the store so the
run's lineage pins exact weights; a registered version (`models:/NAME@champion`) names the merged model an earlier
release of this registry made (SFT, then DPO on it). With no model hub reachable, `tiny-qwen2` makes a
Qwen2-shaped model here: a byte-level BPE trained on the task's text with a ChatML chat
template, then a short full-parameter pretrain on that text. A purely random base barely
learns under LoRA (the tied output layer is not a LoRA target), hence the pretrain.
"""

from __future__ import annotations

import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tasks.data.splits import load_split
from tasks.platform.config import BaseModelSection, TinyModel
from tasks.platform.errors import BadInput
from tasks.platform.quiet import quiet_transformers
from tasks.platform.stage_cache import RunContext, StageMetrics, StageResult, logger, run_cached
from tasks.quality.chat import Conversation
from tasks.quality.models import Compute
from tasks.serving.hf_compat import make_loadable_by_transformers4


@dataclass
class BaseModelMetrics(StageMetrics):
    """What `tiny-qwen2` built and how its pretrain went; a copied base (hub, folder, s3://, a registered version)
    reports its parameters alone, counted from its safetensors headers."""

    STAGES = ("base_model",)

    parameters: int | None = None
    vocab_size: int | None = None
    pretrain_loss_first: float | None = None
    pretrain_loss_last: float | None = None

    def headline(self) -> str:
        return (
            "parameters not counted (weights not in safetensors)"
            if self.parameters is None
            else f"{self.parameters} params"
        )


def counted_parameters(folder: Path) -> int | None:
    """The parameters of a copied base, from its safetensors headers alone (no tensor read); None without any."""
    import math

    from safetensors import safe_open

    shards = sorted(folder.glob("*.safetensors"))
    if not shards:
        return None
    total = 0
    for path in shards:
        with safe_open(str(path), "np") as weights:
            total += sum(math.prod(weights.get_slice(name).get_shape()) for name in weights.keys())  # noqa: SIM118 (a handle, not a dict)
    return total


SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
# ChatML as Qwen2 uses it, without a default system prompt: matches LlamaFactory's `chatml` template.
CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def corpus(conversations: list[Conversation]) -> list[str]:
    """Plain text of the conversations, without chat markup: what the base 'read' in pretraining."""
    return ["\n".join(m["content"] for m in conv) for conv in conversations]


def train_tokenizer(texts: list[str], vocab_size: int):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    bpe.train_from_iterator(texts, trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=bpe,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        additional_special_tokens=["<|im_start|>"],
        chat_template=CHATML_TEMPLATE,
        model_max_length=512,
        clean_up_tokenization_spaces=False,
    )


def pretrain(model, tokenizer, texts: list[str], cfg: TinyModel, device: str = "cpu") -> list[float]:
    import torch

    model.to(device)
    generator = torch.Generator().manual_seed(cfg.seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.pretrain_learning_rate)
    encoded = [tokenizer(t + tokenizer.pad_token)["input_ids"] for t in texts]
    losses = []
    model.train()
    log = logger()
    for step in range(cfg.pretrain_steps):
        picks = torch.randint(len(encoded), (cfg.pretrain_batch_size,), generator=generator).tolist()
        batch = tokenizer.pad({"input_ids": [encoded[i] for i in picks]}, return_tensors="pt").to(device)
        labels = batch["input_ids"].masked_fill(batch["attention_mask"] == 0, -100)
        loss = model(**batch, labels=labels).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
        if (step + 1) % 100 == 0 or step + 1 == cfg.pretrain_steps:
            log.info(f"base_model: pretrain step {step + 1}/{cfg.pretrain_steps} loss {loss.item():.3f}")
    model.to("cpu").eval()
    return losses


def build_tiny_qwen2(texts: list[str], cfg: TinyModel, out_dir: Path, device: str = "cpu") -> BaseModelMetrics:
    """Tokenizer, weights and pretrain of a `tiny-qwen2` base, saved to out_dir in float32; `device` runs the
    pretrain (cuda on a CUDA profile: the same seed gives other weights there, as any GPU kernel does)."""
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    quiet_transformers()
    torch.manual_seed(cfg.seed)
    tokenizer = train_tokenizer(texts, cfg.vocab_size)
    config = Qwen2Config(
        vocab_size=len(tokenizer),
        hidden_size=cfg.hidden_size,
        intermediate_size=cfg.intermediate_size,
        num_hidden_layers=cfg.num_hidden_layers,
        num_attention_heads=cfg.num_attention_heads,
        num_key_value_heads=cfg.num_key_value_heads,
        max_position_embeddings=512,
        tie_word_embeddings=True,
        bos_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    model = Qwen2ForCausalLM(config)
    losses = pretrain(model, tokenizer, texts, cfg, device)
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    make_loadable_by_transformers4(out_dir)
    return BaseModelMetrics(
        parameters=sum(p.numel() for p in model.parameters()),
        vocab_size=len(tokenizer),
        pretrain_loss_first=losses[0] if losses else 0.0,
        pretrain_loss_last=losses[-1] if losses else 0.0,
    )


def copy_model(source: str, out_dir: Path) -> BaseModelMetrics:
    """A named base: a local folder, an s3:// prefix, or a hub id (needs a reachable hub)."""
    if source.startswith("s3://"):
        from tasks.platform.store import s3_client, split_s3_uri

        bucket, prefix = split_s3_uri(source)
        client = s3_client()
        count = 0
        for page in client.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix.rstrip("/") + "/"):
            for item in page.get("Contents", []):
                dest = out_dir / item["Key"][len(prefix.rstrip("/")) + 1 :]
                dest.parent.mkdir(parents=True, exist_ok=True)
                client.download_file(bucket, item["Key"], str(dest))
                count += 1
        if not count:
            raise BadInput(f"base_model.source {source}: no objects under that prefix")
    elif Path(source).is_dir():
        shutil.copytree(source, out_dir, dirs_exist_ok=True)
    else:
        from huggingface_hub import snapshot_download

        try:
            snapshot_download(source, local_dir=out_dir)
        except Exception as exc:
            raise BadInput(
                f"base_model.source {source}: not a local folder and the hub download failed ({exc})"
            ) from None
    if not (out_dir / "config.json").is_file():
        raise BadInput(f"base_model.source {source}: no config.json (not a Hugging Face model folder)")
    return BaseModelMetrics(parameters=counted_parameters(out_dir))


REGISTERED = "models:/"


def registered_merge(ctx: RunContext, source: str) -> str:
    """The store digest of the merged model a registered version of this run's registry released: `models:/NAME@ALIAS`
    or `models:/NAME/VERSION` (MLflow's model URI forms), such as an SFT release's champion a DPO release tunes."""
    from mlflow.exceptions import MlflowException

    from tasks.platform.tracking import not_found

    named = source.removeprefix(REGISTERED)
    client = ctx.tracker.client
    try:
        if "@" in named:
            name, alias = named.split("@", 1)
            version = client.get_model_version_by_alias(name, alias)
        elif "/" in named:
            name, number = named.rsplit("/", 1)
            version = client.get_model_version(name, number)
        else:
            raise BadInput(f"base_model.source {source}: a registered model is models:/NAME@ALIAS or models:/NAME/N")
    except MlflowException as exc:
        if not_found(exc):
            raise BadInput(
                f"base_model.source {source}: no such registered version in {ctx.tracker.tracking_uri} (release that "
                "model first, e.g. `llmops run --profile cpu-tiny` for tiny-qwen2-antonyms)"
            ) from None
        raise
    digest = version.tags.get("artifact.merge.sha256")
    if not digest:
        raise BadInput(f"base_model.source {source}: version {version.version} names no merged model (artifact.merge)")
    return digest


def base_model(ctx: RunContext, data: StageResult) -> StageResult:
    cfg: BaseModelSection = ctx.profile.base_model
    if cfg.source.startswith(REGISTERED):
        merged = registered_merge(ctx, cfg.source)
        logger().info(f"base_model: {cfg.source} is the merged model {merged[:12]}")
        key: dict[str, Any] = {"registered": merged}  # the weights, whichever alias or version named them

        def produce(out_dir: Path) -> dict:
            shutil.copytree(ctx.store.fetch(merged), out_dir, dirs_exist_ok=True)
            return BaseModelMetrics(parameters=counted_parameters(out_dir)).as_mlflow()
    elif cfg.source == "tiny-qwen2":
        key = {"data": data.artifact.digest, "tiny": cfg.tiny.model_dump()}

        def produce(out_dir: Path) -> dict:
            texts = corpus(load_split(ctx.store.fetch(data.artifact.digest), "train"))
            return build_tiny_qwen2(texts, cfg.tiny, out_dir, Compute.of(ctx.profile).device).as_mlflow()
    else:
        key = {"source": cfg.source}

        def produce(out_dir: Path) -> dict:
            return copy_model(cfg.source, out_dir).as_mlflow()

    return run_cached(ctx, "base_model", key, produce, headline=lambda m: BaseModelMetrics.from_mlflow(m).headline())
