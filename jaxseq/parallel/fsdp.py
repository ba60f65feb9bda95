"""FSDP (ZeRO-3) inside the training regions: a weight split over `fsdp` is gathered as a layer uses it, and its
gradient reduce-scattered back onto the shard at once.

`models.model.param_specs` splits every weight's hidden dimension (logical axis `embed`) over `fsdp`; the master
weights, their gradients and Adam moments follow (`parallel.layout.Layout.master_specs`). In a region manual over
`fsdp` (`parallel.region.StageSharder`: gradient accumulation's, the pipeline's) each rank holds its rows of the
batch and its shard of every weight; `gather` is the one place the weight moves. Written as collectives, not left
to the partitioner: under a sharding constraint XLA reduces a weight's gradient where the matmul makes it, in the
compute dtype (bf16); here each rank's gradient is cast to float32 first and the ranks reduce-scatter float32
(Megatron's and PyTorch FSDP's default), and the weight is cast to the compute dtype on its shard, before the
gather (half the bytes of gathering the float32 master). Inside the layer's `jax.checkpoint`, no remat policy names
the gathered weight, so backward gathers it again (one all-gather per weight per pass, as MaxText and FSDP do).

Both collectives run over a new leading axis of the f shards, then merged into the split dimension (in rank order,
as a tiled gather concatenates): XLA:GPU lays out a collective's own dimension major, so gathering in place a weight
split along a minor dimension (the MLP's output [f, h], the attention's output [heads, d, h]) made it keep the whole
float32 master stack and gradient stack of those weights transposed beside the originals (compiled for an H100:
docs/DESIGN.md, "FSDP"); over a new axis only each layer's gathered weight and gradient are rearranged, inside the
layer loop.
"""

from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from jaxseq.mesh import FSDP_AXIS as FSDP


def gather(w, *, dim: int | None, dtype, tensor_spec: P):
    """w (this fsdp rank's shard along `dim`; whole where `dim` is None) cast to `dtype` (None: kept) and gathered
    over `fsdp`. Backward: the gradient cast to float32, reduce-scattered over `fsdp` onto this rank's shard (left
    this rank's own where `dim` is None: it is reduced with the data ranks' after the step's loop), in w's dtype.
    `tensor_spec`: w's split over `tensor` (the collectives run manual over it too: left to the partitioner, XLA
    gathers a tensor-split array whole around a collective over a manual axis)."""
    if dim is None and (dtype is None or jnp.dtype(dtype) == w.dtype):
        return w
    cast = (lambda x: x) if dtype is None else (lambda x: x.astype(dtype))
    master_dtype = w.dtype

    def forward(x):
        x = cast(x)
        if dim is None:
            return x
        shards = jnp.moveaxis(jax.lax.all_gather(x, FSDP, axis=0), 0, dim)  # [..., f, shard, ...]
        return shards.reshape(*x.shape[:dim], -1, *x.shape[dim + 1:])

    def backward(g):
        g = g.astype(jnp.float32)
        if dim is not None:
            f = jax.lax.axis_size(FSDP)
            shards = g.reshape(*g.shape[:dim], f, g.shape[dim] // f, *g.shape[dim + 1:])
            g = jax.lax.psum_scatter(jnp.moveaxis(shards, dim, 0), FSDP, scatter_dimension=0)  # this rank's, summed
        return g.astype(master_dtype)

    if any(tensor_spec):
        nested = partial(jax.shard_map, mesh=jax.sharding.get_abstract_mesh(), in_specs=tensor_spec,
                         out_specs=tensor_spec, axis_names={"tensor"})
        forward, backward = nested(forward), nested(backward)

    @jax.custom_vjp
    def gathered(x):
        return forward(x)

    gathered.defvjp(lambda x: (forward(x), None), lambda _, g: (backward(g),))
    return gathered(w)
