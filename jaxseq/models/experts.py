"""The mixture-of-experts MLP: a top-k softmax router, SwiGLU experts run as capacity-padded batched GEMMs, the
tokens dispatched to their experts' ranks and combined back with one all-to-all each over `expert`, and the
balancing terms (the Switch/Mixtral load-balancing loss, the router z-loss, DeepSeek-V3's aux-loss-free bias).

Routing groups. A group is the tokens one rank holds: its rows of the micro-batch and its tokens of the sequence,
over every mesh axis that splits tokens but `tensor` (data, fsdp, expert, context: `Sharder.token_axes`). Each
group routes and drops on its own, as Megatron-LM's and GShard's capacity is per rank, so a run drops the same
tokens as one device only where nothing drops (dropless, or a capacity no routing fills).

Capacity: C = min(T, ceil(factor·T·k/E)) slots per expert for a group of T tokens; dropless (factor None): C = T,
which no routing can overflow (a token picks an expert at most once), at E/(k·factor) times the buffers.

Which tokens drop: an expert's assignments are ranked by choice (every token's first choice before any token's
second) and then by the token's place in the group (its row, then its position); the expert keeps the first C. A
dropped assignment contributes nothing: the token keeps its other choices and the residual stream. An expert given
n assignments drops max(0, n − C) (`dropped`).

The balancing terms are added to the loss through their gradient (`_with_loss`, Megatron-LM's
MoEAuxLossAutoScaler): the block's output carries them into backward, so no layer returns more than its output and
the pipeline, the accumulation and the remat policies see a block like any other; the loss a run reports is the
cross-entropy alone. `routing` gives the router's logits of every layer, from which `load_balancing_loss` and
`z_loss` give their values.

Shapes: T tokens of a group, E experts, e = E/ep local experts, k choices, C capacity, h hidden, f expert width.
"""

from __future__ import annotations

import math
from functools import partial

import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name

from jaxseq import remat
from jaxseq.config import ModelConfig
from jaxseq.models.ops import swiglu
from jaxseq.sharding import Sharder

EXPERT_AXIS = "expert"  # the mesh axis the experts are split over (mesh.py)


def capacity(tokens: int, cfg: ModelConfig) -> int:
    """Slots per expert for a group of `tokens` tokens: min(T, ceil(factor·T·k/E)); dropless: T."""
    if cfg.moe_capacity_factor is None:
        return tokens
    return min(tokens, math.ceil(cfg.moe_capacity_factor * tokens * cfg.moe_top_k / cfg.moe_experts))


def route(logits, cfg: ModelConfig, bias=None):
    """Router logits [T, E] → (probabilities [T, E] float32, choices [T, k] int32, weights [T, k] float32): the
    softmax over every expert, its k largest (ties to the lower expert), their probabilities renormalised to sum to
    1 where cfg says so (Mixtral). With DeepSeek-V3's bias [E] the choice is the k largest of probability + bias,
    the weights still the probabilities."""
    probs = jax.nn.softmax(logits.astype(jnp.float32), axis=-1)
    scores = probs if bias is None else probs + jax.lax.stop_gradient(bias)
    _, choices = jax.lax.top_k(scores, cfg.moe_top_k)
    weights = jnp.take_along_axis(probs, choices, axis=-1)
    if cfg.moe_norm_topk:
        weights = weights / jnp.sum(weights, axis=-1, keepdims=True)
    return probs, choices, weights


def assign_slots(choices, experts: int, slots: int):
    """Choices [T, k] → each assignment's slot in the [E·C] dispatch buffer (expert e's: e·C … e·C + C − 1), E·C
    where it is dropped: an expert's assignments in (choice, token) order, its first C kept."""
    tokens, k = choices.shape
    order = choices.T.reshape(-1)  # [k·T]: every first choice, then every second, …
    seen = jnp.cumsum(jax.nn.one_hot(order, experts, dtype=jnp.int32), axis=0)
    position = jnp.take_along_axis(seen, order[:, None], axis=1)[:, 0] - 1
    slot = jnp.where(position < slots, order * slots + position, experts * slots)
    return slot.reshape(k, tokens).T


def assignments(choices, experts: int):
    """[E] int32: how many of the group's assignments each expert received (kept or dropped)."""
    return jnp.sum(jax.nn.one_hot(choices, experts, dtype=jnp.int32), axis=(0, 1))


def dropped(counts, slots: int):
    """[E]: the assignments an expert given counts[e] of them drops, max(0, n − C)."""
    return jnp.maximum(counts - slots, 0)


def dispatch_plan(slot, weights, experts: int, slots: int):
    """(token of each slot [E·C] int32, T where empty; routing weight of each slot [E·C] float32, 0 where empty)."""
    tokens, k = slot.shape
    flat = slot.reshape(-1)
    token_ids = jnp.broadcast_to(jnp.arange(tokens, dtype=jnp.int32)[:, None], (tokens, k)).reshape(-1)
    token_of_slot = jnp.full((experts * slots,), tokens, jnp.int32).at[flat].set(token_ids, mode="drop")
    weight_of_slot = jnp.zeros((experts * slots,), jnp.float32).at[flat].set(weights.reshape(-1), mode="drop")
    return token_of_slot, weight_of_slot


def expert_mlps(buffer, wi, wo, shard: Sharder):
    """The local experts' SwiGLU on their slots: buffer [e, N, h] × wi [e, h, 2, f] → [e, N, 2, f] (split over
    `tensor` on f), SwiGLU, × wo [e, f, h] → [e, N, h] (the tensor ranks' partial sums reduced): batched GEMMs, one
    per expert, a plain einsum on every platform (models/cpu_matmul.py's form takes no batch index)."""
    hid = jnp.einsum("enh,ehcf->encf", buffer, wi)
    hid = checkpoint_name(shard(hid, None, None, None, "mlp"), remat.MOE_EXPERT_HIDDEN)
    out = jnp.einsum("enf,efh->enh", swiglu(hid), wo)
    return shard(out, None, None, None)


def load_balancing_loss(probs_sum, counts, tokens: int, experts: int):
    """The Switch/Mixtral load-balancing loss E·Σ_e (n_e/T)·(Σ_t p_te/T) from the probabilities' sums [E] and the
    assignment counts [E] of T tokens (transformers' `load_balancing_loss_func` for one layer: k where the
    routing is uniform). The counts carry no gradient."""
    return experts * jnp.sum(jax.lax.stop_gradient(counts.astype(jnp.float32)) / tokens * probs_sum / tokens)


def z_loss(logits):
    """The router z-loss (ST-MoE): the mean over tokens of logsumexp(logits)², logits [T, E]."""
    return jnp.mean(jnp.square(jax.nn.logsumexp(logits.astype(jnp.float32), axis=-1)))


@partial(jax.custom_vjp, nondiff_argnums=(2,))
def _with_loss(x, loss, seed: float):
    """x, with `loss` (a scalar) added to the training loss `seed` times: its cotangent is `seed` whatever x's is."""
    return x


_with_loss.defvjp(lambda x, loss, seed: (x, loss), lambda seed, loss, g: (g, loss * 0 + seed))


def moe(y, p, cfg: ModelConfig, shard: Sharder, bias=None):
    """The MoE MLP of the normed stream y [b, s(/t), h] → ([b, s(/t), h] before dropout, router logits [b, s, E]).
    p: {"router": {"kernel": [h, E]}, "experts": {"wi": [E, h, 2, f], "wo": [E, f, h]}}, the
    experts split over `expert`. The tokens are gathered over `tensor` (every tensor rank routes them alike) and
    run on each rank's group (`Sharder.token_region`)."""
    whole = shard(y, "batch", "seq", None)
    weights = {"router": p["router"]["kernel"], "wi": p["experts"]["wi"]["kernel"], "wo": p["experts"]["wo"]["kernel"]}
    axes = {"router": (None, None), "wi": ("experts", None, None, "mlp"), "wo": ("experts", "mlp", None)}
    if bias is not None:
        weights["bias"], axes["bias"] = bias, (None,)
    out, logits = shard.token_region(partial(_group, cfg=cfg), whole, weights, axes)
    return shard(out, "batch", "seq_sp", None), logits


def _group(shard: Sharder, y, w, *, cfg: ModelConfig):
    """One routing group (inside `token_region`): y [b, s, h] this rank's tokens, w the router, this rank's experts
    and the bias. → (output [b, s, h], router logits [b, s, E])."""
    b, s, h = y.shape
    tokens, experts, token_axes = b * s, cfg.moe_experts, shard.token_axes
    ranks = math.prod(shard.mesh.shape[a] for a in token_axes) if token_axes else 1
    slots = capacity(tokens, cfg)
    x = y.reshape(tokens, h)
    w = {name: v if name == "bias" else _summed_in_float32(v, token_axes) for name, v in w.items()}
    logits = checkpoint_name(jnp.einsum("th,he->te", x, w["router"]).astype(jnp.float32), remat.MOE_ROUTER_LOGITS)
    probs, choices, weights = route(logits, cfg, w.get("bias"))
    token_of_slot, weight_of_slot = dispatch_plan(assign_slots(choices, experts, slots), weights, experts, slots)
    token_of_slot = checkpoint_name(token_of_slot, remat.MOE_ROUTING)
    weight_of_slot = checkpoint_name(weight_of_slot, remat.MOE_ROUTING)

    buffer = jnp.take(x, token_of_slot, axis=0, mode="fill", fill_value=0).reshape(experts, slots, h)
    buffer = checkpoint_name(_exchange(buffer, EXPERT_AXIS in token_axes, forward=True), remat.MOE_DISPATCHED)
    out = expert_mlps(buffer, w["wi"], w["wo"], shard)
    out = checkpoint_name(_exchange(out, EXPERT_AXIS in token_axes, forward=False), remat.MOE_EXPERT_OUTPUT)
    combined = jnp.zeros((tokens, h), jnp.float32).at[token_of_slot].add(
        out.reshape(experts * slots, h).astype(jnp.float32) * weight_of_slot[:, None], mode="drop")

    # The balancing terms of the whole micro-batch: this group's share of each, its gradient seeded as the ranks'
    # losses are weighed (`Sharder.averaged_ranks`, `Sharder.loss_seed`).
    total, seed, bias = tokens * ranks, shard.averaged_ranks * shard.loss_seed, w.get("bias")
    if cfg.moe_aux_loss_coef or bias is not None:  # the micro-batch's assignments (one all-reduce of E integers)
        counts = assignments(choices, experts)
        counts = checkpoint_name(jax.lax.psum(counts, token_axes) if token_axes else counts, remat.MOE_LOADS)
    if cfg.moe_aux_loss_coef:
        aux = load_balancing_loss(jnp.sum(probs, axis=0), counts, total, experts)  # summed over the ranks: the loss
        combined = _with_loss(combined, aux, cfg.moe_aux_loss_coef * seed)
    if cfg.moe_z_loss_coef:
        combined = _with_loss(combined, z_loss(logits) / ranks, cfg.moe_z_loss_coef * seed)
    if bias is not None:
        combined = _balance_bias(combined, bias, counts)
    return combined.astype(y.dtype).reshape(b, s, h), logits.reshape(b, s, experts)


def _summed_in_float32(weight, axes):
    """`weight` (every rank of `axes` holds it whole, or its experts' share) typed as varying over `axes` in float32,
    then cast back: the transpose of that cast sums the ranks' gradients, and it sums them in float32, as the step
    reduces every gradient (and XLA:CPU aborts promoting a bfloat16 one whose reduction carries a sharding constraint,
    `AllReducePromotion`)."""
    missing = tuple(a for a in axes if a not in jax.typeof(weight).mat.varying)
    if not missing:
        return weight
    return jax.lax.pcast(weight.astype(jnp.float32), missing, to="varying").astype(weight.dtype)


def _exchange(buffer, over_experts: bool, forward: bool):
    """Dispatch (forward=True): this rank's slots of every expert [E, C, h] → its experts' slots from every rank
    [e, ep·C, h], one all-to-all over `expert`. Combine (False): the inverse. Without an expert axis, the buffer."""
    if not over_experts:
        return buffer
    if forward:
        received = jax.lax.all_to_all(buffer, EXPERT_AXIS, 0, 0, tiled=True)  # [ep·e, C, h], by source rank
        ep = jax.lax.axis_size(EXPERT_AXIS)
        e, c, h = received.shape[0] // ep, received.shape[1], received.shape[2]
        return received.reshape(ep, e, c, h).swapaxes(0, 1).reshape(e, ep * c, h)
    e, n, h = buffer.shape
    ep = jax.lax.axis_size(EXPERT_AXIS)
    back = buffer.reshape(e, ep, n // ep, h).swapaxes(0, 1).reshape(ep * e, n // ep, h)
    return jax.lax.all_to_all(back, EXPERT_AXIS, 0, 0, tiled=True)  # [E, C, h], in expert order


def _balance_bias(x, bias, counts):
    """x, with the aux-loss-free bias's update direction as the bias's gradient: n_e − k·T/E over the micro-batch
    (positive for an expert over its share). The bias's optimizer moves it by −γ·sign of that (DeepSeek-V3:
    b_e += γ·sign(mean load − load_e)); any positive scale the step's reductions apply keeps the sign."""
    load = counts.astype(jnp.float32)
    return _with_direction(x, bias, load - jnp.mean(load))


@jax.custom_vjp
def _with_direction(x, bias, direction):
    return x


_with_direction.defvjp(lambda x, bias, direction: (x, direction),
                       lambda direction, g: (g, direction, jnp.zeros_like(direction)))
