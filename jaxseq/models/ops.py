"""The ops the model families share, each written so that its backward stores exactly what Megatron-LM's
does (custom VJPs where plain jnp versions would store more), and the portable matmul.

Shapes: b batch, s sequence, h hidden, a heads, k K/V heads, d head_dim, f MLP width, V padded vocabulary.
"""

from __future__ import annotations

import math
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
from jax.ad_checkpoint import checkpoint_name
from jax.extend.random import threefry2x32_p

from jaxseq.config import ModelConfig
from jaxseq import remat
from jaxseq import deferred
from jaxseq.models import documents, fp8
from jaxseq.models.cpu_matmul import bf16_matmul
from jaxseq.models.cudnn_attention import cudnn_attention
from jaxseq.sharding import Sharder

# ---------------------------------------------------------------------------------------------
# Matmuls

# ModelConfig.matmul → the function a weight matmul runs (`jnp.einsum` signature). The model names
# the portable einsum; an edge may choose the CPU form (models/cpu_matmul.py) once, in the config.
MATMULS = {"einsum": jnp.einsum, "cpu-bf16": bf16_matmul}


def matmul(spec: str, x, w, cfg: ModelConfig, layer: bool = True):
    """jnp.einsum(spec, x, w) for activations x times a weight w, in the form cfg.matmul names: with cfg.fp8 a layer's
    (`layer`; the LM head passes False) an FP8 GEMM in that form (models/fp8.py); a `Deferred` w (zb-h1's split
    backward) leaves its gradient to the pipeline's W op."""
    op = partial(fp8.matmul, form=cfg.matmul) if cfg.fp8 and layer else MATMULS[cfg.matmul]
    return deferred.apply(partial(op, spec), x, w)


# ---------------------------------------------------------------------------------------------
# Elementwise and normalisation ops


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
    mean, rstd = checkpoint_name(mean, remat.NORM_STATS), checkpoint_name(rstd, remat.NORM_STATS)
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
    return checkpoint_name(_gelu_f32(x.astype(jnp.float32)).astype(x.dtype), remat.MLP_ACTIVATION)


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


def causal_mask(order, s_q: int, s_k: int):
    """[s_q, s_k] bool: query i sees key j. order: the global positions of the stored queries and keys (one
    array for both, or a (queries, keys) pair: context parallelism), or None (natural order)."""
    if order is None:
        return jnp.tril(jnp.ones((s_q, s_k), dtype=bool))
    q_order, k_order = order if isinstance(order, tuple) else (order, order)
    return jnp.asarray(q_order)[:, None] >= jnp.asarray(k_order)[None, :]


def document_causal_mask(order, segments, like):
    """[b, s_q, s_k] bool: `causal_mask` and, with packed documents, query and key in the same document.
    segments: (query segments [b, s_q], key segments [b, s_k]) (models/documents.py). They pass an optimization
    barrier with `like` (the scores, or the queries): the mask is the same in every layer, and left alone the layer
    scan's partial evaluation (or XLA) would make it once outside the loop and hold it, b·s_q·s_k bytes."""
    segments, _ = jax.lax.optimization_barrier((segments, like))
    same = documents.same_document(*segments)
    return causal_mask(order, *same.shape[-2:])[None] & same


def _causal_softmax(scores, scale, order, segments=None):
    if segments is None:
        causal = causal_mask(order, *scores.shape[-2:])
    else:  # [b, s_q, s_k] → [b, 1…, s_q, s_k] over the scores' head axes
        causal = document_causal_mask(order, segments, scores)
        causal = causal.reshape(causal.shape[0], *(1,) * (scores.ndim - 3), *causal.shape[1:])
    logits = jnp.where(causal, scores.astype(jnp.float32) * scale, -jnp.inf)
    probs = jax.nn.softmax(logits, axis=-1).astype(scores.dtype)
    return checkpoint_name(probs, remat.ATTN_PROBS)


def causal_softmax(scores, scale, order=None, segments=None):
    """softmax(scale·scores) over keys with a causal mask, in float32; backward keeps only the output. order:
    the global positions of the stored queries and keys (context parallelism's reorder), or None (natural);
    segments: (query, key) segment ids of packed documents (`document_causal_mask`), or None."""
    if segments is None:
        return _masked_softmax(scores, scale, order)
    return _document_softmax(scores, scale, order, segments)


@partial(jax.custom_vjp, nondiff_argnums=(1,))
def _masked_softmax(scores, scale, order):
    return _causal_softmax(scores, scale, order)


def _softmax_fwd(scores, scale, order):
    probs = _causal_softmax(scores, scale, order)
    return probs, probs


def _softmax_bwd(scale, probs, g):
    p, g = probs.astype(jnp.float32), g.astype(jnp.float32)
    ds = p * (g - jnp.sum(g * p, axis=-1, keepdims=True)) * scale  # masked entries have p = 0
    return ds.astype(probs.dtype), None


_masked_softmax.defvjp(_softmax_fwd, _softmax_bwd)


@partial(jax.custom_vjp, nondiff_argnums=(1,))
def _document_softmax(scores, scale, order, segments):
    """`_masked_softmax` with packed documents: the same output kept, the segment ids given no gradient."""
    return _causal_softmax(scores, scale, order, segments)


_document_softmax.defvjp(lambda scores, scale, order, segments: (_causal_softmax(scores, scale, order, segments),) * 2,
                         lambda scale, probs, g: (*_softmax_bwd(scale, probs, g), None))


@partial(jax.custom_vjp, nondiff_argnums=(2,))
def _add_bias(x, bias, bias_ndim):
    return x + bias


def _add_bias_fwd(x, bias, bias_ndim):
    return x + bias, None


def _add_bias_bwd(bias_ndim, _, g):
    g = jax.lax.optimization_barrier(g)  # the bias gradient sums g as rounded to the compute dtype: see add_bias
    axes = tuple(range(g.ndim - bias_ndim))
    return g, jnp.sum(g.astype(jnp.float32), axis=axes).astype(g.dtype)


_add_bias.defvjp(_add_bias_fwd, _add_bias_bwd)


def add_bias(x, bias):
    """x + bias over x's trailing axes. Backward sums the bias gradient in float32 explicitly (the
    sum any backend accumulates in f32 anyway): left to autodiff, a bf16 sum over every token
    becomes a slow pairwise reduce-window on XLA:CPU. It sums g as the program rounds it (an optimization barrier):
    with XLA's excess precision, XLA otherwise drops that rounding, sums g's float32 producer instead, and on a GPU
    writes that producer (GELU's backward) in float32 for the sum to read: 9.7 GB more a gpt3-1.3b step on the
    H100's program (experiments/results/bf16_levers.md). The bias gradients then differ by bf16 rounding."""
    return _add_bias(x, bias.astype(x.dtype), bias.ndim)


def dropout(x, rate: float, key, mask_name: str, order=None, seq_axes=(1,), seq_len: int | None = None,
            shard: Sharder | None = None):
    """Inverted dropout whose backward keeps only the 1-byte mask (regenerable from `key`).

    The mask is `jax.random.bernoulli(key, 1 − rate, global shape)`, whatever the sharding: inside a region
    manual over `data` (the pipeline executor's, gradient accumulation's: `shard.rows_manual`) x holds one data
    rank's rows of the batch, and the rank draws
    exactly those rows of the global mask (`bernoulli_rows`). Where the sequence is stored reordered (`order`:
    the global position of each entry along `seq_axes`, or a tuple of such, one per axis; context parallelism),
    each entry draws the mask's element at its global position (`bernoulli_at`), so the masks are those of the
    natural order. seq_len: the whole sequence's length along `seq_axes` (default: their stored length, times
    the context ranks inside a region manual over `context`, where x holds one context rank's tokens). shard: the
    caller's Sharder (None: no region, as on one device)."""
    if rate == 0.0 or key is None:
        return x
    manual_data = shard is not None and shard.rows_manual
    if order is not None:
        orders = order if isinstance(order, tuple) else (order,) * len(seq_axes)
        coords = {axis % x.ndim: o for axis, o in zip(seq_axes, orders)}
        if seq_len is None:
            manual_context = shard is not None and shard.context_manual
            seq_len = x.shape[seq_axes[0]] * (shard.context if manual_context else 1)
        global_shape = tuple(seq_len if axis in coords else n for axis, n in enumerate(x.shape))
        if manual_data:
            coords[0] = jnp.arange(x.shape[0]) + shard.first_row(x.shape[0])
        keep = bernoulli_at(key, 1.0 - rate, x.shape, coords, global_shape)
    elif manual_data:
        keep = bernoulli_rows(key, 1.0 - rate, x.shape, shard.first_row(x.shape[0]))
    else:  # jax.random.bernoulli's mask, its counter made in the layer loop (`bernoulli_at`'s barrier)
        keep = bernoulli_at(key, 1.0 - rate, x.shape, {})
    keep = checkpoint_name(keep, mask_name)
    return jnp.where(keep, x / jnp.asarray(1.0 - rate, x.dtype), jnp.zeros((), x.dtype))


def _mul_u64(x, c: int):
    """(high, low) uint32 words of the product x · c modulo 2⁶⁴ (x: uint32 array, 0 ≤ c < 2⁶⁴): the 64-bit
    element index JAX counts in, carried in two words so that it needs no `jax_enable_x64`."""
    u = lambda v: jnp.asarray(v, jnp.uint32)
    c_low, c_high = c & 0xFFFFFFFF, c >> 32
    x_lo, x_hi, c_lo, c_hi = x & u(0xFFFF), x >> u(16), c_low & 0xFFFF, c_low >> 16
    ll, lh, hl, hh = x_lo * u(c_lo), x_lo * u(c_hi), x_hi * u(c_lo), x_hi * u(c_hi)
    mid = (ll >> u(16)) + (lh & u(0xFFFF)) + (hl & u(0xFFFF))
    high = hh + (lh >> u(16)) + (hl >> u(16)) + (mid >> u(16))
    return high + x * u(c_high), (ll & u(0xFFFF)) | (mid << u(16))  # x · c_high · 2³² only adds to the high word


def _check_threefry(key, global_shape, caller: str):
    if str(jax.random.key_impl(key)) != "threefry2x32":
        raise ValueError(f"{caller} needs a threefry2x32 key (jax.random.key), got {jax.random.key_impl(key)}")
    if math.prod(global_shape) > 2**64:
        raise ValueError(f"{caller}: a mask of shape {tuple(global_shape)} has more than 2⁶⁴ elements, "
                         "past JAX's 64-bit element counter")


def bernoulli_rows(key, p: float, shape, first_row):
    """Rows first_row … first_row + shape[0] − 1 of `jax.random.bernoulli(key, p, (R, *shape[1:]))` for any
    R past them, computing only those rows.

    Why: `jax_threefry_partitionable` (on by default) makes element i of a random array threefry(key, i),
    i its row-major index as two uint32 words (a 64-bit counter: any size up to 2⁶⁴ elements), and a float32
    uniform is the top 23 bits as a mantissa in [1, 2) minus 1; that is what this recomputes at an offset
    (jax.random offers no offset). It leans on JAX's implementation: tests/test_pipeline.py compares it with
    jax.random.bernoulli, tests/test_long_sequences.py with JAX's own counter past 2³² elements."""
    rows = jnp.arange(shape[0], dtype=jnp.uint32) + jnp.asarray(first_row).astype(jnp.uint32)
    return bernoulli_at(key, p, shape, {0: rows}, caller="bernoulli_rows")


def bernoulli_at(key, p: float, shape, coords: dict, global_shape=None, caller: str = "bernoulli_at"):
    """The entries of `jax.random.bernoulli(key, p, global_shape)` at the given coordinates, shaped `shape`:
    coords maps an axis to the global index of each entry along it (an array of shape[axis]); the other axes
    count from 0. Why: a sequence stored reordered (context parallelism) draws the natural order's mask
    elementwise, each device only its own entries; the same threefry-of-the-global-index as `bernoulli_rows`.
    The index is 64-bit (two uint32 words, as JAX's own `iota_2x32_shape`): any mask size, e.g. the
    attention-probability mask of s = 128k tokens (b·a·s² ≫ 2³² elements), is one global mask."""
    global_shape = tuple(shape if global_shape is None else global_shape)
    _check_threefry(key, global_shape, caller)
    # Every axis's coordinates pass an optimization barrier with the key: the counter depends on positions alone, the
    # same in every layer, and JAX's partial evaluation of the layer scan moves what does not vary with the loop out
    # of it, so that a ring's counters (8 bytes a score) were made for every query tile of a block at once (and
    # jax.random.bernoulli's, the same in every layer, were held whole beside the loop).
    coords = {axis: jnp.asarray(coords[axis]) if axis in coords else jnp.arange(n) for axis, n in enumerate(shape)}
    coords, words = jax.lax.optimization_barrier((coords, jax.random.key_data(key)))
    return _uniform_below(words, p, *element_index(shape, coords, global_shape))


def element_index(shape, coords: dict, global_shape):
    """(high, low) uint32 words of the row-major index in `global_shape` of each entry of `shape` (coords as
    in `bernoulli_at`): the counter JAX's threefry draws element i at (`jax._src.random.prng.iota_2x32_shape`).
    The inner axes whose global extents multiply to under 2³² add their index × stride in the low word alone (no
    carry can occur); each outer axis adds a 64-bit product, with its carry, and so does axis 0 always (a rank's rows
    count past `global_shape[0]`: `bernoulli_rows`). Why: a mask is as large as the attention scores, each op of
    its index runs once per element, and the ring compiles one mask per block; the 64-bit arithmetic on every
    axis was most of a ring layer's compile time."""
    along = lambda v, axis: jnp.broadcast_to(v.reshape([-1 if a == axis else 1 for a in range(len(shape))]), shape)
    index = lambda axis: (jnp.asarray(coords[axis]) if axis in coords
                          else jnp.arange(shape[axis])).astype(jnp.uint32).reshape(-1)
    hi = lo = jnp.uint32(0)  # scalars: every whole-shape word is made from the coordinates (`bernoulli_at`'s barrier)
    stride, axis = 1, len(shape) - 1
    while axis > 0 and stride * global_shape[axis] < 2**32:
        lo = lo + along(index(axis) * jnp.uint32(stride), axis)
        stride, axis = stride * global_shape[axis], axis - 1
    for axis in range(axis, -1, -1):
        add_hi, add_lo = (along(w, axis) for w in _mul_u64(index(axis), stride))
        new_lo = lo + add_lo
        hi, lo = hi + add_hi + (new_lo < lo).astype(jnp.uint32), new_lo
        stride *= global_shape[axis]
    return hi, lo


def _uniform_below(words, p: float, index_hi, index_lo):
    """Whether the float32 uniform JAX draws with a threefry key's `words` (`jax.random.key_data`) at the 64-bit
    element index (index_hi, index_lo) is below p."""
    u = lambda v: jnp.asarray(v, jnp.uint32)
    bits1, bits2 = threefry2x32_p.bind(words[0], words[1], index_hi, index_lo)
    bits = bits1 ^ bits2
    # The primitive's type drops the manual axes its inputs vary over (inside shard_map): restore them.
    varying = (jax.typeof(words).mat.varying | jax.typeof(index_lo).mat.varying) - jax.typeof(bits).mat.varying
    bits = jax.lax.pcast(bits, tuple(sorted(varying)), to="varying") if varying else bits
    mantissa = (bits >> u(9)) | u(0x3F800000)
    return jax.lax.bitcast_convert_type(mantissa, jnp.float32) - jnp.float32(1.0) < jnp.float32(p)


@partial(jax.custom_vjp, nondiff_argnums=(2,))
def rms_norm(x, scale, eps):
    """x / rms(x) · scale over the last axis, statistics in float32 (Llama's RMSNorm); backward keeps x
    and 1/rms (remat.NORM_STATS: 4 bytes per token)."""
    y, _ = _rms_norm_fwd(x, scale, eps)
    return y


def head_rms_norm(x, scale, eps):
    """`rms_norm` of each head's q or k (x [b, s, heads, d], scale [d]) as plain operations: its statistics untagged,
    so a remat policy recomputes them from x (models/llama.py `rotated_qk`) rather than keep [b, s, heads] floats."""
    xf = x.astype(jnp.float32)
    return (xf * jax.lax.rsqrt(jnp.mean(jnp.square(xf), axis=-1, keepdims=True) + eps) * scale).astype(x.dtype)


def _rms_norm_fwd(x, scale, eps):
    xf = x.astype(jnp.float32)
    rstd = checkpoint_name(jax.lax.rsqrt(jnp.mean(jnp.square(xf), axis=-1, keepdims=True) + eps), remat.NORM_STATS)
    return (xf * rstd * scale).astype(x.dtype), (x, rstd, scale)


def _rms_norm_bwd(eps, res, g):
    x, rstd, scale = res
    xhat = x.astype(jnp.float32) * rstd
    g = g.astype(jnp.float32)
    dscale = jnp.sum(g * xhat, axis=tuple(range(g.ndim - 1)))
    gx = g * scale
    dx = rstd * (gx - xhat * jnp.mean(gx * xhat, axis=-1, keepdims=True))
    return dx.astype(x.dtype), dscale.astype(scale.dtype)


rms_norm.defvjp(_rms_norm_fwd, _rms_norm_bwd)


def _swiglu(gate_up):
    g = gate_up[..., 0, :].astype(jnp.float32)
    u = gate_up[..., 1, :].astype(jnp.float32)
    return checkpoint_name((jax.nn.silu(g) * u).astype(gate_up.dtype), remat.MLP_ACTIVATION)


@jax.custom_vjp
def swiglu(gate_up):
    """silu(gate) · up of gate_up [..., 2, f] (gate, up), in float32; backward keeps only the input (the
    output, the second MLP matmul's input, is tagged as GELU's is)."""
    return _swiglu(gate_up)


def _swiglu_bwd(gate_up, g):
    gate, up = gate_up[..., 0, :].astype(jnp.float32), gate_up[..., 1, :].astype(jnp.float32)
    g = g.astype(jnp.float32)
    sig = jax.nn.sigmoid(gate)
    silu = gate * sig
    dgate = g * up * sig * (1.0 + gate * (1.0 - sig))
    return (jnp.stack([dgate, g * silu], axis=-2).astype(gate_up.dtype),)


swiglu.defvjp(lambda gate_up: (_swiglu(gate_up), gate_up), _swiglu_bwd)


def rope_frequencies(cfg: ModelConfig) -> np.ndarray:
    """RoPE's inverse frequencies [d/2] (float32), with Llama 3's frequency scaling where cfg asks for it:
    wavelengths longer than original/low_freq_factor divided by `factor`, shorter than
    original/high_freq_factor kept, and a smooth blend between (as transformers' "llama3" rope type)."""
    d = cfg.head_dim
    inv = 1.0 / (cfg.rope_theta ** (np.arange(0, d, 2, dtype=np.float64) / d))
    if cfg.rope_scaling == "llama3":
        low, high = (cfg.rope_original_positions / cfg.rope_low_freq_factor,
                     cfg.rope_original_positions / cfg.rope_high_freq_factor)
        wavelen = 2 * np.pi / inv
        smooth = (cfg.rope_original_positions / wavelen - cfg.rope_low_freq_factor) / (
            cfg.rope_high_freq_factor - cfg.rope_low_freq_factor)
        blended = (1 - smooth) * inv / cfg.rope_factor + smooth * inv
        inv = np.where(wavelen > low, inv / cfg.rope_factor, np.where(wavelen < high, inv, blended))
    return inv.astype(np.float32)


def rope(x, positions, cfg: ModelConfig):
    """Rotary position embedding of x [b, s, heads, d] at positions [s] (or [b, s]: each row's own, packed
    documents), rotate-half convention (the first and second halves of d are the pair's two coordinates: how Hugging
    Face stores Llama's q and k). Computed in float32; a linear map, so its backward stores nothing."""
    angles = positions.astype(jnp.float32)[..., None] * jnp.asarray(rope_frequencies(cfg))
    angles = angles[None, :, None, :] if angles.ndim == 2 else angles[:, :, None, :]
    cos, sin = jnp.cos(angles), jnp.sin(angles)
    xf = x.astype(jnp.float32)
    x1, x2 = jnp.split(xf, 2, axis=-1)
    return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1).astype(x.dtype)


def attention(q, k, v, cfg: ModelConfig, key, shard: Sharder):
    """Causal attention of q [b, s, a, d] over k, v [b, s, kv, d] (kv dividing a: grouped-query attention,
    each group of a/kv query heads sharing one K/V head); returns the context [b, s, a, d], split by heads and
    tagged CONTEXT (`tagged_context`). Where the sequence is split over `context`, the strategy the run chose
    (`shard.context_attention`, parallel/context.py); cuDNN's kernel where an edge chose it and the sequence is
    whole (models/cudnn_attention.py)."""
    if cfg.attention == "fused" and cfg.fused_kernel == "cudnn" and shard.context == 1:
        return cudnn_attention(q, k, v, shard, tagged_context)
    if shard.context > 1 and shard.context_attention is not None:
        return shard.context_attention(q, k, v, cfg, key, shard)
    segments = None if shard.documents is None else (shard.documents.segments,) * 2
    return tagged_context(causal_attention(q, k, v, cfg, key, shard, shard.reorder(q.shape[1]), segments), shard)


def tagged_context(ctx, shard: Sharder):
    """The attention's output as the model goes on with it (split by heads), tagged CONTEXT once: a kernel whose
    backward keeps its own output (cuDNN's, the ring's) tags it here inside its forward rule, so that the policy
    keeps one tensor, not that and a tagged copy."""
    return checkpoint_name(shard(ctx, "batch", "seq", "heads", None), remat.CONTEXT)


def causal_attention(q, k, v, cfg: ModelConfig, key, shard: Sharder, order=None, segments=None):
    """`attention` written over the whole sequence (the partitioner splits it), queries and keys stored in
    `order` (their global positions, one array or a (queries, keys) pair; None: natural), and with packed documents
    `segments` (the queries' and the keys' segment ids [b, s], as stored; None: no document mask). Scores are split
    over `seq` like the queries."""
    if cfg.attention == "fused":
        # cfg.fused_kernel: cuDNN flash attention where an edge chose it (GPU, bf16), XLA's otherwise (which
        # JAX also picks when not told: it materialises the scores); grouped K/V heads natively. No dropout
        # argument exists, so attention-probs dropout is not applied with the fused implementation.
        if order is None and segments is None:
            return jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation=cfg.fused_kernel)
        # A reordered sequence or packed documents are no top-left triangle: the mask given densely.
        if segments is None:
            mask = causal_mask(order, q.shape[1], k.shape[1])[None, None]
        else:
            mask = document_causal_mask(order, segments, q)[:, None]
        return jax.nn.dot_product_attention(q, k, v, mask=mask, implementation=cfg.fused_kernel)
    b, s, a, d = q.shape
    kv = k.shape[2]
    if kv == a:
        scores = checkpoint_name(jnp.einsum("bqad,bkad->baqk", q, k), remat.ATTN_SCORES)
        scores = shard(scores, "batch", "heads", "seq", None)
        probs = _probs(scores, cfg, key, order, shard, segments)
        return jnp.einsum("baqk,bkad->bqad", probs, v)
    q = q.reshape(b, s, kv, a // kv, d)
    scores = checkpoint_name(jnp.einsum("bqkgd,bskd->bkgqs", q, k), remat.ATTN_SCORES)
    scores = shard(scores, "batch", "heads", None, "seq", None)
    probs = _probs(scores, cfg, key, order, shard, segments)
    return jnp.einsum("bkgqs,bskd->bqkgd", probs, v).reshape(b, s, a, d)


def _probs(scores, cfg: ModelConfig, key, order, shard: Sharder, segments=None):
    probs = causal_softmax(scores, 1.0 / math.sqrt(cfg.head_dim), order, segments)
    if cfg.dropout == 0.0 or key is None:
        # No dropout: tagging the same value again as the dropout output would store it twice (measured:
        # `none` kept 4·as²b bytes of probabilities instead of 2).
        return probs
    dropped = dropout(probs, cfg.dropout, key, remat.ATTN_DROPOUT_MASK, order, seq_axes=(-2, -1),
                      seq_len=scores.shape[-1], shard=shard)
    return checkpoint_name(dropped, remat.ATTN_PROBS_DROPOUT)


def cross_entropy(logits, targets):
    """Mean token cross-entropy of vocab-sharded logits, never gathering the vocabulary (Megatron's
    vocab-parallel cross-entropy: each rank's max, sum-exp and target logit, reduced across ranks)."""
    vocab_ids = jax.lax.broadcasted_iota(jnp.int32, logits.shape, 2)
    m = jax.lax.stop_gradient(jnp.max(logits, axis=-1, keepdims=True))
    lse = jnp.log(jnp.sum(jnp.exp(logits - m), axis=-1)) + m[..., 0]
    target = jnp.sum(jnp.where(vocab_ids == targets[..., None], logits, 0.0), axis=-1)
    return jnp.mean(lse - target)


def vocab_logits(table, x, cfg: ModelConfig, shard: Sharder):
    """x [b, s, h] times a vocabulary table [V, h] (vocab-sharded) → float32 logits [b, s, V] sharded over
    vocab, padded entries -inf: a column-parallel matmul over the vocabulary (all-gathering the sequence
    under SP). The tied embedding (GPT) or the untied lm_head (Llama)."""
    table = {"table": table.astype(x.dtype)}
    logits = shard.column_parallel(lambda y, p: matmul("bsh,vh->bsv", y, p["table"], cfg, layer=False), x, table,
                                   {"table": ("vocab", None)}, ("batch", "seq", "vocab"))
    logits = shard(logits.astype(jnp.float32), "batch", "seq", "vocab")
    vocab_ids = jax.lax.broadcasted_iota(jnp.int32, logits.shape, 2)
    return jnp.where(vocab_ids < cfg.vocab_size, logits, -jnp.inf)
