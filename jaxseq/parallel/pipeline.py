"""The pipeline executor: loss and gradients of the whole model over a `pipe` mesh axis, one schedule tick
at a time, so that 1F1B really holds only the micro-batches its schedule keeps in flight.

Why not `jax.grad` of a forward pipeline: autodiff keeps every micro-batch's activations until the
backward loop (GPipe's memory, whatever the forward order). Here each micro-batch chunk gets its own
`jax.vjp`; its residuals wait in a stash slot until the schedule's backward of that chunk runs.

The program (inside `jax.shard_map`, manual over `pipe` and `data`, `tensor` left to XLA; each data rank
runs its rows of every micro-batch, dropout masks drawn as the rows of the global mask):
- one `lax.scan` over the ticks of `schedule.Schedule.tables` (`TickProgram.tick`); at each tick every
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

from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec as P

from jaxseq.config import ModelConfig, ParallelConfig, replace
from jaxseq.mesh import batch_axes
from jaxseq import deferred as D
from jaxseq.models import model as M
from jaxseq.parallel import schedule as S
from jaxseq.parallel import context as CP
from jaxseq.parallel import data_parallel as DP
from jaxseq.parallel.layout import Layout
from jaxseq.parallel.region import StageSharder
from jaxseq.parallel.ticks import Branch, TickRow, schedule_of, tick_rows
from jaxseq.sharding import Sharder, entry_axes, only_axes

# ---------------------------------------------------------------------------------------------
# What one stage computes for one micro-batch chunk




def micro_keys(key, mb, cfg: ModelConfig):
    """Micro-batch mb's dropout keys exactly as the gradient-accumulating train step derives them:
    fold_in(key, mb) → (embedding key, layers key) → one key per layer."""
    k_embed, k_layers = jax.random.split(jax.random.fold_in(key, mb))
    return k_embed, jax.random.split(k_layers, cfg.layers)


def to_stages(layers, p: int, v: int):
    """Natural-order [L, …] leaves → [p, v, k, …]: stage s, chunk c = layers (c·p + s)·k …"""
    return jax.tree.map(lambda a: a.reshape(v, p, -1, *a.shape[1:]).swapaxes(0, 1), layers)


def from_stages(layers):
    return jax.tree.map(lambda a: a.swapaxes(0, 1).reshape(-1, *a.shape[3:]), layers)


def _zeros(shape, dtype):
    """Zeros varying over the region's axes (`pipe`, `data`, and `context` under context parallelism), as every
    value the tick loop carries and its branches return."""
    return DP.varying(jnp.zeros(shape, dtype))


def _float32(tree):
    return jax.tree.map(lambda a: a.astype(jnp.float32), tree)


# ---------------------------------------------------------------------------------------------
# One stage inside the shard_map


@dataclass(frozen=True, kw_only=True)
class Stage:
    """One stage and data rank's part of the step (inside the shard_map, manual over `pipe` and `data`):
    its weights, its rows of the micro-batches, the step's key, and how it runs one micro-batch chunk."""

    cfg: ModelConfig
    sched: S.Schedule
    loss_ranks: int  # data ranks × context ranks: the loss is the mean over micro-batches and these ranks
    remat: str
    shard: StageSharder
    index: jax.Array  # s: this stage's index on `pipe`
    key: jax.Array | None  # the step's dropout key; None: no dropout (evaluation)
    layers: dict  # this stage's chunks, [v, k, …] per leaf, varying over `pipe` and `data`
    # the embedding group (every part but "layers": the embedding, the final norm, an untied head): on every stage,
    # varying over `pipe` and `data`
    others: dict
    micro: dict  # {"inputs", "targets"}: [m, b, s/c] int32, this data rank's rows, this context rank's tokens
    taps: D.Taps | None = None  # zb-h1: the chunk's deferred weight ops (`discover_taps`); None: B computes them

    @staticmethod
    def enter(layers, others, micro, key_data, *, cfg: ModelConfig, sched: S.Schedule, loss_ranks: int, remat: str,
              shard: StageSharder) -> Stage:
        """The stage of the shard_map's arguments: `layers` [1, v, k, …] (this stage's block of the
        [p, v, k, …] stage layout), `others` and `micro` as above, `key_data` the key's raw data (None: no
        dropout)."""
        key = None if key_data is None else jax.random.wrap_key_data(key_data)
        micro = {name: jax.vmap(shard.split_sequence)(t) for name, t in micro.items()}
        return Stage(cfg=cfg, sched=sched, loss_ranks=loss_ranks, remat=remat, shard=shard,
                     index=jax.lax.axis_index("pipe"), key=key, layers=jax.tree.map(lambda a: DP.varying(a[0]), layers),
                     others=jax.tree.map(DP.varying, others), micro=micro,
                     taps=D.Taps() if sched.split_backward else None)

    def discover_taps(self) -> None:
        """zb-h1: trace chunk 0 once to find its deferred weight ops (`deferred.Taps.discover`)."""
        w, keys, _ = self.chunk_inputs(0, 0)
        self.taps.discover(self._run_layers(keys), w, _zeros(self.activation.shape, self.activation.dtype))

    @property
    def layers_per_chunk(self) -> int:
        return self.cfg.layers // (self.sched.p * self.sched.v)

    @property
    def activation(self) -> jax.ShapeDtypeStruct:
        """What moves between stages: one data (and context) rank's activations (or gradients) of a micro-batch,
        [b, s/c, h]."""
        b, s = self.micro["inputs"].shape[1:]
        return jax.ShapeDtypeStruct((b, s, self.cfg.hidden), jnp.dtype(self.cfg.dtype))

    def chunk_inputs(self, mb, c):
        """(chunk c's weights [k, …], its k layer keys, micro-batch mb's embedding key); the keys are None
        without dropout."""
        p, k = self.sched.p, self.cfg.layers // (self.sched.p * self.sched.v)
        w = jax.tree.map(lambda a: jax.lax.dynamic_index_in_dim(a, c, 0, keepdims=False), self.layers)
        if self.key is None:
            return w, None, None
        ids = (c * p + self.index) * k + jnp.arange(k)
        k_embed, layer_keys = micro_keys(self.key, mb, self.cfg)
        return w, layer_keys[ids], k_embed

    def _run_layers(self, keys) -> Callable:
        return lambda x, w: M.layers(x, w, keys, self.cfg, self.shard, self.remat)

    def chunk_vjp(self, x, w, keys):
        """(y, vjp) of one chunk's k layers: x, y [b, s, h]. The vjp maps dy to (dx, dw); under zb-h1 to (dx, the
        gradients of every parameter but the kernels, each deferred op's (x, dy) [k, …]: the W stash), the
        kernels being `Deferred` constants whose gradients W computes."""
        run = self._run_layers(keys)
        if self.taps is None:
            return jax.vjp(run, x, w)
        kernels, others = D.split_kernels(w)
        return jax.vjp(lambda x, others, probes: run(x, self.taps.wrap(D.merge_kernels(kernels, others), probes)),
                       x, others, jax.tree.map(DP.varying, self.taps.probes(self.layers_per_chunk)))

    def embed(self, embed_params, mb, k_embed):
        """Micro-batch mb's embedded tokens [b, s, h] (the first chunk's input)."""
        return M.embed(embed_params, self.micro["inputs"][mb], k_embed, self.cfg, self.shard)

    @property
    def loss_scale(self) -> float:
        """1/(m·data·context): the step's loss is the mean over micro-batches and data and context ranks."""
        return 1.0 / (self.sched.m * self.loss_ranks)

    def loss(self, y, mb):
        """Micro-batch mb's loss share from the last chunk's output y (forward only)."""
        return M.head_loss(self.others, y, self.micro["targets"][mb], self.cfg, self.shard) * self.loss_scale

    def loss_and_grads(self, y, mb):
        """(loss share, dL/dy, d(embedding, final norm)) of the last chunk's output y: the loss right away, so
        that the chunk's backward needs only dL/dy (an activation-sized slot), not the logits."""
        loss, (gh, gy) = jax.value_and_grad(partial(M.head_loss, cfg=self.cfg, shard=self.shard), argnums=(0, 1))(
            self.others, y, self.micro["targets"][mb])
        scale = self.loss_scale
        return loss * scale, gy * scale, jax.tree.map(lambda a: a.astype(jnp.float32) * scale, gh)


@dataclass(frozen=True)
class ResidualLayout:
    """Where the leaves of one chunk's vjp (`jax.vjp`'s VJP object is a pytree) come from: most are
    activations, kept in a stash slot from the forward to the backward; the rest are the chunk's own
    weights and dropout keys (matched by identity), taken from the live arrays at backward time instead.
    This leans on the layout of jax.vjp's residuals (tests/test_pipeline.py pins it)."""

    treedef: Any  # the VJP's structure; it carries the backward jaxpr
    source: tuple[int, ...]  # per leaf: its index among the leaves of (weights, keys), or −1: stashed
    avals: tuple[jax.ShapeDtypeStruct, ...]  # per leaf

    @property
    def stashed(self) -> tuple[jax.ShapeDtypeStruct, ...]:
        """One stash slot: [k, b, …] per leaf."""
        return tuple(a for a, i in zip(self.avals, self.source) if i < 0)

    @property
    def reused(self) -> tuple[jax.ShapeDtypeStruct, ...]:
        """The leaves taken from the weights and keys."""
        return tuple(a for a, i in zip(self.avals, self.source) if i >= 0)

    @staticmethod
    def of(stage: Stage) -> ResidualLayout:
        """The layout of chunk 0's vjp, traced once under eval_shape (its ops do not enter the program). Every
        chunk's vjp has it: the chunks differ in values, not in shapes or in which residuals are inputs."""
        found = []  # the one trace below records its static findings here

        def residuals(x, w, keys):
            _, f_vjp = stage.chunk_vjp(x, w, keys)
            leaves, treedef = jax.tree.flatten(f_vjp)
            inputs = jax.tree.leaves((w, keys))
            found.append((treedef, tuple(next((i for i, a in enumerate(inputs) if a is leaf), -1) for leaf in leaves)))
            return leaves

        w, keys, _ = stage.chunk_inputs(0, 0)
        x = _zeros(stage.activation.shape, stage.activation.dtype)
        avals = jax.eval_shape(residuals, x, w, keys)
        (treedef, source), = found
        return ResidualLayout(treedef, source, tuple(avals))

    def split(self, f_vjp) -> list:
        """The leaves of a forward's vjp that go to the stash, varying over `pipe` and `data` as the stash is: a
        constant among them (Llama's RoPE frequencies, closed over by the layer) is invariant."""
        leaves = jax.tree.leaves(f_vjp)
        shapes, traced = [a.shape for a in leaves], [a.shape for a in self.avals]
        if shapes != traced:  # not an assert: `python -O` would stash the wrong arrays
            raise RuntimeError(f"a pipeline chunk's vjp changed its layout since `of` traced it: {len(shapes)} residual "
                               f"leaves {shapes} where the stash holds {len(traced)} {traced}")
        return [DP.varying(leaf) for leaf, i in zip(leaves, self.source) if i < 0]

    def join(self, stashed: list, w, keys) -> Callable:
        """The vjp of a chunk from its stash slot and its live weights and keys. The treedef traced in `of`
        serves every branch: it carries the backward jaxpr, whose inputs are the residual leaves (it closes
        over no tracer), so any leaves of the same types run it."""
        inputs, it = jax.tree.leaves((w, keys)), iter(stashed)
        return jax.tree.unflatten(self.treedef, [inputs[i] if i >= 0 else next(it) for i in self.source])


# ---------------------------------------------------------------------------------------------
# The tick loop


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
        no_act = _zeros(act.shape, act.dtype)
        return BranchOut(send_x=no_act, send_g=no_act, slot=[_zeros(a.shape, a.dtype) for a in self.layout.stashed],
                         w_slot=[_zeros(a.shape, a.dtype) for a in self.w_stash_avals], g=g, dw=jax.tree.map(lambda a: _zeros(a.shape[1:], jnp.float32), self.stage.layers),
                         d_others=jax.tree.map(lambda a: _zeros(a.shape, jnp.float32), self.stage.others),
                         loss=_zeros((), jnp.float32))

    def buffers(self) -> Buffers:
        """The empty carry: the schedule's buffer depths (`Schedule.depths`), a trash slot per receive buffer."""
        act, depth = self.stage.activation, self.stage.sched.depths
        return Buffers(
            g=_zeros((depth["g"] + 1, *act.shape), act.dtype),
            grads={"layers": jax.tree.map(lambda a: _zeros(a.shape, jnp.float32), self.stage.layers),
                   "others": jax.tree.map(lambda a: _zeros(a.shape, jnp.float32), self.stage.others)},
            loss=_zeros((), jnp.float32),
            stash=[_zeros((depth["stash"], *a.shape), a.dtype) for a in self.layout.stashed],
            x=_zeros((depth["x"] + 1, *act.shape), act.dtype),
            w_stash=[_zeros((depth["w"], *a.shape), a.dtype) for a in self.w_stash_avals],
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
        y, f_vjp = stage.chunk_vjp(x, w, keys)
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
        nothing = self.nothing(g)
        if stage.taps is None:
            dx, dw = self.layout.join([buf[row.stash] for buf in stash], w, keys)(g)
            out = nothing._replace(dw=_float32(dw))
        else:
            dx, d_others, w_slot = self.layout.join([buf[row.stash] for buf in stash], w, keys)(g)
            kernels, _ = D.split_kernels(nothing.dw)
            out = nothing._replace(dw=D.merge_kernels(kernels, _float32(d_others)), w_slot=jax.tree.leaves(w_slot))
        if not first:
            return out._replace(send_g=dx.astype(stage.activation.dtype))
        _, e_vjp = jax.vjp(lambda e: stage.embed(e, row.mb, k_embed), stage.others["embed"])
        (de,) = e_vjp(dx)
        return out._replace(d_others=dict(nothing.d_others, embed=_float32(de)))

    def weight(self, table_row, x, g, stash, w_stash) -> BranchOut:
        """zb-h1's W: the chunk's kernel gradients from the W stash slot its B wrote (`Taps.weight_gradients`)."""
        stage, row = self.stage, TickRow.of(table_row)
        w, _, _ = stage.chunk_inputs(row.mb, row.chunk)
        avals = stage.taps.stash_avals(stage.layers_per_chunk)
        slot = jax.tree.unflatten(jax.tree.structure(avals), [buf[row.w_slot] for buf in w_stash])
        grads = stage.taps.weight_gradients(w, slot)
        nothing = self.nothing(g)
        return nothing._replace(dw=D.map_kernels(lambda path, _: grads[path].astype(jnp.float32), nothing.dw))

    def branches(self) -> list[Callable]:
        """The switch's branches, indexed by `Branch`."""
        by_branch = {
            Branch.IDLE: self.idle,
            Branch.FORWARD: partial(self.forward, first=False, last=False),
            Branch.FORWARD_FIRST: partial(self.forward, first=True, last=False),
            Branch.FORWARD_LAST: partial(self.forward, first=False, last=True),
            Branch.BACKWARD: partial(self.backward, first=False),
            Branch.BACKWARD_FIRST: partial(self.backward, first=True),
            Branch.WEIGHT: self.weight,
        }
        return [by_branch[b] for b in Branch if b != Branch.WEIGHT or self.stage.taps is not None]

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
        branches = self.branches()
        if self.ring:
            branches = CP.same_context_permutes(branches, operands, lambda o, z: o._replace(loss=o.loss + z))
        out = jax.lax.switch(row.branch, branches, *operands)
        p = self.stage.sched.p
        got_x = jax.lax.ppermute(out.send_x, "pipe", _to_next(p))
        got_g = jax.lax.ppermute(out.send_g, "pipe", [(i, (i - 1) % p) for i in range(p)])
        return Buffers(
            g=carry.g.at[row.g_slot].set(out.g).at[row.recv_g].set(got_g),
            grads=self.accumulate(carry.grads, table_row, out),
            loss=carry.loss + out.loss,
            stash=self.stash(carry.stash, table_row, out),
            x=carry.x.at[row.recv_x].set(got_x),
            w_stash=self.write_w_stash(carry.w_stash, table_row, out),
        ), None

    @staticmethod
    def stash(buffers: list, table_row, out: BranchOut) -> list:
        """The stash buffers with a forward's residuals written into its slot; untouched on the other ticks."""
        row = TickRow.of(table_row)
        forward = (row.branch >= Branch.FORWARD) & (row.branch <= Branch.FORWARD_LAST)
        write = lambda bufs: [buf.at[row.stash].set(r) for buf, r in zip(bufs, out.slot)]
        return jax.lax.cond(forward, write, lambda bufs: bufs, buffers)

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
            return D.map_leaves(lambda path, a, u: a.at[row.chunk].add(u) if which(path) else a, acc, out.dw)

        keep = lambda acc: acc
        if self.stage.taps is None:
            layers = jax.lax.cond(backward, lambda acc: add(acc, lambda path: True), keep, grads["layers"])
        else:
            layers = jax.lax.cond(backward, lambda acc: add(acc, lambda path: not D.is_kernel(path)), keep,
                                  grads["layers"])
            layers = jax.lax.cond(row.branch == Branch.WEIGHT, lambda acc: add(acc, D.is_kernel), keep, layers)
        add_d_others = lambda acc: jax.tree.map(jnp.add, acc, out.d_others)
        return {"layers": layers,
                "others": jax.lax.cond((row.branch == Branch.FORWARD_LAST) | (row.branch == Branch.BACKWARD_FIRST),
                                       add_d_others, keep, grads["others"])}


class ForwardBuffers(NamedTuple):
    """The forward-only tick loop's carry (evaluation): the received activations and the loss share."""

    x: Any  # [depth x + 1, b, s, h]: received activations (+ the trash slot)
    loss: Any  # []: float32


@dataclass(frozen=True)
class ForwardProgram:
    """What a stage runs at each tick of a forward-only schedule (evaluation): the forward branches of
    `TickProgram` without jax.vjp, stash or gradients, and only the forward ppermute."""

    stage: Stage
    ring: bool = False  # as TickProgram's

    def buffers(self) -> ForwardBuffers:
        act = self.stage.activation
        return ForwardBuffers(x=_zeros((self.stage.sched.depths["x"] + 1, *act.shape), act.dtype),
                              loss=_zeros((), jnp.float32))

    def idle(self, table_row, x):
        act = self.stage.activation
        return _zeros(act.shape, act.dtype), _zeros((), jnp.float32)

    def forward(self, table_row, x, *, first: bool, last: bool):
        """(the output for stage s + 1, the loss share): first: embed before; last: the loss after."""
        stage, row = self.stage, TickRow.of(table_row)
        w, keys, k_embed = stage.chunk_inputs(row.mb, row.chunk)
        if first:
            x = stage.embed(stage.others["embed"], row.mb, k_embed)
        y = M.layers(x, w, keys, stage.cfg, stage.shard, stage.remat)
        no_act, no_loss = self.idle(table_row, x)
        if last:
            return no_act, stage.loss(y, row.mb)
        return y.astype(stage.activation.dtype), no_loss

    def tick(self, carry: ForwardBuffers, table_row) -> tuple[ForwardBuffers, None]:
        row = TickRow.of(table_row)
        branches = {Branch.IDLE: self.idle, Branch.FORWARD: partial(self.forward, first=False, last=False),
                    Branch.FORWARD_FIRST: partial(self.forward, first=True, last=False),
                    Branch.FORWARD_LAST: partial(self.forward, first=False, last=True)}
        operands, branches = (table_row, carry.x[row.x_slot]), [branches[b] for b in sorted(branches)]
        if self.ring:
            branches = same_context_permutes(branches, operands, lambda o, z: (o[0], o[1] + z))
        send, loss = jax.lax.switch(row.branch, branches, *operands)
        got = jax.lax.ppermute(send, "pipe", _to_next(self.stage.sched.p))
        return ForwardBuffers(x=carry.x.at[row.recv_x].set(got), loss=carry.loss + loss), None


# ---------------------------------------------------------------------------------------------
# The ring under a pipeline: every branch runs as many context permutes (`context.same_context_permutes`)


def _ring(parallel: ParallelConfig) -> bool:
    """Whether the ring strategy runs inside the stages' branches (their permutes then need padding)."""
    return parallel.context > 1 and parallel.context_strategy == "ring"


def _to_next(p: int) -> list[tuple[int, int]]:
    """The forward ppermute: stage s sends to s + 1 (the last to stage 0: its next chunk, interleaved)."""
    return [(i, (i + 1) % p) for i in range(p)]


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
    others = jax.tree.map(lambda g, spec, axes: DP.reduce_over(g, spec, ("pipe", *axes)), buffers.grads["others"],
                          _others(grad_specs), _others(over["weights"]))
    layers = jax.tree.map(  # local [v, k, …]: a parameter's dimension i ≥ 1 is dimension i + 1
        lambda g, spec, axes: DP.reduce_over(g, P(None, None, *spec[1:]), axes)[None], buffers.grads["layers"],
        grad_specs["layers"], over["weights"]["layers"])
    return loss, layers, others


def _others(tree: dict) -> dict:
    """The parameters every stage holds: all but the layers (the embedding, the final norm, an untied head)."""
    return {name: part for name, part in tree.items() if name != "layers"}


# ---------------------------------------------------------------------------------------------
# The executor


def stage_program(layers, others, micro, key_data, rows, *, cfg: ModelConfig, sched: S.Schedule, loss_ranks: int,
                  remat: str, shard: StageSharder, grad_specs: dict, over: dict, inspect, ring: bool):
    """The shard_map's body: one stage and data rank's loss share and reduced gradients (`reduce_gradients`).
    rows: the tick table [ticks, p, len(FIELDS)]; ring: `TickProgram.ring`; the rest as `Stage.enter` and
    `reduce_gradients`."""
    stage = Stage.enter(layers, others, micro, key_data, cfg=cfg, sched=sched, loss_ranks=loss_ranks, remat=remat,
                        shard=shard)
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
    cast = params if parallel.fsdp > 1 else M.cast_params(params, layout.model)
    constrain = lambda a, spec: jax.lax.with_sharding_constraint(a, NamedSharding(layout.mesh, spec))
    layers = jax.tree.map(lambda a, spec: constrain(a, P("pipe", None, None, *spec[1:])),
                          to_stages(cast["layers"], parallel.pipe, parallel.virtual_stages), specs["layers"])
    return layers, jax.tree.map(constrain, _others(cast), _others(specs))


def _stage_inputs(params, batch, layout: Layout, sched: S.Schedule):
    """(layers in the stage layout, embedding and final norm, the micro-batches [m, B/m, s] split over
    `data` on their rows), the executor's shard_map arguments with the in_specs of those three."""
    layers, others = _stage_weights(params, layout)
    shard = Sharder(layout.mesh, layout.parallel.sequence_parallel)
    micro = jax.tree.map(lambda a: shard(a.reshape(sched.m, -1, *a.shape[1:]), None, "batch", None), batch)
    split = DP.fsdp_split(layout)  # FSDP: each rank enters with its shard of every weight
    layer_specs = jax.tree.map(lambda spec: P("pipe", None, None, *spec[1:]), split["layers"],
                               is_leaf=lambda x: isinstance(x, P))
    return (layers, others, micro), (layer_specs, _others(split), P(None, batch_axes(layout.parallel.fsdp > 1)))


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
                            loss_ranks=parallel.batch_ranks * parallel.context, shard=CP.sharder(mesh, parallel, stage=True))
        forward = ForwardProgram(stage, _ring(parallel))
        buffers, _ = jax.lax.scan(forward.tick, forward.buffers(), rows[:, stage.index])
        return jax.lax.psum(buffers.loss, ("pipe", *layout.gradient_axes))

    fn = jax.shard_map(program, mesh=mesh, axis_names=set(DP.region_axes(parallel)), in_specs=(*in_specs, P()),
                       out_specs=P())
    return fn(*args, jnp.asarray(tick_rows(sched)))


def pipeline_loss_and_grad(params, batch, key, *, layout: Layout, remat: str, microbatches: int, grad_specs=None,
                           inspect=None):
    """(loss, float32 grads) of the mean loss over `microbatches` micro-batches of `batch` ({"inputs", "targets"}:
    [B, s] int32), equal to gradient accumulation with micro-batch i's dropout key fold_in(key, i).
    To be called under jit with the mesh's shardings. `grad_specs`: the gradients' PartitionSpecs (default:
    the parameters'); a leaf whose spec names `data` or, for the embedding and final norm, `pipe` (the master
    shards: `Layout.master_specs`) is reduce-scattered over those axes onto that dimension instead of
    all-reduced. `inspect`, if given, is called
    at trace time with the avals of one stash slot, of every residual leaf the stash leaves out and of one W
    stash slot (zb-h1; empty otherwise; see `stash_layout`)."""
    cfg, parallel, mesh = layout.model, layout.parallel, layout.mesh
    sched = schedule_of(parallel, microbatches, cfg.layers)
    grad_specs = layout.param_specs if grad_specs is None else grad_specs
    for path, spec in jax.tree_util.tree_leaves_with_path(grad_specs["layers"], is_leaf=lambda x: isinstance(x, P)):
        if not spec or entry_axes(spec[0]) != ("pipe",):
            raise ValueError(f"grad_specs: layers{jax.tree_util.keystr(path)} is {spec}; every layer's gradient is "
                             "split over pipe on its first dimension (the stage's layers)")
    args, in_specs = _stage_inputs(params, batch, layout, sched)
    over = {"loss": layout.gradient_axes, "weights": DP.left_to_reduce(layout, layout.gradient_axes)}
    program = partial(stage_program, cfg=cfg, sched=sched, loss_ranks=parallel.batch_ranks * parallel.context, remat=remat,
                      shard=CP.sharder(mesh, parallel, stage=True), grad_specs=grad_specs, over=over, inspect=inspect,
                      ring=_ring(parallel))
    fn = jax.shard_map(program, mesh=mesh, axis_names=set(DP.region_axes(parallel)), in_specs=(*in_specs, P(), P()),
                       out_specs=(P(), *_gradient_specs(grad_specs, layout.gradient_axes)))
    loss, layer_grads, other_grads = fn(*args, jax.random.key_data(key), jnp.asarray(tick_rows(sched)))
    # float32, as accumulated and reduced: not cast back to the dtype of `params` (the step's bf16 compute copy)
    return loss, {"layers": from_stages(layer_grads), **other_grads}


def make_loss_and_grad(layout: Layout, remat: str, microbatches: int):
    """jit(params, batch, key) → (loss, grads), the pipelined counterpart of train_step.make_loss_and_grad."""
    fn = partial(pipeline_loss_and_grad, layout=layout, remat=remat, microbatches=microbatches)
    return jax.jit(
        fn,
        in_shardings=(layout.param_shardings, layout.batch, layout.replicated),
        out_shardings=(layout.replicated, layout.param_shardings),
    )


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
    params = jax.eval_shape(lambda: M.init_params(jax.random.key(0), cfg, layout.parallel.tensor))
    tokens = jax.ShapeDtypeStruct((micro_batch_size * microbatches, cfg.seq_len), jnp.int32)
    with jax.set_mesh(layout.mesh):
        jax.eval_shape(partial(pipeline_loss_and_grad, layout=layout, remat=remat, microbatches=microbatches,
                               inspect=lambda a, b, w: seen.update(stash=a, reused=b, w_stash=w)),
                       params, {"inputs": tokens, "targets": tokens}, jax.random.key(0))
    return seen
