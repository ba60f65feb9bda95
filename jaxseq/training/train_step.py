"""The sharded train state and the one jit-compiled train step (explicit in/out shardings, donated state)."""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial

import jax
import jax.numpy as jnp
import optax

from jaxseq.config import ModelConfig, OptimizerConfig
from jaxseq.models import model
from jaxseq.parallel import context, data_parallel
from jaxseq.parallel.layout import Layout, held
from jaxseq.parallel.pipeline import pipeline_loss_and_grad


@partial(jax.tree_util.register_dataclass, data_fields=["step", "params", "opt_state"], meta_fields=[])
@dataclass
class TrainState:
    step: jax.Array
    params: dict
    opt_state: optax.OptState


def learning_rate_schedule(opt: OptimizerConfig):
    return optax.warmup_cosine_decay_schedule(
        init_value=0.0,
        peak_value=opt.lr,
        warmup_steps=opt.warmup_steps,
        decay_steps=max(opt.decay_steps, opt.warmup_steps + 1),
        end_value=opt.lr * opt.min_lr_ratio,
    )


def make_optimizer(opt: OptimizerConfig, cfg: ModelConfig) -> optax.GradientTransformation:
    """AdamW after global-norm clipping; weight decay where the family's table declares it (`model.decay_mask`).
    A parameter the table moves by sign (`model.sign_update_mask`: a mixture of experts' aux-loss-free bias, whose
    gradient is each expert's load above its share) moves by −moe_bias_rate·sign(gradient), outside the clipping."""
    adamw = optax.chain(
        optax.clip_by_global_norm(opt.clip_norm),
        optax.adamw(learning_rate_schedule(opt), b1=opt.b1, b2=opt.b2, eps=opt.eps,
                    weight_decay=opt.weight_decay, mask=model.decay_mask(cfg)),
    )
    by_sign = model.sign_update_mask(cfg)
    if not any(jax.tree.leaves(by_sign)):
        return adamw
    labels = jax.tree.map(lambda sign: "sign" if sign else "adamw", by_sign)
    return optax.multi_transform({"adamw": adamw, "sign": optax.chain(optax.scale_by_sign(),
                                                                      optax.scale(-cfg.moe_bias_rate))}, labels)


def state_shardings(layout: Layout, optimizer) -> TrainState:
    """The TrainState's shardings, the layout's: master weights and optimizer moments in the master shardings
    (`Layout.master_specs`, `Layout.optimizer_shardings`), the step count replicated; under `offload_optimizer`
    the master weights and moments in host memory (`layout.held`)."""
    host = layout.parallel.offload_optimizer
    return TrainState(step=layout.replicated, params=held(layout.master_shardings, host),
                      opt_state=held(layout.optimizer_shardings(optimizer), host))


def new_state(params, optimizer) -> TrainState:
    """Step 0: the given parameters with fresh optimizer moments."""
    return TrainState(jnp.zeros((), jnp.int32), params, optimizer.init(params))


def init_state(key, layout: Layout, optimizer) -> TrainState:
    """Parameters and optimizer state created directly in their shards (nothing gathered on one device)."""
    init = lambda key: new_state(model.init_params(key, layout.model, layout.parallel.tensor), optimizer)
    return jax.jit(init, out_shardings=state_shardings(layout, optimizer))(key)


def state_from_params(params, layout: Layout, optimizer) -> TrainState:
    """A step-0 state around given parameters (already on the layout's mesh), with moments in their shards."""
    fresh = lambda p: new_state(p, optimizer)
    return jax.jit(fresh, out_shardings=state_shardings(layout, optimizer))(params)


def make_train_step(layout: Layout, remat: str, optimizer, micro_batches: int = 1, donate: bool = True,
                    offload: tuple[str, ...] = ()):
    """jit(step)(state, batch, key) → (state, metrics); batch = {"inputs", "targets"}: [B, s] int32.

    With micro_batches > 1 the global batch is split into that many micro-batches whose gradients
    are summed (gradient accumulation); activation memory is then that of one micro-batch. Micro-batch i
    draws its dropout masks from fold_in(key, i).

    The step differentiates with respect to the compute-dtype copy of the weights, made once per step
    outside the accumulation and the layer scan (`model.cast_params`: LayerNorm parameters stay f32).
    With the distributed optimizer that copy is cast on each rank's shard of the master weights and
    then all-gathered over `data` (one all-gather per weight per step), and the float32 gradients arrive
    in the master shards, so the update runs on 1/d of every tensor. Without it the same code gathers nothing.

    The gradients are reduced over `data` (and `context`) once per step, in float32, as in Megatron-LM: each data
    rank casts its gradients of the compute copy to float32 (summed over the micro-batches when there are several)
    and the ranks reduce that once (an all-reduce, or a reduce-scatter onto the master shards), in a region manual
    over `data` without a pipeline (`parallel.data_parallel.accumulate_loss_and_grad`, with one micro-batch too),
    through the pipeline schedule with parallel.pipe > 1 (`parallel.pipeline.pipeline_loss_and_grad`, same keys).
    Left to XLA (differentiating the bf16 copy under jit), the reductions ran in bf16. Clipping and AdamW see the
    float32 gradients.
    Under a pipeline the embedding's and final norm's master weights and moments are split over `pipe`
    too: the step gathers their compute copy once and the executor reduce-scatters their gradients over `pipe`.
    Under FSDP every weight stays split over `fsdp` in the step: each layer gathers its weights as it uses them and
    reduce-scatters their float32 gradients at once (`parallel.fsdp`); the rest is reduced over data as above. What
    the masters split further (over `data`, `pipe`) is gathered once as the compute copy first (`fsdp_weights`).
    """
    gradients = step_gradients(layout, remat, micro_batches, offload)
    by_sign = model.sign_update_mask(layout.model)
    moves = layout.parallel.offload_optimizer  # the masters and moments to the device and back (`optimizer_offload`)

    def step(state: TrainState, batch, key):
        params, opt_state = (state.params, state.opt_state) if not moves else jax.device_put(
            (state.params, state.opt_state), jax.memory.Space.Device)
        loss, grads = gradients(params, batch, jax.random.fold_in(key, state.step))
        grad_norm = optax.tree.norm(jax.tree.map(lambda g, sign: None if sign else g, grads, by_sign))  # of the
        # global arrays: exact whatever the shards; not of a load moved by sign (`make_optimizer`)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        params = optax.apply_updates(params, updates)
        if moves:
            params, opt_state = jax.device_put((params, opt_state), jax.memory.Space.Host)
        new_state = TrainState(state.step + 1, params, opt_state)
        return new_state, {"loss": loss, "grad_norm": grad_norm}

    shardings = state_shardings(layout, optimizer)
    return jax.jit(
        step,
        in_shardings=(shardings, layout.batch, layout.replicated),
        out_shardings=(shardings, {"loss": layout.replicated, "grad_norm": layout.replicated}),
        donate_argnums=(0,) if donate else (),
    )


def step_gradients(layout: Layout, remat: str, micro_batches: int = 1, offload: tuple[str, ...] = ()):
    """(float32 master params, batch, key) → (loss, float32 gradients in the master weights' shards): what the
    step hands to clipping and AdamW (`make_train_step`), to be called under jit."""
    constrain = lambda tree, shardings: jax.tree.map(jax.lax.with_sharding_constraint, tree, shardings)
    # One micro-batch goes through the accumulation's region too: there the ranks reduce float32 gradients.
    loss_and_grad = pipeline_loss_and_grad if layout.parallel.pipe > 1 else data_parallel.accumulate_loss_and_grad

    def gradients(params, batch, key):
        # The weights enter the step in their compute layout (gathered over `data` here, once, under the
        # distributed optimizer): a gather inside a pipeline tick's branch would deadlock. The cast is pinned to
        # the master weights' shards, so that what is gathered is the compute copy: left to the partitioner, it
        # gathered the float32 masters and cast after (twice the bytes over `data`, on XLA:CPU and XLA:GPU alike).
        # Under FSDP they enter float32, split over `fsdp`: each layer casts its shard and gathers it
        # (`parallel.fsdp.gather`); `fsdp_weights` gathers over `data` (or `pipe`) what the masters split further.
        weights = fsdp_weights(params, layout) if layout.parallel.fsdp > 1 else constrain(
            model.cast_params(params, layout.model), layout.master_shardings)
        loss, grads = loss_and_grad(constrain(weights, layout.param_shardings), batch, key, layout=layout,
                                    remat=remat, microbatches=micro_batches, grad_specs=layout.master_specs,
                                    offload=offload)
        # float32 gradients, reduced in float32, in the master weights' shards (where they already are: a no-op)
        return loss, constrain(grads, layout.master_shardings)

    return gradients


def fsdp_weights(params, layout: Layout) -> dict:
    """Under FSDP, the float32 weights the step's region takes, in their compute layout (split over `fsdp` and
    `tensor`). A master leaf split further (over `data` by the distributed optimizer, the embedding group's over
    `pipe`) is cast to the compute dtype on its shard, gathered so, and made float32 again: the gather moves the
    compute copy (left to the partitioner, it moved the float32 masters: twice the bytes over `data`), and the
    region still gets float32 weights, whose gradients `fsdp.gather` reduce-scatters in float32. The values are
    those the region computes with (its gather casts them to the compute dtype again, exactly)."""
    dtype = jnp.dtype(layout.model.dtype)

    def one(w, cast, master, compute):
        if master == compute:  # nothing to gather: the master shard itself
            return w
        copy = jax.lax.with_sharding_constraint(w.astype(dtype) if cast else w, master)
        return jax.lax.with_sharding_constraint(copy, compute).astype(w.dtype)

    return jax.tree.map(one, params, model.cast_mask(layout.model), layout.master_shardings, layout.param_shardings)


def make_loss_and_grad(layout: Layout, remat: str, offload: tuple[str, ...] = ()):
    """jit(params, batch, key) → (loss, grads) with the same shardings as the train step; for tests
    and ahead-of-time analysis (the gradient a step would apply, before the optimizer)."""
    shard = context.sharder(layout.mesh, layout.parallel)
    fn = jax.value_and_grad(partial(model.loss_fn, cfg=layout.model, shard=shard, remat=remat, offload=offload))
    return jax.jit(
        lambda params, batch, key: fn(params, batch, key=key),
        in_shardings=(layout.param_shardings, layout.batch, layout.replicated),
        out_shardings=(layout.replicated, layout.param_shardings),
    )
