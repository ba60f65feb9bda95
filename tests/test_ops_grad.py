"""The hand-written backward passes of models/gpt.py (LayerNorm, GELU, causal softmax, dropout) against
plain `jax.grad` of independent reference implementations written here, and against central finite
differences at a few points.

Tolerances:
- float32: the custom VJPs and autodiff of the references compute the same derivative in a different
  order of f32 operations, so they agree to a few f32 ulps: rtol 1e-5, atol 1e-6 × the largest entry.
- bfloat16 (inputs and outputs bf16, arithmetic in f32 in both implementations): the reference's
  gradient is computed in float32 from the same bf16-representable inputs and cotangents, so the only
  difference is the final rounding of the jaxseq gradient to bf16 (and, for the softmax, the bf16
  rounding of the stored probabilities it differentiates through): each is at most half a bf16 ulp,
  2⁻⁹ relative. Allowed: 2⁻⁷ of the largest gradient entry (four half-ulps).
- Finite differences (float32, ε = 1e-3, central): the truncation error is O(ε²) ≈ 1e-6 and the
  rounding error ≈ 1e-7·|f|/ε ≈ 1e-4·|f|, so the directional derivative must agree within 1e-2
  relative (jax.test_util.check_grads).
"""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.test_util import check_grads

from jaxseq.models import ops as M

BF16_TOL = 2.0**-7
EPS_LN = 1e-3  # not the default 1e-5: a VJP that ignored eps would show


# --------------------------------------------------------------------------------------------
# Independent references: textbook formulas, differentiated by plain autodiff.


def ref_layer_norm(x, scale, bias, eps):
    xf = x.astype(jnp.float32)
    mean = xf.mean(-1, keepdims=True)
    var = ((xf - mean) ** 2).mean(-1, keepdims=True)
    return ((xf - mean) / jnp.sqrt(var + eps) * scale + bias).astype(x.dtype)


def ref_gelu(x):
    return jax.nn.gelu(x.astype(jnp.float32), approximate=True).astype(x.dtype)


def ref_causal_softmax(scores, scale):
    s_q, s_k = scores.shape[-2:]
    mask = np.tril(np.ones((s_q, s_k), bool))
    logits = jnp.where(mask, scores.astype(jnp.float32) * scale, -1e30)
    e = jnp.exp(logits - logits.max(-1, keepdims=True)) * mask
    return (e / e.sum(-1, keepdims=True)).astype(scores.dtype)


# --------------------------------------------------------------------------------------------
# Helpers


def _inputs(dtype, *shape, seed=0, scale=1.0):
    x = scale * np.random.default_rng(seed).standard_normal(shape).astype(np.float32)
    return jnp.asarray(x).astype(dtype)  # bf16-representable when dtype is bf16


def _grads(op, args, cotangent):
    """Gradients of <cotangent, op(*args)> with respect to every argument, in float32."""
    loss = lambda *a: jnp.sum(op(*a).astype(jnp.float32) * cotangent.astype(jnp.float32))
    return [g.astype(jnp.float32) for g in jax.grad(loss, argnums=tuple(range(len(args))))(*args)]


def _assert_close(got, want, dtype):
    for g, w in zip(got, want):
        g, w = np.asarray(g), np.asarray(w)
        assert np.isfinite(g).all()
        peak = np.abs(w).max()
        assert peak > 0
        if dtype == jnp.float32:
            np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-6 * peak)
        else:
            np.testing.assert_allclose(g, w, rtol=0, atol=BF16_TOL * peak)


def _f32(*args):
    return [a.astype(jnp.float32) if a.dtype == jnp.bfloat16 else a for a in args]


DTYPES = [pytest.param(jnp.float32, id="float32"), pytest.param(jnp.bfloat16, id="bfloat16")]


# --------------------------------------------------------------------------------------------
# LayerNorm


@pytest.mark.parametrize("dtype", DTYPES)
def test_layer_norm_gradients_match_autodiff_of_a_reference(dtype):
    # Non-zero mean and a spread like a residual stream's; scale and bias stay float32 as in the model.
    x = _inputs(dtype, 2, 5, 48, seed=1, scale=0.05) + jnp.asarray(0.3, dtype)
    scale = 1.0 + _inputs(jnp.float32, 48, seed=2, scale=0.2)
    bias = _inputs(jnp.float32, 48, seed=3, scale=0.2)
    g = _inputs(dtype, 2, 5, 48, seed=4)
    op = lambda x, s, b: M.layer_norm(x, s, b, EPS_LN)
    np.testing.assert_allclose(np.asarray(op(x, scale, bias), np.float32),
                               np.asarray(ref_layer_norm(x, scale, bias, EPS_LN), np.float32),
                               rtol=0, atol=1e-5 if dtype == jnp.float32 else 2**-7 * 4)
    want = _grads(lambda x, s, b: ref_layer_norm(x, s, b, EPS_LN), _f32(x, scale, bias), g)
    _assert_close(_grads(op, (x, scale, bias), g), want, dtype)
    # The input's gradient depends on eps at this spread (std 0.05 vs sqrt(1e-3) ≈ 0.03).
    other = _grads(lambda x, s, b: ref_layer_norm(x, s, b, 1e-5), _f32(x, scale, bias), g)
    assert np.abs(np.asarray(other[0]) - np.asarray(want[0])).max() > 0.1 * np.abs(np.asarray(want[0])).max()


def test_layer_norm_finite_differences():
    x = _inputs(jnp.float32, 3, 16, seed=5, scale=0.5)
    scale, bias = 1.0 + _inputs(jnp.float32, 16, seed=6, scale=0.2), _inputs(jnp.float32, 16, seed=7)
    check_grads(lambda x, s, b: M.layer_norm(x, s, b, EPS_LN), (x, scale, bias), order=1, modes=["rev"],
                eps=1e-3, atol=1e-2, rtol=1e-2)


# --------------------------------------------------------------------------------------------
# GELU


@pytest.mark.parametrize("dtype", DTYPES)
def test_gelu_gradients_match_autodiff_of_a_reference(dtype):
    x = _inputs(dtype, 4, 64, seed=8, scale=2.0)  # covers both tails and the bend around 0
    g = _inputs(dtype, 4, 64, seed=9)
    np.testing.assert_allclose(np.asarray(M.gelu(x), np.float32), np.asarray(ref_gelu(x), np.float32),
                               rtol=1e-6 if dtype == jnp.float32 else 2**-8, atol=1e-6)
    _assert_close(_grads(M.gelu, (x,), g), _grads(ref_gelu, _f32(x), g), dtype)


def test_gelu_finite_differences():
    x = jnp.asarray([-3.0, -1.2, -0.4, 0.0, 0.3, 1.0, 2.5], jnp.float32)
    check_grads(M.gelu, (x,), order=1, modes=["rev"], eps=1e-3, atol=1e-2, rtol=1e-2)


# --------------------------------------------------------------------------------------------
# Causal softmax


@pytest.mark.parametrize("dtype", DTYPES)
def test_causal_softmax_gradients_match_autodiff_of_a_reference(dtype):
    scores = _inputs(dtype, 2, 3, 8, 8, seed=10, scale=3.0)  # [b, a, q, k]
    g = _inputs(dtype, 2, 3, 8, 8, seed=11)
    scale = 1.0 / math.sqrt(16)
    probs = np.asarray(M.causal_softmax(scores, scale), np.float32)
    np.testing.assert_allclose(probs, np.asarray(ref_causal_softmax(scores, scale), np.float32),
                               rtol=0, atol=1e-6 if dtype == jnp.float32 else 2**-9)
    assert (probs[..., np.triu_indices(8, 1)[0], np.triu_indices(8, 1)[1]] == 0).all()  # nothing from the future
    got = _grads(lambda s: M.causal_softmax(s, scale), (scores,), g)
    _assert_close(got, _grads(lambda s: ref_causal_softmax(s, scale), _f32(scores), g), dtype)
    # Masked scores get no gradient at all.
    future = np.triu(np.ones((8, 8), bool), 1)
    assert (np.asarray(got[0])[..., future] == 0).all()


def test_causal_softmax_finite_differences():
    scores = _inputs(jnp.float32, 1, 2, 5, 5, seed=12)
    check_grads(lambda s: M.causal_softmax(s, 0.5), (scores,), order=1, modes=["rev"], eps=1e-3, atol=1e-2, rtol=1e-2)


# --------------------------------------------------------------------------------------------
# Dropout


@pytest.mark.parametrize("dtype", DTYPES)
def test_dropout_gradient_is_the_scaled_mask(dtype):
    rate, key = 0.25, jax.random.key(3)
    x = _inputs(dtype, 64, 32, seed=13)
    g = _inputs(dtype, 64, 32, seed=14)
    keep = np.asarray(jax.random.bernoulli(key, 1.0 - rate, x.shape))  # the reference mask, drawn directly
    assert 0.7 < keep.mean() < 0.8
    ref = lambda x: jnp.where(keep, x.astype(jnp.float32) / (1.0 - rate), 0.0).astype(x.dtype)
    np.testing.assert_array_equal(np.asarray(M.dropout(x, rate, key, "mask"), np.float32),
                                  np.asarray(ref(x), np.float32))
    got = _grads(lambda x: M.dropout(x, rate, key, "mask"), (x,), g)
    _assert_close(got, _grads(ref, _f32(x), g), dtype)
    # And in closed form: dL/dx = g · keep / (1 − rate); no gradient where dropped.
    assert (np.asarray(got[0])[~keep] == 0).all()
    # The same gradient when the layer body is rematerialised keeping only the mask (as the policies do).
    remat = jax.checkpoint(lambda x: M.dropout(x, rate, key, "mask"),
                           policy=jax.checkpoint_policies.save_only_these_names("mask"))
    np.testing.assert_array_equal(np.asarray(_grads(remat, (x,), g)[0]), np.asarray(got[0]))


def test_dropout_finite_differences_and_rate_zero():
    key = jax.random.key(4)
    x = _inputs(jnp.float32, 6, 7, seed=15)
    check_grads(lambda x: M.dropout(x, 0.5, key, "mask"), (x,), order=1, modes=["rev"], eps=1e-3, atol=1e-2, rtol=1e-2)
    assert M.dropout(x, 0.0, key, "mask") is x and M.dropout(x, 0.5, None, "mask") is x
