"""The GPT: vocab-parallel embedding, a scanned stack of pre-LN blocks, vocab-parallel cross-entropy.

Plain JAX functions over a parameter pytree. Why not Flax modules: what a layer stores for backward
is decided by the exact ops autodiff sees, and here every one of them is visible in one screen.
Tensor parallelism comes from the parameter specs (`param_axes`), sequence parallelism from the
activation constraints (`shard(x, "batch", "seq_sp", None)`); XLA inserts the collectives.

Shapes: b batch, s sequence, h hidden, a heads, d head_dim, f mlp width, V padded vocabulary.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import partial

import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name
from jax.extend.random import threefry2x32_p

from jaxseq.config import ModelConfig, ParallelConfig
from jaxseq.mesh import logical_rules, logical_to_spec
from jaxseq import remat as R
from jaxseq.sharding import Sharder

# ---------------------------------------------------------------------------------------------
# Parameters: each declared once; shapes, logical axes, init, weight decay and cast derive from it


@dataclass(frozen=True)
class Param:
    """One parameter's declaration. `dims` name the shape symbolically: L layers, V padded vocabulary,
    s positions, h hidden, a heads, d head width, f MLP width, 3 (q, k, v)."""

    dims: tuple[str, ...]
    axes: tuple[str | None, ...]  # logical axes; mesh.logical_rules maps them to mesh axes
    init: str  # "normal" N(0, 0.02), "residual" N(0, 0.02/sqrt(2L)), "zeros", "ones"
    decay: bool  # AdamW weight decay applies (kernels and the token embedding)
    cast: bool  # copied to the compute dtype each step (LayerNorm parameters stay float32)


def _kernel(dims, axes, init="normal") -> Param:
    return Param(dims, axes, init, decay=True, cast=True)


def _bias(dims, axes) -> Param:
    return Param(dims, axes, "zeros", decay=False, cast=True)


def _layer_norm(layers: bool) -> dict:
    dims, axes = (("L", "h"), ("layers", None)) if layers else (("h",), (None,))
    return {"scale": Param(dims, axes, "ones", decay=False, cast=False),
            "bias": Param(dims, axes, "zeros", decay=False, cast=False)}


# QKV and MLP-up are column-parallel (heads / mlp split), the projection and MLP-down are
# row-parallel, the token embedding is vocab-parallel. The QKV kernel is [h, 3, a, d] so that
# splitting heads keeps each rank's Q, K and V together.
PARAMS = {
    "embed": {"token": _kernel(("V", "h"), ("vocab", None)),
              "position": Param(("s", "h"), (None, None), "normal", decay=False, cast=True)},
    "layers": {
        "ln1": _layer_norm(layers=True),
        "attn": {
            "qkv": {"kernel": _kernel(("L", "h", "3", "a", "d"), ("layers", None, None, "heads", None)),
                    "bias": _bias(("L", "3", "a", "d"), ("layers", None, "heads", None))},
            "out": {"kernel": _kernel(("L", "a", "d", "h"), ("layers", "heads", None, None), "residual"),
                    "bias": _bias(("L", "h"), ("layers", None))},
        },
        "ln2": _layer_norm(layers=True),
        "mlp": {
            "wi": {"kernel": _kernel(("L", "h", "f"), ("layers", None, "mlp")), "bias": _bias(("L", "f"), ("layers", "mlp"))},
            "wo": {"kernel": _kernel(("L", "f", "h"), ("layers", "mlp", None), "residual"),
                   "bias": _bias(("L", "h"), ("layers", None))},
        },
    },
    "final_ln": _layer_norm(layers=False),
}


def _derive(fn, *trees):
    """A tree like PARAMS with fn(declaration, *leaves) at each parameter."""
    return jax.tree.map(fn, PARAMS, *trees, is_leaf=lambda x: isinstance(x, Param))


def param_axes() -> dict:
    """Logical axes of every parameter."""
    return _derive(lambda p: p.axes)


def param_specs(parallel: ParallelConfig) -> dict:
    """PartitionSpecs of the weights the layers compute with (`mesh.logical_rules` of `param_axes`): split
    over `tensor` (and the stacked layers over `pipe`), replicated over `data`."""
    rules = logical_rules(parallel.sequence_parallel, parallel.pipe > 1)
    return _derive(lambda p: logical_to_spec(p.axes, rules))


def param_shapes(cfg: ModelConfig, tensor: int) -> dict:
    sizes = {"L": cfg.layers, "V": cfg.padded_vocab(tensor), "s": cfg.seq_len, "h": cfg.hidden, "a": cfg.heads,
             "d": cfg.head_dim, "f": cfg.mlp_hidden, "3": 3}
    return _derive(lambda p: tuple(sizes[d] for d in p.dims))


def decay_mask() -> dict:
    """True where AdamW applies weight decay (kernels, token embedding); not biases, LayerNorm, positions."""
    return _derive(lambda p: p.decay)


def cast_mask() -> dict:
    """True where a parameter is copied to the compute dtype; LayerNorm parameters stay float32."""
    return _derive(lambda p: p.cast)


def vocab_mask() -> dict:
    """True where a parameter's rows are the padded vocabulary V (re-padded when the tensor size changes)."""
    return _derive(lambda p: p.dims[0] == "V")


def init_params(key: jax.Array, cfg: ModelConfig, tensor: int = 1) -> dict:
    """GPT-2 initialisation: N(0, 0.02), residual projections scaled by 1/sqrt(2L), zero biases, unit LN."""
    std = {"normal": 0.02, "residual": 0.02 / math.sqrt(2 * cfg.layers)}
    shapes = param_shapes(cfg, tensor)
    keys = jax.tree.unflatten(jax.tree.structure(shapes, is_leaf=lambda x: isinstance(x, tuple)),
                              list(jax.random.split(key, len(jax.tree.leaves(PARAMS)))))

    def init(p: Param, shape, k):
        if p.init == "zeros":
            return jnp.zeros(shape, jnp.float32)
        if p.init == "ones":
            return jnp.ones(shape, jnp.float32)
        return std[p.init] * jax.random.normal(k, shape, jnp.float32)

    return _derive(init, shapes, keys)


# ---------------------------------------------------------------------------------------------
# Ops whose backward stores exactly what Megatron's does (custom VJPs: plain jnp versions store more)


@partial(jax.custom_vjp, nondiff_argnums=(3,))
def layer_norm(x, scale, bias, eps):
    y, _ = _layer_norm_fwd(x, scale, bias, eps)
    return y


def _ln_stats(x, eps):
    xf = x.astype(jnp.float32)
    mean = jnp.mean(xf, axis=-1, keepdims=True)
    rstd = jax.lax.rsqrt(jnp.mean(jnp.square(xf - mean), axis=-1, keepdims=True) + eps)
    return mean, rstd


def _layer_norm_fwd(x, scale, bias, eps):
    mean, rstd = _ln_stats(x, eps)
    mean, rstd = checkpoint_name(mean, R.LN_STATS), checkpoint_name(rstd, R.LN_STATS)
    y = ((x.astype(jnp.float32) - mean) * rstd * scale + bias).astype(x.dtype)
    return y, (x, mean, rstd, scale)


def _layer_norm_bwd(eps, res, g):
    x, mean, rstd, scale = res
    xhat = (x.astype(jnp.float32) - mean) * rstd
    g = g.astype(jnp.float32)
    dscale = jnp.sum(g * xhat, axis=tuple(range(g.ndim - 1)))
    dbias = jnp.sum(g, axis=tuple(range(g.ndim - 1)))
    gx = g * scale
    dx = rstd * (gx - jnp.mean(gx, axis=-1, keepdims=True) - xhat * jnp.mean(gx * xhat, axis=-1, keepdims=True))
    return dx.astype(x.dtype), dscale.astype(scale.dtype), dbias.astype(scale.dtype)


layer_norm.defvjp(_layer_norm_fwd, _layer_norm_bwd)

_GELU_C = math.sqrt(2.0 / math.pi)


def _gelu_f32(x):
    return 0.5 * x * (1.0 + jnp.tanh(_GELU_C * (x + 0.044715 * x**3)))


def _gelu(x):
    # Named here, not only in `gelu`: the VJP's forward must itself produce the tagged value.
    return checkpoint_name(_gelu_f32(x.astype(jnp.float32)).astype(x.dtype), R.GELU_OUTPUT)


@jax.custom_vjp
def gelu(x):
    """GPT-2's tanh GELU; backward keeps only the input (jax.nn.gelu's autodiff keeps more)."""
    return _gelu(x)


def _gelu_fwd(x):
    return _gelu(x), x


def _gelu_bwd(x, g):
    xf = x.astype(jnp.float32)
    u = _GELU_C * (xf + 0.044715 * xf**3)
    t = jnp.tanh(u)
    dgelu = 0.5 * (1.0 + t) + 0.5 * xf * (1.0 - t * t) * _GELU_C * (1.0 + 3 * 0.044715 * xf * xf)
    return ((g.astype(jnp.float32) * dgelu).astype(x.dtype),)


gelu.defvjp(_gelu_fwd, _gelu_bwd)


def _causal_softmax(scores, scale):
    s_q, s_k = scores.shape[-2:]
    causal = jnp.tril(jnp.ones((s_q, s_k), dtype=bool))
    logits = jnp.where(causal, scores.astype(jnp.float32) * scale, -jnp.inf)
    probs = jax.nn.softmax(logits, axis=-1).astype(scores.dtype)
    return checkpoint_name(probs, R.ATTN_PROBS)


@partial(jax.custom_vjp, nondiff_argnums=(1,))
def causal_softmax(scores, scale):
    """softmax(scale·scores) over keys with a causal mask, in float32; backward keeps only the output."""
    return _causal_softmax(scores, scale)


def _softmax_fwd(scores, scale):
    probs = _causal_softmax(scores, scale)
    return probs, probs


def _softmax_bwd(scale, probs, g):
    p, g = probs.astype(jnp.float32), g.astype(jnp.float32)
    ds = p * (g - jnp.sum(g * p, axis=-1, keepdims=True)) * scale  # masked entries have p = 0
    return (ds.astype(probs.dtype),)


causal_softmax.defvjp(_softmax_fwd, _softmax_bwd)


@partial(jax.custom_vjp, nondiff_argnums=(2,))
def _add_bias(x, bias, bias_ndim):
    return x + bias


def _add_bias_fwd(x, bias, bias_ndim):
    return x + bias, None


def _add_bias_bwd(bias_ndim, _, g):
    axes = tuple(range(g.ndim - bias_ndim))
    return g, jnp.sum(g.astype(jnp.float32), axis=axes).astype(g.dtype)


_add_bias.defvjp(_add_bias_fwd, _add_bias_bwd)


def add_bias(x, bias):
    """x + bias over x's trailing axes. Backward sums the bias gradient in float32 explicitly (the
    sum any backend accumulates in f32 anyway): left to autodiff, a bf16 sum over every token
    becomes a slow pairwise reduce-window on XLA:CPU."""
    return _add_bias(x, bias.astype(x.dtype), bias.ndim)


def dropout(x, rate: float, key, mask_name: str):
    """Inverted dropout whose backward keeps only the 1-byte mask (regenerable from `key`).

    The mask is `jax.random.bernoulli(key, 1 − rate, global shape)`, whatever the sharding: inside a region
    manual over `data` (the pipeline executor) x holds one data rank's rows of the batch, and the rank draws
    exactly those rows of the global mask (`bernoulli_rows`)."""
    if rate == 0.0 or key is None:
        return x
    mesh = jax.sharding.get_abstract_mesh()
    if not mesh.empty and "data" in mesh.manual_axes:
        keep = bernoulli_rows(key, 1.0 - rate, x.shape, jax.lax.axis_index("data") * x.shape[0])
    else:
        keep = jax.random.bernoulli(key, 1.0 - rate, x.shape)
    keep = checkpoint_name(keep, mask_name)
    return jnp.where(keep, x / jnp.asarray(1.0 - rate, x.dtype), jnp.zeros((), x.dtype))


def _mul_u32(x, c: int):
    """(high, low) uint32 words of the 64-bit product x · c (x: uint32 array, 0 ≤ c < 2³²)."""
    u = lambda v: jnp.asarray(v, jnp.uint32)
    x_lo, x_hi, c_lo, c_hi = x & u(0xFFFF), x >> u(16), c & 0xFFFF, c >> 16
    ll, lh, hl, hh = x_lo * u(c_lo), x_lo * u(c_hi), x_hi * u(c_lo), x_hi * u(c_hi)
    mid = (ll >> u(16)) + (lh & u(0xFFFF)) + (hl & u(0xFFFF))
    return hh + (lh >> u(16)) + (hl >> u(16)) + (mid >> u(16)), (ll & u(0xFFFF)) | (mid << u(16))


def bernoulli_rows(key, p: float, shape, first_row):
    """Rows first_row … first_row + shape[0] − 1 of `jax.random.bernoulli(key, p, (R, *shape[1:]))` for any
    R past them, computing only those rows.

    Why: `jax_threefry_partitionable` (on by default) makes element i of a random array threefry(key, i),
    i its row-major index as two uint32 words, and a float32 uniform is the top 23 bits as a mantissa in
    [1, 2) minus 1; that is what this recomputes at an offset (jax.random offers no offset). It leans on
    JAX's implementation: tests/test_pipeline.py compares it with jax.random.bernoulli."""
    u = lambda v: jnp.asarray(v, jnp.uint32)
    row_size = math.prod(shape[1:])
    if str(jax.random.key_impl(key)) != "threefry2x32" or row_size >= 2**32:
        raise ValueError(f"bernoulli_rows needs a threefry2x32 key and rows under 2³² elements, got "
                         f"{str(jax.random.key_impl(key))}, {row_size}")
    rows = jax.lax.broadcasted_iota(jnp.uint32, shape, 0) + jnp.asarray(first_row).astype(jnp.uint32)
    within, stride = jnp.zeros(shape, jnp.uint32), 1
    for axis in range(len(shape) - 1, 0, -1):
        within = within + jax.lax.broadcasted_iota(jnp.uint32, shape, axis) * u(stride)
        stride *= shape[axis]
    hi, lo = _mul_u32(rows, row_size)
    index_lo = lo + within
    index_hi = hi + (index_lo < lo).astype(jnp.uint32)  # the carry
    words = jax.random.key_data(key)
    bits1, bits2 = threefry2x32_p.bind(words[0], words[1], index_hi, index_lo)
    bits = bits1 ^ bits2
    # The primitive's type drops the manual axes its inputs vary over (inside shard_map): restore them.
    varying = (jax.typeof(words).mat.varying | jax.typeof(index_lo).mat.varying) - jax.typeof(bits).mat.varying
    bits = jax.lax.pcast(bits, tuple(sorted(varying)), to="varying") if varying else bits
    mantissa = (bits >> u(9)) | u(0x3F800000)
    return jax.lax.bitcast_convert_type(mantissa, jnp.float32) - jnp.float32(1.0) < jnp.float32(p)


# ---------------------------------------------------------------------------------------------
# Matmuls: bf16 operands, float32 accumulation, one rounding of the output


def matmul(spec: str, x, w, platform: str):
    """jnp.einsum(spec, x, w) for activations x times a weight w, written for the platform so that a
    bf16 matmul runs as one.

    A bf16 GEMM accumulates in float32 and rounds its output once; cuBLAS runs a plain bf16 einsum so,
    and off CPU this is just that einsum. XLA:CPU instead runs every plain bf16 dot (forward and both
    backward) by converting its operands to float32: float32 speed, plus the converts. Asked for a
    float32 result, the same dot runs natively (AVX512-BF16, AMX): twice the float32 rate here
    (docs/DESIGN.md, "bf16 matmuls on CPU"). So on CPU a bf16 matmul is that dot and one rounding, under a
    custom VJP whose two backward dots are written the same way. The numbers are the same (a bf16
    product is exact in float32; only the order of the float32 sums may differ), and so is what a
    layer stores: JAX's dot policies cannot see a dot inside a custom VJP, so its output carries the
    name R.MATMUL, which the `dots` policies save too."""
    if platform != "cpu" or x.dtype != jnp.bfloat16 or w.dtype != jnp.bfloat16:
        return jnp.einsum(spec, x, w)
    xs, ws, out = _indices(spec)
    if set(xs) & set(ws) & set(out) or not set(xs) <= set(ws + out) or not set(ws) <= set(xs + out):
        raise ValueError(f"matmul {spec!r}: not activations × weight (a batch index, or one summed within an operand)")
    return checkpoint_name(_matmul_f32_accumulated(spec, x, w), R.MATMUL)


def _indices(spec: str) -> tuple[str, str, str]:
    """"bsh,hf->bsf" → ("bsh", "hf", "bsf")."""
    operands, out = spec.split("->")
    a, b = operands.split(",")
    return a, b, out


def _transposed(x, perm):
    """An operand x transposed by perm, as its own op: an optimization barrier keeps XLA from folding the
    transpose into the dot that consumes it. (A result's transpose needs the barrier on the other
    side, between the dot and the transpose: `_dot_rounded` writes that one.)"""
    return x if list(perm) == sorted(perm) else jax.lax.optimization_barrier(jnp.transpose(x, perm))


def _dot_rounded(spec: str, a, b, dtype):
    """einsum(spec, a, b) (no batch indices) accumulated in float32 and rounded to dtype, written as a
    dot of [m, k] × [k, n] operands: the form XLA:CPU's bf16 kernels (YNNPACK) take, while its generic
    dot kernel runs no bf16 × bf16 → f32 dot at all. Left to itself, XLA folds a weight gradient's
    transposes into its dot, which then fails to run ("Unsupported element type for DotThunk")."""
    sa, sb, so = _indices(spec)
    contract = [i for i in sa if i in sb]
    m, n = [i for i in sa if i not in sb], [i for i in sb if i not in sa]
    a = _transposed(a, [sa.index(i) for i in m + contract])
    b = _transposed(b, [sb.index(i) for i in contract + n])
    k = tuple(range(len(contract)))
    y = jax.lax.dot_general(a, b, ((tuple(len(m) + i for i in k), k), ((), ())), preferred_element_type=jnp.float32)
    perm = [(m + n).index(i) for i in so]
    y = y.astype(dtype)
    return y if perm == sorted(perm) else jnp.transpose(jax.lax.optimization_barrier(y), perm)


def _einsum_rounded(spec: str, a, b, like):
    """einsum(spec, a, b) accumulated in float32, rounded to like's dtype, and summed over the manual
    mesh axes (inside shard_map) that it varies over and `like` does not: the psum JAX's own transpose
    adds for an operand that was replicated over them."""
    y = _dot_rounded(spec, a, b, like.dtype)
    extra = tuple(sorted(jax.typeof(y).mat.varying - jax.typeof(like).mat.varying))
    return jax.lax.psum(y, extra) if extra else y


@partial(jax.custom_vjp, nondiff_argnums=(0,))
def _matmul_f32_accumulated(spec, x, w):
    with jax.named_scope(spec):  # the op name jnp.einsum gives its dots, which planning/hlo.py's readers report
        return _dot_rounded(spec, x, w, x.dtype)


def _matmul_fwd(spec, x, w):
    return _matmul_f32_accumulated(spec, x, w), (x, w)


def _matmul_bwd(spec, res, g):
    x, w = res
    xs, ws, out = _indices(spec)
    with jax.named_scope(spec):  # named after the forward matmul, as JAX names an einsum's transposes
        return _einsum_rounded(f"{out},{ws}->{xs}", g, w, like=x), _einsum_rounded(f"{xs},{out}->{ws}", x, g, like=w)


_matmul_f32_accumulated.defvjp(_matmul_fwd, _matmul_bwd)


# ---------------------------------------------------------------------------------------------
# The transformer block


def attention(q, k, v, cfg: ModelConfig, key, shard: Sharder):
    """Causal attention over [b, s, a, d]; returns the context [b, s, a, d]."""
    if cfg.attention == "fused":
        # cuDNN flash attention on GPU (bf16/fp16), XLA elsewhere. No dropout argument exists, so
        # attention-probs dropout is not applied with the fused implementation.
        return jax.nn.dot_product_attention(q, k, v, is_causal=True)  # JAX picks cuDNN where it can
    scores = checkpoint_name(jnp.einsum("bqad,bkad->baqk", q, k), R.ATTN_SCORES)
    scores = shard(scores, "batch", "heads", None, None)
    probs = causal_softmax(scores, 1.0 / math.sqrt(cfg.head_dim))
    probs = checkpoint_name(dropout(probs, cfg.dropout, key, R.ATTN_DROPOUT_MASK), R.ATTN_PROBS_DROPOUT)
    return jnp.einsum("baqk,bkad->bqad", probs, v)


def _drop_layer_axis(axes: dict) -> dict:
    return jax.tree.map(lambda a: a[1:], axes, is_leaf=lambda a: isinstance(a, tuple))


# Logical axes of one layer's parameters (the scan slices off the leading `layers` axis).
LAYER_AXES = _drop_layer_axis(param_axes()["layers"])


def _linear(spec: str, platform: str):
    return lambda x, p: matmul(spec, x, p["kernel"], platform)


def block(x, p, key, cfg: ModelConfig, shard: Sharder):
    """One pre-LN block. x: [b, s, h], sequence-sharded between blocks under sequence parallelism."""
    train = key is not None
    k_attn, k_resid1, k_resid2 = jax.random.split(key, 3) if train else (None, None, None)
    x = checkpoint_name(shard(x, "batch", "seq_sp", None), R.DECODER_LAYER_INPUT)

    # Attention: LN on the (sequence-sharded) stream, all-gather, column-parallel QKV.
    y = checkpoint_name(shard(layer_norm(x, p["ln1"]["scale"], p["ln1"]["bias"], cfg.ln_eps), "batch", "seq_sp", None), R.QKV_INPUT)
    qkv = shard.column_parallel(_linear("bsh,hcad->bscad", shard.platform), y, {"kernel": p["attn"]["qkv"]["kernel"]},
                                {"kernel": LAYER_AXES["attn"]["qkv"]["kernel"]}, ("batch", None, None, "heads", None))
    qkv = add_bias(qkv, p["attn"]["qkv"]["bias"])
    # One split (backward: one concatenate), not three slices (backward: three zero-padded full-size
    # gradients summed).
    q, k, v = (t[:, :, 0] for t in jnp.split(qkv, 3, axis=2))
    q, k, v = checkpoint_name(q, R.QUERY), checkpoint_name(k, R.KEY), checkpoint_name(v, R.VALUE)
    ctx = checkpoint_name(shard(attention(q, k, v, cfg, k_attn, shard), "batch", None, "heads", None), R.CONTEXT)
    # Row-parallel projection: partial sums reduced (all-reduce; reduce-scatter with SP).
    out = add_bias(matmul("bsad,adh->bsh", ctx, p["attn"]["out"]["kernel"], shard.platform), p["attn"]["out"]["bias"])
    out = checkpoint_name(shard(out, "batch", "seq_sp", None), R.OUT_PROJ)
    x = checkpoint_name(x + dropout(out, cfg.dropout, k_resid1, R.ATTN_OUT_DROPOUT_MASK), R.MID_LAYER_RESIDUAL)

    # MLP: LN, all-gather, column-parallel up, GELU, row-parallel down.
    y = checkpoint_name(shard(layer_norm(x, p["ln2"]["scale"], p["ln2"]["bias"], cfg.ln_eps), "batch", "seq_sp", None), R.MLPWI_INPUT)
    hid = shard.column_parallel(_linear("bsh,hf->bsf", shard.platform), y, {"kernel": p["mlp"]["wi"]["kernel"]},
                                {"kernel": LAYER_AXES["mlp"]["wi"]["kernel"]}, ("batch", None, "mlp"))
    hid = add_bias(hid, p["mlp"]["wi"]["bias"])
    hid = checkpoint_name(shard(hid, "batch", None, "mlp"), R.MLPWI)
    out = add_bias(matmul("bsf,fh->bsh", gelu(hid), p["mlp"]["wo"]["kernel"], shard.platform), p["mlp"]["wo"]["bias"])
    out = checkpoint_name(shard(out, "batch", "seq_sp", None), R.MLPWO)
    x = x + dropout(out, cfg.dropout, k_resid2, R.MLP_DROPOUT_MASK)
    return shard(x, "batch", "seq_sp", None)


def decoder(x, layers, key, cfg: ModelConfig, shard: Sharder, remat: str):
    """The layer stack under lax.scan, each layer under jax.checkpoint with the named policy.

    Scan keeps compile time flat in depth, and it is what makes remat work on XLA:CPU (unrolled
    layers let CSE undo the checkpoint). Residuals become stacked [L, …] buffers of the loop.
    """
    policy = R.remat_policy(remat).policy
    body = jax.checkpoint(partial(block, cfg=cfg, shard=shard), policy=policy, prevent_cse=False)
    layer_keys = None if key is None else jax.random.split(key, cfg.layers)

    def step(x, inputs):
        p, k = inputs
        return body(x, p, k), None

    x, _ = jax.lax.scan(step, x, (layers, layer_keys))
    return x


def cast_params(params, dtype):
    """Compute-dtype copy of the weights, made once per step *outside* the scan (a cast inside a
    layer would be stored for backward as if it were an activation)."""
    return jax.tree.map(lambda p, cast: p.astype(dtype) if cast else p, params, cast_mask())


def hidden_states(params, tokens, cfg: ModelConfig, shard: Sharder, remat: str, key=None):
    """tokens [b, s] → final-LN output [b, s, h] (sequence-sharded under SP). key=None: no dropout."""
    dtype = jnp.dtype(cfg.dtype)
    params = cast_params(params, dtype)
    k_embed, k_layers = jax.random.split(key) if key is not None else (None, None)
    # Vocab-parallel lookup: each rank masks its rows and the ranks reduce (reduce-scatter with SP).
    x = shard.embed(params["embed"]["token"], tokens)
    x = shard(x + params["embed"]["position"][: tokens.shape[1]], "batch", "seq_sp", None)
    x = dropout(x, cfg.dropout, k_embed, R.EMBED_DROPOUT_MASK)
    x = decoder(x, params["layers"], k_layers, cfg, shard, remat)
    return layer_norm(x, params["final_ln"]["scale"], params["final_ln"]["bias"], cfg.ln_eps)


def logits_fn(params, x, cfg: ModelConfig, shard: Sharder):
    """Tied-embedding logits [b, s, V] sharded over vocab; padded vocabulary entries are -inf.
    A column-parallel matmul over the vocabulary (all-gathering the sequence under SP)."""
    emb = {"token": params["embed"]["token"].astype(x.dtype)}
    logits = shard.column_parallel(lambda y, p: matmul("bsh,vh->bsv", y, p["token"], shard.platform), x, emb,
                                   {"token": ("vocab", None)}, ("batch", None, "vocab"))
    logits = shard(logits.astype(jnp.float32), "batch", None, "vocab")
    vocab_ids = jax.lax.broadcasted_iota(jnp.int32, logits.shape, 2)
    return jnp.where(vocab_ids < cfg.vocab_size, logits, -jnp.inf)


def cross_entropy(logits, targets):
    """Mean token cross-entropy of vocab-sharded logits, never gathering the vocabulary (Megatron's
    vocab-parallel cross-entropy: each rank's max, sum-exp and target logit, reduced across ranks)."""
    vocab_ids = jax.lax.broadcasted_iota(jnp.int32, logits.shape, 2)
    m = jax.lax.stop_gradient(jnp.max(logits, axis=-1, keepdims=True))
    lse = jnp.log(jnp.sum(jnp.exp(logits - m), axis=-1)) + m[..., 0]
    target = jnp.sum(jnp.where(vocab_ids == targets[..., None], logits, 0.0), axis=-1)
    return jnp.mean(lse - target)


def loss_fn(params, batch, cfg: ModelConfig, shard: Sharder, remat: str, key=None):
    """Next-token loss of batch = {"inputs": [b, s], "targets": [b, s]} (int32)."""
    x = hidden_states(params, batch["inputs"], cfg, shard, remat, key)
    return cross_entropy(logits_fn(params, x, cfg, shard), batch["targets"])
