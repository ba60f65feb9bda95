"""FP8 GEMMs: a layer's weight matmul with e4m3 activations and weights and e5m2 gradients, each tensor scaled by
its own amax at the moment it is used (per-tensor current scaling), under a custom VJP.

The recipe (`ModelConfig.fp8`, chosen at the edge; the model writes every layer matmul as `ops.matmul`): the
forward quantizes the activation x and the weight w to e4m3 (3 mantissa bits, ±448), the backward the output
gradient dy to e5m2 (2 mantissa bits, ±57344: the range gradients need), and all three GEMMs (y = x·w, dx = dy·wᵀ,
dw = xᵀ·dy) take FP8 operands, accumulate in float32 and round once to the compute dtype. The master weights, the
optimizer, the LM head, the norms and the attention core are untouched (bf16 or float32 as before).

Scaling. A tensor's scale is its absolute maximum over the whole tensor (every rank's part of it: inside a region
manual over mesh axes the maximum is reduced over the axes the tensor varies over, so a parallel run quantizes as one
device does) over the format's maximum, rounded up to a power of two. Why a power of two: multiplying by it is exact
in any float format, so dequantizing (q · scale) in bf16 loses nothing and the GEMM of the dequantized operands is the
FP8 GEMM's arithmetic exactly; it costs at most one binade of the format's range. The exponent is held to float32's
normal range, so a scale is never zero, subnormal or infinite (a zero tensor's is 2⁻¹²⁶, a non-finite one's 1).

Why this form and not FP8 arrays into the dot: XLA:GPU's GEMM rewriter turns exactly this pattern, a dot whose
operands are converts from FP8 times a scalar, into one cuBLASLt FP8 GEMM with the scales as its operands
(`__cublas$lt$matmul$f8`), forward and both backward GEMMs, where its Triton GEMMs are off (`GPU_OPTIONS`). With
them on, a Triton fusion takes the FP8 operands but its dot ran on dequantized bf16 in the program compiled for an
H100 without one (a dot of FP8 arrays ran Triton's FP8 MMA forward only, and not for the e5m2 × e4m3 backward
GEMMs): which kernel the device's autotuner keeps cannot be read offline. So an FP8 run compiles with `GPU_OPTIONS`
on a GPU (the train command, `plan --target`), and tests/test_gpu_target.py counts the FP8 GEMMs in that program.

On the CPU the same quantization runs and the GEMM is the emulated one: FP8 values exact in bf16, the dot XLA:CPU's
native bf16 dot with a float32 result (`models/cpu_matmul.py`), scaled and rounded once: the numbers a GPU computes,
up to the order of float32 sums (tests/test_fp8.py holds both forms to a float64 reference).
"""

from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name

from jaxseq import remat
from jaxseq.models.cpu_matmul import dot_rounded, indices

E4M3 = jnp.float8_e4m3fn  # activations and weights
E5M2 = jnp.float8_e5m2  # gradients
MIN_EXPONENT = -126  # float32's smallest normal exponent: the smallest scale, 2⁻¹²⁶
# XLA:GPU's options under which the dequantize-dot pattern becomes cuBLASLt's FP8 GEMM (the module docstring): an FP8
# run's compile options on a GPU, and the program `plan --target --fp8` reads. Why no dot merging: XLA's dot merger
# joins dots that share an operand (Llama's Q and K/V projections, forward, and their weight gradients) into one dot
# of the concatenated dequantized operands, each with its own scale, which the rewriter can then only run in bf16.
GPU_OPTIONS = {"xla_gpu_enable_triton_gemm": False, "xla_gpu_dot_merger_threshold_mb": 0}


def scale(x, fmt) -> jax.Array:
    """x's per-tensor scale for format `fmt` (float32 scalar): 2^⌈log₂(amax / fmt's max)⌉, amax over the whole tensor
    (reduced over the manual mesh axes x varies over), held to float32's normal range (2⁻¹²⁶ for a zero tensor), 1
    where amax is not finite.

    Written in lax's primitives on x alone: jnp's where, clip and frexp call jitted helpers with constant arguments,
    which a remat policy's partial evaluation hands a shard_map nested in a region manual over `data` as operands of
    their own, and JAX 0.10.2 gives those an invalid sharding (parallel/region.py's column_parallel under SP failed
    to lower)."""
    amax = jax.lax.reduce_max(jax.lax.abs(x), tuple(range(x.ndim))).astype(jnp.float32)  # exact in x's dtype
    varying = tuple(sorted(jax.typeof(amax).mat.varying))
    if varying:
        amax = jax.lax.pmax(amax, varying)
    bits = jax.lax.bitcast_convert_type(amax / float(jnp.finfo(fmt).max), jnp.int32)
    biased = jax.lax.shift_right_logical(bits, 23) & 255  # the float32 exponent field
    inexact = jax.lax.convert_element_type(jax.lax.ne(bits & 0x7FFFFF, 0), jnp.int32)  # not a power of two: round up
    exponent = jax.lax.max(jax.lax.min(biased - 127 + inexact, 127), MIN_EXPONENT)
    exponent = exponent * jax.lax.convert_element_type(jax.lax.ne(biased, 255), jnp.int32)  # inf or NaN: 2⁰
    return jax.lax.bitcast_convert_type(jax.lax.shift_left(exponent + 127, 23), jnp.float32)


def quantize(x, fmt) -> tuple[jax.Array, jax.Array]:
    """(q, s): x / s rounded to the nearest `fmt` value, and s = `scale(x, fmt)`. The division is in x's dtype, where
    it is exact (s a power of two; bf16 has float32's exponent range): a float32 copy of a bf16 x would be one more
    tensor for XLA to write and read (it did, for the MLP's GELU output). No clip: |x / s| exceeds fmt's maximum by at
    most the rounding of amax / max (one float32 ulp), far below the halfway point to the next binade, so it rounds
    to the maximum (a clip's constant bounds, broadcast to x's shape, are values made of constants alone: `scale`'s
    docstring)."""
    s = scale(x, fmt)
    return (x / s.astype(x.dtype)).astype(fmt), s


def dequantize(q, s, dtype) -> jax.Array:
    """q · s in `dtype`: exact, s being a power of two."""
    return q.astype(dtype) * s.astype(dtype)


def matmul(spec: str, x, w, form: str = "einsum"):
    """jnp.einsum(spec, x, w) for activations x times a weight w as an FP8 GEMM (the module docstring), in `form`:
    "einsum" the dot XLA:GPU rewrites into cuBLASLt's FP8 GEMM, "cpu-bf16" XLA:CPU's native bf16 dot (the same
    numbers). Its output carries the name the `dots` policies save (they cannot see a dot inside a custom VJP)."""
    if x.dtype != w.dtype:
        raise ValueError(f"fp8 matmul {spec!r}: activations {x.dtype} and weight {w.dtype} (the weight is the compute "
                         "copy, in the activations' dtype)")
    return checkpoint_name(_fp8_matmul(spec, form, x, w), remat.MATMUL)


def _product(form: str, spec: str, a, b, like=None):
    """einsum(spec, a, b) of dequantized operands, accumulated in float32 and rounded once to their dtype; with
    `like`, summed over the manual mesh axes it varies over and `like` does not (the psum JAX's own transpose adds
    for an operand replicated over them)."""
    y = dot_rounded(spec, a, b, a.dtype) if form == "cpu-bf16" else jnp.einsum(spec, a, b)
    if like is None:
        return y
    extra = tuple(sorted(jax.typeof(y).mat.varying - jax.typeof(like).mat.varying))
    return jax.lax.psum(y, extra) if extra else y


@partial(jax.custom_vjp, nondiff_argnums=(0, 1))
def _fp8_matmul(spec, form, x, w):
    return _fp8_forward(spec, form, x, w)[0]


def _fp8_forward(spec, form, x, w):
    (xq, xs), (wq, ws) = quantize(x, E4M3), quantize(w, E4M3)
    with jax.named_scope(spec):  # the op name jnp.einsum gives its dots, which planning/hlo_flops.py reads
        y = _product(form, spec, dequantize(xq, xs, x.dtype), dequantize(wq, ws, x.dtype))
    return y, (xq, xs, wq, ws)


def _fp8_backward(spec, form, residuals, dy):
    """dx = dy·wᵀ and dw = xᵀ·dy, dy in e5m2, x and w the forward's e4m3 copies (or, where the remat policy kept
    neither, as the replayed forward quantized them again: the same values)."""
    xq, xs, wq, ws = residuals
    gq, gs = quantize(dy, E5M2)
    g = dequantize(gq, gs, dy.dtype)
    xi, wi, out = indices(spec)
    with jax.named_scope(spec):  # named after the forward matmul, as JAX names an einsum's transposes
        dx = _product(form, f"{out},{wi}->{xi}", g, dequantize(wq, ws, dy.dtype), like=xq)
        dw = _product(form, f"{xi},{out}->{wi}", dequantize(xq, xs, dy.dtype), g, like=wq)
    return dx, dw


_fp8_matmul.defvjp(_fp8_forward, _fp8_backward)
