"""What a pipeline stage runs at each tick of the schedule: the training program (`TickProgram`: forward under
jax.vjp with its residuals to the stash, backward, zb-h1's W) and the forward-only one (`ForwardProgram`:
evaluation), both in one tick skeleton (`run_tick`: the row's `lax.switch` branch, padded under the ring, then the
two ppermutes between stages), so that what one tick needs the other has."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from jaxseq import deferred
from jaxseq.models import model
from jaxseq.parallel import context
from jaxseq.parallel.stage import ResidualLayout, Stage, as_float32, varying_zeros
from jaxseq.parallel.ticks import Branch, TickRow


class Buffers(NamedTuple):
    """The tick loop's carry, per stage and data rank (all varying over `pipe` and `data`)."""

    g: Any  # [depth g + 1, b, s, h]: received gradients and the loss gradients (+ the trash slot)
    grads: dict  # {"layers": [v, k, …], "others": the embedding group}: float32 gradient accumulators
    loss: Any  # []: float32, this stage's share of the loss
    stash: list  # per stashed residual leaf: [depth stash, k, b, …]
    x: Any  # [depth x + 1, b, s, h]: received activations (+ the trash slot)
    w_stash: list  # zb-h1: per W stash leaf (`Taps.stash_avals`), [depth w, k, …]; empty otherwise


class BranchOut(NamedTuple):
    """What a `lax.switch` branch returns: slot-sized values only (see `TickProgram.tick`)."""

    send_x: Any  # [b, s, h]: the forward output for stage s + 1 (zeros when there is none)
    send_g: Any  # [b, s, h]: the input gradient for stage s − 1 (zeros when there is none)
    slot: list  # the stash slot a forward writes (zeros from the other branches: nothing is written then)
    w_slot: list  # the W stash slot a split backward's B writes (zeros from the other branches)
    g: Any  # [b, s, h]: the gradient slot: the loss gradient from the last chunk's forward, else passed through
    dw: dict  # [k, …] per leaf: the chunk's weight gradients (float32; zeros unless a backward)
    d_others: dict  # the embedding group's gradients (float32; zeros unless the first backward or last forward)
    loss: Any  # []: the micro-batch's loss share (zero unless the last forward)


@dataclass(frozen=True)
class TickProgram:
    """What a stage runs at each tick: one branch that returns slot-sized values, the buffers written after
    it on the ticks that change them, then the two ppermutes."""

    stage: Stage
    layout: ResidualLayout
    ring: bool = False  # the ring strategy's sends run inside the branches: pad them (`context.same_context_permutes`)

    def nothing(self, g) -> BranchOut:
        """What a branch returns for the outputs it has none of: zeros, and the gradient slot `g` unchanged.
        Made inside each branch: made once before the loop they were loop-carried, the chunk's weight
        gradients' zeros (f32) and a stash slot's among them, each its size in memory for the whole loop."""
        act = self.stage.activation
        no_act = varying_zeros(act.shape, act.dtype)
        return BranchOut(send_x=no_act, send_g=no_act, slot=self.layout.slot_zeros(),
                         w_slot=[varying_zeros(a.shape, a.dtype) for a in self.w_stash_avals], g=g,
                         dw=jax.tree.map(lambda a: varying_zeros(a.shape[1:], jnp.float32), self.stage.layers),
                         d_others=jax.tree.map(lambda a: varying_zeros(a.shape, jnp.float32), self.stage.others),
                         loss=varying_zeros((), jnp.float32))

    def buffers(self) -> Buffers:
        """The empty carry: the schedule's buffer depths (`Schedule.depths`), a trash slot per receive buffer."""
        act, depth = self.stage.activation, self.stage.sched.depths
        return Buffers(
            g=varying_zeros((depth["g"] + 1, *act.shape), act.dtype),
            grads={"layers": jax.tree.map(lambda a: varying_zeros(a.shape, jnp.float32), self.stage.layers),
                   "others": jax.tree.map(lambda a: varying_zeros(a.shape, jnp.float32), self.stage.others)},
            loss=varying_zeros((), jnp.float32),
            stash=self.layout.slot_zeros(depth["stash"]),
            x=varying_zeros((depth["x"] + 1, *act.shape), act.dtype),
            w_stash=[varying_zeros((depth["w"], *a.shape), a.dtype) for a in self.w_stash_avals],
        )

    @property
    def w_stash_avals(self) -> list[jax.ShapeDtypeStruct]:
        """One W stash slot's leaves (zb-h1: each deferred op's x and dy for the chunk's k layers); none otherwise."""
        taps = self.stage.taps
        return [] if taps is None else jax.tree.leaves(taps.stash_avals(self.stage.layers_per_chunk))

    # The branches: (table_row, x, g, stash, w_stash) → BranchOut. table_row is the tick's row (int32
    # [len(FIELDS)]), x and g [b, s, h] its activation and gradient slots, stash the stash buffers (read by a
    # backward only), w_stash the W stash buffers (read by a W only).

    def idle(self, table_row, x, g, stash, w_stash) -> BranchOut:
        return self.nothing(g)

    def forward(self, table_row, x, g, stash, w_stash, *, first: bool, last: bool) -> BranchOut:
        """The chunk's forward under jax.vjp, its residuals to the stash slot; first: embed before; last:
        the loss and its gradient after (into the gradient slot this chunk's backward reads)."""
        stage, row = self.stage, TickRow.of(table_row)
        w, keys, k_embed = stage.chunk_inputs(row.mb, row.chunk)
        if first:
            x = stage.embed(stage.others["embed"], row.mb, k_embed)
        y, f_vjp = stage.chunk_vjp(x, w, keys, stage.documents_of(row.mb))
        slot = self.layout.split(f_vjp)
        if not last:
            return self.nothing(g)._replace(send_x=y.astype(stage.activation.dtype), slot=slot)
        loss, gy, d_others = stage.loss_and_grads(y, row.mb)
        return self.nothing(gy.astype(stage.activation.dtype))._replace(slot=slot, d_others=d_others, loss=loss)

    def backward(self, table_row, x, g, stash, w_stash, *, first: bool) -> BranchOut:
        """The vjp stashed in this op's slot applied to the gradient slot; first: the embedding's vjp after.
        Under zb-h1 this is B: the kernels' gradients are left to W, their inputs go to the W stash slot."""
        stage, row = self.stage, TickRow.of(table_row)
        w, keys, k_embed = stage.chunk_inputs(row.mb, row.chunk)
        nothing, docs = self.nothing(g), stage.documents_of(row.mb)
        if stage.taps is None:
            dx, dw = self.layout.join(self.layout.read(stash, row.stash), w, keys, docs)(g)
            out = nothing._replace(dw=as_float32(dw))
        else:
            dx, d_others, w_slot = self.layout.join(self.layout.read(stash, row.stash), w, keys, docs)(g)
            kernels, _ = deferred.split_kernels(nothing.dw)
            out = nothing._replace(dw=deferred.merge_kernels(kernels, as_float32(d_others)),
                                   w_slot=jax.tree.leaves(w_slot))
        if not first:
            return out._replace(send_g=dx.astype(stage.activation.dtype))
        _, e_vjp = jax.vjp(lambda e: stage.embed(e, row.mb, k_embed), stage.others["embed"])
        (de,) = e_vjp(dx)
        return out._replace(d_others=dict(nothing.d_others, embed=as_float32(de)))

    def weight(self, table_row, x, g, stash, w_stash) -> BranchOut:
        """zb-h1's W: the chunk's kernel gradients from the W stash slot its B wrote (`Taps.weight_gradients`)."""
        stage, row = self.stage, TickRow.of(table_row)
        w, _, _ = stage.chunk_inputs(row.mb, row.chunk)
        avals = stage.taps.stash_avals(stage.layers_per_chunk)
        slot = jax.tree.unflatten(jax.tree.structure(avals), [buf[row.w_slot] for buf in w_stash])
        grads = stage.taps.weight_gradients(w, slot)
        nothing = self.nothing(g)
        return nothing._replace(dw=deferred.map_kernels(lambda path, _: grads[path].astype(jnp.float32), nothing.dw))

    def branches(self) -> dict[Branch, Callable]:
        """The switch's branches by `Branch` (W only under zb-h1)."""
        by_branch = {
            Branch.IDLE: self.idle,
            Branch.FORWARD: partial(self.forward, first=False, last=False),
            Branch.FORWARD_FIRST: partial(self.forward, first=True, last=False),
            Branch.FORWARD_LAST: partial(self.forward, first=False, last=True),
            Branch.BACKWARD: partial(self.backward, first=False),
            Branch.BACKWARD_FIRST: partial(self.backward, first=True),
            Branch.WEIGHT: self.weight,
        }
        if self.stage.taps is None:
            del by_branch[Branch.WEIGHT]
        return by_branch

    def tick(self, carry: Buffers, table_row) -> tuple[Buffers, None]:
        """One tick of this stage: table_row (int32 [len(FIELDS)]) is its `TickRow`. The branches return only
        slot-sized values (one stash slot, one activation, one chunk's weight gradient); the big buffers are
        written after the switch, each under a `lax.cond` on the branch (`stash`, `accumulate`), so XLA updates
        them in place on the ticks that change them instead of copying them into and out of the conditional.
        The stash buffers go into the switch read-only and only a backward reads its slot (a slot read before
        the switch and written back after it on every tick, idle ones included, moved 3 slots per tick; now 3
        per forward-backward pair: experiments/results/pipeline_stash.md). The branches and conds read their
        fields from the whole row (one int32 [8] operand; fields sliced outside became scalar operands, and
        XLA's program 64 bytes larger)."""
        row = TickRow.of(table_row)
        operands = (table_row, carry.x[row.x_slot], carry.g[row.g_slot], carry.stash, carry.w_stash)
        out, got_x, got_g = run_tick(row, self.branches(), operands, p=self.stage.sched.p, ring=self.ring)
        return Buffers(
            g=carry.g.at[row.g_slot].set(out.g).at[row.recv_g].set(got_g),
            grads=self.accumulate(carry.grads, table_row, out),
            loss=carry.loss + out.loss,
            stash=self.stash(carry.stash, table_row, out),
            x=carry.x.at[row.recv_x].set(got_x),
            w_stash=self.write_w_stash(carry.w_stash, table_row, out),
        ), None

    def stash(self, buffers: list, table_row, out: BranchOut) -> list:
        """The stash buffers with a forward's residuals written into its slot; untouched on the other ticks. A
        buffer in host memory (an offloaded residual) is written on every tick, the other ticks' zeros into its
        trash slot (its last), by a plain dynamic-update-slice: under the cond, or as `.at[].set` (a scatter, bounds
        checked), XLA:GPU made the write a select of the old slot, which it computes on the host."""
        row = TickRow.of(table_row)
        forward = (row.branch >= Branch.FORWARD) & (row.branch <= Branch.FORWARD_LAST)
        hosted = self.layout.hosted
        write = lambda bufs: [buf if h else buf.at[row.stash].set(r) for buf, r, h in zip(bufs, out.slot, hosted)]
        written = jax.lax.cond(forward, write, lambda bufs: bufs, buffers) if not all(hosted) else buffers
        place = lambda buf, r: jax.lax.dynamic_update_index_in_dim(buf, r, jnp.where(forward, row.stash,
                                                                                     buf.shape[0] - 1), 0)
        return [place(buf, r) if h else buf for buf, r, h in zip(written, out.slot, hosted)]

    @staticmethod
    def write_w_stash(buffers: list, table_row, out: BranchOut) -> list:
        """zb-h1: the W stash buffers with a B's (x, dy) written into its slot; untouched on the other ticks."""
        if not buffers:
            return buffers
        row = TickRow.of(table_row)
        backward = (row.branch == Branch.BACKWARD) | (row.branch == Branch.BACKWARD_FIRST)
        write = lambda bufs: [buf.at[row.w_slot].set(r) for buf, r in zip(bufs, out.w_slot)]
        return jax.lax.cond(backward, write, lambda bufs: bufs, buffers)

    def accumulate(self, grads: dict, table_row, out: BranchOut) -> dict:
        """The float32 accumulators plus the branch's gradients. Only the ticks whose branch has gradients
        touch them (a read-add-write of the chunk's weight gradients on every tick, idle and forward ones
        included, was the executor's largest per-tick traffic: experiments/results/pipeline_overhead.md); under
        zb-h1 a B adds all but the kernels' and a W the kernels'."""
        row = TickRow.of(table_row)
        backward = (row.branch == Branch.BACKWARD) | (row.branch == Branch.BACKWARD_FIRST)

        def add(acc, which):  # which(path) → whether this branch adds that leaf
            return deferred.map_leaves(lambda path, a, u: a.at[row.chunk].add(u) if which(path) else a, acc, out.dw)

        keep = lambda acc: acc
        if self.stage.taps is None:
            layers = jax.lax.cond(backward, lambda acc: add(acc, lambda path: True), keep, grads["layers"])
        else:
            layers = jax.lax.cond(backward, lambda acc: add(acc, lambda path: not deferred.is_kernel(path)), keep,
                                  grads["layers"])
            layers = jax.lax.cond(row.branch == Branch.WEIGHT, lambda acc: add(acc, deferred.is_kernel), keep, layers)
        add_d_others = lambda acc: jax.tree.map(jnp.add, acc, out.d_others)
        return {"layers": layers,
                "others": jax.lax.cond((row.branch == Branch.FORWARD_LAST) | (row.branch == Branch.BACKWARD_FIRST),
                                       add_d_others, keep, grads["others"])}


class ForwardBuffers(NamedTuple):
    """The forward-only tick loop's carry (evaluation): the received activations and the loss share."""

    x: Any  # [depth x + 1, b, s, h]: received activations (+ the trash slot)
    loss: Any  # []: float32


class ForwardOut(NamedTuple):
    """What a forward-only branch returns (`BranchOut`'s fields that a forward without gradients has)."""

    send_x: Any  # [b, s, h]: the forward output for stage s + 1 (zeros when there is none)
    loss: Any  # []: the micro-batch's loss share (zero unless the last forward)
    send_g: None = None  # nothing moves backward


@dataclass(frozen=True)
class ForwardProgram:
    """What a stage runs at each tick of a forward-only schedule (evaluation): the forward branches of
    `TickProgram` without jax.vjp, stash or gradients, in the same tick (`run_tick`)."""

    stage: Stage
    ring: bool = False  # as TickProgram's

    def buffers(self) -> ForwardBuffers:
        act = self.stage.activation
        return ForwardBuffers(x=varying_zeros((self.stage.sched.depths["x"] + 1, *act.shape), act.dtype),
                              loss=varying_zeros((), jnp.float32))

    def idle(self, table_row, x) -> ForwardOut:
        act = self.stage.activation
        return ForwardOut(send_x=varying_zeros(act.shape, act.dtype), loss=varying_zeros((), jnp.float32))

    def forward(self, table_row, x, *, first: bool, last: bool) -> ForwardOut:
        """first: embed before; last: the loss after, and nothing to send."""
        stage, row = self.stage, TickRow.of(table_row)
        w, keys, k_embed = stage.chunk_inputs(row.mb, row.chunk)
        if first:
            x = stage.embed(stage.others["embed"], row.mb, k_embed)
        y = model.layers(x, w, keys, stage.cfg, stage.shard_of(stage.documents_of(row.mb)), stage.remat)
        nothing = self.idle(table_row, x)
        if last:
            return nothing._replace(loss=stage.loss(y, row.mb))
        return nothing._replace(send_x=y.astype(stage.activation.dtype))

    def branches(self) -> dict[Branch, Callable]:
        return {Branch.IDLE: self.idle, Branch.FORWARD: partial(self.forward, first=False, last=False),
                Branch.FORWARD_FIRST: partial(self.forward, first=True, last=False),
                Branch.FORWARD_LAST: partial(self.forward, first=False, last=True)}

    def tick(self, carry: ForwardBuffers, table_row) -> tuple[ForwardBuffers, None]:
        row = TickRow.of(table_row)
        out, got_x, _ = run_tick(row, self.branches(), (table_row, carry.x[row.x_slot]), p=self.stage.sched.p,
                                 ring=self.ring)
        return ForwardBuffers(x=carry.x.at[row.recv_x].set(got_x), loss=carry.loss + out.loss), None


# ---------------------------------------------------------------------------------------------
# The tick skeleton both programs run


def run_tick(row: TickRow, branches: dict[Branch, Callable], operands: tuple, *, p: int, ring: bool):
    """(the branch's output, the activation received from stage s − 1, the gradient received from stage s + 1 or
    None): one tick of a stage, the training program's (`TickProgram`) and the forward-only one's
    (`ForwardProgram`) alike. The row's branch runs in one `lax.switch` (`branches`: by `Branch`, numbered from
    IDLE up, each returning a NamedTuple with `send_x`, `send_g` (None: nothing moves backward) and `loss`); then
    the forward output moves to stage s + 1 and the input gradient to stage s − 1 (cyclic: the last stage feeds
    stage 0's next chunk under the interleaved schedule). `ring`: the ring strategy's sends run inside the
    branches, which are padded to as many context permutes each (`context.same_context_permutes`)."""
    ordered = [branches[b] for b in sorted(branches)]
    if list(sorted(branches)) != list(range(len(ordered))):
        raise ValueError(f"a tick's branches must be numbered 0 … n − 1 as `Branch` is; got {sorted(branches)}")
    if ring:
        ordered = context.same_context_permutes(ordered, operands, lambda out, zero: out._replace(loss=out.loss + zero))
    out = jax.lax.switch(row.branch, ordered, *operands)
    got_x = jax.lax.ppermute(out.send_x, "pipe", [(i, (i + 1) % p) for i in range(p)])
    got_g = None if out.send_g is None else jax.lax.ppermute(out.send_g, "pipe", [(i, (i - 1) % p) for i in range(p)])
    return out, got_x, got_g
