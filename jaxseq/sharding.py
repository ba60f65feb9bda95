"""Activation sharding by logical axis names, and the collectives XLA's partitioner is not left to choose.

`Sharder` applies the mesh's logical rules (`mesh.logical_rules`) as sharding constraints; its
`column_parallel` (the sequence-parallel all-gather) and `embed` (the vocab-parallel lookup) are written
as explicit collectives inside `jax.shard_map`, because left to the partitioner XLA stores or moves more
than Megatron-LM does (docs/DESIGN.md). `parallel/region.StageSharder` is the same for code inside a region
manual over `pipe`, `data` and `context` (the pipeline's, gradient accumulation's).

Under context parallelism the Sharder also knows the sequence's layout (`reorder`: 2c chunks, rank r holding
chunks r and 2c−1−r) and carries the context attention a run chose (`context_attention`, from
parallel/context.py: the models below it call attention through `models.ops.attention`, which asks for it here).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from functools import partial
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from jaxseq.mesh import batch_axes, logical_rules, logical_to_spec
from jaxseq import deferred


@dataclass(frozen=True)
class Sharder:
    """Applies activation sharding constraints by logical axis names; a no-op without a mesh."""

    mesh: Mesh | None
    sequence_parallel: bool = False
    # attention(q, k, v, cfg, key, shard) over the whole causal prefix when the sequence is split over
    # `context` (parallel/context.py's strategies); None: the partitioner's choice (`models.ops.attention`).
    context_attention: Callable | None = field(default=None, compare=False)
    # The packed documents of the tokens being run (models/documents.Documents, in their stored order), or None:
    # no document mask. Set per batch (`with_documents`): the model's attention and positions read it here.
    documents: Any = field(default=None, compare=False)

    def with_documents(self, documents) -> "Sharder":
        """This Sharder for tokens whose packed documents are `documents` (None: no document mask)."""
        return dataclasses.replace(self, documents=documents)

    @property
    def rules(self) -> dict[str, str | None]:
        return logical_rules(self.sequence_parallel, context=self.context > 1, fsdp=self.fsdp > 1,
                             expert=self.expert > 1)

    @property
    def tensor(self) -> int:
        """Ranks of the `tensor` axis (1 without a mesh)."""
        return self.mesh.shape["tensor"] if self.mesh is not None else 1

    @property
    def context(self) -> int:
        """Ranks of the `context` axis (1 without a mesh)."""
        return self.mesh.shape.get("context", 1) if self.mesh is not None else 1

    @property
    def fsdp(self) -> int:
        """Ranks of the `fsdp` axis (1 without a mesh or without FSDP)."""
        return self.mesh.shape.get("fsdp", 1) if self.mesh is not None else 1

    @property
    def expert(self) -> int:
        """Ranks of the `expert` axis (1 without a mesh or without expert parallelism)."""
        return self.mesh.shape.get("expert", 1) if self.mesh is not None else 1

    @property
    def token_axes(self) -> tuple[str, ...]:
        """The mesh axes but `tensor` that split a micro-batch's tokens (its rows over data, fsdp and expert, the
        sequence over context), those of size > 1: a mixture of experts routes each rank's tokens over them as one
        group (models/experts.py)."""
        if self.mesh is None:
            return ()
        return tuple(a for a in ("data", "fsdp", "expert", "context") if self.mesh.shape.get(a, 1) > 1)

    @property
    def averaged_ranks(self) -> int:
        """How many ranks' gradients the step averages where this Sharder's code runs: 1 where autodiff sums them
        (the partitioner, a shard_map's transpose). A loss term of the whole micro-batch, of which each rank holds
        a share, is seeded this many times on each (models/experts.py), times `loss_seed`."""
        return 1

    @property
    def loss_seed(self) -> float:
        """The cotangent this rank's loss enters backward with: 1 here (an executor that weighs each micro-batch's
        loss as it seeds backward sets its weight: the pipeline's `StageSharder`)."""
        return 1.0

    def token_region(self, fn, x, params, param_axes):
        """fn(shard, x, params) → (y, z) on each rank's own tokens: x [b, s, h] whole over `tensor`, split over
        `token_axes`; `params` (their logical `param_axes`) each rank's shard over `expert`, whole over the other
        token axes; y and z [b, s, …] split as x. A shard_map manual over the token axes (`tensor` left to the
        partitioner; `shard` the Sharder of code inside it), or fn itself where there are none."""
        axes = self.token_axes
        if not axes:
            return fn(self, x, params)
        inner = RegionView(self.mesh, self.sequence_parallel, manual=frozenset(axes))
        x_spec = only_axes(self.spec("batch", "seq", None), axes)
        p_specs = jax.tree.map(lambda a: only_axes(self.spec(*a), axes), param_axes,
                               is_leaf=lambda a: isinstance(a, tuple))
        return jax.shard_map(partial(fn, inner), mesh=self.mesh, axis_names=set(axes), in_specs=(x_spec, p_specs),
                             out_specs=(x_spec, x_spec))(x, params)

    def first_row(self, rows: int):
        """Inside a region manual over the batch's rows (`rows_manual`): the global index of this rank's first
        row when each holds `rows` (data-major, then fsdp, as `batch_sharding` splits them)."""
        return jax.lax.axis_index(batch_axes(self.fsdp > 1, self.expert > 1)) * rows

    @property
    def casts_at_gather(self) -> bool:
        """Whether `gather_weights` casts the weights to the compute dtype itself (they arrive float32)."""
        return False

    def gather_weights(self, params, *, axes, cast, dtype):
        """FSDP: `params` (a layer's, the embedding's; their logical `axes`) whole over `fsdp`, as a layer
        computes with them; without FSDP `params` themselves. Here the partitioner gathers them (a sharding
        constraint that names no `fsdp`: evaluation, sampling); the training regions write the gather and its
        float32 reduce-scatter (`parallel.region.StageSharder`). `cast`, `dtype`: where the weights are cast
        when `casts_at_gather`."""
        if self.fsdp == 1:
            return params
        return jax.tree.map(lambda w, a: self(w, *a), params, axes, is_leaf=lambda a: isinstance(a, tuple))

    @property
    def map_mesh(self):
        """The mesh a shard_map names here: the concrete one (the abstract one inside a manual region)."""
        return self.mesh

    def reorder(self, s: int) -> np.ndarray | None:
        """The global position of each stored token of a sequence of s when it is split over `context`
        (`context_order`); None when it is not (the stored order is the natural one)."""
        return context_order(s, self.context) if self.context > 1 else None

    def positions(self, s: int):
        """The global positions of the stored tokens of a sequence of s (0 … s−1 without context parallelism); with
        packed documents each token's position in its document, [b, s]."""
        if self.documents is not None:
            return self.documents.positions
        order = self.reorder(s)
        return np.arange(s) if order is None else order

    def split_sequence(self, tokens: jax.Array) -> jax.Array:
        """Tokens [b, s] in natural order → as stored: reordered (`reorder`) and split over `context`."""
        order = self.reorder(tokens.shape[1])
        return tokens if order is None else self(jnp.take(tokens, jnp.asarray(order), axis=1), "batch", "seq")

    def seq_length(self, n: int) -> int:
        """The whole sequence's length when n of its tokens are stored here (the Sharder sees whole sequences)."""
        return n

    @property
    def context_manual(self) -> bool:
        """Whether code here runs manual over `context`, on one context rank's tokens (`StageSharder`)."""
        return False

    @property
    def rows_manual(self) -> bool:
        """Whether code here runs manual over `data`, on one data rank's rows of the batch (`StageSharder`)."""
        return False

    def spec(self, *axes: str | None) -> P:
        return logical_to_spec(axes, self.rules)

    def named(self, *axes: str | None) -> NamedSharding:
        return NamedSharding(self.mesh, self.spec(*axes))

    def __call__(self, x: jax.Array, *axes: str | None) -> jax.Array:
        if self.mesh is None:
            return x
        return jax.lax.with_sharding_constraint(x, self.named(*axes))

    def column_parallel(self, fn, x: jax.Array, params, param_axes, out_axes: tuple):
        """fn(x, params) for a column-parallel linear whose input x is [b, s(/t), h]; out_axes are the logical
        axes of its output, or a tuple of them where fn returns several outputs (one all-gather for all).

        With sequence parallelism this is Megatron's exit from the sequence-parallel region, written
        as an explicit all-gather inside `shard_map` (its transpose is a reduce-scatter). Why not a
        sharding constraint: then XLA stores the *gathered* input for backward, and its backward
        all-reduces before scattering. Here the stored tensor is the sequence-sharded input, backward
        all-gathers it again and reduce-scatters the gradient, exactly as Megatron-LM does.

        `Deferred` params (zb-h1's split backward): the whole linear, gather included, is the op whose weight
        gradient waits for the pipeline's W op (`deferred`).
        """
        if deferred.has_deferred(params):
            return deferred.apply(lambda x, p: self.column_parallel(fn, x, p, param_axes, out_axes), x, params)
        if self.mesh is None:
            return fn(x, params)
        if not self.sequence_parallel and not several_outputs(out_axes):
            return _map_outputs(lambda y, axes: self(y, *axes), fn(self(x, "batch", "seq", None), params), out_axes)
        # Several outputs without SP (GPT's Q, K and V): in the region too, the input cast to varying over `tensor`
        # once (Megatron's f), so that backward sums their input gradients on each rank and all-reduces that once,
        # where the partitioner (and a cast per use) all-reduced each.
        enter = (lambda y: jax.lax.all_gather(y, "tensor", axis=1, tiled=True)) if self.sequence_parallel else (
            lambda y: jax.lax.pcast(y, ("tensor",), to="varying"))
        local = lambda y, p: fn(enter(y), p)
        specs = jax.tree.map(lambda axes: self.spec(*axes), param_axes, is_leaf=lambda a: isinstance(a, tuple))
        x_spec = self.spec("batch", "seq_sp" if self.sequence_parallel else "seq", None)
        return jax.shard_map(local, mesh=self.mesh, in_specs=(x_spec, specs), out_specs=self.out_specs(out_axes))(
            x, params)

    def out_specs(self, out_axes):
        """The specs of `column_parallel`'s outputs: one tuple of logical axes, or a tuple of such tuples."""
        if several_outputs(out_axes):
            return tuple(self.spec(*axes) for axes in out_axes)
        return self.spec(*out_axes)

    def embed(self, table: jax.Array, tokens: jax.Array) -> jax.Array:
        """Vocab-parallel lookup of tokens [b, s] in table [V, h] (rows split over `tensor`) → [b, s(/t), h].

        Megatron's: each rank looks up the tokens that fall in its rows (zeros elsewhere) and the
        partial embeddings are all-reduced, or reduce-scattered along the sequence under sequence
        parallelism. Left to the partitioner, XLA all-gathers the whole table instead (V·h per step,
        and an all-reduce of its gradient)."""
        if self.mesh is None:
            return jnp.take(table, tokens, axis=0)
        return jax.shard_map(
            partial(vocab_parallel_lookup, sequence_parallel=self.sequence_parallel), mesh=self.mesh,
            in_specs=(self.spec("vocab", None), self.spec("batch", "seq")),
            out_specs=self.spec("batch", "seq_sp", None),
        )(table, tokens)


@dataclass(frozen=True)
class RegionView(Sharder):
    """The Sharder of code inside `Sharder.token_region`'s shard_map, manual over `manual`: its constraints name the
    abstract mesh and none of those axes."""

    manual: frozenset[str] = frozenset()

    @property
    def rules(self) -> dict:
        keep = lambda entry: only_axes(P(entry), tuple(a for a in spec_axes(P(entry)) if a not in self.manual))[0]
        return {name: keep(entry) for name, entry in super().rules.items()}

    def named(self, *axes: str | None) -> NamedSharding:
        return NamedSharding(jax.sharding.get_abstract_mesh(), self.spec(*axes))

    @property
    def map_mesh(self):
        return jax.sharding.get_abstract_mesh()


def several_outputs(out_axes) -> bool:
    """Whether column_parallel's out_axes name several outputs (a tuple of axis tuples)."""
    return len(out_axes) > 0 and isinstance(out_axes[0], tuple)


def _map_outputs(fn, outputs, out_axes):
    if several_outputs(out_axes):
        return tuple(fn(y, axes) for y, axes in zip(outputs, out_axes))
    return fn(outputs, out_axes)


def entry_axes(entry) -> tuple[str, ...]:
    """The mesh axes one PartitionSpec entry names (None, an axis, or a tuple of axes)."""
    return () if entry is None else tuple(entry) if isinstance(entry, tuple) else (entry,)


def spec_axes(spec: P) -> tuple[str, ...]:
    """Every mesh axis a PartitionSpec names, in order."""
    return tuple(a for entry in spec for a in entry_axes(entry))


def only_axes(spec: P, axes: tuple[str, ...]) -> P:
    """`spec` naming only the mesh axes in `axes` (an entry of several keeps their order)."""
    def keep(entry):
        kept = tuple(a for a in entry_axes(entry) if a in axes)
        return kept[0] if len(kept) == 1 else kept or None
    return P(*(keep(e) for e in spec))


def batch_sharding(mesh: Mesh) -> NamedSharding:
    """The global batch [B, s] as placed, in natural order: rows split over `data` (data × fsdp under FSDP),
    replicated over `pipe`, `context` and `tensor`. Under context parallelism `models.model.loss_fn` reorders
    the tokens (`context_order`) and keeps each context rank's; placed whole on every context rank (token ids: 4
    bytes a token), the reorder is a local gather that moves nothing between devices."""
    return NamedSharding(mesh, P(batch_axes("fsdp" in mesh.shape, "expert" in mesh.shape), None))


def context_chunks(c: int) -> tuple[tuple[int, int], ...]:
    """The two of 2c equal chunks of the sequence each context rank holds: rank r holds r and 2c−1−r
    (Megatron-LM's and TransformerEngine's order). Causal attention then costs every rank the same: a
    contiguous split gives the last rank about 2c−1 times the first rank's work."""
    return tuple((r, 2 * c - 1 - r) for r in range(c))


def context_order(s: int, c: int, chunks=None) -> np.ndarray:
    """Global positions of the stored tokens when rank r stores `chunks[r]` (default `context_chunks(c)`)
    one after another: storage index j holds the token at position order[j]."""
    n = s // (2 * c)
    chunks = context_chunks(c) if chunks is None else chunks
    return np.concatenate([np.arange(i * n, (i + 1) * n) for pair in chunks for i in pair]).astype(np.int32)


def stored_positions(index, s: int, c: int):
    """`context_order(s, c)[index]` computed, not read from a constant table: the global positions of the tokens
    at storage indices `index` (an int32 array) of a sequence of s split over c context ranks."""
    n = s // (2 * c)  # tokens a chunk
    rank, j = index // (2 * n), index % (2 * n)  # the rank storing it, its index among that rank's two chunks
    return jnp.where(j < n, rank * n + j, (2 * c - 1 - rank) * n + j - n).astype(jnp.int32)


def vocab_parallel_lookup(table, tokens, sequence_parallel: bool):
    """One tensor rank's part of the vocab-parallel lookup (inside shard_map, manual over `tensor`): its
    rows' embeddings (zeros for other ids), all-reduced, or reduce-scattered along the sequence under SP."""
    rows = table.shape[0]
    ids, mine = rank_rows(rows, tokens)
    x = jnp.where(mine[..., None], jnp.take(table, jnp.clip(ids, 0, rows - 1), axis=0), jnp.zeros((), table.dtype))
    if sequence_parallel:
        return jax.lax.psum_scatter(x, "tensor", scatter_dimension=1, tiled=True)
    return jax.lax.psum(x, "tensor")


def rank_rows(rows: int, tokens):
    """(tokens as row indices into this tensor rank's `rows` rows of the table, whether each falls in them)."""
    ids = tokens - jax.lax.axis_index("tensor") * rows
    return ids, (ids >= 0) & (ids < rows)
