"""The VJP jaxseq wraps cuDNN's attention in (models/cudnn_attention.py), on this CPU: the same code with XLA's
kernel in cuDNN's place, against autodiff of XLA's kernel on one device (the outside reference), at the top level
and nested inside the regions manual over `data` and `pipe`. What cuDNN's kernel itself compiles to (one forward per
layer, the regions it now compiles in) is read from programs compiled for an H100: tests/test_gpu_target.py.
Float32, tiny models, 8 devices."""

from functools import lru_cache, partial

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxseq.config import ParallelConfig, replace
from jaxseq.presets import preset
from jaxseq.mesh import make_mesh
from jaxseq.models import cudnn_attention as CA
from jaxseq.models import model as M
from jaxseq.models import ops
from jaxseq.parallel.layout import Layout
from jaxseq.training import train_step as T

from compiled_steps import counting_batch
from trees import comparable

GPT = replace(preset("tiny"), dtype="float32", attention="fused", dropout=0.0, fused_kernel="xla")
LLAMA = replace(preset("tiny-llama"), dtype="float32", attention="fused", dropout=0.0, fused_kernel="xla")


@jax.custom_vjp
def flash_kernel(q, k, v):
    """A stand-in for cuDNN's kernel: one opaque call each way (as cuDNN's custom calls; here NumPy through
    `jax.pure_callback`), with cuDNN's residuals (the VJP's leaves): q, k, v, an empty bias, the float32
    log-sum-exp per head and query, and the output. Its backward recomputes the probabilities from the
    log-sum-exp (dS = P∘(dP − rowsum(dO∘O))), as flash attention does."""
    return _flash_forward(q, k, v)[0]


def _np_scores(q, k):
    b, s, a, d = q.shape
    scores = np.einsum("bqkgd,bskd->bkgqs", q.reshape(b, s, k.shape[2], -1, d), k) / np.sqrt(d)
    return np.where(np.tril(np.ones((s, s), bool)), scores, -np.inf)


def _np_forward(q, k, v):
    b, s, a, d = q.shape
    scores = _np_scores(q, k)
    top = scores.max(-1, keepdims=True)
    lse = (top + np.log(np.exp(scores - top).sum(-1, keepdims=True)))[..., 0]
    out = np.einsum("bkgqs,bskd->bqkgd", np.exp(scores - lse[..., None]), v).reshape(q.shape)
    return out.astype(q.dtype), lse.astype(np.float32)


def _np_backward(q, k, v, lse, out, g):
    b, s, a, d = q.shape
    kv = k.shape[2]
    probs = np.exp(_np_scores(q, k) - lse[..., None])
    g5, out5, q5 = (x.reshape(b, s, kv, -1, d) for x in (g, out, q))
    dv = np.einsum("bkgqs,bqkgd->bskd", probs, g5)
    dp = np.einsum("bqkgd,bskd->bkgqs", g5, v)
    ds = probs * (dp - np.einsum("bqkgd,bqkgd->bkgq", g5, out5)[..., None]) / np.sqrt(d)
    dq = np.einsum("bkgqs,bskd->bqkgd", ds, k).reshape(q.shape)
    dk = np.einsum("bkgqs,bqkgd->bskd", ds, q5)
    return dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype)


def _flash_forward(q, k, v):
    b, s, a, d = q.shape
    shapes = (jax.ShapeDtypeStruct(q.shape, q.dtype),
              jax.ShapeDtypeStruct((b, k.shape[2], a // k.shape[2], s), jnp.float32))
    out, lse = (_varying_like(x, q) for x in jax.pure_callback(_np_forward, shapes, q, k, v))
    return out, (q, k, v, jnp.zeros((0,), q.dtype), lse, out)


def _flash_backward(residuals, g):
    q, k, v, _, lse, out = residuals
    shapes = tuple(jax.ShapeDtypeStruct(x.shape, x.dtype) for x in (q, k, v))
    return tuple(_varying_like(x, q) for x in jax.pure_callback(_np_backward, shapes, q, k, v, lse, out, g))


def _varying_like(x, ref):
    """A callback's result, typed as varying over the manual axes `ref` varies over (a callback's is over none)."""
    missing = tuple(a for a in sorted(jax.typeof(ref).mat.varying) if a not in jax.typeof(x).mat.varying)
    return jax.lax.pcast(x, missing, to="varying") if missing else x


flash_kernel.defvjp(_flash_forward, _flash_backward)
ROWS = 8
# name → (model, layout, remat, micro-batches): top level (cuDNN's own partitioning), and nested in the regions
LAYOUTS = {
    "tensor=2+sp none": (GPT, ParallelConfig(tensor=2, sequence_parallel=True), "none", 1),
    "data=2,tensor=2 llama full": (LLAMA, ParallelConfig(data=2, tensor=2), "full", 2),
    "pipe=2,tensor=2+sp lean": (GPT, ParallelConfig(pipe=2, tensor=2, sequence_parallel=True), "lean", 2),
}


@lru_cache(maxsize=None)
def gradients(cfg, parallel: ParallelConfig, remat: str, micro_batches: int):
    """(loss, float32 gradients as numpy) of the step's gradients on `parallel`."""
    mesh = make_mesh(parallel, jax.devices()[: parallel.num_devices])
    layout = Layout(cfg, parallel, mesh)
    params = jax.device_put(M.init_params(jax.random.key(0), cfg, parallel.tensor), layout.master_shardings)
    fn = jax.jit(T.step_gradients(layout, remat, micro_batches))
    loss, grads = fn(params, counting_batch(cfg, ROWS, 0), jax.random.key(1))
    return float(loss), jax.tree.map(np.asarray, grads)


@pytest.mark.parametrize("name", [n if n.startswith("tensor") else pytest.param(n, marks=pytest.mark.slow)
                                  for n in LAYOUTS])
def test_the_wrapped_kernels_gradients_equal_autodiff_on_one_device(devices, monkeypatch, name):
    cfg, parallel, remat, micro_batches = LAYOUTS[name]
    want_loss, want = gradients(cfg, ParallelConfig(), "selective", micro_batches)
    monkeypatch.setattr(ops, "cudnn_attention", partial(CA.cudnn_attention, kernel=flash_kernel))
    loss, grads = gradients(replace(cfg, fused_kernel="cudnn"), parallel, remat, micro_batches)
    assert abs(loss - want_loss) <= 1e-5 * abs(want_loss)
    for (path, got), ref in zip(jax.tree_util.tree_leaves_with_path(comparable(grads)),
                                jax.tree.leaves(comparable(want))):
        assert np.abs(got - ref).max() <= 1e-5 * np.abs(ref).max(), jax.tree_util.keystr(path)
