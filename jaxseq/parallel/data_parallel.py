"""Megatron's data parallelism: each data rank sums its own gradients over the step's micro-batches, and
the ranks reduce that sum once per step, after the accumulation. Under context parallelism the context ranks
are data ranks to the weights (each holds other tokens of the same sequences): the same, over data × context.

Why not leave it to XLA: the gradient of a weight replicated over `data` is reduced where autodiff makes
it, so under a loop over micro-batches XLA reduces every micro-batch's gradients (m times Megatron's
traffic). Inside a `jax.shard_map` manual over `data` the weights are cast to varying over `data` before
the loop (`varying`), so each rank's gradients stay its own, and `reduce_over` runs the one reduction
after it: an all-reduce, or onto the distributed optimizer's master shards a reduce-scatter. The pipeline
executor (`parallel.pipeline`) does this around its tick loop; `accumulate_loss_and_grad` around a plain
scan over the micro-batches (no pipeline).
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from jaxseq.config import ModelConfig, ParallelConfig
from jaxseq.models import model
from jaxseq.parallel import context
from jaxseq.parallel.layout import Layout, gradient_axes
from jaxseq.mesh import EXPERT_AXIS, FSDP_AXIS, batch_axes
from jaxseq.sharding import Sharder, entry_axes, only_axes, spec_axes


def region_axes(parallel: ParallelConfig) -> frozenset[str]:
    """The axes the pipeline's and gradient accumulation's regions are manual over: `pipe`, `data`, and
    `context` under context parallelism (each rank then runs its own tokens; the mesh has no `context` axis
    otherwise), `fsdp` under FSDP (each rank its rows, and its shard of every weight: `parallel.fsdp`), and
    `expert` under expert parallelism (each rank its rows and its experts: models/experts.py). `tensor` stays with
    XLA's partitioner."""
    return frozenset({"pipe", "data"} | ({"fsdp"} if parallel.fsdp > 1 else set())
                     | ({"expert"} if parallel.expert > 1 else set())
                     | ({"context"} if parallel.context > 1 else set()))


def varying(x, axes=None):
    """pcast to varying over `axes` (default: every manual axis of the enclosing region) where not already so
    (pcast of a varying value raises). Weights cast to varying over `data` (and `context`) before a loop get
    per-rank gradients: autodiff then inserts no psum (the transpose of the implicit cast) inside it, and the
    step reduces over those axes once, after it."""
    axes = sorted(jax.sharding.get_abstract_mesh().manual_axes) if axes is None else axes
    missing = tuple(a for a in axes if a not in jax.typeof(x).mat.varying)
    return jax.lax.pcast(x, missing, to="varying") if missing else x


def reduce_over(g, spec: P, over: tuple[str, ...]):
    """A gradient summed over the manual axes `over`: reduce-scattered onto each dimension where `spec` (its
    master weights' split of g's dimensions) names some of them, in the order it names them, and all-reduced
    over the rest. The scatter runs manual over `tensor` too where `spec` splits over it: left to the
    partitioner, XLA gathered a tensor-split gradient whole before scattering it over `data`."""
    scatters = [(dim, axes) for dim, axes in enumerate(entry_axes(e) for e in only_axes(spec, over)) if axes]
    rest = tuple(a for a in over if not any(a in axes for _, axes in scatters))

    def reduce(x):
        for dim, axes in scatters:
            x = jax.lax.psum_scatter(x, axes, scatter_dimension=dim, tiled=True)
        return jax.lax.psum(x, rest) if rest else x

    tensor_spec = only_axes(spec, ("tensor",))
    if not scatters or not any(tensor_spec):
        return reduce(g)
    return jax.shard_map(reduce, mesh=jax.sharding.get_abstract_mesh(), in_specs=tensor_spec, out_specs=tensor_spec,
                         axis_names={"tensor"})(g)


def region_split(layout: Layout) -> dict:
    """The weights' specs naming `fsdp` and `expert` alone: how each enters a region manual over them (its shard
    of every weight under FSDP, of the experts under expert parallelism)."""
    return jax.tree.map(lambda spec: only_axes(spec, (FSDP_AXIS, EXPERT_AXIS)), layout.param_specs,
                        is_leaf=lambda x: isinstance(x, P))


def left_to_reduce(layout: Layout, over: tuple[str, ...]) -> dict:
    """Per weight, the axes of `over` its gradient is still summed over after the region's loop: a weight split
    over `fsdp` arrives reduce-scattered over it (`parallel.fsdp.gather`'s backward), an expert's over `expert`
    summed by the all-to-all's transpose; the rest are not."""
    return jax.tree.map(lambda spec: tuple(a for a in over if a not in spec_axes(spec)), region_split(layout),
                        is_leaf=lambda x: isinstance(x, P))


def accumulate_loss_and_grad(params, batch, key, *, layout: Layout, remat: str, microbatches: int, grad_specs,
                             offload: tuple[str, ...] = ()):
    """(loss, float32 grads) of the mean loss over `microbatches` micro-batches of `batch` ({"inputs", "targets"}:
    [B, s] int32), micro-batch i with dropout key fold_in(key, i) (one micro-batch: `key` itself, no scan), without
    a pipeline. The train step's gradients take this path with one micro-batch too: left to XLA, the reduction of
    a gradient of the compute-dtype weights runs in that dtype (bf16), where here each rank's gradient is cast to
    float32 first and the ranks sum float32 (Megatron's default, --accumulate-allreduce-grads-in-fp32). To be called
    under jit with `params` in their compute layout (`model.param_specs`). Each data rank runs its rows of every
    micro-batch (dropout masks: those rows of the global mask, `model.bernoulli_rows`), each context rank its
    tokens of them, and sums its float32 gradients in a `lax.scan`; after it the sum is reduced over data ×
    context once (`reduce_over`), reduce-scattered onto the dimension `grad_specs` splits over those axes (the
    distributed optimizer's master shards) or else all-reduced. `tensor` stays with XLA's partitioner inside
    (`StageSharder` writes its collectives). The region is manual over `pipe` too, of size 1 here, as the
    pipeline's is: with `pipe` left automatic, the vocab-parallel lookup's nested shard_map over `tensor` is not
    manual over every axis, and XLA:CPU aborted compiling a bfloat16 step (that psum's reduction was exported
    ending in a copy, which all-reduce promotion cannot clone)."""
    cfg, parallel, mesh = layout.model, layout.parallel, layout.mesh
    micro = jax.tree.map(lambda a: Sharder(mesh, parallel.sequence_parallel)(
        a.reshape(microbatches, -1, *a.shape[1:]), None, "batch", None), batch)
    over = gradient_axes(parallel)
    if parallel.batch_ranks * parallel.context == 1:
        return _unreduced_loss_and_grad(params, micro, key, cfg=cfg, parallel=parallel, remat=remat, mesh=mesh,
                                        offload=offload)
    loss_and_grad = jax.value_and_grad(partial(model.loss_fn, cfg=cfg, remat=remat, offload=offload,
                                               shard=context.sharder(mesh, parallel, stage=True)))
    # the mean over micro-batches, data, fsdp, expert and context ranks (each rank's loss: the mean over its tokens)
    scale = 1.0 / (microbatches * parallel.batch_ranks * parallel.context)
    weight_specs, still_over = region_split(layout), left_to_reduce(layout, over)

    def rank(params, micro, key_data):
        key, weights = jax.random.wrap_key_data(key_data), jax.tree.map(lambda a: varying(a, over), params)
        loss, grads = _summed(loss_and_grad, weights, micro, key, lambda z: varying(z, over))
        return (jax.lax.psum(loss, over) * scale,
                jax.tree.map(lambda g, spec, axes: reduce_over(g * scale, spec, axes), grads, grad_specs, still_over))

    out_specs = jax.tree.map(lambda spec: only_axes(spec, over), grad_specs, is_leaf=lambda x: isinstance(x, P))
    return jax.shard_map(rank, mesh=mesh, axis_names=set(region_axes(parallel)),
                         in_specs=(weight_specs, P(None, batch_axes(parallel.fsdp > 1, parallel.expert > 1)), P()),
                         out_specs=(P(), out_specs))(params, micro, jax.random.key_data(key))


def _unreduced_loss_and_grad(params, micro, key, *, cfg: ModelConfig, parallel: ParallelConfig, remat: str, mesh,
                             offload: tuple[str, ...] = ()):
    """`accumulate_loss_and_grad` where there is no data or context rank to reduce over (data = context = 1): no
    region (one manual over axes all of size 1 made XLA's partitioner refuse its psum: "Cross-partition allreduce
    must be in (partial) manual partitioning mode"), the same keys and float32 sums."""
    loss_and_grad = jax.value_and_grad(partial(model.loss_fn, cfg=cfg, remat=remat, offload=offload,
                                               shard=context.sharder(mesh, parallel)))
    microbatches = jax.tree.leaves(micro)[0].shape[0]
    loss, grads = _summed(loss_and_grad, params, micro, key, lambda z: z)
    if microbatches == 1:
        return loss, grads
    return loss / microbatches, jax.tree.map(lambda g: g / microbatches, grads)


def _summed(loss_and_grad, weights, micro, key, accumulator: Callable):
    """The float32 (loss, grads) of `loss_and_grad` summed over the micro-batches of `micro` ([m, b, …] per leaf),
    micro-batch i with dropout key fold_in(key, i); one micro-batch: `key` itself, as a step without accumulation
    draws it, and no scan or accumulator. accumulator(zeros): the accumulator's type (varying inside a region)."""
    float32 = lambda tree: jax.tree.map(lambda x: x.astype(jnp.float32), tree)
    microbatches = jax.tree.leaves(micro)[0].shape[0]
    if microbatches == 1:
        return float32(loss_and_grad(weights, jax.tree.map(lambda a: a[0], micro), key=key))

    def add(total, inputs):
        mb, i = inputs
        return jax.tree.map(jnp.add, total, float32(loss_and_grad(weights, mb, key=jax.random.fold_in(key, i)))), None

    zeros = jax.tree.map(lambda a: accumulator(jnp.zeros(a.shape, jnp.float32)), (jnp.zeros(()), weights))
    (loss, grads), _ = jax.lax.scan(add, zeros, (micro, jnp.arange(microbatches)))
    return loss, grads


def accumulated_loss(params, batch, *, layout: Layout, micro_batches: int):
    """The mean of `model.loss_fn` (no dropout) over the micro-batches of `batch`, one at a time (lax.map),
    on the compute copy of the weights made once (gathered over data, as the train step's): the evaluation's
    forward-only counterpart of `accumulate_loss_and_grad`, its activations one micro-batch's."""
    cfg, shard = layout.model, context.sharder(layout.mesh, layout.parallel)
    weights = jax.tree.map(jax.lax.with_sharding_constraint, model.cast_params(params, cfg), layout.param_shardings)
    micro = jax.tree.map(lambda x: shard(x.reshape(micro_batches, -1, *x.shape[1:]), None, "batch", None), batch)
    return jnp.mean(jax.lax.map(lambda mb: model.loss_fn(weights, mb, cfg, shard, "none"), micro))
