"""A profile's memory per GPU before anything runs: its training, and its canary's two served models.

From the base model's shape (`base_model.architecture`, config.json's names), the train section, the world
size and the DeepSpeed config, training needs per GPU (bytes):

    weights      parameters x 2 (bf16/fp16; 4-bit QLoRA: the linear layers at 0.5), / world size under ZeRO-3
    gathered     ZeRO-3 only: weights gathered to compute with, the larger of the largest module and
                 stage3_max_live_parameters, plus the prefetch bucket (0.9 x hidden²), x 2
    lora states  trainable LoRA parameters x 16 (fp32 weight, gradient, Adam's two moments; LlamaFactory keeps
                 trainable parameters in fp32, llamafactory/model/adapter.py:313-325), or x 18 under DeepSpeed
                 (its own count: a 16-bit copy besides the fp32 master), partitioned as the ZeRO stage says
    activations  with gradient checkpointing (LlamaFactory's default): every layer's input kept, layers x batch x
                 cutoff_len x hidden x 2, plus one layer recomputed in the backward pass with its gradients,
                 2 x batch x cutoff_len x (12 hidden + 4 kv width + 8 intermediate) (what a Llama/Qwen2 layer saves
                 for backward in 16-bit: both norms' inputs, the attention's input, q, k, v and output, the MLP's
                 input, gate, up, SiLU(gate) and their product); without it, every layer's saved activations
    logits       batch x cutoff_len x vocab x 10: the 16-bit logits, their fp32 copy for the loss and its
                 log-softmax (transformers' ForCausalLMLoss)
    runtime      CUDA context, cuBLAS and NCCL workspaces (the serving plan's RUNTIME_RESERVE_GIB), plus
                 DeepSpeed's communication buckets x 2

where batch is per_device_train_batch_size, twice it under DPO (its chosen and rejected in one batch); DPO with a
reference model (not orpo or simpo) and KTO add the reference model's logits, computed without gradients while the
policy's are held (sequences_per_step says where in LlamaFactory). The sum must fit the GPU's memory less the serving plan's FRAGMENTATION margin. A profile that does not
fit is refused naming the term that overflows (the largest) and what shrinks it. docs/gpu.md#memory-plans
checks these terms against LlamaFactory's hardware table and DeepSpeed's ZeRO-3 estimator.

The canary's serving memory is tasks/serving/memory_plan.py's, fed with a checkpoint's footprint computed
from the same shape instead of read from its files (the checkpoint does not exist before the release runs).
"""

from __future__ import annotations

from dataclasses import dataclass

from tasks.platform.config import Profile
from tasks.platform.config.training import ModelArchitecture, TrainSection
from tasks.platform.errors import BadInput
from tasks.serving.llm_api import llm_args
from tasks.serving.memory_plan import (
    CUDA_CONTEXT_GIB,
    CUDA_GRAPHS_GIB,
    DTYPE_BYTES,
    FRAGMENTATION,
    GIB,
    RUNTIME_RESERVE_GIB,
    TRITONSERVER_GIB,
    ModelFootprint,
    gpu_gib,
    kv_tokens_for_canary,
)
from tasks.training.deepspeed import ZeroConfig, read_zero_config

LINEAR_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
# Bytes per weight of a served checkpoint by ModelOpt format: FP8 (E4M3) and int4 AWQ (4 bits plus a 16-bit
# scale per 128 weights) quantize the decoder's linear layers; embeddings, lm_head and norms stay 16-bit.
SERVED_LINEAR_BYTES = {"fp8": 1.0, "int4_awq": 0.5 + 2 / 128, "nvfp4": 0.5 + 1 / 16}


@dataclass(frozen=True)
class Shape:
    """Parameter counts of a Llama/Qwen2-form decoder (biases left out: under 0.01% of the weights)."""

    arch: ModelArchitecture

    def linear_shapes(self) -> dict[str, tuple[int, int]]:
        """(in, out) of each linear module of one layer."""
        h, kv, i = self.arch.hidden_size, self.arch.kv_width, self.arch.intermediate_size
        return {
            "q_proj": (h, h),
            "k_proj": (h, kv),
            "v_proj": (h, kv),
            "o_proj": (h, h),
            "gate_proj": (h, i),
            "up_proj": (h, i),
            "down_proj": (i, h),
        }

    @property
    def linear(self) -> int:
        """Weights of every layer's linear modules."""
        return self.arch.num_hidden_layers * sum(a * b for a, b in self.linear_shapes().values())

    @property
    def embeddings(self) -> int:
        """The input embedding and, unless tied, the output layer."""
        one = self.arch.vocab_size * self.arch.hidden_size
        return one if self.arch.tie_word_embeddings else 2 * one

    @property
    def norms(self) -> int:
        return (2 * self.arch.num_hidden_layers + 1) * self.arch.hidden_size

    @property
    def total(self) -> int:
        return self.linear + self.embeddings + self.norms

    @property
    def largest_module(self) -> int:
        return max(self.arch.vocab_size * self.arch.hidden_size, *(a * b for a, b in self.linear_shapes().values()))

    def lora(self, rank: int, targets: str) -> int:
        shapes = self.linear_shapes()
        names = list(shapes) if targets == "all" else [t.strip() for t in targets.split(",")]
        unknown = [n for n in names if n not in shapes]
        if unknown:
            raise BadInput(
                f"train.lora_target {targets}: {', '.join(unknown)} is not a linear module of this architecture "
                f"({', '.join(shapes)})"
            )
        return self.arch.num_hidden_layers * sum(rank * sum(shapes[n]) for n in names)


@dataclass(frozen=True)
class Term:
    name: str
    bytes: float
    how: str


@dataclass(frozen=True)
class Plan:
    """What one GPU holds, term by term, against what it has."""

    what: str
    terms: tuple[Term, ...]
    gpu: str
    gpu_gib: float

    @property
    def usable_gib(self) -> float:
        return self.gpu_gib * (1 - FRAGMENTATION)

    @property
    def total_gib(self) -> float:
        return sum(t.bytes for t in self.terms) / GIB

    @property
    def largest(self) -> Term:
        return max(self.terms, key=lambda t: t.bytes)

    def lines(self) -> list[str]:
        head = (
            f"{self.what}: {self.total_gib:.1f} GiB per GPU of {self.usable_gib:.1f} usable "
            f"({self.gpu}: {self.gpu_gib:.2f} GiB less {FRAGMENTATION:.0%} for fragmentation)"
        )
        return [head] + [f"  {t.name:12} {t.bytes / GIB:7.2f} GiB  {t.how}" for t in self.terms]


def training_dtype_bytes(profile: Profile) -> int:
    train = profile.train
    return 2 if train.bf16 or train.fp16 else 4


def weights_term(profile: Profile, shape: Shape, zero: ZeroConfig | None) -> Term:
    train, world = profile.train, profile.hardware.world_size
    width = training_dtype_bytes(profile)
    # bitsandbytes NF4: 4 bits, and an fp32 constant per block of 64 (8-bit with double quantization, whose own
    # fp32 constants come one per 256 blocks)
    nf4 = 0.5 + (1 / 64 + 4 / (64 * 256) if train.double_quantization else 4 / 64)
    linear_bytes = {4: nf4, 8: 1.0}.get(train.quantization_bit or 0, width)
    total = shape.linear * linear_bytes + (shape.embeddings + shape.norms) * width
    kind = f"{train.quantization_bit}-bit linear layers" if train.quantization_bit else f"{width} B each"
    if zero is not None and zero.partitions_weights:
        return Term("weights", total / world, f"{shape.total / 1e9:.1f}B parameters, {kind}, / {world} (ZeRO-3)")
    return Term("weights", total, f"{shape.total / 1e9:.1f}B parameters, {kind}, a whole copy on every GPU")


def gathered_term(profile: Profile, shape: Shape, zero: ZeroConfig) -> Term:
    width = training_dtype_bytes(profile)
    live = max(shape.largest_module, zero.max_live_parameters)
    prefetch = 0.9 * profile.base_model.architecture.hidden_size**2  # type: ignore[union-attr]
    return Term(
        "gathered",
        (live + prefetch) * width,
        f"ZeRO-3 gathers weights to use them: max(largest module {shape.largest_module / 1e9:.2f}B, "
        f"max_live_parameters {zero.max_live_parameters:.0e}) + prefetch 0.9 x hidden², x {width} B",
    )


def lora_term(profile: Profile, shape: Shape, zero: ZeroConfig | None) -> Term:
    train, world = profile.train, profile.hardware.world_size
    params = shape.lora(train.lora_rank, train.lora_target)
    if zero is None:
        return Term("lora states", params * 16, f"{params / 1e6:.0f}M LoRA parameters x 16 B, on every GPU")
    stage = zero.stage
    # DeepSpeed's 18 B: the 16-bit weight (partitioned by ZeRO-3), the fp32 gradient (by ZeRO-2 and 3), the fp32
    # master weight and Adam's two moments (by ZeRO-1 and up).
    per_gpu = params * (2 / (world if stage >= 3 else 1) + 4 / (world if stage >= 2 else 1) + 12 / world)
    return Term("lora states", per_gpu, f"{params / 1e6:.0f}M LoRA parameters x 18 B, partitioned by ZeRO-{stage}")


def sequences_per_step(train: TrainSection) -> tuple[int, int]:
    """Sequences in the forward pass that keeps its graph, and in the reference model's forward (no gradients, its
    logits held beside the policy's until the loss), per device and step. LlamaFactory 0.9.5: DPO's collator puts a
    batch's chosen and rejected sequences in one batch of 2n (data/collator.py:542-564, PairwiseDataCollatorWithPadding;
    train/dpo/trainer.py:230-238 splits the fp32 logits), and its reference forward reads the same 2n unless the loss
    needs no reference model (orpo, simpo: hparams/finetuning_args.py:574; dpo/trainer.py:259-274); KTO's graph
    holds the n target sequences while its KL sequences and the reference's n + n pass without gradients
    (train/kto/trainer.py:184-218)."""
    batch = train.per_device_train_batch_size
    if train.stage == "dpo":
        return 2 * batch, 0 if train.pref_loss in ("orpo", "simpo") else 2 * batch
    if train.stage == "kto":
        return batch, 2 * batch
    return batch, 0


def activation_terms(profile: Profile) -> list[Term]:
    arch, train = profile.base_model.architecture, profile.train
    assert arch is not None
    (batch, reference), tokens = sequences_per_step(train), train.cutoff_len
    width = training_dtype_bytes(profile)
    h, kv, i, layers = arch.hidden_size, arch.kv_width, arch.intermediate_size, arch.num_hidden_layers
    layer = batch * tokens * (6 * h + 2 * kv + 4 * i) * width  # what one layer saves for its backward pass
    checkpointing = not train.extra_args.get("disable_gradient_checkpointing", False)
    if checkpointing:
        kept = layers * batch * tokens * h * width
        activations = Term(
            "activations",
            kept + 2 * layer,
            f"gradient checkpointing: {layers} layer inputs of {batch} x {tokens} tokens, plus one layer recomputed "
            f"({layer / GIB:.2f} GiB) and its gradients",
        )
    else:
        activations = Term("activations", layers * layer, f"{layers} layers x {layer / GIB:.2f} GiB, no checkpointing")
    logits = Term(
        "logits",
        batch * tokens * arch.vocab_size * 10,
        f"{batch} x {tokens} tokens x {arch.vocab_size} vocabulary x 10 B (16-bit logits, fp32 copy, log-softmax)"
        + (f"; {train.stage}: chosen and rejected in one batch" if train.stage == "dpo" else ""),
    )
    if not reference:
        return [activations, logits]
    held = Term(
        "reference logits",
        reference * tokens * arch.vocab_size * 10,
        f"{train.stage}'s reference forward without gradients: {reference} x {tokens} tokens x {arch.vocab_size} "
        "vocabulary x 10 B, beside the policy's",
    )
    return [activations, logits, held]


def runtime_term(profile: Profile, zero: ZeroConfig | None) -> Term:
    arch = profile.base_model.architecture
    assert arch is not None
    buckets = 0.0
    if zero is not None:
        buckets = (zero.reduce_bucket_size or arch.hidden_size**2) + (zero.allgather_bucket_size or 0)
    return Term(
        "runtime",
        RUNTIME_RESERVE_GIB * GIB + buckets * training_dtype_bytes(profile),
        f"CUDA context, cuBLAS and NCCL workspaces ({RUNTIME_RESERVE_GIB} GiB)"
        + (f", DeepSpeed's buckets {buckets:.2e} elements" if zero is not None else ""),
    )


def training_plan(profile: Profile) -> Plan | None:
    """Per-GPU training memory; None for a CPU profile or one without base_model.architecture."""
    arch, hardware = profile.base_model.architecture, profile.hardware
    if arch is None or hardware.accelerator != "cuda":
        return None
    if profile.train.finetuning_type != "lora":
        return None  # full and freeze tuning are not planned: their states depend on which layers train
    shape, zero = Shape(arch), read_zero_config(profile.train)
    terms = [weights_term(profile, shape, zero)]
    if zero is not None and zero.partitions_weights:
        terms.append(gathered_term(profile, shape, zero))
    terms += [lora_term(profile, shape, zero), *activation_terms(profile), runtime_term(profile, zero)]
    gpu = hardware.gpu_type or f"{hardware.gpu_memory_gb} GB GPU"
    nodes = f"{hardware.nodes} x {hardware.gpus}" if hardware.nodes > 1 else f"{hardware.gpus}"
    memory = gpu_gib(hardware.gpu_type, hardware.gpu_memory_gb, f"profile {profile.name}")
    return Plan(f"train on {nodes} {gpu}", tuple(terms), gpu, memory)


REMEDIES = {
    "weights": "spread them with ZeRO-3 (train.deepspeed: infra/deepspeed/zero3.json) over more GPUs (hardware.gpus, "
    "hardware.nodes), or quantize the base (train.quantization_bit)",
    "gathered": "lower stage3_max_live_parameters in the DeepSpeed config",
    "lora states": "lower train.lora_rank or target fewer modules (train.lora_target), or partition them with ZeRO",
    "activations": "lower train.cutoff_len or train.per_device_train_batch_size (raise gradient_accumulation_steps "
    "to keep the global batch)",
    "logits": "lower train.cutoff_len or train.per_device_train_batch_size (raise gradient_accumulation_steps to "
    "keep the global batch)",
    "reference logits": "lower train.cutoff_len or train.per_device_train_batch_size (raise "
    "gradient_accumulation_steps to keep the global batch), or a loss without a reference model (train.pref_loss "
    "orpo or simpo)",
    "runtime": "use a GPU with more memory",
}


def check_training_fits(profile: Profile) -> Plan | None:
    """The training plan, or a refusal naming the term that overflows and what shrinks it."""
    plan = training_plan(profile)
    if plan is None or plan.total_gib <= plan.usable_gib:
        return plan
    over = plan.largest
    raise BadInput(
        f"profile {profile.name}: training needs {plan.total_gib:.1f} GiB per GPU and each {plan.gpu} has "
        f"{plan.usable_gib:.1f} usable: {over.name} overflow ({over.bytes / GIB:.1f} GiB: {over.how}); "
        f"{REMEDIES[over.name]}"
    )


def served_footprint(profile: Profile) -> ModelFootprint:
    """What tasks/serving/memory_plan.py:footprint reads from a checkpoint's files, computed from the shape: the
    quantize stage's format sets the weights' bytes, the engine's parallelism their share per GPU."""
    arch, quantize, engine = profile.base_model.architecture, profile.quantize, profile.engine
    assert arch is not None
    shape, tp, pp = Shape(arch), engine.tensor_parallel_size, engine.pipeline_parallel_size
    if quantize.backend == "modelopt":
        dtype = DTYPE_BYTES[quantize.modelopt.dtype]
        checkpoint = (
            shape.linear * SERVED_LINEAR_BYTES[quantize.modelopt.qformat] + (shape.embeddings + shape.norms) * dtype
        )
        kv_dtype = 1 if quantize.modelopt.kv_cache_fp8 else dtype
    else:
        dtype = kv_dtype = DTYPE_BYTES[profile.hardware.compute_dtype]
        checkpoint = shape.total * dtype
    # The same arithmetic as footprint(): weights split over the GPUs, K and V of this GPU's layers and heads,
    # one layer's activations over max_num_tokens plus fp32 logits of max_batch_size sequences.
    weights = -(-int(checkpoint) // (tp * pp))
    kv = 2 * -(-arch.num_hidden_layers // pp) * max(arch.num_key_value_heads // tp, 1) * arch.head_dim
    activations = (
        engine.max_num_tokens * (2 * arch.intermediate_size // tp + 4 * arch.hidden_size) * 2
        + engine.max_batch_size * arch.vocab_size * 4
    )
    return ModelFootprint(weights, activations, kv * kv_dtype)


def serving_plan(profile: Profile) -> Plan | None:
    """The canary's two models (champion and candidate) on the serving GPUs, with the KV cache budget each gets
    (tasks/serving/memory_plan.py refuses a layout without room for one full sequence each); None where the
    profile does not serve on TensorRT-LLM's LLM API or has no base_model.architecture."""
    if profile.base_model.architecture is None or profile.serve.backend != "llmapi":
        return None
    model, hardware = served_footprint(profile), profile.hardware
    memory = gpu_gib(hardware.gpu_type, hardware.gpu_memory_gb, f"profile {profile.name}")
    max_seq_len = llm_args(profile)["max_seq_len"]
    tokens = kv_tokens_for_canary(model, memory, max_seq_len, f"profile {profile.name}: the canary")
    engine = profile.engine
    gpus = f"tensor parallel {engine.tensor_parallel_size} x pipeline parallel {engine.pipeline_parallel_size}"
    terms = (
        Term("weights", 2 * model.weights_bytes, "champion and candidate, this GPU's share of each checkpoint"),
        Term("activations", 2 * model.activation_bytes, "one layer over engine.max_num_tokens, logits of the batch"),
        Term("runtime", 2 * RUNTIME_RESERVE_GIB * GIB, f"{RUNTIME_RESERVE_GIB} GiB per model's worker"),
        Term("stubs", 2 * CUDA_CONTEXT_GIB * GIB, f"{CUDA_CONTEXT_GIB} GiB per model's Triton stub"),
        Term("cuda graphs", 2 * CUDA_GRAPHS_GIB * GIB, f"{CUDA_GRAPHS_GIB} GiB per model's decode graphs"),
        Term("tritonserver", TRITONSERVER_GIB * GIB, "its CUDA context and 64 MB CUDA memory pool"),
        Term(
            "kv cache",
            2 * tokens * model.kv_bytes_per_token,
            f"{tokens:,} tokens each ({tokens // max_seq_len:,} sequences of {max_seq_len}), "
            f"{model.kv_bytes_per_token:,} B per token",
        ),
    )
    gpu = hardware.gpu_type or f"{hardware.gpu_memory_gb} GB GPU"
    return Plan(f"canary on {gpus} {gpu}", terms, gpu, memory)


def memory_plan(profile: Profile) -> list[Plan]:
    """Every plan the profile has; a layout that cannot fit is refused (BadInput naming the term)."""
    return [plan for plan in (check_training_fits(profile), serving_plan(profile)) if plan is not None]
