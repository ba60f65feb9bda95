"""Megatron's data parallelism: each data rank sums its own gradients over the step's micro-batches, and
the ranks reduce that sum once per step, after the accumulation.

Why not leave it to XLA: the gradient of a weight replicated over `data` is reduced where autodiff makes
it, so under a loop over micro-batches XLA reduces every micro-batch's gradients (m times Megatron's
traffic). Inside a `jax.shard_map` manual over `data` the weights are cast to varying over `data` before
the loop (`varying`), so each rank's gradients stay its own, and `reduce_over_data` runs the one reduction
after it: an all-reduce, or onto the distributed optimizer's master shards a reduce-scatter. The pipeline
executor (`parallel.pipeline`) does this around its tick loop; `accumulate_loss_and_grad` around a plain
scan over the micro-batches (no pipeline).
"""

from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from jaxseq.config import ModelConfig, ParallelConfig
from jaxseq.models import gpt as M
from jaxseq.sharding import Sharder, StageSharder


def varying(x, axes=("pipe", "data")):
    """pcast to varying over `axes` where not already so (pcast of a varying value raises). Weights cast
    to varying over `data` before a loop get per-rank gradients: autodiff then inserts no psum (the
    transpose of the implicit cast) inside it, and the step reduces over `data` once, after it."""
    missing = tuple(a for a in axes if a not in jax.typeof(x).mat.varying)
    return jax.lax.pcast(x, missing, to="varying") if missing else x


def data_dims(grad_specs) -> dict:
    """Where each gradient is split over `data`, as an index into the parameter's shape (−1: all-reduced)."""
    return jax.tree.map(lambda spec: list(spec).index("data") if "data" in spec else -1, grad_specs,
                        is_leaf=lambda x: isinstance(x, P))


def reduce_over_data(g, dim: int, tensor_spec: P):
    """A gradient summed over `data`: all-reduced (dim −1), or reduce-scattered onto dimension `dim`.
    The scatter runs manual over `tensor` too (`tensor_spec`: the gradient's split): left to the
    partitioner, XLA gathered a tensor-split gradient whole before scattering it over `data`."""
    if dim < 0:
        return jax.lax.psum(g, "data")
    scatter = lambda x: jax.lax.psum_scatter(x, "data", scatter_dimension=dim, tiled=True)
    if "tensor" not in tensor_spec:
        return scatter(g)
    return jax.shard_map(scatter, mesh=jax.sharding.get_abstract_mesh(), in_specs=tensor_spec, out_specs=tensor_spec,
                         axis_names={"tensor"})(g)


def accumulate_loss_and_grad(params, batch, key, *, cfg: ModelConfig, parallel: ParallelConfig, remat: str, mesh,
                             microbatches: int, grad_specs):
    """(loss, float32 grads) of the mean loss over `microbatches` micro-batches of `batch` ({"inputs", "targets"}:
    [B, s] int32), micro-batch i with dropout key fold_in(key, i), without a pipeline. To be called under
    jit with `params` in their compute layout (`model.param_specs`). Each data rank runs its rows of every
    micro-batch (dropout masks: those rows of the global mask, `model.bernoulli_rows`) and sums its float32
    gradients in a `lax.scan`; after it the sum is reduced over `data` once, reduce-scattered onto dimension
    `grad_specs` names `data` on (the distributed optimizer's master shards) or else all-reduced. `tensor`
    stays with XLA's partitioner inside (`StageSharder` writes its collectives). The region is manual over
    `pipe` too, of size 1 here, as the pipeline's is: with `pipe` left automatic, the vocab-parallel lookup's
    nested shard_map over `tensor` is not manual over every axis, and XLA:CPU aborted compiling a bfloat16
    step (that psum's reduction was exported ending in a copy, which all-reduce promotion cannot clone)."""
    micro = jax.tree.map(lambda a: Sharder(mesh, parallel.sequence_parallel)(
        a.reshape(microbatches, -1, *a.shape[1:]), None, "batch", None), batch)
    dims, specs = data_dims(grad_specs), M.param_specs(parallel)
    loss_and_grad = jax.value_and_grad(partial(M.loss_fn, cfg=cfg, remat=remat,
                                               shard=StageSharder(mesh, parallel.sequence_parallel)))
    scale = 1.0 / (microbatches * parallel.data)  # the mean over micro-batches and data ranks

    def rank(params, micro, key_data):
        key, weights = jax.random.wrap_key_data(key_data), jax.tree.map(lambda a: varying(a, ("data",)), params)

        def add(total, inputs):
            mb, i = inputs
            loss, grads = loss_and_grad(weights, mb, key=jax.random.fold_in(key, i))
            return jax.tree.map(lambda acc, x: acc + x.astype(jnp.float32), total, (loss, grads)), None

        zeros = jax.tree.map(lambda a: varying(jnp.zeros(a.shape, jnp.float32), ("data",)), (jnp.zeros(()), params))
        (loss, grads), _ = jax.lax.scan(add, zeros, (micro, jnp.arange(microbatches)))
        return (jax.lax.psum(loss, "data") * scale,
                jax.tree.map(lambda g, dim, spec: reduce_over_data(g * scale, dim, spec), grads, dims, specs))

    out_specs = jax.tree.map(lambda dim: P(*[None] * dim, "data") if dim >= 0 else P(), dims)
    return jax.shard_map(rank, mesh=mesh, axis_names={"pipe", "data"}, in_specs=(P(), P(None, "data"), P()),
                         out_specs=(P(), out_specs))(params, micro, jax.random.key_data(key))
