"""Activation sharding by logical axis names, and the collectives XLA's partitioner is not left to choose.

`Sharder` applies the mesh's logical rules (`mesh.logical_rules`) as sharding constraints; its
`column_parallel` (the sequence-parallel all-gather) and `embed` (the vocab-parallel lookup) are written
as explicit collectives inside `jax.shard_map`, because left to the partitioner XLA stores or moves more
than Megatron-LM does (docs/DESIGN.md).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from jaxseq.mesh import logical_rules, logical_to_spec


@dataclass(frozen=True)
class Sharder:
    """Applies activation sharding constraints by logical axis names; a no-op without a mesh."""

    mesh: Mesh | None
    sequence_parallel: bool = False

    @property
    def rules(self) -> dict[str, str | None]:
        return logical_rules(self.sequence_parallel)

    @property
    def platform(self) -> str:
        """Where the program runs ("cpu", "gpu", "tpu"): the mesh's devices, the default backend without
        a mesh. The model writes its bf16 matmuls for it (`model.matmul`)."""
        return self.mesh.devices.flat[0].platform if self.mesh is not None else jax.default_backend()

    def spec(self, *axes: str | None) -> P:
        return logical_to_spec(axes, self.rules)

    def named(self, *axes: str | None) -> NamedSharding:
        return NamedSharding(self.mesh, self.spec(*axes))

    def __call__(self, x: jax.Array, *axes: str | None) -> jax.Array:
        if self.mesh is None:
            return x
        return jax.lax.with_sharding_constraint(x, self.named(*axes))

    def column_parallel(self, fn, x: jax.Array, params, param_axes, out_axes: tuple):
        """fn(x, params) for a column-parallel linear whose input x is [b, s(/t), h].

        With sequence parallelism this is Megatron's exit from the sequence-parallel region, written
        as an explicit all-gather inside `shard_map` (its transpose is a reduce-scatter). Why not a
        sharding constraint: then XLA stores the *gathered* input for backward, and its backward
        all-reduces before scattering. Here the stored tensor is the sequence-sharded input, backward
        all-gathers it again and reduce-scatters the gradient, exactly as Megatron-LM does.
        """
        if self.mesh is None:
            return fn(x, params)
        if not self.sequence_parallel:
            return self(fn(self(x, "batch", None, None), params), *out_axes)
        local = lambda y, p: fn(jax.lax.all_gather(y, "tensor", axis=1, tiled=True), p)
        specs = jax.tree.map(lambda axes: self.spec(*axes), param_axes, is_leaf=lambda a: isinstance(a, tuple))
        return jax.shard_map(
            local, mesh=self.mesh, in_specs=(self.spec("batch", "seq_sp", None), specs), out_specs=self.spec(*out_axes)
        )(x, params)

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
            in_specs=(self.spec("vocab", None), self.spec("batch", None)), out_specs=self.spec("batch", "seq_sp", None),
        )(table, tokens)


def vocab_parallel_lookup(table, tokens, sequence_parallel: bool):
    """One tensor rank's part of the vocab-parallel lookup (inside shard_map, manual over `tensor`): its
    rows' embeddings (zeros for other ids), all-reduced, or reduce-scattered along the sequence under SP."""
    rows = table.shape[0]
    ids = tokens - jax.lax.axis_index("tensor") * rows
    mine = (ids >= 0) & (ids < rows)
    x = jnp.where(mine[..., None], jnp.take(table, jnp.clip(ids, 0, rows - 1), axis=0), jnp.zeros((), table.dtype))
    if sequence_parallel:
        return jax.lax.psum_scatter(x, "tensor", scatter_dimension=1, tiled=True)
    return jax.lax.psum(x, "tensor")
