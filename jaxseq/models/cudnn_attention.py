"""cuDNN's flash attention (`jax.nn.dot_product_attention(implementation="cudnn")`) under a VJP of ours.

Why not call it as it is (both found by compiling for an H100: tests/test_gpu_target.py):
- Its residuals, the output and the float32 softmax statistics (log-sum-exp), carry no checkpoint name, so every
  whitelist policy (remat.py) recomputed them: backward ran the forward kernel again, `none` included. Here the
  output is tagged CONTEXT inside the forward rule (`ops.tagged_context`: what the model goes on with, kept once by
  every policy that keeps the context) and the statistics ATTN_SOFTMAX_STATS.
- Its custom partitioning fails inside the regions manual over `data`, `fsdp` and `pipe` (an AssertionError in
  XLA's SPMD partitioner). There the kernel runs in a nested shard_map manual over the rest (`tensor`), on one
  rank's heads, forward and backward each a forward-only shard_map (autodiff through a nested one fails to lower),
  the residuals passed between them stacked on a new leading axis over `tensor`.
"""

from __future__ import annotations

from functools import partial

import jax
from jax.ad_checkpoint import checkpoint_name
from jax.sharding import PartitionSpec as P

from jaxseq import remat
from jaxseq.sharding import Sharder

KERNEL = partial(jax.nn.dot_product_attention, is_causal=True, implementation="cudnn")


def cudnn_attention(q, k, v, shard: Sharder, tag, kernel=KERNEL):
    """Causal attention of q [b, s, a, d] over k, v [b, s, kv, d], split by heads over `tensor`; the context
    [b, s, a, d] as `tag` (ops.tagged_context) makes it. `kernel` is cuDNN's (a stand-in of the same residuals runs
    this code on a CPU: tests/test_cudnn_attention.py)."""
    nested = shard.rows_manual and shard.mesh is not None
    heads = shard.spec("batch", None, "heads", None)
    stacked = P(tuple(sorted(shard.manual_axes))) if nested else None
    vjp_of = {}  # the kernel's VJP, as a tree over its residuals, and where each residual comes from

    def local_forward(q, k, v):
        out, vjp = jax.vjp(kernel, q, k, v)
        residuals, vjp_of["tree"] = jax.tree.flatten(vjp)
        known = (q, k, v, out)  # passed on as they are; the others (the statistics) returned beside the output
        vjp_of["source"] = [next((i for i, x in enumerate(known) if r is x), None) for r in residuals]
        own = [r for r, i in zip(residuals, vjp_of["source"]) if i is None]
        return out, [_stack(r, shard.manual_axes) for r in own] if nested else own

    def local_backward(q, k, v, out, own, g):
        own = iter([r[0] for r in own] if nested else own)
        known = (q, k, v, out)
        residuals = [known[i] if i is not None else next(own) for i in vjp_of["source"]]
        return jax.tree.unflatten(vjp_of["tree"], residuals)(g)

    def forward(q, k, v):
        if nested:
            return jax.shard_map(local_forward, mesh=shard.map_mesh, axis_names=shard.manual_axes,
                                 in_specs=(heads,) * 3, out_specs=(heads, stacked))(q, k, v)
        return local_forward(q, k, v)

    @jax.custom_vjp
    def attend(q, k, v):
        return shard(forward(q, k, v)[0], "batch", "seq", "heads", None)

    def attend_fwd(q, k, v):
        out, own = forward(q, k, v)
        out = tag(out, shard)  # what the model goes on with is what backward keeps: tagged once, here
        return out, (q, k, v, out, [checkpoint_name(r, remat.ATTN_SOFTMAX_STATS) for r in own])

    def attend_bwd(residuals, g):
        if nested:
            return jax.shard_map(local_backward, mesh=shard.map_mesh, axis_names=shard.manual_axes,
                                 in_specs=(heads,) * 4 + (stacked, heads), out_specs=(heads,) * 3)(*residuals, g)
        return local_backward(*residuals, g)

    attend.defvjp(attend_fwd, attend_bwd)
    return attend(q, k, v)


def _stack(x, axes):
    """x on a new leading axis, typed as varying over `axes` (a value alike on every rank, a constant, is not)."""
    missing = tuple(a for a in sorted(axes) if a not in jax.typeof(x).mat.varying)
    return (jax.lax.pcast(x, missing, to="varying") if missing else x)[None]
