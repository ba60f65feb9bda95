"""What a pipeline chunk keeps between its forward and its backward, per stage and data rank, as the executor
lays it out: read from one trace of the pipelined step (`pipeline.pipeline_loss_and_grad`'s `inspect` hook), for the
plan's in-flight memory (`in_flight.py`)."""

from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp

from jaxseq.models import model
from jaxseq.parallel.layout import Layout
from jaxseq.parallel.pipeline import pipeline_loss_and_grad


def stash_layout(layout: Layout, remat: str, microbatches: int, micro_batch_size: int):
    """(avals of one stash slot, avals of the residuals taken from the weights and keys instead): what
    one micro-batch chunk keeps between its forward and its backward, per stage and data rank (global over
    tensor)."""
    seen = residual_layouts(layout, remat, microbatches, micro_batch_size)
    return seen["stash"], seen["reused"]


def w_stash_layout(layout: Layout, remat: str, microbatches: int, micro_batch_size: int):
    """The avals of one W stash slot (zb-h1: what a micro-batch chunk keeps from its B to its W, each deferred
    weight matmul's input and output gradient for the chunk's layers, per stage and data rank, global over
    tensor); empty for the schedules whose backward is not split."""
    return residual_layouts(layout, remat, microbatches, micro_batch_size)["w_stash"]


def residual_layouts(layout: Layout, remat: str, microbatches: int, micro_batch_size: int) -> dict:
    """{"stash", "reused", "w_stash"}: `stash_layout`'s two and `w_stash_layout`'s, from one trace."""
    seen, cfg = {}, layout.model
    params = jax.eval_shape(lambda: model.init_params(jax.random.key(0), cfg, layout.parallel.tensor))
    tokens = jax.ShapeDtypeStruct((micro_batch_size * microbatches, cfg.seq_len), jnp.int32)
    with jax.set_mesh(layout.mesh):
        jax.eval_shape(partial(pipeline_loss_and_grad, layout=layout, remat=remat, microbatches=microbatches,
                               inspect=lambda a, b, w: seen.update(stash=a, reused=b, w_stash=w)),
                       params, {"inputs": tokens, "targets": tokens}, jax.random.key(0))
    return seen
