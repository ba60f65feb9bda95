"""The papers' formulas (Korthikanti et al. 2022; Narayanan et al. 2021): activation bytes per layer, FLOPs per
iteration, and the one table of the paper's configurations; and jaxseq's own per-tensor counts that extend them
to the Llama family (through each family's `Traits`), context parallelism (`context_kv_bytes`, the ring's
blocks) and flash attention's working memory. Arithmetic only: nothing is traced or compiled.

Bytes per layer assume 16-bit activations and 1-byte dropout masks (the paper's Table 2); FLOPs are
matmul FLOPs (2 per multiply-add).

`activation_bytes` is the same count for any registered policy, family (GPT, Llama), dtype and dropout,
term by term (docs/DESIGN.md, "Stored bytes per layer, by family"); tests/test_llama_memory.py holds it to the
compiled program exactly.
"""

from __future__ import annotations

from dataclasses import dataclass

from jaxseq.config import ConfigError, ModelConfig
from jaxseq.models import experts
from jaxseq.models.model import family
from jaxseq.remat import POLICIES, layer_counts


@dataclass(frozen=True)
class PaperConfiguration:
    """One row of the paper's Table 2: how it runs in jaxseq."""

    remat: str  # the registered remat policy
    sequence_parallel: bool
    tensor_parallel: bool  # False: one device, no parallelism


# The paper's configurations, in the order of its Table 2 (plus full recompute with SP).
PAPER_CONFIGURATIONS: dict[str, PaperConfiguration] = {
    "none": PaperConfiguration("none", False, False),
    "tp": PaperConfiguration("none", False, True),
    "tp+sp": PaperConfiguration("none", True, True),
    "tp+selective": PaperConfiguration("selective", False, True),
    "tp+sp+selective": PaperConfiguration("selective", True, True),
    "full": PaperConfiguration("full", False, True),
    "full+sp": PaperConfiguration("full", True, True),
}


def paper_activation_bytes(config: str, s: int, b: int, h: int, a: int, t: int) -> float:
    """Table 2 of the paper (and 2sbh/t for full recompute with sequence parallelism)."""
    sbh, scores = s * b * h, 5 * a * s / h
    table = {
        "none": sbh * (34 + scores),
        "tp": sbh * (10 + 24 / t + scores / t),
        "tp+sp": sbh * (34 / t + scores / t),
        "tp+selective": sbh * (10 + 24 / t),
        "tp+sp+selective": sbh * 34 / t,
        "full": 2 * sbh,
        "full+sp": 2 * sbh / t,
    }
    if config not in table:
        raise ValueError(f"unknown paper configuration {config!r}; valid: {', '.join(table)}")
    return table[config]


def layer_tensor_bytes(cfg: ModelConfig, b: int, t: int, sequence_parallel: bool, context: int = 1) -> dict[str, float]:
    """Per-device bytes of each tensor one layer can keep for backward (explicit attention), by what it is.
    With context parallelism (c = `context`) every one is per token and so divided by c (the scores too: a
    rank's s/c queries against the whole sequence); the ring's own residual is `ring_lse`.

    e = the activation dtype's bytes, masks 1 byte (none without dropout), "/seq" = /t under sequence
    parallelism, else whole. Where the families differ: the norm statistics (LayerNorm's f32 mean and 1/std,
    8 bytes per token; RMSNorm's 1/rms, 4), K and V (a heads for GPT; Llama's kv_heads, repeated to one per
    rank where t > kv_heads: max(kv_heads, t) heads, `llama.cache_heads`), and the MLP's first matmul
    output (GELU's input, f wide; SwiGLU's gate and up, 2f)."""
    e, s, h, a, d, f = cfg.itemsize, cfg.seq_len, cfg.hidden, cfg.heads, cfg.head_dim, cfg.mlp_hidden
    traits = family(cfg).TRAITS
    sb, seq, r = s * b / context, (t if sequence_parallel else 1), (1 if cfg.dropout > 0 else 0)
    kv_heads = max(cfg.num_kv_heads, t)
    scores = a * sb * s / t
    n = s / (2 * context)
    ring_blocks = (2 * context + 1) * 4 * b * a / t * n * (n + d) if context > 1 else 0.0
    return {
        "residual": e * sb * h / seq,  # one [s, b, h] of the residual stream (layer input, norm outputs, …)
        "norm_stats": traits.norm_stat_bytes * sb / seq,  # of one norm
        "q": e * sb * a * d / t,  # after RoPE for Llama (linear: its backward needs only cos and sin)
        "kv": 2 * e * sb * kv_heads * d / t,  # K and V
        "probs": e * scores,  # the softmax output
        "probs_dropout": r * (1 + e) * scores,  # its dropout's mask and output; none without dropout
        "qk_scores": e * scores,  # QKᵀ before softmax (the dots policy saves it as a matmul output)
        "context": e * sb * a * d / t,  # scores × V, the output projection's input
        "mask": r * sb * h / seq,  # one residual dropout's mask
        "mlp_in": e * sb * traits.mlp_up_widths * f / t,  # the first MLP matmul's output
        "mlp_mid": e * sb * f / t,  # GELU's or SwiGLU's output, the second MLP matmul's input
        # the ring strategy's backward residual beside the context (parallel/context.py, `ring_fwd`; its output is
        # the context itself): its float32 log-sum-exp, per local query head and token
        "ring_lse": 4 * sb * a / t,
        # the ring's block matmul outputs (`_ring_forward`), what `dots` keeps of it: each of the 2c + 1 query-half
        # × key-half blocks a rank computes (`context.attention_work`) has a float32 q·kᵀ [b, a/t, n, n] and a
        # float32 probs·v [b, n, a/t, d], n = s/2c
        "ring_blocks": ring_blocks,
    }


# What each registered policy keeps, in terms of `layer_tensor_bytes` (name, count). "residual" ×4: the layer
# input, the first norm's output (the QKV input), the mid-layer residual, the second norm's output; `full`
# keeps only the layer input (the scan's carry); the dot policies keep the out-projection's output (what the
# mid-layer residual is recomputed from) where the others keep the residual itself.
POLICY_TERMS: dict[str, tuple[tuple[str, int], ...]] = {
    "none": (("residual", 4), ("norm_stats", 2), ("q", 1), ("kv", 1), ("probs", 1), ("probs_dropout", 1),
             ("context", 1), ("mask", 2), ("mlp_in", 1), ("mlp_mid", 1)),
    "selective": (("residual", 4), ("norm_stats", 2), ("q", 1), ("kv", 1), ("context", 1), ("mask", 2),
                  ("mlp_in", 1), ("mlp_mid", 1)),
    "full": (("residual", 1),),
    "lean": (("residual", 2), ("q", 1), ("kv", 1), ("context", 1), ("mlp_in", 1)),
    "dots": (("residual", 2), ("q", 1), ("kv", 1), ("qk_scores", 1), ("context", 1), ("mlp_in", 1)),
    "dots_no_batch": (("residual", 2), ("q", 1), ("kv", 1), ("mlp_in", 1)),
}


# The ring computes its blocks itself (no scores kept: P is recomputed from the log-sum-exp) and keeps its
# log-sum-exp (tagged `context`) wherever a policy keeps the context, its output being the context itself.
RING_DROPS = ("probs", "probs_dropout", "qk_scores")
# `dots` under the ring (measured, tests/test_plan.py): every matmul output the ring's forward makes, its blocks'
# q·kᵀ and probs·v in float32, and not its output and log-sum-exp (no matmul outputs: recomputed from the blocks
# by the merge), so not the context either; the weight matmuls' outputs as without the ring.
RING_POLICY_TERMS: dict[str, tuple[tuple[str, int], ...]] = {
    "dots": (("residual", 2), ("q", 1), ("kv", 1), ("mlp_in", 1), ("ring_blocks", 1)),
}


def policy_terms(remat: str, context: int = 1, strategy: str = "all-gather") -> tuple[tuple[str, int], ...]:
    """What `remat` keeps (POLICY_TERMS), under the ring strategy the ring's own residuals for the scores."""
    if remat not in POLICY_TERMS:
        raise ConfigError(f"remat={remat!r} has no formula; valid: {', '.join(POLICY_TERMS)}")
    terms = POLICY_TERMS[remat]
    if context == 1 or strategy == "all-gather":
        return terms
    if remat in RING_POLICY_TERMS:
        return RING_POLICY_TERMS[remat]
    kept = tuple((name, n) for name, n in terms if name not in RING_DROPS)
    return kept + ((("ring_lse", 1),) if any(name == "context" for name, _ in kept) else ())


def moe_tensor_bytes(cfg: ModelConfig, b: int, t: int, context: int = 1) -> dict[str, float]:
    """Per-device bytes of each tensor a mixture of experts' MLP (models/experts.py) can keep for backward, for one
    routing group: a rank's T = b·s/c tokens, whole over `tensor` (every tensor rank routes them alike), E·C slots
    (C = `experts.capacity(T)`: ceil(factor·T·k/E), T dropless). With expert parallelism a rank's e = E/ep experts
    hold ep·C slots each after the dispatch: E·C slots still, so no term depends on ep. e = the activation dtype's
    bytes; the router's logits and the routing weights float32, the slots' tokens int32."""
    e, h, f, E = cfg.itemsize, cfg.hidden, cfg.mlp_hidden, cfg.moe_experts
    tokens = b * cfg.seq_len // context
    slots = E * experts.capacity(tokens, cfg)
    shared = cfg.moe_shared_experts * f  # the shared experts' width g: one SwiGLU MLP every token passes through
    counted = bool(cfg.moe_aux_loss_coef or cfg.moe_bias_rate)  # the loads exist for a balancing term alone
    return {
        "router_logits": 4 * tokens * E,  # the router's logits [T, E], float32 (`moe_router_logits`)
        "router_dot": e * tokens * E,  # the router matmul's own output, before its cast (what `dots` keep)
        "routing": 8 * slots,  # each slot's token (int32) and routing weight (float32) (`moe_routing`)
        "loads": 4 * E if counted else 0,  # each expert's assignments over the micro-batch, int32 (`moe_loads`)
        "dispatched": e * slots * h,  # the experts' input after the dispatch (`moe_dispatched`)
        "expert_hidden": e * slots * 2 * f / t,  # gate and up of every slot, split over tensor (`moe_expert_hidden`)
        "expert_mid": e * slots * f / t,  # SwiGLU's output, the down matmul's input (`mlp_activation`)
        # the experts' output: after the combine (`moe_expert_output`); under `dots` the down matmul's output before
        # it, the same E·C slots (the combine's weight gradient reads it)
        "expert_output": e * slots * h,
        # the MLP's input (the second norm's output) whole over `tensor` where the dense layer keeps it split under
        # SP: the partitioner stores the all-gathered copy the router and the dispatch read, not the split one (with
        # shared experts, whose column-parallel matmul gathers its own copy, it keeps the split one)
        "moe_input": e * tokens * h,
        "shared_in": e * tokens * 2 * shared / t,  # the shared experts' gate and up (the dense MLP's `mlp_in`)
        "shared_mid": e * tokens * shared / t,  # their SwiGLU output (`mlp_mid`)
    }


# What each registered policy keeps of a mixture of experts' MLP, in terms of `moe_tensor_bytes`, in place of the
# dense MLP's mlp_in and mlp_mid (the attention half's terms are the dense layer's). `lean` replays the router and
# the routing (a small matmul, a sort of E·C ints) but keeps what a collective or the experts' GEMMs would bring
# back; `dots` keep every matmul's output, the experts' batched ones included; `dots_no_batch` the router's alone
# (the experts' matmuls have a batch dimension, the experts). `full` keeps the layer input alone.
MOE_POLICY_TERMS: dict[str, tuple[tuple[str, int], ...]] = {
    "none": (("router_logits", 1), ("routing", 1), ("loads", 1), ("dispatched", 1), ("expert_hidden", 1),
             ("expert_mid", 1), ("expert_output", 1), ("shared_in", 1), ("shared_mid", 1)),
    "selective": (("router_logits", 1), ("routing", 1), ("loads", 1), ("dispatched", 1), ("expert_hidden", 1),
                  ("expert_mid", 1), ("expert_output", 1), ("shared_in", 1), ("shared_mid", 1)),
    "full": (),
    "lean": (("loads", 1), ("dispatched", 1), ("expert_hidden", 1), ("expert_output", 1), ("shared_in", 1)),
    "dots": (("router_dot", 1), ("expert_hidden", 1), ("expert_output", 1), ("shared_in", 1)),
    "dots_no_batch": (("router_dot", 1), ("shared_in", 1)),
}
DENSE_MLP_TERMS = ("mlp_in", "mlp_mid")  # what a mixture's MLP replaces of the dense layer's terms
MOE_INPUT_KEPT = ("none", "selective")  # the policies that keep the MLP's input (`mlpwi_input`)


def moe_activation_bytes(cfg: ModelConfig, remat: str, b: int, t: int, sequence_parallel: bool, context: int = 1,
                         strategy: str = "all-gather") -> float:
    """Bytes one mixture of experts' layer stores for backward per device under a registered remat policy: the
    dense Llama layer's attention half (`activation_bytes`' terms but the MLP's) and the MoE MLP's
    (`MOE_POLICY_TERMS`), term by term (docs/DESIGN.md, "Stored bytes of a mixture of experts' layer")."""
    attention = tuple((name, n) for name, n in policy_terms(remat, context, strategy) if name not in DENSE_MLP_TERMS)
    dense = layer_tensor_bytes(cfg, b, t, sequence_parallel, context)
    moe = moe_tensor_bytes(cfg, b, t, context)
    total = sum(n * dense[name] for name, n in attention) + sum(n * moe[name] for name, n in MOE_POLICY_TERMS[remat])
    if remat in MOE_INPUT_KEPT and not cfg.moe_shared_experts:  # of its residual-stream tensors, the MLP's input
        total += moe["moe_input"] - dense["residual"]  # kept whole (with shared experts split, as the dense layer's)
    return total


def moe_nonlinear_bytes(cfg: ModelConfig, remat: str, b: int, t: int, context: int = 1) -> float:
    """What a mixture's stored bytes at micro-batch b hold beyond b times their bytes at b = 1 (0 for a dense layer):
    the capacity's ceiling (C at b·s tokens against b times C at s) and the loads, which do not grow with b. The
    search measures a layer at b = 1 and scales it by b (`SearchCosts.layer`), so it adds this."""
    if not cfg.moe_experts:
        return 0  # an int: a dense layer's scaled bytes keep their type
    terms = MOE_POLICY_TERMS[remat]
    at = lambda n: sum(k * moe_tensor_bytes(cfg, n, t, context)[name] for name, k in terms)
    return at(b) - b * at(1)


def activation_bytes(cfg: ModelConfig, remat: str, b: int, t: int, sequence_parallel: bool, context: int = 1,
                     strategy: str = "all-gather") -> float:
    """Bytes one layer stores for backward per device under a registered remat policy (explicit attention:
    the fused one stores what its kernel chooses). For GPT with dropout and the paper's configurations it is
    the paper's Table 2 plus the LayerNorm statistics. With context parallelism over c ranks every term is
    divided by c (all-gather: the gathered K/V are not stored); the ring keeps no scores but its log-sum-exp
    (`ring_lse`)."""
    terms = policy_terms(remat, context, strategy)
    if cfg.attention != "explicit":
        raise ConfigError(f"attention={cfg.attention!r}: the formula counts the explicit attention's tensors")
    if cfg.moe_experts:
        return moe_activation_bytes(cfg, remat, b, t, sequence_parallel, context, strategy)
    tensors = layer_tensor_bytes(cfg, b, t, sequence_parallel, context)
    return sum(n * tensors[name] for name, n in terms)


def context_kv_bytes(cfg: ModelConfig, b: int, t: int, context: int, strategy: str) -> dict[str, float]:
    """Per device per layer, the K/V context parallelism moves and holds for a moment, not divided by c
    (docs/DESIGN.md, "Context parallelism"): K and V of a rank's max(kv_heads, t)/t heads.
    transient: all-gather, the gathered K and V of the whole sequence (forward, and again in backward beside
    their full-length gradient: twice that at backward's peak, `transient_backward`); ring, two K/V blocks
    (the one in use and the one arriving), in backward with their dK/dV blocks too.
    traffic (bytes each device sends per layer, forward + backward): all-gather, K and V gathered forward and
    again backward ((c−1)/c of the whole each), dK/dV reduce-scattered ((c−1)/c); ring, c−1 K/V block sends
    forward, c−1 K/V and c dK/dV block sends backward."""
    if context <= 1:
        return {"transient": 0.0, "transient_backward": 0.0, "traffic": 0.0}
    kv = 2 * cfg.itemsize * cfg.seq_len * b * cfg.head_dim * max(cfg.num_kv_heads, t) / t  # K and V, whole sequence
    block = kv / context
    if strategy == "ring":
        return {"transient": 2 * block, "transient_backward": 4 * block,
                "traffic": (context - 1) * block + (context - 1) * block + context * block}
    share = (context - 1) / context
    return {"transient": kv, "transient_backward": 2 * kv, "traffic": 3 * share * kv}


FLASH_TILE = (128, 128)  # query rows × key columns of a flash kernel's score tile (FlashAttention-2's, cuDNN's)


def flash_attention_working_bytes(cfg: ModelConfig, b: int, t: int, context: int = 1) -> dict[str, float]:
    """Per device per layer, what a GPU's fused (flash) attention kernel holds beyond its inputs and output
    (Dao 2023, FlashAttention-2): never the [s/c, s] scores of a head, only a Br × Bc tile of them per thread
    block in on-chip memory (`tile`: float32, shared memory/registers, not HBM); in HBM the float32 log-sum-exp
    of each query row (forward, kept for backward) and, in backward, the float32 dQ accumulator [b, s/c, a/t, d]
    and the row sums D = rowsum(dO·O) [b, a/t, s/c] (`hbm`). XLA:CPU has no such kernel: its compiled
    `--attention fused` materialises the scores (`explicit_scores`: one float32 [b, a/t, s/c, s] buffer; the
    compiled step's working memory holds one or more of them at its peak, as XLA's buffer assignment decides)."""
    rows = b * cfg.heads / t * cfg.seq_len / context  # query rows on a device: local heads × its s/c tokens
    return {"hbm": 4 * rows * (cfg.head_dim + 2), "tile": 4 * FLASH_TILE[0] * FLASH_TILE[1],
            "explicit_scores": 4 * rows * cfg.seq_len}


def model_flops(B: int, s: int, L: int, h: int, V: int) -> float:
    """Model FLOPs per iteration (forward + backward, no recompute): 72·B·s·L·h²·(1 + s/(6h) + V/(12hL))."""
    return 72 * B * s * L * h * h * (1 + s / (6 * h) + V / (12 * h * L))


def paper_hardware_flops(B: int, s: int, L: int, h: int, V: int, remat: str) -> float:
    """The paper's hardware FLOPs: selective adds the core attention's forward (QKᵀ and scores×V),
    full adds one whole forward."""
    if remat == "full":
        return 96 * B * s * L * h * h * (1 + s / (6 * h) + V / (16 * h * L))
    if remat == "selective":
        return 72 * B * s * L * h * h * (1 + s / (3 * h) + V / (12 * h * L))
    return model_flops(B, s, L, h, V)


def layer_matmul_flops(cfg: ModelConfig, batch: int) -> dict[str, float]:
    """Forward FLOPs of each matmul of one layer (remat.MATMULS) for `batch` sequences: model FLOPs, so
    grouped-query attention counts its kv_heads K/V heads once (a rank that holds a repeated head,
    t > kv_heads, computes max(kv_heads, t)/t of them: hardware work the model does not need), and a
    SwiGLU MLP's first matmul is gate and up, 2f wide."""
    b, s, h, w, f, d = batch, cfg.seq_len, cfg.hidden, cfg.attention_width, cfg.mlp_hidden, cfg.head_dim
    qkv = w + 2 * cfg.num_kv_heads * d  # a·d query columns + k and v of each K/V head
    up = family(cfg).TRAITS.mlp_up_widths * f
    flops = {"qkv": 2 * b * s * h * qkv, "scores": 2 * b * s * s * w, "context": 2 * b * s * s * w,
             "out": 2 * b * s * w * h, "mlp_up": 2 * b * s * h * up, "mlp_down": 2 * b * s * f * h}
    return flops | (moe_matmul_flops(cfg, batch) if cfg.moe_experts else {})


def moe_matmul_flops(cfg: ModelConfig, batch: int) -> dict[str, float]:
    """A mixture's MLP matmuls in model FLOPs: each token's k experts (gate and up 2f wide, down) and the shared
    experts' (g = shared·f), and the router [h, E]; the capacity's padding and dropped tokens are not model FLOPs
    (the time model prices the padded GEMMs: `kernel_time.forward_gemms`)."""
    tokens, h, f = batch * cfg.seq_len, cfg.hidden, cfg.mlp_hidden
    width = (cfg.moe_top_k + cfg.moe_shared_experts) * f
    return {"mlp_up": 2 * tokens * h * 2 * width, "mlp_down": 2 * tokens * width * h,
            "router": 2 * tokens * h * cfg.moe_experts}


def deferred_stash_bytes(cfg: ModelConfig, b: int, t: int, sequence_parallel: bool, context: int = 1) -> float:
    """Bytes per device one layer keeps from its B to its W under zb-h1 (`deferred`): each weight matmul's
    input and output gradient, in the compute dtype. Column-parallel (QKV, MLP up): the input as the layer
    stores it (sequence-split under SP, W gathers it again) and the output gradient split over t; row-parallel
    (projection, MLP down): the input split over t and the output gradient as it arrives (sequence-split under
    SP, whole without: the gradient of the partial sums). Under context parallelism every weight matmul runs on
    the rank's s/c tokens (K and V are gathered or passed after their projection), so all of it is / c."""
    s, h, w, f, d = cfg.seq_len // context, cfg.hidden, cfg.attention_width, cfg.mlp_hidden, cfg.head_dim
    up = family(cfg).TRAITS.mlp_up_widths * f
    stream = b * s * h / (t if sequence_parallel else 1)  # a [b, s, h] tensor as SP stores it
    elements = (stream + b * s * (w + 2 * cfg.num_kv_heads * d) / t  # QKV (Llama: Q and K/V, one input)
                + b * s * w / t + stream  # projection
                + stream + b * s * up / t  # MLP up
                + b * s * f / t + stream)  # MLP down
    return elements * cfg.itemsize


def train_flops(cfg: ModelConfig, batch: int, remat: str | None = None, chunks: int = 1) -> float:
    """Matmul FLOPs of one training iteration over `batch` sequences: three times every forward
    matmul (forward, and backward's two), logits included, plus the forward matmuls the remat policy
    replays in backward (None: model FLOPs). For attention width h and MLP width 4h the model FLOPs
    are exactly the paper's 72·B·s·L·h²·(1 + s/(6h) + V/(12hL)); the replays match XLA's cost
    analysis (tests/test_flops.py), where the paper's hardware formulas assume more recompute.
    A block spec's replays are its policies' by layer (`remat.layer_counts`, the stack in `chunks` = p·v chunks)."""
    matmuls = layer_matmul_flops(cfg, batch)
    logits = 2 * batch * cfg.seq_len * cfg.hidden * cfg.vocab_size
    flops = 3 * (cfg.layers * sum(matmuls.values()) + logits)
    if remat is not None:
        for policy, layers in layer_counts(remat, cfg.layers, chunks).items():
            flops += layers * sum(matmuls[m] for m in POLICIES[policy].replays)
    return flops
