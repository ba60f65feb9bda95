"""One pipeline stage inside the executor's shard_map (`Stage`): its weights, its rows of the micro-batches, and
how it runs one micro-batch chunk forward, under `jax.vjp`, and back; and where a chunk's vjp residuals come from
(`ResidualLayout`): the stash keeps only the activations, not the chunk's weights or dropout keys, so a slot costs
what the remat policy stores for k layers. The executor: `pipeline.py`; what a stage runs at each tick:
`tick_programs.py`."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import Any

import jax
import jax.numpy as jnp

from jaxseq import deferred
from jaxseq.config import ModelConfig
from jaxseq.models import documents, model
from jaxseq.parallel import data_parallel
from jaxseq.parallel.region import StageSharder
from jaxseq.parallel.schedule import Schedule


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


def varying_zeros(shape, dtype):
    """Zeros varying over the region's axes (`pipe`, `data`, and `context` under context parallelism), as every
    value the tick loop carries and its branches return."""
    return data_parallel.varying(jnp.zeros(shape, dtype))


def in_memory(a, host: bool):
    """`a` placed in host memory where `host` (a stash slot of an offloaded residual: jaxseq/offload.py)."""
    return jax.device_put(a, jax.memory.Space.Host) if host else a


def as_float32(tree):
    return jax.tree.map(lambda a: a.astype(jnp.float32), tree)


# ---------------------------------------------------------------------------------------------
# One stage inside the shard_map


@dataclass(frozen=True, kw_only=True)
class Stage:
    """One stage and data rank's part of the step (inside the shard_map, manual over `pipe` and `data`):
    its weights, its rows of the micro-batches, the step's key, and how it runs one micro-batch chunk."""

    cfg: ModelConfig
    sched: Schedule
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
    taps: deferred.Taps | None = None  # zb-h1: the chunk's deferred weight ops (`discover_taps`); None: B computes them
    # the micro-batches' packed documents ([m, b, s/c] each, stored order: `ModelConfig.document_mask`), or None
    documents: documents.Documents | None = None
    offload: tuple[str, ...] = ()  # the stored tensors a chunk's forward sends to host memory (jaxseq/offload.py)

    @staticmethod
    def enter(layers, others, micro, key_data, *, cfg: ModelConfig, sched: Schedule, loss_ranks: int, remat: str,
              shard: StageSharder, offload: tuple[str, ...] = ()) -> Stage:
        """The stage of the shard_map's arguments: `layers` [1, v, k, …] (this stage's block of the
        [p, v, k, …] stage layout), `others` and `micro` as above, `key_data` the key's raw data (None: no
        dropout)."""
        key = None if key_data is None else jax.random.wrap_key_data(key_data)
        split = jax.vmap(shard.split_sequence)
        docs = documents.split(model.packed_documents(micro["inputs"], cfg), split)  # read in natural order
        micro = {name: split(t) for name, t in micro.items()}
        return Stage(cfg=cfg, sched=sched, loss_ranks=loss_ranks, remat=remat, shard=shard,
                     index=jax.lax.axis_index("pipe"), key=key,
                     layers=jax.tree.map(lambda a: data_parallel.varying(a[0]), layers),
                     others=jax.tree.map(data_parallel.varying, others), micro=micro,
                     taps=deferred.Taps() if sched.split_backward else None, documents=docs, offload=offload)

    def discover_taps(self) -> None:
        """zb-h1: trace chunk 0 once to find its deferred weight ops (`deferred.Taps.discover`)."""
        w, keys, _ = self.chunk_inputs(0, 0)
        self.taps.discover(self._run_layers(keys, self.documents_of(0)), w,
                           varying_zeros(self.activation.shape, self.activation.dtype))

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

    def documents_of(self, mb) -> documents.Documents | None:
        """Micro-batch mb's packed documents ([b, s/c] each), or None without a document mask."""
        return None if self.documents is None else documents.Documents(*(a[mb] for a in self.documents))

    def shard_of(self, docs) -> StageSharder:
        """The stage's Sharder for a micro-batch whose packed documents are `docs` (`documents_of`)."""
        return self.shard if docs is None else self.shard.with_documents(docs)

    def _run_layers(self, keys, docs=None) -> Callable:
        return lambda x, w: model.layers(x, w, keys, self.cfg, self.shard_of(docs), self.remat, self.offload)

    def chunk_vjp(self, x, w, keys, docs=None):
        """(y, vjp) of one chunk's k layers: x, y [b, s, h]; docs: its micro-batch's packed documents (or None). The
        vjp maps dy to (dx, dw); under zb-h1 to (dx, the gradients of every parameter but the kernels, each deferred
        op's (x, dy) [k, …]: the W stash), the kernels being `Deferred` constants whose gradients W computes."""
        run = self._run_layers(keys, docs)
        if self.taps is None:
            return jax.vjp(run, x, w)
        kernels, others = deferred.split_kernels(w)
        return jax.vjp(lambda x, others, probes: run(x, self.taps.wrap(deferred.merge_kernels(kernels, others),
                                                                       probes)),
                       x, others, jax.tree.map(data_parallel.varying, self.taps.probes(self.layers_per_chunk)))

    def embed(self, embed_params, mb, k_embed):
        """Micro-batch mb's embedded tokens [b, s, h] (the first chunk's input)."""
        shard = self.shard_of(self.documents_of(mb))
        return model.embed(embed_params, self.micro["inputs"][mb], k_embed, self.cfg, shard)

    @property
    def loss_scale(self) -> float:
        """1/(m·data·context): the step's loss is the mean over micro-batches and data and context ranks."""
        return 1.0 / (self.sched.m * self.loss_ranks)

    def loss(self, y, mb):
        """Micro-batch mb's loss share from the last chunk's output y (forward only)."""
        return model.head_loss(self.others, y, self.micro["targets"][mb], self.cfg, self.shard) * self.loss_scale

    def loss_and_grads(self, y, mb):
        """(loss share, dL/dy, d(embedding, final norm)) of the last chunk's output y: the loss right away, so
        that the chunk's backward needs only dL/dy (an activation-sized slot), not the logits."""
        loss, (gh, gy) = jax.value_and_grad(partial(model.head_loss, cfg=self.cfg, shard=self.shard), argnums=(0, 1))(
            self.others, y, self.micro["targets"][mb])
        scale = self.loss_scale
        return loss * scale, gy * scale, jax.tree.map(lambda a: a.astype(jnp.float32) * scale, gh)


@dataclass(frozen=True)
class ResidualLayout:
    """Where the leaves of one chunk's vjp (`jax.vjp`'s VJP object is a pytree) come from: most are
    activations, kept in a stash slot from the forward to the backward; the rest are the chunk's own
    weights, dropout keys and packed documents (matched by identity), taken from the live arrays at backward time
    instead.
    This leans on the layout of jax.vjp's residuals (tests/test_pipeline.py pins it).

    An offloaded residual (`--offload`, jaxseq/offload.py) is a leaf in host memory: its stash slots are in host
    memory too, so that a stage's stash of it waits there from the forward to the backward (`hosted`)."""

    treedef: Any  # the VJP's structure; it carries the backward jaxpr
    source: tuple[int, ...]  # per leaf: its index among the leaves of (weights, keys, documents), or −1: stashed
    avals: tuple[jax.ShapeDtypeStruct, ...]  # per leaf
    host: tuple[bool, ...] = ()  # per leaf: in host memory (an offloaded residual); () for none

    @property
    def stashed(self) -> tuple[jax.ShapeDtypeStruct, ...]:
        """One stash slot: [k, b, …] per leaf."""
        return tuple(a for a, i in zip(self.avals, self.source) if i < 0)

    @property
    def hosted(self) -> tuple[bool, ...]:
        """Per stashed leaf (`stashed`): whether its slots are in host memory."""
        host = self.host or (False,) * len(self.avals)
        return tuple(h for h, i in zip(host, self.source) if i < 0)

    def slot_zeros(self, depth: int | None = None) -> list:
        """Zeros of one stash slot per stashed leaf, each in its leaf's memory; with `depth`, of the whole buffer:
        `depth` slots, and a trash slot more where it is in host memory (`TickProgram.stash` writes there)."""
        lead = lambda h: () if depth is None else (depth + h,)
        return [in_memory(varying_zeros((*lead(h), *a.shape), a.dtype), h) for a, h in zip(self.stashed, self.hosted)]

    def read(self, stash: list, slot) -> list:
        """Stash slot `slot` of every stashed leaf, on the device: a slot in host memory is copied back whole as the
        chunk's backward starts (XLA's host offloader takes a slice of host memory only as a copy to the device)."""
        return [jax.device_put(buf[slot], jax.memory.Space.Device) if h else buf[slot]
                for buf, h in zip(stash, self.hosted)]

    @property
    def reused(self) -> tuple[jax.ShapeDtypeStruct, ...]:
        """The leaves taken from the weights, keys and documents."""
        return tuple(a for a, i in zip(self.avals, self.source) if i >= 0)

    @staticmethod
    def of(stage: Stage) -> ResidualLayout:
        """The layout of chunk 0's vjp, traced once under eval_shape (its ops do not enter the program). Every
        chunk's vjp has it: the chunks differ in values, not in shapes or in which residuals are inputs."""
        found = []  # the one trace below records its static findings here

        def residuals(x, w, keys, docs):
            _, f_vjp = stage.chunk_vjp(x, w, keys, docs)
            leaves, treedef = jax.tree.flatten(f_vjp)
            inputs = jax.tree.leaves((w, keys, docs))
            found.append((treedef, tuple(next((i for i, a in enumerate(inputs) if a is leaf), -1) for leaf in leaves),
                          tuple(jax.typeof(leaf).memory_space == jax.memory.Space.Host for leaf in leaves)))
            return leaves

        w, keys, _ = stage.chunk_inputs(0, 0)
        x = varying_zeros(stage.activation.shape, stage.activation.dtype)
        avals = jax.eval_shape(residuals, x, w, keys, stage.documents_of(0))
        (treedef, source, host), = found
        return ResidualLayout(treedef, source, tuple(avals), host)

    def split(self, f_vjp) -> list:
        """The leaves of a forward's vjp that go to the stash, varying over `pipe` and `data` as the stash is: a
        constant among them (Llama's RoPE frequencies, closed over by the layer) is invariant."""
        leaves = jax.tree.leaves(f_vjp)
        shapes, traced = [a.shape for a in leaves], [a.shape for a in self.avals]
        if shapes != traced:  # not an assert: `python -O` would stash the wrong arrays
            raise RuntimeError(f"a pipeline chunk's vjp changed its layout since `of` traced it: {len(shapes)} "
                               f"residual leaves {shapes} where the stash holds {len(traced)} {traced}")
        return [data_parallel.varying(leaf) for leaf, i in zip(leaves, self.source) if i < 0]

    def join(self, stashed: list, w, keys, docs=None) -> Callable:
        """The vjp of a chunk from its stash slot and its live weights, keys and packed documents. The treedef traced
        in `of` serves every branch: it carries the backward jaxpr, whose inputs are the residual leaves (it closes
        over no tracer), so any leaves of the same types run it."""
        inputs, it = jax.tree.leaves((w, keys, docs)), iter(stashed)
        return jax.tree.unflatten(self.treedef, [inputs[i] if i >= 0 else next(it) for i in self.source])
