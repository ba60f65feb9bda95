"""The CPU form of a bf16 matmul: float32 accumulation with one rounding, as a GEMM does it.

Chosen once, at an edge (`ModelConfig.matmul = "cpu-bf16"`, which the commands set on CPU devices): the
model itself writes every matmul as the portable `jnp.einsum`, which is what a GPU runs and what `plan`
and `search` measure.

Why a CPU form at all: a bf16 GEMM accumulates in float32 and rounds its output once; cuBLAS runs a plain
bf16 einsum so. XLA:CPU instead runs every plain bf16 dot (forward and both backward) by converting its
operands to float32: float32 speed, plus the converts. Asked for a float32 result, the same dot runs
natively (AVX512-BF16, AMX): twice the float32 rate here (docs/DESIGN.md, "bf16 matmuls on CPU"). So on
CPU a bf16 matmul is that dot and one rounding, under a custom VJP whose two backward dots are written
the same way. The numbers are the same (a bf16 product is exact in float32; only the order of the
float32 sums may differ), and so is what a layer stores: JAX's dot policies cannot see a dot inside a
custom VJP, so its output carries the name remat.MATMUL, which the `dots` policies save too.
"""

from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name

from jaxseq import remat


def bf16_matmul(spec: str, x, w):
    """jnp.einsum(spec, x, w) for activations x times a weight w; bf16 × bf16 runs as XLA:CPU's native
    bf16 dot with a float32 result, rounded once (any other dtype: the plain einsum)."""
    if x.dtype != jnp.bfloat16 or w.dtype != jnp.bfloat16:
        return jnp.einsum(spec, x, w)
    xs, ws, out = indices(spec)
    if set(xs) & set(ws) & set(out) or not set(xs) <= set(ws + out) or not set(ws) <= set(xs + out):
        raise ValueError(f"matmul {spec!r}: not activations × weight (a batch index, or one summed within an operand)")
    return checkpoint_name(_matmul_f32_accumulated(spec, x, w), remat.MATMUL)


def indices(spec: str) -> tuple[str, str, str]:
    """"bsh,hf->bsf" → ("bsh", "hf", "bsf")."""
    operands, out = spec.split("->")
    a, b = operands.split(",")
    return a, b, out


def _transposed(x, perm):
    """An operand x transposed by perm, as its own op: an optimization barrier keeps XLA from folding the
    transpose into the dot that consumes it. (A result's transpose needs the barrier on the other
    side, between the dot and the transpose: `dot_rounded` writes that one.)"""
    return x if list(perm) == sorted(perm) else jax.lax.optimization_barrier(jnp.transpose(x, perm))


def dot_rounded(spec: str, a, b, dtype):
    """einsum(spec, a, b) (no batch indices) accumulated in float32 and rounded to dtype, written as a
    dot of [m, k] × [k, n] operands: the form XLA:CPU's bf16 kernels (YNNPACK) take, while its generic
    dot kernel runs no bf16 × bf16 → f32 dot at all. Left to itself, XLA folds a weight gradient's
    transposes into its dot, which then fails to run ("Unsupported element type for DotThunk")."""
    sa, sb, so = indices(spec)
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
    y = dot_rounded(spec, a, b, like.dtype)
    extra = tuple(sorted(jax.typeof(y).mat.varying - jax.typeof(like).mat.varying))
    return jax.lax.psum(y, extra) if extra else y


@partial(jax.custom_vjp, nondiff_argnums=(0,))
def _matmul_f32_accumulated(spec, x, w):
    with jax.named_scope(spec):  # the op name jnp.einsum gives its dots, which planning/hlo_flops.py's `dots` report
        return dot_rounded(spec, x, w, x.dtype)


def _matmul_fwd(spec, x, w):
    return _matmul_f32_accumulated(spec, x, w), (x, w)


def _matmul_bwd(spec, res, g):
    x, w = res
    xs, ws, out = indices(spec)
    with jax.named_scope(spec):  # named after the forward matmul, as JAX names an einsum's transposes
        return _einsum_rounded(f"{out},{ws}->{xs}", g, w, like=x), _einsum_rounded(f"{xs},{out}->{ws}", x, g, like=w)


_matmul_f32_accumulated.defvjp(_matmul_fwd, _matmul_bwd)
