"""Model, parallelism and optimizer configuration: frozen dataclasses, validated once at the edge."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Callable

from jaxseq.remat import segments

ATTENTION_IMPLEMENTATIONS = ("explicit", "fused")
MATMUL_FORMS = ("einsum", "cpu-bf16")  # models/ops.MATMULS: the portable einsum, XLA:CPU's bf16 form
LAYER_LOOPS = ("scan", "unrolled")  # models/model.layers: lax.scan over the stacked layers, or a Python loop
CONTEXT_STRATEGIES = ("all-gather", "ring")  # parallel/context.py


FUSED_KERNELS = ("xla", "cudnn")  # jax.nn.dot_product_attention's implementations


def on_platform(model: "ModelConfig", platform: str, parallel: "ParallelConfig | None" = None) -> "ModelConfig":
    """`model` with the kernels for devices of `platform` ("cpu", "gpu", "tpu"), chosen once by the commands that
    run a model (train, generate): XLA:CPU's bf16 matmul form on CPU (models/cpu_matmul.py), the portable einsum
    elsewhere; for `attention=fused`, cuDNN's flash attention on GPU in bf16 where it compiles for `parallel`
    (`cudnn_compiles`; jax.nn.dot_product_attention chooses XLA's, which materialises the scores, unless asked for
    cuDNN), XLA's elsewhere."""
    cudnn = platform == "gpu" and model.dtype == "bfloat16" and (parallel is None or cudnn_compiles(parallel))
    cudnn = cudnn and not model.document_mask  # cuDNN's kernel as jaxseq calls it takes no segment ids
    if platform == "cpu" and model.layer_loop == "unrolled":
        raise ConfigError("layer_loop='unrolled' on CPU: XLA:CPU does not keep a remat policy for unrolled layers (it "
                          "merges selective's replay with the forward, and full holds more than none); use scan, "
                          "the default, on CPUs")
    return dataclasses.replace(model, matmul="cpu-bf16" if platform == "cpu" else "einsum",
                               fused_kernel="cudnn" if cudnn else "xla")


def cudnn_compiles(parallel: "ParallelConfig") -> bool:
    """Whether cuDNN's attention compiles in this layout. Its custom partitioning fails (an AssertionError inside
    XLA's SPMD partitioner, JAX 0.10.2 and 0.12) in the partly manual regions jaxseq opens over `data`, `fsdp` and
    `pipe`, where it therefore runs nested manual over `tensor` too (models/cudnn_attention.py); the all-gather
    `context` strategy's queries are no top-left causal triangle (a dense mask), which that wrapper does not take.
    Found by compiling for an H100 without one (tests/test_gpu_target.py): such runs take XLA's attention, and
    `train` says so."""
    return parallel.context == 1 or parallel.context_strategy == "ring"


COMPUTE_DTYPES = ("bfloat16", "float32")
ITEMSIZE = {"bfloat16": 2, "float32": 4}  # bytes per element of each compute dtype


class ConfigError(ValueError):
    """A configuration value is invalid; the message is one line naming the value and what is valid."""


@dataclass(frozen=True, kw_only=True)
class ModelConfig:
    """A decoder of a family: "gpt" (GPT-2/3: pre-LayerNorm, learned positions, GELU, tied embeddings) or
    "llama" (RMSNorm, RoPE, SwiGLU, grouped-query attention, untied lm_head, no biases)."""

    family: str = "gpt"
    vocab_size: int = 50257
    seq_len: int = 1024
    hidden: int = 768
    heads: int = 12
    layers: int = 12
    mlp_ratio: int = 4
    dropout: float = 0.1
    dtype: str = "bfloat16"  # compute dtype; parameters are always float32
    attention: str = "explicit"  # "explicit" (scores materialised) or "fused" (jax.nn.dot_product_attention)
    ln_eps: float = 1e-5
    kv_channels: int | None = None  # per-head width; None: hidden // heads (Megatron's --kv-channels)
    matmul: str = "einsum"  # how weight matmuls run: the portable einsum, or "cpu-bf16" (set on CPU devices)
    fused_kernel: str = "xla"  # attention=fused's implementation: "xla", or "cudnn" (set on GPUs in bf16)
    layer_loop: str = "scan"  # how the layers run: "scan" (lax.scan) or "unrolled" (a Python loop: models/model.layers)
    # the layers' weight matmuls as FP8 GEMMs (e4m3 activations and weights, e5m2 gradients: models/fp8.py)
    fp8: bool = False
    # GPT's Q, K and V as one [h, 3, a, d] weight and one GEMM (Megatron's layout; jaxseq's before 2026-12-04, which
    # a run saved without this field resumes with) or as three (MaxText's default: models/gpt.py says why)
    fused_qkv: bool = False
    # The Llama family's, which it validates (models/llama.py, `validate`):
    kv_heads: int | None = None  # K/V heads of grouped-query attention; None: heads (multi-head)
    ffn_hidden: int | None = None  # MLP width f; None: mlp_ratio · hidden
    rope_theta: float = 10000.0
    rope_scaling: str | None = None  # None, or "llama3" (Llama 3.1's frequency scaling, the fields below)
    rope_factor: float = 8.0
    rope_low_freq_factor: float = 1.0
    rope_high_freq_factor: float = 4.0
    rope_original_positions: int = 8192
    qk_norm: bool = False  # an RMSNorm over each head's q and k (one scale [d] each) before RoPE (Qwen3, Qwen3-MoE)
    # Packed documents (models/documents.py): attention within each document, positions from its first token.
    document_mask: bool = False
    eod_token: int | None = None  # the end-of-document id that separates them: the data's (set at the edge)
    # The mixture-of-experts family's, which it validates (models/moe.py, `validate`; models/experts.py):
    moe_experts: int = 0  # routed experts per layer (0: none, the dense families)
    moe_top_k: int = 2  # experts each token is routed to
    moe_capacity_factor: float | None = 1.25  # slots per expert: ceil(factor·T·k/E) of T tokens; None: dropless
    moe_shared_experts: int = 0  # experts every token passes through (one SwiGLU of this many expert widths)
    moe_norm_topk: bool = True  # the k routing weights renormalised to sum to 1 (Mixtral; Qwen3-MoE's norm_topk_prob)
    moe_aux_loss_coef: float = 0.01  # the load-balancing loss's coefficient (Switch/Mixtral form), per MoE layer
    moe_z_loss_coef: float = 0.0  # the router z-loss's coefficient (ST-MoE)
    moe_bias_rate: float = 0.0  # DeepSeek-V3's aux-loss-free balancing: the bias's update rate γ (0: no bias)

    @property
    def num_kv_heads(self) -> int:
        return self.kv_heads if self.kv_heads is not None else self.heads

    @property
    def head_dim(self) -> int:
        return self.kv_channels if self.kv_channels is not None else self.hidden // self.heads

    @property
    def attention_width(self) -> int:
        return self.heads * self.head_dim

    @property
    def itemsize(self) -> int:
        """Bytes per element of the compute dtype (activations, the weight copy)."""
        return ITEMSIZE[self.dtype]

    @property
    def mlp_hidden(self) -> int:
        return self.ffn_hidden if self.ffn_hidden is not None else self.mlp_ratio * self.hidden

    def padded_vocab(self, tensor: int) -> int:
        """Vocabulary rounded up to a multiple of 128·tensor, as Megatron pads it (even vocab shards)."""
        multiple = 128 * tensor
        return -(-self.vocab_size // multiple) * multiple


# How a model computes, free to change between runs of the same weights; every other ModelConfig
# field is its architecture, which a resume or --init-from must keep.
RUNTIME_FIELDS = ("dropout", "dtype", "attention", "matmul", "fused_kernel", "layer_loop", "document_mask",
                  "eod_token", "moe_capacity_factor", "moe_aux_loss_coef", "moe_z_loss_coef", "fp8")
ARCHITECTURE_FIELDS = tuple(f.name for f in dataclasses.fields(ModelConfig) if f.name not in RUNTIME_FIELDS)


@dataclass(frozen=True, kw_only=True)
class ParallelConfig:
    """Mesh: pipe × data × fsdp × expert × context × tensor; sequence parallelism rides on `tensor`. With pipe > 1 the
    layers split into pipe·virtual_stages chunks run by `schedule` (gpipe, 1f1b, interleaved, zb-h1; see
    parallel/schedule.py). With context > 1 the whole sequence is split over `context`, attention included, by
    `context_strategy` ("all-gather": K and V gathered; "ring": K/V blocks passed rank to rank; parallel/context.py).

    distributed_optimizer: the fp32 master weights and both Adam moments are sharded over `data` (data ×
    context under context parallelism: ZeRO-1, Megatron-LM's --use-distributed-optimizer over its data ×
    context group); see parallel/layout.Layout.master_specs.

    fsdp: ranks that split the batch's rows as data ranks do and also every weight, its gradient and its
    optimizer state (FSDP, ZeRO-3): each weight's hidden dimension is split over `fsdp` and gathered layer by
    layer as it is used (parallel/fsdp.py). data × fsdp is HSDP: shards within an fsdp group, replicas across.

    expert: ranks that split the batch's rows as data ranks do and a mixture of experts' experts (expert
    parallelism: tokens sent to their experts' ranks and back by all-to-all; models/experts.py).
    """

    data: int = 1
    tensor: int = 1
    sequence_parallel: bool = False
    distributed_optimizer: bool = False
    pipe: int = 1
    schedule: str = "1f1b"
    virtual_stages: int = 1
    context: int = 1
    context_strategy: str = "all-gather"
    fsdp: int = 1
    expert: int = 1
    # The float32 master weights and Adam moments in host memory between steps, sharded as above; each step copies
    # them to the device for the update and back (training/train_step.py, docs/parallelism.md "Host offload").
    offload_optimizer: bool = False

    @property
    def num_devices(self) -> int:
        return self.pipe * self.data * self.fsdp * self.expert * self.context * self.tensor

    @property
    def chunks(self) -> int:
        """The layer stack's pipeline chunks, p·v (1 without a pipeline): where a block remat spec counts its N."""
        return self.pipe * self.virtual_stages

    @property
    def batch_ranks(self) -> int:
        """Ranks that each hold other rows of the batch: data × fsdp × expert."""
        return self.data * self.fsdp * self.expert

    def mesh_text(self) -> str:
        return ((f"pipe={self.pipe} × " if self.pipe > 1 else "") + f"data={self.data} × "
                + (f"fsdp={self.fsdp} × " if self.fsdp > 1 else "")
                + (f"expert={self.expert} × " if self.expert > 1 else "")
                + (f"context={self.context} × " if self.context > 1 else "") + f"tensor={self.tensor}")


@dataclass(frozen=True, kw_only=True)
class OptimizerConfig:
    """AdamW with linear warmup, cosine decay to min_lr_ratio·lr, and global-norm clipping."""

    lr: float = 6e-4
    min_lr_ratio: float = 0.1
    warmup_steps: int = 100
    decay_steps: int = 10000
    weight_decay: float = 0.1
    clip_norm: float = 1.0
    b1: float = 0.9
    b2: float = 0.95
    eps: float = 1e-8


@dataclass(frozen=True, kw_only=True)
class DistributedConfig:
    """Explicit coordinates, or none of them to auto-detect (SLURM, Open MPI) or run single-process."""

    coordinator: str | None = None  # HOST:PORT of process 0
    num_processes: int | None = None
    process_id: int | None = None
    # A peer silent this long is declared dead and every process exits: bounded time, no hang.
    heartbeat_timeout_s: int = 20
    initialization_timeout_s: int = 120

    @property
    def explicit(self) -> bool:
        return self.coordinator is not None


# The remat policy a GPU run with fused attention gets when none is asked for, by its layer loop. With cuDNN's flash
# attention the scores `selective` exists to drop are never stored, so it equals `none`. Scanned, `lean` held 9–10%
# less memory and ran 1–2% faster than both on an H100 (the scan's stacks cost by the bytes a layer stores); unrolled
# (no stacks), `none` ran fastest of every configuration measured, 12% faster than scanned `lean`
# (experiments/results/gpu_h100_2026-11-27/; priced on the program: experiments/results/bf16_levers.md).
GPU_FUSED_REMAT = {"scan": "lean", "unrolled": "none"}


def default_remat(platform: str, attention: str, layer_loop: str = "scan") -> str:
    """The remat policy of a run that asks for none: on GPUs with fused attention `GPU_FUSED_REMAT` of its layer loop,
    the paper's `selective` elsewhere (explicit attention, whose scores it drops; CPUs)."""
    return GPU_FUSED_REMAT[layer_loop] if platform == "gpu" and attention == "fused" else TrainConfig().remat


def default_layer_loop(platform: str, parallel: "ParallelConfig") -> str:
    """The layer loop of a run that asks for none: unrolled on GPUs without a pipeline, where it drops the scan's
    stacked buffers (an H100 ran gpt3-1.3b's step 13.9% faster under `none`) for a compile time that grows with depth
    (21 s against 8 s for its 24 layers there); scan elsewhere: XLA:CPU keeps no remat policy for unrolled layers, and
    a pipeline's stages have never been compiled unrolled."""
    return "unrolled" if platform == "gpu" and parallel.pipe == 1 else "scan"


@dataclass(frozen=True, kw_only=True)
class TrainConfig:
    steps: int = 1000
    batch_size: int = 32  # global, sequences per optimizer step
    micro_batch_size: int | None = None  # gradient accumulation when smaller than batch_size
    remat: str = "selective"
    # The stored tensors the remat policy keeps in host memory between the forward and the backward: checkpoint
    # names, comma-separated, or "all" (jaxseq/offload.py); None: none. The edge resolves it to the names.
    offload: str | None = None
    seed: int = 0
    data: str | None = None  # None: the embedded corpus
    tokenizer: str | None = None  # a local tokenizer.json for text data; None: bytes
    run_dir: str = "runs/default"
    log_every: int = 50
    eval_every: int = 200
    eval_batches: int = 8
    checkpoint_every: int = 200
    keep_checkpoints: int = 3
    resume: bool = False
    init_from: str | None = None  # a run or converted directory whose weights start the run (step 0)
    peak_tflops: float | None = None
    sample_tokens: int = 200
    host_devices: int = 8  # simulated CPU devices when there is no accelerator
    record_autotune: str | None = None  # a GPU run: where XLA writes its autotuner's choices for the train step
    profile: str | None = None  # "START:STOP": a jax.profiler trace of those steps (training/profile.py)


@dataclass(frozen=True, kw_only=True)
class RunConfig:
    model: ModelConfig
    parallel: ParallelConfig
    optimizer: OptimizerConfig
    train: TrainConfig
    distributed: DistributedConfig = DistributedConfig()

    def to_dict(self) -> dict:
        return {f.name: dataclasses.asdict(getattr(self, f.name)) for f in dataclasses.fields(self)}


# The sections a user configures (a YAML file's sections, `section.field=value` overrides, what a resume restores).
SECTIONS = {"model": ModelConfig, "optimizer": OptimizerConfig, "train": TrainConfig, "parallel": ParallelConfig}


def replace(cfg, **changes):
    """dataclasses.replace that turns unknown field names into a ConfigError."""
    names = {f.name for f in dataclasses.fields(cfg)}
    for key in changes:
        if key not in names:
            raise ConfigError(f"unknown {type(cfg).__name__} field {key!r}; valid: {', '.join(sorted(names))}")
    return dataclasses.replace(cfg, **changes)


SCHEDULES = ("gpipe", "1f1b", "interleaved", "zb-h1")  # pipeline schedules (jaxseq/parallel/schedule.py)


def resolve_schedule(name: str, virtual_stages: int) -> str:
    """The schedule a (name, v) pair means: 1F1B with v > 1 is the interleaved schedule (as in Megatron-LM)."""
    if name not in SCHEDULES:
        raise ConfigError(f"schedule={name!r} is not valid; valid: {', '.join(SCHEDULES)}")
    if not isinstance(virtual_stages, int) or virtual_stages < 1:
        raise ConfigError(f"virtual_stages={virtual_stages!r} must be a positive integer")
    if name == "gpipe" and virtual_stages > 1:
        raise ConfigError(f"virtual_stages={virtual_stages} needs the interleaved schedule, not gpipe")
    if name == "interleaved" and virtual_stages == 1:
        raise ConfigError("schedule=interleaved needs virtual_stages ≥ 2 (with 1 it is 1f1b)")
    return "interleaved" if name == "1f1b" and virtual_stages > 1 else name


def validate_pipeline(pipe: int, microbatches: int, virtual_stages: int = 1, schedule: str = "1f1b",
                      layers: int | None = None) -> str:
    """One-line ConfigErrors for a pipeline that cannot run; returns the resolved schedule name."""
    name = resolve_schedule(schedule, virtual_stages)
    if not isinstance(pipe, int) or pipe < 1:
        raise ConfigError(f"pipe={pipe!r} must be a positive integer")
    if not isinstance(microbatches, int) or microbatches < 1:
        raise ConfigError(f"microbatches={microbatches!r} must be a positive integer")
    if layers is not None and layers % (pipe * virtual_stages):
        raise ConfigError(f"layers={layers} is not divisible by pipe×virtual_stages = {pipe}×{virtual_stages}")
    if pipe > 1 and microbatches < pipe:
        raise ConfigError(f"microbatches={microbatches} is fewer than pipe={pipe} stages "
                          "(m = batch_size / micro_batch_size must be ≥ p)")
    if virtual_stages > 1 and microbatches % pipe:
        raise ConfigError(f"microbatches={microbatches} is not a multiple of pipe={pipe} "
                          f"({name} with virtual_stages={virtual_stages} needs m % p == 0)")
    return name


def validate_model(model: ModelConfig) -> None:
    positive = ("vocab_size", "seq_len", "hidden", "heads", "layers", "mlp_ratio")
    for name in positive:
        value = getattr(model, name)
        if not isinstance(value, int) or value <= 0:
            raise ConfigError(f"{name}={value!r} must be a positive integer")
    if model.kv_channels is None and model.hidden % model.heads:
        raise ConfigError(f"heads={model.heads} does not divide hidden={model.hidden} (or set kv_channels)")
    if model.kv_channels is not None and (not isinstance(model.kv_channels, int) or model.kv_channels <= 0):
        raise ConfigError(f"kv_channels={model.kv_channels!r} must be a positive integer")
    if not 0.0 <= model.dropout < 1.0:
        raise ConfigError(f"dropout={model.dropout!r} must be in [0, 1)")
    if model.dtype == "float16":
        # float16's 5-bit exponent flushes small gradients to zero unless the loss is scaled, and
        # jaxseq has no loss scaling; bfloat16 has float32's range at the same 2 bytes.
        raise ConfigError("dtype='float16' needs loss scaling, which jaxseq does not implement; "
                          "use bfloat16 (same memory, float32's exponent range) or float32")
    if model.dtype not in COMPUTE_DTYPES:
        raise ConfigError(f"dtype={model.dtype!r} is not valid; valid: {', '.join(COMPUTE_DTYPES)}")
    if model.attention not in ATTENTION_IMPLEMENTATIONS:
        raise ConfigError(
            f"attention={model.attention!r} is not valid; valid: {', '.join(ATTENTION_IMPLEMENTATIONS)}"
        )
    if model.matmul not in MATMUL_FORMS:
        raise ConfigError(f"matmul={model.matmul!r} is not valid; valid: {', '.join(MATMUL_FORMS)}")
    if model.fused_kernel not in FUSED_KERNELS:
        raise ConfigError(f"fused_kernel={model.fused_kernel!r} is not valid; valid: {', '.join(FUSED_KERNELS)}")
    if model.layer_loop not in LAYER_LOOPS:
        raise ConfigError(f"layer_loop={model.layer_loop!r} is not valid; valid: {', '.join(LAYER_LOOPS)}")
    validate_documents(model)
    validate_fp8(model)
    validate_family(model)


def validate_documents(model: ModelConfig) -> None:
    """The document mask needs the id that ends each document, one of the vocabulary's."""
    if not isinstance(model.document_mask, bool):
        raise ConfigError(f"document_mask={model.document_mask!r} must be true or false")
    eod = model.eod_token
    if model.document_mask and (not isinstance(eod, int) or not 0 <= eod < model.vocab_size):
        raise ConfigError(f"document_mask needs eod_token, the end-of-document id, in 0 … {model.vocab_size - 1}; "
                          f"got {eod!r}")


def validate_fp8(model: ModelConfig) -> None:
    """FP8 GEMMs dequantize into bf16 operands (models/fp8.py): a float32 model has none to give them."""
    if not isinstance(model.fp8, bool):
        raise ConfigError(f"fp8={model.fp8!r} must be true or false")
    if model.fp8 and model.dtype != "bfloat16":
        raise ConfigError(f"fp8=True with dtype={model.dtype!r}: FP8 GEMMs run in a bfloat16 model (their operands "
                          "dequantized to bf16, their outputs bf16); add --dtype bfloat16, or leave --fp8 out")


# Each model family's check of its own fields, by family name (the names a ModelConfig's `family` may take), in
# the order an error lists them. models/model.py registers every family it holds (`register_family`): a family's
# fields are its own to validate, and this base layer cannot import the models.
FAMILY_CHECKS: dict[str, Callable[[ModelConfig], None]] = {}


def register_family(name: str, check: Callable[[ModelConfig], None]) -> None:
    """Make `name` a valid `ModelConfig.family`, whose own fields `check` validates (one-line ConfigErrors)."""
    FAMILY_CHECKS[name] = check


def validate_family(model: ModelConfig) -> None:
    """The family, and the fields only it has (its registered check)."""
    if model.family not in FAMILY_CHECKS:
        valid = ", ".join(FAMILY_CHECKS) or "none registered (import jaxseq.models.model, which registers them)"
        raise ConfigError(f"family={model.family!r} is not valid; valid: {valid}")
    FAMILY_CHECKS[model.family](model)


def validate_parallel(model: ModelConfig, parallel: ParallelConfig, num_devices: int | None = None) -> None:
    for name in ("pipe", "data", "fsdp", "expert", "context", "tensor"):
        value = getattr(parallel, name)
        if not isinstance(value, int) or value <= 0:
            raise ConfigError(f"{name}={value!r} must be a positive integer")
    for name in ("sequence_parallel", "distributed_optimizer", "offload_optimizer"):
        if not isinstance(getattr(parallel, name), bool):
            raise ConfigError(f"{name}={getattr(parallel, name)!r} must be true or false")
    t = parallel.tensor
    if model.heads % t:
        raise ConfigError(f"tensor={t} does not divide heads={model.heads}")
    kv = model.num_kv_heads
    if kv % t and t % kv:
        raise ConfigError(f"tensor={t} neither divides kv_heads={kv} nor is a multiple of it (K/V heads are split "
                          "over tensor, or each repeated over tensor/kv_heads ranks)")
    if model.mlp_hidden % t:
        raise ConfigError(f"tensor={t} does not divide mlp width={model.mlp_hidden}")
    if parallel.sequence_parallel and model.seq_len % t:
        raise ConfigError(f"tensor={t} does not divide seq_len={model.seq_len} (required by sequence parallelism)")
    validate_context(model, parallel)
    validate_fsdp(model, parallel)
    validate_expert(model, parallel)
    if parallel.pipe > 1 or parallel.virtual_stages != 1 or parallel.schedule != "1f1b":
        resolve_schedule(parallel.schedule, parallel.virtual_stages)
        if parallel.pipe == 1:  # accepted and ignored, a run would not be what was asked for
            raise ConfigError(f"schedule={parallel.schedule!r} with virtual_stages={parallel.virtual_stages} needs a "
                              "pipeline, and pipe=1: set pipe > 1 in the mesh, or leave the schedule (1f1b) and "
                              "virtual_stages (1) at their defaults")
        validate_zero_bubble(model, parallel)
        stages = parallel.pipe * parallel.virtual_stages
        if model.layers % stages:
            raise ConfigError(f"layers={model.layers} is not divisible by pipe×virtual_stages = "
                              f"{parallel.pipe}×{parallel.virtual_stages}")
    if num_devices is not None and parallel.num_devices != num_devices:
        names = tuple(n for n in ("pipe", "data", "fsdp", "expert", "context", "tensor")
                      if n in ("data", "tensor") or getattr(parallel, n) > 1)
        raise ConfigError(
            f"{'×'.join(names)} = {'×'.join(str(getattr(parallel, n)) for n in names)} = {parallel.num_devices} "
            f"does not equal the device count {num_devices}"
        )


def validate_context(model: ModelConfig, parallel: ParallelConfig) -> None:
    """Context parallelism: 2c equal chunks of the sequence (each further split t ways under SP)."""
    c = parallel.context
    if parallel.context_strategy not in CONTEXT_STRATEGIES:
        raise ConfigError(f"context_strategy={parallel.context_strategy!r} is not valid; valid: "
                          f"{', '.join(CONTEXT_STRATEGIES)}")
    if c == 1:
        return
    split = 2 * c * (parallel.tensor if parallel.sequence_parallel else 1)
    if model.seq_len % split:
        what = f"2·context·tensor = {split} (2c load-balanced chunks, each split over tensor by SP)" \
            if parallel.sequence_parallel else f"2·context = {split} (2c load-balanced chunks)"
        raise ConfigError(f"seq_len={model.seq_len} is not divisible by {what}")


def validate_zero_bubble(model: ModelConfig, parallel: ParallelConfig) -> None:
    """zb-h1 defers each weight matmul's gradient to its W op (deferred.py): the weight must reach the
    matmul as it is stored, which FSDP's gather and Llama's K/V heads repeated over t > kv_heads ranks change."""
    if parallel.schedule != "zb-h1":
        return
    if parallel.fsdp > 1:
        raise ConfigError(f"schedule=zb-h1 with fsdp={parallel.fsdp} is not supported: its W ops would need FSDP's "
                          "gather and reduce-scatter again; use 1f1b or interleaved with fsdp, or zb-h1 without it")
    if model.moe_experts:
        raise ConfigError("schedule=zb-h1 with a mixture of experts is not supported: its W ops defer the weight "
                          "matmuls' gradients, and the experts' are batched GEMMs with an all-to-all between them; "
                          "use 1f1b or interleaved")
    if parallel.tensor > model.num_kv_heads:
        raise ConfigError(f"schedule=zb-h1 with tensor={parallel.tensor} > kv_heads={model.num_kv_heads} is not "
                          "supported (the K/V kernel is repeated over tensor ranks before its matmul): use tensor ≤ "
                          f"{model.num_kv_heads}, or 1f1b")


def validate_fsdp(model: ModelConfig, parallel: ParallelConfig) -> None:
    """FSDP splits every weight's hidden dimension h over `fsdp`; the distributed optimizer splits the state
    further over `data` (× `context`) only, so with fsdp it needs data or context ranks to split over."""
    f = parallel.fsdp
    if f == 1:
        return
    if model.hidden % f:
        raise ConfigError(f"fsdp={f} does not divide hidden={model.hidden}: FSDP splits each weight's hidden "
                          f"dimension over fsdp (e.g. the token embedding [V, {model.hidden}])")
    if parallel.distributed_optimizer and parallel.data * parallel.context == 1:
        raise ConfigError(f"the distributed optimizer with fsdp={f} and data=1 means nothing: fsdp already splits "
                          "the master weights and Adam moments; the distributed optimizer splits them further over "
                          "data (HSDP's replicas): drop it, or add data ranks")


def validate_expert(model: ModelConfig, parallel: ParallelConfig) -> None:
    """Expert parallelism splits a mixture of experts' experts over `expert`: it needs experts, as many on each rank."""
    e = parallel.expert
    if e == 1:
        return
    if model.moe_experts == 0:
        raise ConfigError(f"expert={e} splits a mixture of experts' experts, and this model has none (moe_experts=0); "
                          "use a mixture-of-experts preset (e.g. tiny-moe), or expert=1")
    if model.moe_experts % e:
        raise ConfigError(f"expert={e} does not divide moe_experts={model.moe_experts}: each expert rank holds "
                          "moe_experts/expert experts")


def validate_optimizer(opt: OptimizerConfig) -> None:
    """Numeric ranges of AdamW and its schedule (lr = 0 is allowed: it evaluates weights unchanged)."""
    checks = [
        ("lr", opt.lr >= 0, "must be ≥ 0"),
        ("min_lr_ratio", 0 <= opt.min_lr_ratio <= 1, "must be in [0, 1]"),
        ("warmup_steps", isinstance(opt.warmup_steps, int) and opt.warmup_steps >= 0, "must be an integer ≥ 0"),
        ("decay_steps", isinstance(opt.decay_steps, int) and opt.decay_steps >= 1, "must be an integer ≥ 1"),
        ("weight_decay", opt.weight_decay >= 0, "must be ≥ 0"),
        ("clip_norm", opt.clip_norm > 0, "must be > 0"),
        ("b1", 0 <= opt.b1 < 1, "must be in [0, 1)"),
        ("b2", 0 <= opt.b2 < 1, "must be in [0, 1)"),
        ("eps", opt.eps > 0, "must be > 0"),
    ]
    for name, ok, rule in checks:
        value = getattr(opt, name)
        if not ok or value != value:  # value != value: NaN
            raise ConfigError(f"{name}={value!r} {rule}")


def validate_batch(parallel: ParallelConfig, batch_size: int, micro_batch_size: int | None = None) -> None:
    if not isinstance(batch_size, int) or batch_size <= 0:
        raise ConfigError(f"batch_size={batch_size!r} must be a positive integer")
    ranks = parallel.batch_ranks
    what = f"data={parallel.data}"
    if parallel.fsdp > 1 or parallel.expert > 1:
        names = [n for n in ("data", "fsdp", "expert") if n == "data" or getattr(parallel, n) > 1]
        what = f"{'×'.join(names)} = {'×'.join(str(getattr(parallel, n)) for n in names)}"
    if batch_size % ranks:
        raise ConfigError(f"{what} does not divide batch_size={batch_size}")
    if micro_batch_size is not None:
        if micro_batch_size <= 0 or batch_size % micro_batch_size:
            raise ConfigError(f"micro_batch_size={micro_batch_size} does not divide batch_size={batch_size}")
        if micro_batch_size % ranks:
            raise ConfigError(f"{what} does not divide micro_batch_size={micro_batch_size}")
    if parallel.pipe > 1:
        m = batch_size // micro_batch_size if micro_batch_size else 1
        validate_pipeline(parallel.pipe, m, parallel.virtual_stages, parallel.schedule)


def validate_remat(remat: str, chunk_layers: int) -> None:
    """A registered policy, or a block spec (`remat.block_spec`) whose N fits a chunk of `chunk_layers` layers
    (the stack, a pipeline stage's, or a stage's chunk's under interleaving: where Megatron-LM counts N)."""
    try:
        segments(remat, chunk_layers)
    except ValueError as e:
        raise ConfigError(str(e)) from None


def validate(
    model: ModelConfig,
    parallel: ParallelConfig,
    remat: str,
    num_devices: int | None = None,
    batch_size: int | None = None,
    micro_batch_size: int | None = None,
) -> None:
    """Check everything once, at the edge; the core then trusts its inputs."""
    validate_model(model)
    validate_parallel(model, parallel, num_devices)
    validate_remat(remat, model.layers // parallel.chunks)
    if batch_size is not None:
        validate_batch(parallel, batch_size, micro_batch_size)
