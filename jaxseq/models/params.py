"""What a family declares: each parameter once in its table (`Param`), and every tree the rest of jaxseq
needs (shapes, logical axes, PartitionSpecs, init, weight decay, cast, the parameter count) derived from it;
and its `Traits`, what the cost side (formulas, the plan's and the search's memory and time models) asks of
a family beyond its parameters.

A family (models/gpt.py, models/llama.py) writes its table and its traits; the functions here are the same for all.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import jax
import jax.numpy as jnp

from jaxseq.config import ModelConfig


@dataclass(frozen=True)
class Param:
    """One parameter's declaration. `dims` name the shape symbolically: L layers, V padded vocabulary,
    s positions, h hidden, a heads, k K/V heads, d head width, f MLP width, 2 and 3 (stacked projections), E experts,
    g the shared experts' width."""

    dims: tuple[str, ...]
    axes: tuple[str | None, ...]  # logical axes; mesh.logical_rules maps them to mesh axes
    init: str  # "normal" N(0, 0.02), "residual" N(0, 0.02/sqrt(2L)), "zeros", "ones"
    decay: bool  # AdamW weight decay applies (kernels and the token embedding)
    cast: bool  # copied to the compute dtype each step (norm parameters stay float32)
    update: str = "adamw"  # how the optimizer moves it: AdamW, or "sign", −rate·sign(its gradient) (DeepSeek-V3's
    # aux-loss-free balancing bias, whose "gradient" is each expert's load above its share: models/experts.py)


@dataclass(frozen=True)
class Traits:
    """What the formulas and the plan's and search's cost models read of a family (its layer's shapes come
    from the config, its parameters from its table)."""

    norm_stat_bytes: int  # float32 bytes per token a norm keeps for backward (LayerNorm: mean, 1/std; RMSNorm: 1/rms)
    mlp_up_widths: int  # the first MLP matmul's output in MLP widths f (GELU's input: 1; SwiGLU's gate and up: 2)
    mlp_elementwise: tuple[int, int]  # bytes per MLP element (s·b·f/t) of its activation, in activation
    # itemsizes e, forward and backward (GELU + bias: 2e, 3e; SwiGLU: 3e, 5e)
    learned_positions: bool  # a position table added at the lookup (read, add, write: 3e per element; else 2e)
    rotary: bool  # RoPE on q and the K heads: read and write each, forward and backward
    papers_formulas: bool  # the papers' GPT formulas (Table 2, 72·B·s·L·h²·…) describe it
    shape_fields: tuple[tuple[str, str], ...]  # what a plan's header prints beyond h, a, L, s, V: (label, the
    # ModelConfig attribute it shows) each


def kernel(dims, axes, init="normal") -> Param:
    return Param(dims, axes, init, decay=True, cast=True)


def bias(dims, axes) -> Param:
    return Param(dims, axes, "zeros", decay=False, cast=True)


def norm_scale(layers: bool) -> Param:
    dims, axes = (("L", "h"), ("layers", None)) if layers else (("h",), (None,))
    return Param(dims, axes, "ones", decay=False, cast=False)


def norm_bias(layers: bool) -> Param:
    dims, axes = (("L", "h"), ("layers", None)) if layers else (("h",), (None,))
    return Param(dims, axes, "zeros", decay=False, cast=False)


def is_param(x) -> bool:
    return isinstance(x, Param)


def derive(table: dict, fn, *trees):
    """A tree like `table` with fn(declaration, *leaves) at each parameter."""
    return jax.tree.map(fn, table, *trees, is_leaf=is_param)


def sizes(cfg: ModelConfig, tensor: int) -> dict[str, int]:
    """What each symbolic dimension of a declaration is for `cfg` on `tensor` ranks."""
    return {"L": cfg.layers, "V": cfg.padded_vocab(tensor), "s": cfg.seq_len, "h": cfg.hidden, "a": cfg.heads,
            "k": cfg.num_kv_heads, "d": cfg.head_dim, "f": cfg.mlp_hidden, "2": 2, "3": 3,
            "E": cfg.moe_experts, "g": cfg.moe_shared_experts * cfg.mlp_hidden}


def count(table: dict, cfg: ModelConfig) -> int:
    """Trainable parameters, the vocabulary unpadded (`sizes` at t = 1 with V = the vocabulary)."""
    n = sizes(cfg, 1) | {"V": cfg.vocab_size}
    return sum(math.prod(n[d] for d in p.dims) for p in jax.tree.leaves(table, is_leaf=is_param))


def shapes(table: dict, cfg: ModelConfig, tensor: int) -> dict:
    n = sizes(cfg, tensor)
    return derive(table, lambda p: tuple(n[d] for d in p.dims))


def init(table: dict, key: jax.Array, cfg: ModelConfig, tensor: int) -> dict:
    """GPT-2's initialisation (Megatron's for both families): N(0, 0.02), residual projections scaled by
    1/sqrt(2L), zero biases, unit norm scales."""
    std = {"normal": 0.02, "residual": 0.02 / math.sqrt(2 * cfg.layers)}
    shape_tree = shapes(table, cfg, tensor)
    keys = jax.tree.unflatten(jax.tree.structure(shape_tree, is_leaf=lambda x: isinstance(x, tuple)),
                              list(jax.random.split(key, len(jax.tree.leaves(table, is_leaf=is_param)))))

    def one(p: Param, shape, k):
        if p.init == "zeros":
            return jnp.zeros(shape, jnp.float32)
        if p.init == "ones":
            return jnp.ones(shape, jnp.float32)
        return std[p.init] * jax.random.normal(k, shape, jnp.float32)

    return derive(table, one, shape_tree, keys)


def drop_layer_axis(axes: dict) -> dict:
    """Logical axes of one layer's parameters (the scan slices off the leading `layers` axis)."""
    return jax.tree.map(lambda a: a[1:], axes, is_leaf=lambda a: isinstance(a, tuple))
