"""The pipeline executor's entry points: loss and gradients of the whole model over a `pipe` mesh axis, one
schedule tick at a time, so that 1F1B really holds only the micro-batches its schedule keeps in flight; and the
forward-only loss (evaluation). One stage: `stage.py`; what it runs at each tick: `tick_programs.py`; the tick
table: `ticks.py`.

Why not `jax.grad` of a forward pipeline: autodiff keeps every micro-batch's activations until the
backward loop (GPipe's memory, whatever the forward order). Here each micro-batch chunk gets its own
`jax.vjp`; its residuals wait in a stash slot until the schedule's backward of that chunk runs.

The program (inside `jax.shard_map`, manual over `pipe` and `data`, `tensor` left to XLA; each data rank
runs its rows of every micro-batch, dropout masks drawn as the rows of the global mask):
- one `lax.scan` over the ticks of `schedule.Schedule.tables` (`tick_programs.TickProgram`); at each tick every
  stage reads its `TickRow` (branch, micro-batch, chunk, buffer slots) and runs one `lax.switch` branch
  (`Branch`): idle, forward (first chunk: embedding first; last chunk: final norm, logits, loss and
  the loss gradient), backward (first chunk: the embedding gradient after);
- after the switch two `ppermute`s move the forward output to stage s + 1 and the input gradient to
  stage s − 1 (cyclic: the last stage feeds stage 0's next chunk under the interleaved schedule);
- the stash keeps only the residuals that are not the chunk's weights or dropout keys (those are the same
  arrays at backward time: `ResidualLayout`), so a slot costs what the remat policy stores for k layers;
- weights are cast to `pipe`- and `data`-varying before the loop, so each stage and data rank accumulates
  its own gradients over the micro-batches; after the loop they are summed over `data` once (Megatron's
  one data-parallel reduction per step), and the embedding's two gradients (first stage's lookup, last
  stage's logits) and the final norm's over `pipe` too (Megatron's embedding group):
  `reduce_gradients`.

Layers are stored in natural order, sharded over `pipe` in L/p blocks; stage s, chunk c runs layers
(c·p + s)·k … + k − 1 (k = L/(p·v)). For v = 1 that is the stored block (no data moves); for v > 1 the
step regroups the layers (an all-to-all over `pipe` of the weights and, after, of their gradients).

Shapes (global over `tensor`, which XLA splits): m micro-batches, p stages, v chunks per stage, k layers per
chunk, b one data rank's rows of a micro-batch, s sequence, h hidden; "[v, k, …]" is a layer parameter's
shape with its L layers regrouped as v chunks of k.
"""

from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec as P

from jaxseq.config import ModelConfig, ParallelConfig, replace
from jaxseq.mesh import batch_axes
from jaxseq.models import model
from jaxseq.parallel import context
from jaxseq.parallel import data_parallel
from jaxseq.parallel.layout import Layout
from jaxseq.parallel.region import StageSharder
from jaxseq.parallel.schedule import Schedule
from jaxseq.parallel.stage import ResidualLayout, Stage, from_stages, to_stages
from jaxseq.parallel.tick_programs import Buffers, ForwardProgram, TickProgram
from jaxseq.parallel.ticks import schedule_of, tick_rows
from jaxseq.sharding import Sharder, entry_axes, only_axes


def _ring(parallel: ParallelConfig) -> bool:
    """Whether the ring strategy runs inside the stages' branches (their permutes then need padding)."""
    return parallel.context > 1 and parallel.context_strategy == "ring"


# ---------------------------------------------------------------------------------------------
# After the loop: the step's one data-parallel reduction


def reduce_gradients(buffers: Buffers, grad_specs: dict, over: dict):
    """(loss, layer gradients [1, v, k, …], embedding and final-LN gradients) of the step from a stage's
    accumulators: Megatron's one data-parallel reduction (over `over`: data, and context under context
    parallelism), and the embedding group's over `pipe` (the first stage's lookup and the last stage's logits
    and final norm add to the same parameters); each a reduce-scatter onto the master shards where `grad_specs`
    (the master weights' PartitionSpecs) split the gradient over those axes, else an all-reduce. `over`: per
    weight, the axes its gradient is still summed over (`data_parallel.left_to_reduce`: not `fsdp` where the
    layers reduce-scattered it already)."""
    loss = jax.lax.psum(buffers.loss, ("pipe", *over["loss"]))
    others = jax.tree.map(lambda g, spec, axes: data_parallel.reduce_over(g, spec, ("pipe", *axes)),
                          buffers.grads["others"], _others(grad_specs), _others(over["weights"]))
    layers = jax.tree.map(  # local [v, k, …]: a parameter's dimension i ≥ 1 is dimension i + 1
        lambda g, spec, axes: data_parallel.reduce_over(g, P(None, None, *spec[1:]), axes)[None],
        buffers.grads["layers"], grad_specs["layers"], over["weights"]["layers"])
    return loss, layers, others


def _others(tree: dict) -> dict:
    """The parameters every stage holds: all but the layers (the embedding, the final norm, an untied head)."""
    return {name: part for name, part in tree.items() if name != "layers"}


# ---------------------------------------------------------------------------------------------
# The executor


def stage_program(layers, others, micro, key_data, rows, *, cfg: ModelConfig, sched: Schedule, loss_ranks: int,
                  remat: str, shard: StageSharder, grad_specs: dict, over: dict, inspect, ring: bool,
                  offload: tuple[str, ...] = ()):
    """The shard_map's body: one stage and data rank's loss share and reduced gradients (`reduce_gradients`).
    rows: the tick table [ticks, p, len(FIELDS)]; ring: `TickProgram.ring`; the rest as `Stage.enter` and
    `reduce_gradients`."""
    stage = Stage.enter(layers, others, micro, key_data, cfg=cfg, sched=sched, loss_ranks=loss_ranks, remat=remat,
                        shard=shard, offload=offload)
    if stage.taps is not None:
        stage.discover_taps()
    layout = ResidualLayout.of(stage)
    program = TickProgram(stage, layout, ring)
    if inspect is not None:
        inspect(list(layout.stashed), list(layout.reused), program.w_stash_avals)
    buffers, _ = jax.lax.scan(program.tick, program.buffers(), rows[:, stage.index])
    return reduce_gradients(buffers, grad_specs, over)


def _gradient_specs(grad_specs: dict, over: tuple[str, ...]) -> tuple[dict, dict]:
    """The shard_map's out_specs of the reduced gradients: the layers' in the stage layout [p, v, k, …] (a
    parameter's dimension i ≥ 1 is dimension i + 2 there), the embedding's and final norm's; each split over
    `pipe` and `over` (data, context) where it was reduce-scattered (`grad_specs`: the master weights' specs)."""
    layers = jax.tree.map(lambda spec: P("pipe", None, None, *only_axes(spec, over)[1:]), grad_specs["layers"],
                          is_leaf=lambda x: isinstance(x, P))
    others = jax.tree.map(lambda spec: only_axes(spec, ("pipe", *over)), _others(grad_specs),
                          is_leaf=lambda x: isinstance(x, P))
    return layers, others


def _stage_weights(params, layout: Layout):
    """(layers in the stage layout [p, v, k, …], split over `pipe` on p; the embedding and final norm, whole on
    every stage), cast to the compute dtype. Master weights split over `pipe` or `data` are gathered here, once
    (left to propagation, the position table's went from its `pipe` split to the sequence-parallel one by a
    "full rematerialization")."""
    parallel, specs = layout.parallel, layout.param_specs
    # Under FSDP the weights stay float32 and split over `fsdp`: each chunk's layers cast and gather theirs.
    cast = params if parallel.fsdp > 1 else model.cast_params(params, layout.model)
    constrain = lambda a, spec: jax.lax.with_sharding_constraint(a, NamedSharding(layout.mesh, spec))
    layers = jax.tree.map(lambda a, spec: constrain(a, P("pipe", None, None, *spec[1:])),
                          to_stages(cast["layers"], parallel.pipe, parallel.virtual_stages), specs["layers"])
    return layers, jax.tree.map(constrain, _others(cast), _others(specs))


def _stage_inputs(params, batch, layout: Layout, sched: Schedule):
    """(layers in the stage layout, embedding and final norm, the micro-batches [m, B/m, s] split over
    `data` on their rows), the executor's shard_map arguments with the in_specs of those three."""
    layers, others = _stage_weights(params, layout)
    shard = Sharder(layout.mesh, layout.parallel.sequence_parallel)
    micro = jax.tree.map(lambda a: shard(a.reshape(sched.m, -1, *a.shape[1:]), None, "batch", None), batch)
    split = data_parallel.region_split(layout)  # FSDP, experts: each rank enters with its shard of every weight
    layer_specs = jax.tree.map(lambda spec: P("pipe", None, None, *spec[1:]), split["layers"],
                               is_leaf=lambda x: isinstance(x, P))
    rows = batch_axes(layout.parallel.fsdp > 1, layout.parallel.expert > 1)
    return (layers, others, micro), (layer_specs, _others(split), P(None, rows))


def pipeline_loss(params, batch, *, layout: Layout, microbatches: int):
    """The mean loss over `microbatches` micro-batches of `batch`, forward only and without dropout: the
    evaluation loss of a pipelined run, equal to `model.loss_fn` of the whole batch, each stage holding only
    its layers (the unpipelined loss of pipe-split weights gathers every layer onto every device). Runs a
    forward-only schedule (`Schedule.forward_only`: mv + p − 1 ticks) with `ForwardProgram`. Under jit with
    the mesh's shardings."""
    parallel, mesh = layout.parallel, layout.mesh
    cfg = replace(layout.model, dropout=0.0)
    sched = schedule_of(parallel, microbatches, cfg.layers, forward_only=True)
    args, in_specs = _stage_inputs(params, batch, layout, sched)

    def program(layers, others, micro, rows):
        stage = Stage.enter(layers, others, micro, None, cfg=cfg, sched=sched, remat="none",
                            loss_ranks=parallel.batch_ranks * parallel.context,
                            shard=context.sharder(mesh, parallel, stage=True))
        forward = ForwardProgram(stage, _ring(parallel))
        buffers, _ = jax.lax.scan(forward.tick, forward.buffers(), rows[:, stage.index])
        return jax.lax.psum(buffers.loss, ("pipe", *layout.gradient_axes))

    fn = jax.shard_map(program, mesh=mesh, axis_names=set(data_parallel.region_axes(parallel)),
                       in_specs=(*in_specs, P()), out_specs=P())
    return fn(*args, jnp.asarray(tick_rows(sched)))


def pipeline_loss_and_grad(params, batch, key, *, layout: Layout, remat: str, microbatches: int, grad_specs=None,
                           inspect=None, offload: tuple[str, ...] = ()):
    """(loss, float32 grads) of the mean loss over `microbatches` micro-batches of `batch` ({"inputs", "targets"}:
    [B, s] int32), equal to gradient accumulation with micro-batch i's dropout key fold_in(key, i).
    To be called under jit with the mesh's shardings. `grad_specs`: the gradients' PartitionSpecs (default:
    the parameters'); a leaf whose spec names `data` or, for the embedding and final norm, `pipe` (the master
    shards: `Layout.master_specs`) is reduce-scattered over those axes onto that dimension instead of
    all-reduced. `inspect`, if given, is called
    at trace time with the avals of one stash slot, of every residual leaf the stash leaves out and of one W
    stash slot (zb-h1; empty otherwise; `planning.stash` reads them for the plan)."""
    cfg, parallel, mesh = layout.model, layout.parallel, layout.mesh
    sched = schedule_of(parallel, microbatches, cfg.layers)
    grad_specs = layout.param_specs if grad_specs is None else grad_specs
    for path, spec in jax.tree_util.tree_leaves_with_path(grad_specs["layers"], is_leaf=lambda x: isinstance(x, P)):
        if not spec or entry_axes(spec[0]) != ("pipe",):
            raise ValueError(f"grad_specs: layers{jax.tree_util.keystr(path)} is {spec}; every layer's gradient is "
                             "split over pipe on its first dimension (the stage's layers)")
    args, in_specs = _stage_inputs(params, batch, layout, sched)
    over = {"loss": layout.gradient_axes, "weights": data_parallel.left_to_reduce(layout, layout.gradient_axes)}
    loss_ranks = parallel.batch_ranks * parallel.context
    seed = 1.0 / (sched.m * loss_ranks)  # Stage.loss_scale
    shard = replace(context.sharder(mesh, parallel, stage=True), loss_seed=seed)
    program = partial(stage_program, cfg=cfg, sched=sched, loss_ranks=loss_ranks, remat=remat, shard=shard,
                      grad_specs=grad_specs, over=over, inspect=inspect, ring=_ring(parallel), offload=offload)
    fn = jax.shard_map(program, mesh=mesh, axis_names=set(data_parallel.region_axes(parallel)),
                       in_specs=(*in_specs, P(), P()),
                       out_specs=(P(), *_gradient_specs(grad_specs, layout.gradient_axes)))
    loss, layer_grads, other_grads = fn(*args, jax.random.key_data(key), jnp.asarray(tick_rows(sched)))
    # float32, as accumulated and reduced: not cast back to the dtype of `params` (the step's bf16 compute copy)
    return loss, {"layers": from_stages(layer_grads), **other_grads}


def make_loss_and_grad(layout: Layout, remat: str, microbatches: int, offload: tuple[str, ...] = ()):
    """jit(params, batch, key) → (loss, grads), the pipelined counterpart of train_step.make_loss_and_grad."""
    fn = partial(pipeline_loss_and_grad, layout=layout, remat=remat, microbatches=microbatches, offload=offload)
    return jax.jit(
        fn,
        in_shardings=(layout.param_shardings, layout.batch, layout.replicated),
        out_shardings=(layout.replicated, layout.param_shardings),
    )
