"""Megatron's data parallelism: each data rank sums its own gradients over the step's micro-batches, and
the ranks reduce that sum once per step, after the accumulation.

Why not leave it to XLA: the gradient of a weight replicated over `data` is reduced where autodiff makes
it, so under a loop over micro-batches XLA reduces every micro-batch's gradients (m times Megatron's
traffic). Inside a `jax.shard_map` manual over `data` the weights are cast to varying over `data` before
the loop (`varying`), so each rank's gradients stay its own, and `reduce_over_data` runs the one reduction
after it: an all-reduce, or onto the distributed optimizer's master shards a reduce-scatter. The pipeline
executor (`parallel.pipeline`) does this around its tick loop.
"""

from __future__ import annotations

import jax
from jax.sharding import PartitionSpec as P


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
