"""The Sharder of code inside a region manual over `pipe`, `data` and `context` (the pipeline executor's and
gradient accumulation's `jax.shard_map`): `StageSharder`, where only `tensor` is left to XLA's partitioner."""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import partial

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding

from jaxseq.mesh import logical_rules
from jaxseq import deferred
from jaxseq.parallel import fsdp
from jaxseq.sharding import Sharder, only_axes, rank_rows, several_outputs, stored_positions, vocab_parallel_lookup


@dataclass(frozen=True)
class StageSharder(Sharder):
    """Sharder for code running inside a region manual over `pipe`, `data` and, under context parallelism,
    `context` (the pipeline executor's, gradient accumulation's): one data rank's rows of the batch and one
    context rank's tokens, so constraints name neither axis and only `tensor` is left to the partitioner.
    Shardings name the abstract mesh (a concrete-mesh NamedSharding fails in a partial-manual region), and the
    collectives over `tensor` (sequence-parallel all-gather, vocab-parallel lookup) are custom_vjps whose
    forward and backward are forward-only nested shard_maps (autodiff through a nested shard_map fails to
    lower). A context rank's stored order is a traced value here (`reorder`: its chunks depend on its index).
    `loss_seed`: the cotangent each rank's loss enters backward with (the pipeline's 1/(m·ranks); 1 where gradient
    accumulation scales the summed gradients after)."""

    loss_seed: float = 1.0

    @property
    def rules(self) -> dict[str, str | None]:
        return {**logical_rules(self.sequence_parallel), "batch": None}

    @property
    def manual_axes(self) -> frozenset[str]:
        """The axes the collectives' nested shard_maps are manual over (the region is already over the rest)."""
        return frozenset({"tensor"})

    @property
    def context_manual(self) -> bool:
        return self.context > 1

    @property
    def averaged_ranks(self) -> int:
        """The region's ranks of the batch's tokens (data, fsdp, expert, context): the step averages their
        gradients (each rank's loss is the mean over its own tokens)."""
        return math.prod(self.mesh.shape[a] for a in self.token_axes)

    def token_region(self, fn, x, params, param_axes):
        """fn itself: the region is manual over every token axis already, its experts this rank's."""
        return fn(self, x, params)

    @property
    def casts_at_gather(self) -> bool:
        return self.fsdp > 1

    def gather_weights(self, params, *, axes, cast, dtype):
        """FSDP in the region (manual over `fsdp`): each weight cast to `dtype` where `cast` says so and
        gathered over `fsdp` on its `embed` dimension, its gradient reduce-scattered in float32 (`fsdp.gather`);
        a leaf with no `embed` dimension (biases, norm scales) is cast alone, its gradient left this rank's."""
        if self.fsdp == 1:
            return params

        def one(w, leaf_axes, leaf_cast):
            dim = leaf_axes.index("embed") if "embed" in leaf_axes else None
            return fsdp.gather(w, dim=dim, dtype=dtype if leaf_cast else None,
                               tensor_spec=only_axes(self.spec(*leaf_axes), ("tensor",)))

        return jax.tree.map(one, params, axes, cast, is_leaf=lambda a: isinstance(a, tuple))

    @property
    def rows_manual(self) -> bool:
        return True

    def reorder(self, s: int):
        """The global positions of this context rank's s stored tokens, traced: rank r's chunks r and 2c−1−r of
        s/2 tokens each (`context_chunks`). Computed from its index, not read from a table: a table would be a
        constant every pipeline chunk's vjp keeps as a residual (a stash slot's worth each)."""
        if self.context == 1:
            return None
        return stored_positions(jax.lax.axis_index("context") * s + jax.lax.iota(jnp.int32, s), s * self.context,
                                self.context)

    def whole_order(self, s: int):
        """The global positions of a whole sequence of s gathered over `context` (every rank's tokens, rank
        after rank), traced as `reorder` is."""
        return stored_positions(jax.lax.iota(jnp.int32, s), s, self.context)

    def split_sequence(self, tokens: jax.Array) -> jax.Array:
        """Tokens [b, s] in natural order → this context rank's s/c, in stored order."""
        if self.context == 1:
            return tokens
        return jnp.take(tokens, self.reorder(tokens.shape[1] // self.context), axis=1)

    def seq_length(self, n: int) -> int:
        return n * self.context

    def named(self, *axes: str | None) -> NamedSharding:
        return NamedSharding(jax.sharding.get_abstract_mesh(), self.spec(*axes))

    @property
    def map_mesh(self):
        return jax.sharding.get_abstract_mesh()

    def column_parallel(self, fn, x, params, param_axes, out_axes: tuple):
        if deferred.has_deferred(params):
            return deferred.apply(lambda x, p: self.column_parallel(fn, x, p, param_axes, out_axes), x, params)
        sp = self.sequence_parallel
        if self.mesh is None or not (sp or several_outputs(out_axes)):
            return super().column_parallel(fn, x, params, param_axes, out_axes)
        mesh = jax.sharding.get_abstract_mesh()
        x_spec = self.spec("batch", "seq_sp" if sp else "seq", None)
        p_specs = jax.tree.map(lambda axes: self.spec(*axes), param_axes, is_leaf=lambda a: isinstance(a, tuple))
        out_spec = self.out_specs(out_axes)
        # Enter: all-gather the sequence (SP), or cast to varying over `tensor` once, so that backward sums several
        # outputs' input gradients before its one reduction (Megatron's f); leave: reduce-scatter, or all-reduce.
        if sp:
            enter = lambda y: jax.lax.all_gather(y, "tensor", axis=1, tiled=True)
            reduce = lambda g: jax.lax.psum_scatter(g, "tensor", scatter_dimension=1, tiled=True)
        else:
            enter, reduce = lambda y: jax.lax.pcast(y, ("tensor",), to="varying"), lambda g: jax.lax.psum(g, "tensor")
        nested = partial(jax.shard_map, mesh=mesh, axis_names=self.manual_axes)

        def forward(x, p):
            return nested(lambda y, q: fn(enter(y), q), in_specs=(x_spec, p_specs), out_specs=out_spec)(x, p)

        def backward(x, p, g):
            def local(y, q, gy):
                _, vjp = jax.vjp(fn, enter(y), q)
                gx, gq = vjp(gy)
                return reduce(gx), gq

            return nested(local, in_specs=(x_spec, p_specs, out_spec), out_specs=(x_spec, p_specs))(x, p, g)

        @jax.custom_vjp
        def column(x, p):
            return forward(x, p)

        column.defvjp(lambda x, p: (forward(x, p), (x, p)), lambda res, g: backward(*res, g))
        return column(x, params)

    def embed(self, table, tokens):
        """`Sharder.embed` (the same `vocab_parallel_lookup` per tensor rank) as a custom_vjp whose backward
        scatter-adds the gradient into this rank's rows. Why not jnp.take under sharding constraints: XLA
        then emits collective-permutes spanning every stage, and a stage that runs the first chunk while
        the others run something else would wait for them forever. The table gradient stays this data
        rank's partial sum (reduced over `data` once per step, after the tick loop)."""
        if self.mesh is None:
            return jnp.take(table, tokens, axis=0)
        nested = partial(jax.shard_map, mesh=jax.sharding.get_abstract_mesh(), axis_names=self.manual_axes)
        t_spec, id_spec, x_spec = (self.spec("vocab", None), self.spec("batch", "seq"),
                                   self.spec("batch", "seq_sp", None))
        sp = self.sequence_parallel

        def forward(table, tokens):
            return nested(partial(vocab_parallel_lookup, sequence_parallel=sp), in_specs=(t_spec, id_spec),
                          out_specs=x_spec)(table, tokens)

        rows = table.shape[0] // self.tensor  # a tensor rank's rows of the table

        def backward(tokens, g):
            def local(tokens, g):
                if sp:
                    g = jax.lax.all_gather(g, "tensor", axis=1, tiled=True)
                ids, mine = rank_rows(rows, tokens)
                g = (g * mine[..., None].astype(g.dtype)).reshape(-1, g.shape[-1])
                return jnp.zeros((rows, g.shape[-1]), g.dtype).at[jnp.where(mine, ids, 0).reshape(-1)].add(g)

            return nested(local, in_specs=(id_spec, x_spec), out_specs=t_spec)(tokens, g)

        # The backward needs the table's shape alone: keeping the table as a residual would keep it alive from the
        # lookup to the end of backward (under FSDP, the whole gathered table).
        @jax.custom_vjp
        def lookup(table, tokens):
            return forward(table, tokens)

        lookup.defvjp(lambda table, tokens: (forward(table, tokens), tokens),
                      lambda tokens, g: (backward(tokens, g).astype(table.dtype), None))
        return lookup(table, tokens)
