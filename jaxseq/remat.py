"""Named remat policies: which tensors a layer keeps for backward, and which it recomputes.

Every tensor the backward pass of a layer needs is tagged with `checkpoint_name` in the model families (models/), and
every policy is a *whitelist* over those names (`save_only_these_names`). Why a whitelist: a
blacklist (`save_anything_except_these_names`) silently recomputes nothing, because autodiff saves
the untagged producer of a tagged value instead (measured: docs/DESIGN.md). Untagged values (the
all-gathered LayerNorm output under sequence parallelism, bf16 casts) are always recomputed, which is
exactly what Megatron-LM does: it keeps the sequence-sharded tensor and all-gathers it again in
backward.

Bytes per layer below are in units of s·b·h (16-bit activations, 1-byte dropout masks, t tensor
ranks; "/t" on replicated parts only with sequence parallelism).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import jax

# Tags, with their size per layer in units of sbh (attention-score tags in units of a·s²·b).
# MaxText's names where the tensor is the same, plain names for the paper-only ones.
DECODER_LAYER_INPUT = "decoder_layer_input"  # LN1 input, 2 (replicated under TP)
NORM_STATS = "norm_stats"  # a norm's float32 statistics: LayerNorm's mean and 1/std (16 bytes per token per
# layer, two norms), RMSNorm's 1/rms (8)
QKV_INPUT = "qkv_input"  # LN1 output, 2 (replicated under TP)
QUERY, KEY, VALUE = "query_proj", "key_proj", "value_proj"  # 2 each, split t ways
ATTN_SCORES = "attn_scores"  # QKᵀ before softmax: never needed by backward, tagged for user policies
ATTN_PROBS = "attn_probs"  # softmax output, 2 as²b
ATTN_DROPOUT_MASK = "attn_dropout_mask"  # 1 as²b
ATTN_PROBS_DROPOUT = "attn_probs_dropout"  # dropout output, 2 as²b
ATTN_SOFTMAX_STATS = "attn_softmax_stats"  # cuDNN attention's float32 log-sum-exp, 4·b·s·a/t bytes (cudnn_attention)
CONTEXT = "context"  # scores × V, the output projection's input, 2, split t ways
OUT_PROJ = "out_proj"  # attention block output before dropout: not needed by backward
ATTN_OUT_DROPOUT_MASK = "attn_out_dropout_mask"  # 1 (replicated under TP)
MID_LAYER_RESIDUAL = "mid_layer_residual"  # LN2 input, 2 (replicated under TP)
MLPWI_INPUT = "mlpwi_input"  # LN2 output, 2 (replicated under TP)
MLPWI = "mlpwi"  # first MLP matmul output, before its bias (GELU input less the bias), 8, split t ways
MLP_ACTIVATION = "mlp_activation"  # GELU's or SwiGLU's output, the second MLP matmul's input, 8, split t ways
MLPWO = "mlpwo"  # second MLP matmul output before dropout: not needed by backward
MLP_DROPOUT_MASK = "mlp_dropout_mask"  # 1 (replicated under TP)
EMBED_DROPOUT_MASK = "embed_dropout_mask"  # outside the layers: not subject to the layer policy
# A weight matmul's output where models/cpu_matmul.py hides the dot in a custom VJP (bf16 on CPU): the `dots`
# policies save it there as JAX's dot policies save a plain dot.
MATMUL = "matmul"
# A mixture-of-experts layer's (models/experts.py), in place of the MLP's MLPWI (its MLP_ACTIVATION the same name),
# per routing group of T tokens, E experts, C slots each, e = E/ep local experts (ep·C slots each):
MOE_ROUTER_LOGITS = "moe_router_logits"  # the router's float32 logits [T, E]: 4E bytes a token
MOE_ROUTING = "moe_routing"  # each slot's token (int32) and routing weight (float32) [E·C]: 8 bytes a slot
MOE_DISPATCHED = "moe_dispatched"  # the experts' input after the dispatch all-to-all [e, ep·C, h]: 2h a slot
MOE_EXPERT_HIDDEN = "moe_expert_hidden"  # the experts' first matmul output [e, ep·C, 2, f]: 4f a slot, split t ways
MOE_EXPERT_OUTPUT = "moe_expert_output"  # the experts' output after the combine all-to-all [E, C, h]: 2h a slot
MOE_LOADS = "moe_loads"  # each expert's assignments over the micro-batch [E] int32 (an all-reduce to recompute)
MOE = (MOE_ROUTER_LOGITS, MOE_ROUTING, MOE_LOADS, MOE_DISPATCHED, MOE_EXPERT_HIDDEN, MOE_EXPERT_OUTPUT)

CORE_ATTENTION = (ATTN_PROBS, ATTN_DROPOUT_MASK, ATTN_PROBS_DROPOUT)

# Everything the backward pass needs: the paper's 34·sbh + 5·as²b (plus the norm statistics).
EVERYTHING = (
    DECODER_LAYER_INPUT,
    NORM_STATS,
    QKV_INPUT,
    QUERY,
    KEY,
    VALUE,
    ATTN_SOFTMAX_STATS,
    *CORE_ATTENTION,
    CONTEXT,
    ATTN_OUT_DROPOUT_MASK,
    MID_LAYER_RESIDUAL,
    MLPWI_INPUT,
    MLPWI,
    MLP_ACTIVATION,
    MLP_DROPOUT_MASK,
    *MOE,
)

SELECTIVE = tuple(n for n in EVERYTHING if n not in CORE_ATTENTION)

# What the matmuls need and nothing cheap to recompute: 2+2 residuals, 6 q/k/v, 2 context, 8 mlpwi = 20.
# A mixture of experts' layer: the experts' input and output and the experts' loads, which only a collective would
# bring back, and their hidden activations; the router (a small matmul) and its routing replayed.
LEAN = (DECODER_LAYER_INPUT, MID_LAYER_RESIDUAL, QUERY, KEY, VALUE, ATTN_SOFTMAX_STATS, CONTEXT, MLPWI, MOE_LOADS,
        MOE_DISPATCHED, MOE_EXPERT_HIDDEN, MOE_EXPERT_OUTPUT)


# The policies that keep not a mixture's dispatched buffer: backward replays its dispatch and combine all-to-alls
# (the compiled MoE layer has 6 all-to-alls a step where the others have 4: docs/planning.md, "Mixture of experts").
MOE_EXCHANGE_REPLAYED = ("full", "dots", "dots_no_batch")

# The forward matmuls of a layer, by the names `formulas.layer_matmul_flops` counts them under.
MATMULS = ("qkv", "scores", "context", "out", "mlp_up", "mlp_down")  # scores = QKᵀ, context = scores×V


@dataclass(frozen=True)
class RematPolicy:
    name: str
    policy: Callable | None  # a jax.checkpoint policy
    stores: str  # what one layer keeps for backward
    recomputes: str  # what backward recomputes
    replays: tuple[str, ...] = ()  # the forward matmuls (MATMULS) backward runs again: its extra FLOPs
    replays_norms: bool = False  # backward runs the LayerNorms and the MLP's activation forward again (no matmul)
    saves_dots: bool = False  # keeps every dot's output, named or not (JAX's dots_saveable): an untagged kernel's too


def _names(names) -> Callable:
    return jax.checkpoint_policies.save_only_these_names(*names)


def _dots_or_names(dots_policy, names) -> Callable:
    """A JAX dot policy, also saving the same matmuls where they are tagged rather than plain dots."""
    return jax.checkpoint_policies.save_from_both_policies(dots_policy, _names(names))


POLICIES: dict[str, RematPolicy] = {
    p.name: p
    for p in (
        RematPolicy(
            "none",
            _names(EVERYTHING),
            "everything backward needs: sbh(34 + 5as/h) without parallelism; sbh(10 + 24/t + 5as/(ht)) "
            "with TP; sbh(34/t + 5as/(ht)) with TP+SP",
            "nothing but the sequence-parallel all-gathers (as Megatron-LM)",
        ),
        RematPolicy(
            "selective",
            _names(SELECTIVE),
            "everything except the core attention: sbh(10 + 24/t) with TP, 34·sbh/t with TP+SP",
            "QKᵀ, softmax and its dropout (scores×V's own output is not needed again)",
            replays=("scores",),
        ),
        RematPolicy(
            "full",
            jax.checkpoint_policies.nothing_saveable,
            "only the layer input: 2·sbh (2·sbh/t with SP)",
            "the whole layer forward but its last matmul (whose output backward never needs)",
            replays=("qkv", "scores", "context", "out", "mlp_up"),
        ),
        RematPolicy(
            "lean",
            _names(LEAN),
            "the layer input, the mid-layer residual, q/k/v, the context and the first MLP matmul output: "
            "sbh(4 + 16/t) with TP, 20·sbh/t with TP+SP",
            "LayerNorms, GELU, dropout masks (from the RNG key), QKᵀ, softmax and its dropout",
            replays=("scores",), replays_norms=True,
        ),
        RematPolicy(
            "dots",
            _dots_or_names(jax.checkpoint_policies.dots_saveable, (MATMUL,)),
            "every matmul output (JAX's dots_saveable), attention scores and context included",
            "everything between matmuls: LayerNorms, GELU, softmax, dropout", replays_norms=True, saves_dots=True,
        ),
        RematPolicy(
            "dots_no_batch",
            _dots_or_names(jax.checkpoint_policies.dots_with_no_batch_dims_saveable, (MATMUL,)),
            "the outputs of the weight matmuls (q/k/v, projection, both MLP matmuls) — MaxText's 'minimal'",
            "the attention matmuls, softmax, LayerNorms, GELU, dropout",
            replays=("scores", "context"), replays_norms=True,
        ),
    )
}


def remat_policy(name: str) -> RematPolicy:
    return POLICIES[name]


# ---------------------------------------------------------------------------------------------
# Block recompute: Megatron-LM's `--recompute-method block --recompute-num-layers N`, as a spec "full:N" (the rest
# of the layers store everything: "full:N+none") or "POLICY:N+POLICY". Megatron counts N per pipeline stage, per
# chunk of a stage under interleaving (NeMo's activation-recomputation docs), which is what `layers` below sees: the
# stacked layers of one chunk (the whole stack without a pipeline).


def block_spec(spec: str) -> tuple[str, int, str] | None:
    """(first policy, its layers per chunk N, the rest's policy) of a block spec; None for a plain policy name.
    ValueError with one line for a malformed or unknown spec."""
    if spec in POLICIES:
        return None
    head, _, rest = spec.partition("+")
    first, _, count = head.partition(":")
    rest = rest or "none"
    valid = f"valid: {', '.join(POLICIES)}, or POLICY:N[+POLICY] (the first N layers of each chunk, e.g. full:4+none)"
    if not count.isdigit() or int(count) < 1 or first not in POLICIES or rest not in POLICIES:
        raise ValueError(f"remat={spec!r} is not a registered policy or block spec; {valid}")
    if first == rest:
        raise ValueError(f"remat={spec!r} puts every layer under {first!r}: write remat={first!r}")
    return first, int(count), rest


def segments(spec: str, layers: int) -> list[tuple[str, int]]:
    """A chunk of `layers` layers' policies, in order: [(policy, count)], counts > 0 (a block spec's N ≤ layers)."""
    block = block_spec(spec)
    if block is None:
        return [(spec, layers)]
    first, n, rest = block
    if n > layers:
        raise ValueError(f"remat={spec!r}: {n} layers under {first!r}, but a chunk (the stack, or L/(p·v) layers "
                         f"under a pipeline) has {layers}: N must be 1…{layers}")
    return [(first, n)] + ([(rest, layers - n)] if n < layers else [])


def layer_counts(spec: str, layers: int, chunks: int = 1) -> dict[str, int]:
    """How many of the model's `layers` run under each policy, its stack split into `chunks` equal chunks (p·v)."""
    counts: dict[str, int] = {}
    for policy, count in segments(spec, layers // chunks):
        counts[policy] = counts.get(policy, 0) + count * chunks
    return counts
