"""Profile sections of the stages up to a merged model: base model, data, train, evaluate, merge."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, model_validator

from tasks.platform.config.base import FILE_ONLY, Section


class TinyModel(Section):
    """Shape of the locally made Qwen2 base used where no model hub is reachable (base_model.source tiny-qwen2)."""

    vocab_size: int = Field(
        512, ge=64, description="Tokenizer vocabulary size of the byte-level BPE trained on the data."
    )
    hidden_size: int = Field(64, ge=8, description="Width of the hidden states.")
    num_hidden_layers: int = Field(2, ge=1, description="Number of transformer layers.")
    num_attention_heads: int = Field(
        2,
        ge=1,
        description="Attention heads; head_dim is hidden_size / heads (vLLM's CPU attention refuses a head_dim of 16).",
    )
    num_key_value_heads: int = Field(1, ge=1, description="Key/value heads (grouped-query attention).")
    intermediate_size: int = Field(128, ge=8, description="Width of the MLP's inner layer.")
    pretrain_steps: int = Field(300, ge=0, description="Optimizer steps of the short pretraining on the data's text.")
    pretrain_learning_rate: float = Field(3e-3, gt=0, description="Learning rate of that pretraining.")
    pretrain_batch_size: int = Field(32, ge=1, description="Sequences per pretraining step.")
    seed: int = Field(0, description="Seed of the initial weights and the pretraining order.")


class ModelArchitecture(Section):
    """The base model's shape under its config.json names, for the memory plan `llmops profiles show` prints before
    anything is downloaded (tasks/training/memory_plan.py). A decoder of Llama/Qwen2 form: grouped-query attention
    and a gated MLP in every layer."""

    hidden_size: int = Field(ge=1, description="config.json hidden_size.")
    intermediate_size: int = Field(ge=1, description="config.json intermediate_size: the gated MLP's width.")
    num_hidden_layers: int = Field(ge=1, description="config.json num_hidden_layers.")
    num_attention_heads: int = Field(ge=1, description="config.json num_attention_heads.")
    num_key_value_heads: int = Field(ge=1, description="config.json num_key_value_heads.")
    vocab_size: int = Field(ge=1, description="config.json vocab_size.")
    tie_word_embeddings: bool = Field(
        False, description="config.json tie_word_embeddings: the output layer shares the embedding's weights."
    )

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads

    @property
    def kv_width(self) -> int:
        return self.num_key_value_heads * self.head_dim


class BaseModelSection(Section):
    """The model the release fine-tunes (base_model stage)."""

    source: str = Field(
        "tiny-qwen2",
        description="tiny-qwen2 builds a small model here (base_model.tiny); models:/NAME@ALIAS or "
        "models:/NAME/VERSION is the merged model a release of this registry made (an SFT champion a dpo run tunes); "
        "anything else is a Hugging Face hub id, a local folder or an s3:// URI.",
    )
    tiny: TinyModel = TinyModel()
    architecture: ModelArchitecture | None = Field(
        None,
        description="The source model's shape (config.json's names), for the memory plan of training and of the "
        "canary that `llmops profiles validate` checks and `show` prints; null: no plan before the model is there.",
    )


class DataSection(Section):
    """The SFT records (prepare_data stage) and how they split into train and eval."""

    source: str = Field(
        description="Records to train on: a file, a folder or s3://; a relative path in a profile file is "
        "relative to that file (`--data` overrides it)."
    )
    eval_source: str | None = Field(
        None,
        description="A fixed held-out set (file, folder or s3://) used as the eval split instead of the hash "
        "split of `source`; records it shares with `source` are left out of training. It is the exam of this "
        "profile's own `source`: a run given other data (`--data`, a run's data_source) is judged on a hash split "
        "of that data (this set moves to harvest_eval_source) unless it names its exam (`--eval-data`).",
    )
    harvest_eval_source: str | None = Field(
        None,
        description="The curated held-out set for data holding records harvested from served traffic when "
        "eval_source names none (a hash split would put client-written records in the exam). `llmops run --data` "
        "moves the profile's eval_source here, so harvested data is still scored on the curated exam.",
    )
    format: Literal["auto", "alpaca", "sharegpt", "openai"] = Field(
        "auto", description="Record format; auto detects it per record."
    )
    eval_fraction: float = Field(
        0.15, gt=0, lt=1, description="Share of `source` records hashed into the eval split (without eval_source)."
    )
    split_salt: str = Field(
        "v1", description="Salt of the record hash that assigns the split; change it to draw a different split."
    )

    @property
    def curated_exam(self) -> str | None:
        """The held-out set harvested records are scored on: eval_source, else harvest_eval_source."""
        return self.eval_source or self.harvest_eval_source


# The transformers of the training stack (pyproject.toml's `train` extra, which tests/unit/test_gpu_profiles.py holds
# this to), and the attention implementations it is known to break: LlamaFactory's flash_attn value -> why.
TRAIN_TRANSFORMERS = "5.6.0"
BROKEN_ATTENTION = {
    (
        "5.6.0",
        "fa2",
    ): "transformers 5.6.0 (the training stack's) raises \"'NoneType' object has no attribute 'to'\" at the "
    "first forward pass of FlashAttention-2 on Llama and Qwen2 (huggingface/transformers#45588, fixed in 5.6.1, which "
    "LlamaFactory 0.9.5 refuses: transformers<=5.6.0); use sdpa (PyTorch's scaled dot-product attention)",
}


# LlamaFactory 0.9.5's preference losses of stage dpo (hparams/finetuning_args.py:183); orpo and simpo need no reference
# model (finetuning_args.py:574, use_ref_model).
PreferenceLoss = Literal["sigmoid", "hinge", "ipo", "kto_pair", "orpo", "simpo"]
PREFERENCE_STAGES = ("dpo", "kto")


class TrainSection(Section):
    """LlamaFactory training arguments, under LlamaFactory's own names (train stage)."""

    stage: Literal["sft", "dpo", "kto"] = Field(
        "sft",
        description="LlamaFactory training stage: sft (supervised fine-tuning on answers), dpo (preference pairs, "
        "chosen/rejected; train.pref_loss picks DPO, IPO, ORPO, SimPO...) or kto (answers rated desirable or not, "
        "kto_tag). dpo and kto train on preference data (docs/user-guide.md#preference-tuning-dpo-orpo-simpo-kto); "
        "with LoRA the reference model is the base with the adapter off, so a base that is an SFT release's merged "
        "model makes SFT then DPO (base_model.source).",
    )
    pref_beta: float = Field(
        0.1, gt=0, description="dpo/kto: the preference loss's beta (how far from the reference model it may go)."
    )
    pref_loss: PreferenceLoss = Field(
        "sigmoid",
        description="dpo: the preference loss: sigmoid (DPO), hinge, ipo, kto_pair, orpo or simpo (these two without "
        "a reference model).",
    )
    pref_ftx: float = Field(
        0.0, ge=0, description="dpo: the weight of an SFT loss on the chosen answers added to the preference loss."
    )
    finetuning_type: Literal["lora", "full", "freeze"] = Field(
        "lora", description="LoRA adapters, all weights, or the last layers only (LlamaFactory's finetuning_type)."
    )
    template: str = Field(
        "chatml", description="LlamaFactory chat template the prompts are encoded with (serving uses the same)."
    )
    lora_rank: int = Field(8, ge=1, description="Rank of the LoRA matrices.")
    lora_alpha: int | None = Field(None, description="LoRA scaling numerator; null: LlamaFactory's default, 2 x rank.")
    lora_dropout: float = Field(0.0, ge=0, lt=1, description="Dropout on the LoRA path.")
    lora_target: str = Field(
        "all", description="Modules that get adapters: all linear layers, or a comma list such as q_proj,v_proj."
    )
    quantization_bit: Literal[4, 8] | None = Field(
        None, description="Quantize the frozen base to 4 or 8 bits while training (QLoRA); null: no quantization."
    )
    quantization_method: Literal["bnb", "hqq", "eetq"] = Field(
        "bnb", description="Library that quantizes the base when quantization_bit is set (bnb: bitsandbytes)."
    )
    double_quantization: bool = Field(True, description="bitsandbytes double quantization of the 4-bit constants.")
    cutoff_len: int = Field(128, ge=8, description="Longest tokenized sample in tokens; longer ones are cut.")
    per_device_train_batch_size: int = Field(8, ge=1, description="Samples per step on each device.")
    gradient_accumulation_steps: int = Field(1, ge=1, description="Steps whose gradients add up before an update.")
    learning_rate: float = Field(5e-3, gt=0, description="Peak learning rate of the optimizer.")
    num_train_epochs: float = Field(3.0, gt=0, description="Passes over the train split (ignored when max_steps > 0).")
    max_steps: int = Field(-1, description="Optimizer updates to run; -1: as many as num_train_epochs takes.")
    lr_scheduler_type: str = Field("cosine", description="Learning-rate schedule (transformers' scheduler names).")
    warmup_ratio: float = Field(0.0, ge=0, lt=1, description="Share of the updates spent warming up the learning rate.")
    logging_steps: int = Field(5, ge=1, description="Updates between logged losses (MLflow metrics).")
    save_steps: int = Field(
        50, ge=1, description="Updates between checkpoints (uploaded to the store; a rerun resumes)."
    )
    seed: int = Field(42, description="Seed of the adapter's initial weights and the data order.")
    bf16: bool = Field(False, description="Train in bfloat16 mixed precision (GPUs that have it).")
    fp16: bool = Field(False, description="Train in float16 mixed precision.")
    mask_history: bool = Field(
        False,
        description="Train on each record's last answer only: earlier assistant turns are context, never labels "
        "(LlamaFactory's mask_history). Needed for data harvested from served traffic whose history clients wrote "
        "(prepare_data refuses such data without it). sft only: dpo and kto train on the last answer anyway, and "
        "LlamaFactory refuses the setting there, so it is not passed to them.",
    )
    deepspeed: str | None = Field(
        None, description="A DeepSpeed config file for LlamaFactory; null: no DeepSpeed.", json_schema_extra=FILE_ONLY
    )
    extra_args: dict[str, Any] = Field(
        {},
        description="Any further LlamaFactory argument, passed through as is (LlamaFactory validates it).",
        json_schema_extra=FILE_ONLY,
    )

    @model_validator(mode="after")
    def _attention_the_training_stack_runs(self) -> TrainSection:
        """An attention implementation the training stack's transformers is known to break is refused here, before a
        GPU is booked, not at the first forward pass of a multi-hour job."""
        attention = str(self.extra_args.get("flash_attn", "auto"))
        broken = BROKEN_ATTENTION.get((TRAIN_TRANSFORMERS, attention))
        if broken:
            raise ValueError(f"extra_args.flash_attn {attention}: {broken}")
        return self


DEFAULT_RUBRIC = (
    "Grade the answer against the reference answer: is it correct and complete for the question? "
    "1 means wrong or unrelated, the top of the scale means as good as the reference."
)
PAIRWISE_RUBRIC = (
    "Two answers to the question follow. Which one answers it better: correct, complete and close to the reference "
    "answer?"
)


class JudgeSection(Section):
    """An LLM that grades the served answers of the candidate and the champion against the reference, on a scale, for
    answers that overlap metrics read badly (sentences, explanations); tasks/quality/judge.py."""

    url: str = Field(
        description="Its OpenAI-compatible API, ending in /v1 (a served model of this project's `llmops serve` too). "
        "A run started through the Prefect API may name only an endpoint of LLMOPS_RUN_JUDGES: the judge gets "
        "the eval split and both versions' answers."
    )
    model: str = Field(description="The model name the endpoint serves.")
    api_key_env: str = Field(
        "LLMOPS_JUDGE_API_KEY",
        description="The environment variable holding its API key (never the key itself); unset: no key sent.",
        json_schema_extra=FILE_ONLY,
    )
    pairwise: bool = Field(
        False,
        description="Compare instead of grade: for each eval prompt the judge says which of two answers is better, "
        "the candidate's or the champion's (the base model's on a first release), twice with the order swapped; a "
        "preference that flips with the order is a tie. The gate checks the candidate's win rate (a tie counts a "
        "half) against gate.min_win_rate.",
    )
    rubric: str | None = Field(
        None,
        description="What the judge is asked to grade (or, pairwise, what makes one answer better), before the "
        "question; null: the mode's own.",
    )
    scale: int = Field(5, ge=2, le=10, description="The grades run from 1 to this; a score is (grade - 1)/(scale - 1).")
    max_tokens: int = Field(16, ge=1, description="Tokens of the judge's answer (its grade comes first).")
    timeout_s: float = Field(
        60, gt=0, description="Seconds per judge request; past them the gate's fault is transient."
    )
    concurrency: int = Field(4, ge=1, description="Judge requests in flight.")
    max_malformed: float = Field(
        0.1,
        ge=0,
        le=1,
        description="Largest share of the judge's answers without a grade in 1..scale: past it the gate fails "
        "(a malformed answer is counted and said, never scored 0).",
    )


class EvaluateSection(Section):
    """The task metric the gate decides on, and how sure it must be (tasks/quality/metrics.py, tasks/quality/stats.py).
    Left at `auto`, the metric and the answer length follow from the eval split's references
    (tasks/quality/answer_kind.py), and the run says what it chose and why."""

    metric: Literal[
        "auto", "exact_match", "rouge_l", "bleu_4", "answer_loss", "preference_accuracy", "reward_margin"
    ] = Field(
        "auto",
        description="The deciding metric: exact_match, rouge_l, bleu_4 (higher is better) or answer_loss (lower is "
        "better); all are logged. auto: exact_match where the references are closed answers (90% of them at most "
        "3 words, or at most 10 distinct ones), rouge_l where they are open-ended. preference_accuracy: on "
        "preference pairs (train.stage dpo), the share of held-out pairs whose chosen answer the model gives a "
        "higher log-probability than the rejected one (transformers only); the answers are scored against the "
        "chosen ones too. reward_margin: on the same pairs, DPO's reward margin with the base as reference "
        "(train.pref_beta times the log-probability margin of chosen over rejected, the candidate's minus the "
        "base's; in its own units, without a headroom: min_improvement is the margin to size).",
    )
    max_new_tokens: int | Literal["auto"] = Field(
        "auto",
        description="Tokens generated per eval prompt (and per served eval request). auto: the references' 95th "
        "percentile in the base model's tokens, times 1.25 plus 2, at least 8 and at most max_new_tokens_cap.",
    )
    max_new_tokens_cap: int = Field(256, ge=1, description="The most evaluate.max_new_tokens auto chooses.")
    max_samples: int = Field(256, ge=1, description="Most eval records scored; the rest of the split is not used.")
    engine: Literal["transformers", "vllm"] = Field(
        "transformers",
        description="What answers and scores the eval split: transformers (`generate` in batches of 32, the answer "
        "loss from a forward pass), or vllm: the serving engine, the base model and base + adapter on one vLLM "
        "engine with LoRA (serve.vllm's environment and settings; tasks/runners/vllm_answers.py), the same token "
        "ids in, greedy, the answer loss from the prompt's log probabilities. Same metrics either way.",
    )
    min_improvement: float = Field(
        0.0,
        description="How much the candidate must beat the base model by on the metric (in the metric's units), on "
        "the paired interval's lower bound where evaluate.confidence is set; 0: above 0. Negative: no margin at all "
        "(nor the relative or the permutation check), for a run that is about something else than the model.",
    )
    min_relative_improvement: float = Field(
        0.05,
        ge=0,
        lt=1,
        description="The share of the base's headroom the candidate must gain: (candidate - base) / (1 - base) for "
        "a 0..1 metric, (base - candidate) / base for answer_loss. A margin that means the same on every metric.",
    )
    permutation_check: bool = Field(
        True,
        description="The candidate must improve on the base by more than it gains against other questions' "
        "references (its answers scored against 8 other records' references): a model that learned only the "
        "answers' shared phrasing gains as much there, and is refused. Text metrics only (answer_loss has none).",
    )
    confidence: float | None = Field(
        0.9,
        gt=0,
        lt=1,
        description="A level such as 0.9: checks use the paired bootstrap interval's bound (an improvement's lower "
        "bound, a drop's upper bound). null: the point difference.",
    )
    bootstrap_resamples: int = Field(2000, ge=100, description="Resamples of the paired bootstrap (with confidence).")
    seed: int = Field(0, description="Seed of the bootstrap resampling.")
    min_samples: int = Field(
        20, ge=1, description="Fewer eval samples than this: no decision, and a message saying to add data."
    )
    judge: JudgeSection | None = Field(
        None,
        description="An LLM judge of the served answers (null: none). The gate then checks its score: "
        "gate.max_judge_drop against the champion, gate.min_judge_score without one.",
    )

    @model_validator(mode="after")
    def positive_answer_length(self) -> EvaluateSection:
        if self.max_new_tokens != "auto" and self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens {self.max_new_tokens}: at least 1, or auto")
        if self.metric in ("preference_accuracy", "reward_margin") and self.engine == "vllm":
            raise ValueError(
                f"metric {self.metric} with engine vllm: the rejected answers' log-probabilities are scored by "
                "transformers; set evaluate.engine transformers"
            )
        return self

    @property
    def decided(self) -> bool:
        """Neither the metric nor the answer length is left to the data any more (tasks/evaluate.py, judged_as)."""
        return self.metric != "auto" and self.max_new_tokens != "auto"

    @property
    def answer_tokens(self) -> int:
        """evaluate.max_new_tokens once decided; what answers a prompt of the eval split reads it only then."""
        if self.max_new_tokens == "auto":
            raise RuntimeError("evaluate.max_new_tokens auto read before the eval split decided it")
        return self.max_new_tokens


class MergeSection(Section):
    """Folding the adapter into the base (merge stage), checked against the unmerged model's logits."""

    tolerance: float = Field(
        1e-3,
        ge=0,
        description="Largest |logits(base+adapter) - logits(merged)| accepted: 1e-3 in float32; bfloat16 rounds the "
        "merged weights to 8 mantissa bits, so the GPU profiles allow more (tests/unit/test_merge.py measures it).",
    )
    probe_samples: int = Field(16, ge=1, description="Eval prompts the logits are compared on.")
